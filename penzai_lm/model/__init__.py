"""The transformer model family and its cached sampling mode."""

from penzai_lm.model.build import build_transformer
from penzai_lm.model.config import RopeScaling
from penzai_lm.model.config import TransformerConfig
from penzai_lm.model.transformer import TransformerLM
from penzai_lm.model.transformer import eager
from penzai_lm.model.transformer import leading_padding
from penzai_lm.model.transformer import positions_from_padding
from penzai_lm.model.kv_cache import CacheOverflowError
from penzai_lm.model.kv_cache import KVCachingTransformerLM
from penzai_lm.model.memory import InsufficientMemoryError
