"""The two real models, loaded once per test process.

Several test files compare penzai_lm against transformers on SmolLM2 and
Gemma 3; transformers' GGUF loader dequantizes in Python (Gemma 3 270M:
about a minute), so each model -- ours and theirs -- is loaded once per
process and shared. Models are immutable (frozen weights), so sharing them
is safe; sharing one model object also lets the default engine reuse its
prepared layouts and programs across files (within one pytest-xdist
worker: each worker is a process of its own).

One model of each kind is held at a time: tests/conftest.py runs every
SmolLM2 test of these files before the first Gemma 3 one, so each is
loaded once, and the worker never holds all four (4.1 GB, measured).
"""

import functools

import pytest

import penzai_lm
from penzai_lm.fetch import resolve_model_path

NAMES = ("smollm2-135m-instruct", "gemma3-270m")



@functools.lru_cache(maxsize=1)
def ours(name: str):
  """``(model, tokenizer)`` as `penzai_lm.load` returns them (float32)."""
  return penzai_lm.load(name)


@functools.lru_cache(maxsize=1)
def theirs(name: str):
  """transformers' model of the same GGUF file (float32, eager attention so
  that hooks see every attention value)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  path = resolve_model_path(name)
  return transformers.AutoModelForCausalLM.from_pretrained(
      path.parent, gguf_file=path.name, dtype=torch.float32,
      attn_implementation="eager").eval()
