"""A small real attribution graph and a tokenizer both penzai_lm and
transformers read, for the export tests (Neuronpedia JSON, HTML, CLI).

The tokenizer is the tiny byte-level BPE of the tokenizer tests written as
a Hugging Face directory (``tokenizer.json`` + ``tokenizer_config.json``):
penzai_lm reads it with `Tokenizer.from_hf`, circuit-tracer with
``AutoTokenizer.from_pretrained`` on the directory, offline. The graph is
`circuits.attribute` on a random Llama (vocabulary of that tokenizer) with
random JumpReLU transcoders, as in ``test_attribute.py``.
"""

import dataclasses
import functools
import json
import pathlib
import tempfile

import numpy as np

import penzai_lm
from penzai_lm import circuits
from penzai_lm.sae import SAEConfig
from penzai_lm.sae import SparseAutoencoder
from penzai_lm.tokenizer import Tokenizer
from tests.model.configs import config
from tests.sae.random_saes import random_arrays
from tests.tokenizer.conftest import write_tiny_bpe_gguf

# Markup in the prompt: the pages must show it as text.
PROMPT = "hello world</script><script>window.pwned=1</script>"
LAYERS = 3
WIDTH = 32
FEATURES = 64


def write_tokenizer_dir(folder: pathlib.Path) -> pathlib.Path:
  """Writes the Hugging Face tokenizer directory ``folder / "hf"``."""
  gguf = Tokenizer.from_gguf(write_tiny_bpe_gguf(folder / "t.gguf"))
  hf = folder / "hf"
  hf.mkdir()
  gguf.backend.save(str(hf / "tokenizer.json"))
  (hf / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast",
      "clean_up_tokenization_spaces": False,
      "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
  return hf


@functools.cache
def graph(max_feature_nodes: int | None = 120) -> circuits.Graph:
  """The attribution graph of `PROMPT` (every position kept)."""
  with tempfile.TemporaryDirectory() as folder:
    tok = Tokenizer.from_hf(write_tokenizer_dir(pathlib.Path(folder)))
  cfg = dataclasses.replace(config("llama_gqa", True),
                            vocab_size=tok.vocab_size)
  model = penzai_lm.build_transformer(cfg, seed=3)
  transcoders = []
  for layer in range(LAYERS):
    tc_cfg = SAEConfig(
        activation="jumprelu", num_features=FEATURES,
        input_axes=(("embedding", WIDTH),),
        output_axes=(("embedding", WIDTH),),
        hook_point=f"blocks.{layer}.mlp_in",
        output_point=f"blocks.{layer}.mlp_out")
    transcoders.append(SparseAutoencoder.from_arrays(
        tc_cfg, **random_arrays(WIDTH, FEATURES, WIDTH, seed=10 + layer,
                                threshold=True)))
  ids = np.array(tok.encode(PROMPT))
  return circuits.attribute(model, transcoders, ids, batch_size=64,
                            zero_positions=0,
                            max_feature_nodes=max_feature_nodes)
