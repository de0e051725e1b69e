"""The KV cache's layout: one end index per row, rows reset and refilled
while the others keep decoding, the same tokens as separate runs."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

import penzai_lm
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model.cache_layout import CacheLayout
from penzai_lm.model.cache_layout import write_at
from penzai_lm.runtime.compiler_options import small_model_options
from tests.model.conftest import _model

PAD = 0
CACHE = 24


def _frozen(name, stacked):
  return pz.freeze_params(_model(name, stacked))


# Small test models: compiled as the engine compiles theirs (LLVM -O0).
@functools.partial(jax.jit, compiler_options=small_model_options())
def _step(model, state, tokens, padding):
  """One call of a cached model, stateless; per-row values are data."""
  return model.stateless_call(state, pz.nx.wrap(tokens).tag("batch", "seq"),
                              is_padding=pz.nx.wrap(padding).tag("batch",
                                                                 "seq"))


@functools.partial(jax.jit, compiler_options=small_model_options())
def _reset(state, rows):
  """`CacheLayout.reset_rows` on a stateless model's state values."""
  layout = CacheLayout((("batch", rows.shape[0]),), CACHE, per_row_end=True)
  labels = layout.labels
  values = {v.label: v.value for v in state}
  new = dict(zip((labels.end, labels.positions, labels.tokens),
                 layout.reset_rows(values[labels.end],
                                   values[labels.positions],
                                   values[labels.tokens],
                                   pz.nx.wrap(rows).tag("batch"), PAD)))
  return [dataclasses.replace(v, value=new[v.label]) if v.label in new
          else v for v in state]


def _logits_at(out, rows_at):
  data = np.asarray(out.order_as("batch", "seq", "vocabulary").data_array)
  return np.stack([data[r, i] for r, i in enumerate(rows_at)])


def _separate(model, prompt, steps):
  """(tokens, logits) of greedy decoding ``prompt`` alone, shared end."""
  cached = KVCachingTransformerLM.from_uncached(model, CACHE, {"batch": 1})
  stateless, state = pz.unbind_state_vars(cached, freeze=True)
  ids = np.array([prompt], np.int32)
  out, state = _step(stateless, state, ids, np.zeros_like(ids, bool))
  logits = [_logits_at(out, [len(prompt) - 1])[0]]
  tokens = [int(np.argmax(logits[-1]))]
  for _ in range(steps):
    ids = np.array([[tokens[-1]]], np.int32)
    out, state = _step(stateless, state, ids, np.zeros_like(ids, bool))
    logits.append(_logits_at(out, [0])[0])
    tokens.append(int(np.argmax(logits[-1])))
  return tokens, np.stack(logits)


def _padded(rows, width):
  """``(ids, padding)``: ``rows`` padded at the end to ``width``."""
  ids = np.full((len(rows), width), PAD, np.int32)
  padding = np.ones((len(rows), width), bool)
  for r, row in enumerate(rows):
    ids[r, :len(row)] = row
    padding[r, :len(row)] = False
  return ids, padding


def _interleaved(model, a, b, c, before, after):
  """Row 0 decodes ``a``; row 1 decodes ``b`` for ``before`` steps, is
  reset and refilled with ``c`` (in one call in which row 0 feeds its next
  token) and decodes ``after`` steps. Returns each row's greedy tokens and
  logits, row 1's split at the reset."""
  cached = KVCachingTransformerLM.from_uncached(model, CACHE, {"batch": 2},
                                                per_row_end=True)
  stateless, state = pz.unbind_state_vars(cached, freeze=True)
  ids, padding = _padded([a, b], max(len(a), len(b)))
  out, state = _step(stateless, state, ids, padding)
  logits = [_logits_at(out, [len(a) - 1, len(b) - 1])]
  tokens = [np.argmax(logits[-1], -1)]
  for _ in range(before):
    out, state = _step(stateless, state, tokens[-1][:, None].astype(np.int32),
                       np.zeros((2, 1), bool))
    logits.append(_logits_at(out, [0, 0]))
    tokens.append(np.argmax(logits[-1], -1))
  state = _reset(state, np.array([False, True]))
  ids, padding = _padded([[int(tokens[-1][0])], c], len(c))
  out, state = _step(stateless, state, ids, padding)
  logits.append(_logits_at(out, [0, len(c) - 1]))
  tokens.append(np.argmax(logits[-1], -1))
  for _ in range(after):
    out, state = _step(stateless, state, tokens[-1][:, None].astype(np.int32),
                       np.zeros((2, 1), bool))
    logits.append(_logits_at(out, [0, 0]))
    tokens.append(np.argmax(logits[-1], -1))
  tokens, logits = np.stack(tokens), np.stack(logits)
  cut = before + 1
  return (tokens[:, 0], logits[:, 0], tokens[:cut, 1], logits[:cut, 1],
          tokens[cut:, 1], logits[cut:, 1])


@pytest.mark.parametrize("name, stacked", [("llama_gqa", True),
                                           ("gemma3", False)])
def test_a_row_reset_and_refilled_while_the_other_decodes(name, stacked):
  """One row is emptied and gets a new prompt while the other row feeds its
  next token in the same call: both rows decode exactly what they decode
  alone (windowed attention included: gemma3's local layers)."""
  model = _frozen(name, stacked)
  a, b, c = [5, 17, 3, 44, 9], [60, 2, 71], [33, 8, 90, 12]
  before, after = 3, 4
  a_tokens, a_logits = _separate(model, a, before + 1 + after)
  b_tokens, b_logits = _separate(model, b, before)
  c_tokens, c_logits = _separate(model, c, after)
  row0, row0_logits, row1, row1_logits, refilled, refilled_logits = (
      _interleaved(model, a, b, c, before, after))
  assert row0.tolist() == a_tokens
  assert row1.tolist() == b_tokens
  assert refilled.tolist() == c_tokens
  for got, want in ((row0_logits, a_logits), (row1_logits, b_logits),
                    (refilled_logits, c_logits)):
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_new_rows_and_resets_do_not_recompile():
  """Row ends, resets and padding are data: a second run with other
  prompts (other lengths within the call shapes) compiles nothing."""
  model = _frozen("llama_gqa", True)
  _interleaved(model, [5, 17, 3, 44, 9], [60, 2, 71], [33, 8, 90, 12], 2, 2)
  compiled = (_step._cache_size(), _reset._cache_size())  # pylint: disable=protected-access
  _interleaved(model, [1, 2], [4, 5, 6, 7, 8], [9, 10, 11, 13], 2, 2)
  assert (_step._cache_size(), _reset._cache_size()) == compiled  # pylint: disable=protected-access


def test_per_row_ends_equal_a_shared_end_for_aligned_rows():
  model = _frozen("llama_gqa", False)
  ids = np.array([[5, 17, 3, 44], [60, 2, 71, 9]], np.int32)
  outs = []
  for per_row in (False, True):
    cached = KVCachingTransformerLM.from_uncached(
        model, CACHE, {"batch": 2}, per_row_end=per_row)
    stateless, state = pz.unbind_state_vars(cached, freeze=True)
    out, state = _step(stateless, state, ids, np.zeros_like(ids, bool))
    out2, state = _step(stateless, state, ids[:, :1], np.zeros((2, 1), bool))
    outs.append([np.asarray(o.order_as("batch", "seq", "vocabulary")
                            .data_array) for o in (out, out2)])
    end = {v.label: v.value for v in state}["sampler/cache_end_index"]
    assert np.all(np.asarray(end.unwrap("batch") if per_row else end) == 5)
  for shared, per_row in zip(*outs):
    np.testing.assert_allclose(per_row, shared, atol=1e-5, rtol=1e-5)


def test_reset_rows_on_the_stateful_model():
  model = _frozen("llama_gqa", True)
  cached = KVCachingTransformerLM.from_uncached(model, CACHE, {"batch": 3},
                                                per_row_end=True)
  with penzai_lm.eager():
    cached(pz.nx.wrap(jnp.array([[5, 6], [7, 8], [9, 10]])).tag(
        "batch", "seq"))
  cached.reset_rows([False, True, False])
  assert cached.cache_end_index.value.unwrap("batch").tolist() == [2, 0, 2]
  positions = cached.kv_positions.value.unwrap("batch", "seq")
  assert positions[1].tolist() == [-1] * CACHE
  assert positions[0, :2].tolist() == [0, 1]
  assert cached.previous_tokens.value.unwrap("batch", "seq")[1, :2].tolist(
  ) == [PAD, PAD]


@pytest.mark.parametrize("per_row, rows, match", [
    (False, [True, False], "needs a cache with one end per row"),
    (True, [True], "rows must be 2 booleans"),
    (True, [1, 0], "rows must be 2 booleans"),
])
def test_reset_rows_refuses_what_it_cannot_do(per_row, rows, match):
  cached = KVCachingTransformerLM.from_uncached(
      _frozen("llama_gqa", True), CACHE, {"batch": 2}, per_row_end=per_row)
  with pytest.raises(ValueError, match=match):
    cached.reset_rows(rows)


def test_generate_refuses_a_per_row_cached_model():
  cached = KVCachingTransformerLM.from_uncached(
      _frozen("llama_gqa", True), CACHE, {"batch": 2}, per_row_end=True)
  with pytest.raises(ValueError, match="one per row"):
    penzai_lm.generate(cached, [[1, 2]], max_new_tokens=2)


def test_per_row_writes_land_at_each_rows_end():
  cache = pz.nx.zeros({"batch": 3, "seq": 6, "projection": 2})
  new = pz.nx.wrap(jnp.arange(1, 13, dtype=jnp.float32).reshape(3, 2, 2)
                   ).tag("batch", "seq", "projection")
  ends = pz.nx.wrap(jnp.array([0, 3, 4], jnp.int32)).tag("batch")
  got = np.asarray(write_at(cache, new, "seq", ends).unwrap(
      "batch", "seq", "projection"))
  want = np.zeros((3, 6, 2), np.float32)
  for r, e in enumerate([0, 3, 4]):
    want[r, e:e + 2] = np.asarray(new.unwrap("batch", "seq", "projection"))[r]
  np.testing.assert_array_equal(got, want)
