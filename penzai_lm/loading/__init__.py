"""Loading real checkpoints into `TransformerLM` models."""

from penzai_lm.loading.config_mapping import config_from_checkpoint
from penzai_lm.loading.load import load
from penzai_lm.loading.load import load_model
from penzai_lm.loading.parameters import parameters_from_checkpoint
