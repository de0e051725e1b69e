"""Requests and sessions too large for the machine are refused up front."""

import time

import numpy as np
import pytest

from penzai_lm.generation import generate
from penzai_lm.generation.session import Session
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model import memory

GREEDY = dict(temperature=0.0, stop_tokens=[])


def _refused(fn, *match):
  start = time.perf_counter()
  with pytest.raises(memory.InsufficientMemoryError) as info:
    fn()
  assert time.perf_counter() - start < 5, "refusing took too long"
  for text in match:
    assert text in str(info.value)
  return str(info.value)


def test_a_batch_of_2_31_rows_is_refused_quickly(model):
  _refused(lambda: generate(model, [1, 2, 3], num_samples=2**31),
           "2**31 sample(s)", "available", "Lower the batch")
  # A broadcast array holds 2**31 prompts in no memory at all.
  rows = np.broadcast_to(np.array([[1, 2, 3]], np.int32), (2**31, 3))
  _refused(lambda: generate(model, rows), "2**31 prompt(s)")


def test_session_min_cache_len_is_checked_up_front(model):
  message = _refused(lambda: Session(model, min_cache_len=2**40),
                     "Session(min_cache_len=2**40)", "2**40 slots x 1 row",
                     "Lower min_cache_len")
  assert "needs" in message and "available" in message


def test_the_planned_shapes_are_checked(model, monkeypatch):
  """With little memory, requests that pass the early row check are
  refused by planning, naming the shapes and what to lower."""
  small = memory.Available(40 << 10, "test memory")
  monkeypatch.setattr(memory, "available_memory", lambda device=None: small)
  generate(model, [1, 2, 3], max_new_tokens=2, **GREEDY)  # Fits.
  _refused(lambda: generate(model, [1, 2, 3], max_new_tokens=40, **GREEDY),
           "generate() with 1 prompt(s)", "max_new_tokens up to 40",
           "slots x 1 row", "40 KiB of test memory", "Lower max_new_tokens")
  session = Session(model)
  session.generate([1, 2, 3], max_new_tokens=2, **GREEDY)
  before = session.tokens
  _refused(lambda: session.generate([4], max_new_tokens=40, **GREEDY),
           "a Session turn", "reset()")
  assert session.tokens == before  # Nothing changed.


def test_a_cached_model_batch_is_checked_before_rows_are_built(model):
  cached = KVCachingTransformerLM.from_uncached(model, 16, {"batch": 2})
  start = time.perf_counter()
  with pytest.raises(ValueError, match="built for 2 row"):
    generate(cached, [1, 2], num_samples=2**31)
  assert time.perf_counter() - start < 5


def test_decode_weights_share_the_stacked_buffers(model):
  """Decoding runs on per-layer blocks; on CPU they alias the user's stacked
  weights instead of being a second copy of every weight (issue 10)."""
  import jax  # pylint: disable=g-import-not-at-top
  from penzai import pz  # pylint: disable=g-import-not-at-top

  from penzai_lm.runtime import unstack  # pylint: disable=g-import-not-at-top

  stacked = [p.value.data_array for p in pz.select(model).at_instances_of(
      pz.ParameterValue).get_sequence() if "blocks" in p.value.named_shape]
  assert stacked, "the fixture model should have a layer stack"
  spans = [(a.unsafe_buffer_pointer(), a.nbytes) for a in stacked]

  def inside(array):
    start = array.unsafe_buffer_pointer()
    return any(lo <= start and start + array.nbytes <= lo + n
               for lo, n in spans)

  unstacked = unstack.unstack_layers(model)
  weights = [p.value.data_array for p in pz.select(unstacked)
             .at_instances_of(pz.ParameterValue).get_sequence()
             if "/blocks/" in p.label]
  assert len(weights) == len(stacked) * model.config.num_layers
  assert all(isinstance(w, jax.Array) and inside(w) for w in weights)
  # The decode tokens are those of the stacked model run uncached.
  plain = generate(model, [1, 2, 3], max_new_tokens=4, **GREEDY)
  assert plain.tokens == generate(model, [1, 2, 3], max_new_tokens=4,
                                  use_cache=False, **GREEDY).tokens
