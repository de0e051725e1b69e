"""Shared tiny models for the generation tests.

Compiled programs are cached across tests (per model structure and bucket
shapes), so tests reuse a few shapes: prompts of at most 8 tokens (prompt
bucket 8), at most 9 new tokens (cache bucket 16) and batches of 1, 2 or 4
rows.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

from penzai_lm.model import TransformerConfig
from penzai_lm.model import build_transformer  # pylint: disable=unused-import
from tests.model.configs import config  # pylint: disable=unused-import

VOCAB = 97
MAX_NEW = 8  # With prompts of <= 8 tokens: cache bucket 16.


@functools.cache
def tiny_model(name: str = "llama_gqa", stacked: bool = True):
  """A tiny random model (97 tokens, 3 layers, hidden 32)."""
  return build_transformer(config(name, stacked), seed=7)


@functools.cache
def smol_sized_vocab_model():
  """A tiny random model with SmolLM2's vocabulary (49152 tokens)."""
  cfg = TransformerConfig(
      family="llama", vocab_size=49152, hidden_size=16, num_layers=2,
      num_heads=2, num_kv_heads=1, head_dim=8, mlp_hidden_size=32,
      eos_token_ids=(2,))
  return build_transformer(cfg, seed=3)


@functools.cache
def smol_tokenizer():
  from penzai_lm.fetch import resolve_model_path  # pylint: disable=g-import-not-at-top
  from penzai_lm.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
  return Tokenizer.from_gguf(resolve_model_path("smollm2-135m-instruct"))


@pytest.fixture
def model():
  return tiny_model()


@pytest.fixture(scope="session")
def tok():
  return smol_tokenizer()


@pytest.fixture
def text_model():
  return smol_sized_vocab_model()


def prompts(lengths, seed=0, vocab=VOCAB):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, vocab, n).tolist() for n in lengths]


CALLS: list[tuple[int, int]] = []


@pz.pytree_dataclass
class CallRecorder(pz.nn.Layer):
  """Identity layer with its own state: counts the tokens it has seen, and
  reports the (batch, seq) shape of every call to the host (CALLS)."""

  seen: pz.StateVariable

  def __call__(self, x, **_):
    shape = (x.named_shape["batch"], x.named_shape["seq"])
    self.seen.value = self.seen.value + shape[1]
    jax.debug.callback(lambda: CALLS.append(shape))
    return x


@functools.cache
def patched_model():
  """The tiny model with a CallRecorder inserted after the embedding."""
  recorder = CallRecorder(seen=pz.StateVariable(
      value=jnp.array(0, jnp.int32), label="probe/seen"))
  return (pz.select(tiny_model()).at_instances_of(pz.nn.EmbeddingLookup)
          .insert_after(recorder))
