"""Cached sampling mode against the uncached model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

from penzai_lm.model import CacheOverflowError
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model import positions_from_padding
from tests.model.conftest import _model
from tests.model.conftest import random_tokens
from tests.model.conftest import run_cached
from tests.model.conftest import uncached_logits
from tests.model.reference import reference_logits


def _named(ids, *axes):
  return pz.nx.wrap(jnp.asarray(ids, jnp.int32)).tag(*axes)


def _prefill_then_steps(cached, tokens, prefill):
  return run_cached(cached, tokens, prefill)[0]


# The tests below run on every family, stacked and unstacked (14 models),
# and XLA compiles each program for each model: they share four batch
# shapes (every batch 4 rows, prefill 9 then 3 steps of 1, a 16-slot cache)
# and pass positions explicitly, so a model compiles 6 programs for all
# four tests instead of 14 (this was the suite's slowest file).
_ROWS, _WIDTH, _STEPS, _CACHE = 4, 9, 3, 16


def _uncached(model, tokens, positions=None):
  """Uncached logits of (batch, seq) ``tokens`` at ``positions`` (default:
  0, 1, 2, ... in every row), one program per token shape."""
  if positions is None:
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  named = pz.nx.wrap(jnp.asarray(positions, jnp.int32)).tag("batch", "seq")
  return uncached_logits(model, tokens, "batch", "seq",
                         token_positions=named)


def test_cached_equals_uncached(model):
  tokens = random_tokens((_ROWS, _WIDTH + _STEPS))
  expected = _uncached(model, tokens)
  cached = KVCachingTransformerLM.from_uncached(model, _CACHE,
                                                {"batch": _ROWS})
  got = _prefill_then_steps(cached, tokens, prefill=_WIDTH)
  np.testing.assert_allclose(got, expected, atol=1e-5)


def test_sliding_window_cached_matches_reference(family):
  """Decoding far past the window (4) still attends only inside it."""
  if family not in ("mistral_window", "gemma3"):
    pytest.skip("no sliding window")
  model = _model(family, True)
  tokens = random_tokens((1, 14), seed=3)
  cached = KVCachingTransformerLM.from_uncached(model, 14, {"batch": 1})
  got = _prefill_then_steps(cached, tokens, prefill=2)[0]
  np.testing.assert_allclose(got, reference_logits(model, tokens[0]), atol=2e-4)


def _ragged_batch(vocab, pad_id):
  """Rows of lengths 9, 4, 1, 6 left-padded with ``pad_id`` (never their
  first token, which would make it padding)."""
  lengths = [9, 4, 1, 6]
  rows = [random_tokens((n,), vocab, seed=10 + i) for i, n in enumerate(lengths)]
  rows = [np.r_[pad_id + 1, r[1:]] if r[0] == pad_id else r for r in rows]
  padded = np.full((len(rows), _WIDTH), pad_id, np.int32)
  for i, row in enumerate(rows):
    padded[i, _WIDTH - len(row):] = row
  return rows, padded


def _positions_after_padding(tokens, pad_id):
  is_padding = pz.nx.wrap(jnp.asarray(tokens == pad_id)).tag("batch", "seq")
  return np.asarray(positions_from_padding(is_padding).unwrap("batch", "seq"))


def test_left_padding_invariance_cached(model):
  """The cached model on left-padded rows equals the uncached one on the
  same padded batch with positions counted from each row's first token,
  which `test_left_padding_invariance_uncached` holds to each row alone."""
  pad_id = 0
  rows, padded = _ragged_batch(model.config.vocab_size, pad_id)
  extra = random_tokens((_ROWS, _STEPS), seed=99)
  tokens = np.concatenate([padded, extra], 1)
  cached = KVCachingTransformerLM.from_uncached(model, _CACHE,
                                                {"batch": _ROWS}, pad_id)
  got = _prefill_then_steps(cached, tokens, _WIDTH)
  expected = _uncached(model, tokens,
                       _positions_after_padding(tokens, pad_id))
  for i, row in enumerate(rows):
    real = slice(tokens.shape[1] - len(row) - _STEPS, None)
    np.testing.assert_allclose(got[i, real], expected[i, real], atol=1e-5,
                               rtol=1e-5)


def test_left_padding_invariance_uncached(model):
  """Each left-padded row equals that row alone. Alone is computed with
  the rows right-padded in one batch: causal attention never lets a token
  see the ones after it, so a row's own logits do not depend on them."""
  rows, padded = _ragged_batch(model.config.vocab_size, 0)
  logits = _uncached(model, padded, _positions_after_padding(padded, 0))
  right = np.zeros_like(padded)
  for i, row in enumerate(rows):
    right[i, :len(row)] = row
  alone = _uncached(model, right)
  for i, row in enumerate(rows):
    np.testing.assert_allclose(logits[i, -len(row):], alone[i, :len(row)],
                               atol=1e-5, rtol=1e-5)


def test_generated_pad_token_is_a_real_token(model):
  """Pad ids after a row's first real token are tokens: generated ones
  (fed one by one) and ones inside a prompt."""
  pad_id = 0
  tokens = random_tokens((_ROWS, _WIDTH + _STEPS), seed=4)
  tokens[:, 0] = 8
  tokens[:, 3] = pad_id  # Inside the prompts.
  tokens[:, _WIDTH:_WIDTH + 2] = pad_id  # Fed as generated tokens.
  expected = _uncached(model, tokens)
  cached = KVCachingTransformerLM.from_uncached(model, _CACHE,
                                                {"batch": _ROWS}, pad_id)
  got, state = run_cached(cached, tokens, prefill=_WIDTH)
  np.testing.assert_allclose(got, expected, atol=1e-5)
  positions = np.asarray(state["sampler/kv_positions"].unwrap("batch", "seq"))
  np.testing.assert_array_equal(positions[:, :tokens.shape[1]],
                                np.broadcast_to(np.arange(tokens.shape[1]),
                                                tokens.shape))


def test_overflow_raises_and_leaves_state_untouched():
  model = _model("llama_gqa", False)
  cached = KVCachingTransformerLM.from_uncached(model, 6, {"batch": 1})
  cached(_named(random_tokens((1, 4)), "batch", "seq"))
  before = cached.kv_positions.value
  with pytest.raises(CacheOverflowError, match="holds 6 tokens"):
    cached(_named(random_tokens((1, 3)), "batch", "seq"))
  assert int(cached.cache_end_index.value) == 4
  assert cached.kv_positions.value is before


@pytest.mark.parametrize("name", ["llama_gqa", "gemma3"])
def test_overflow_raises_under_jit(name):
  model = _model(name, True)
  cached = KVCachingTransformerLM.from_uncached(model, 6, {"batch": 1})
  stateless, state = pz.unbind_state_vars(cached, freeze=True)
  step = jax.jit(lambda s, t: stateless.stateless_call(s, t))
  _, state = step(state, _named(random_tokens((1, 4)), "batch", "seq"))
  with pytest.raises(Exception, match="KV cache holds 6 tokens"):
    out, _ = step(state, _named(random_tokens((1, 4)), "batch", "seq"))
    jax.block_until_ready(out)


@pytest.mark.parametrize("name", ["llama_gqa", "gemma3"])
def test_stateless_call_under_jit_equals_stateful(name):
  model = _model(name, True)
  tokens = random_tokens((2, 7), seed=5)
  stateful = KVCachingTransformerLM.from_uncached(model, 8, {"batch": 2})
  outs = [stateful(_named(tokens[:, :4], "batch", "seq"))]
  outs += [stateful(_named(tokens[:, t : t + 1], "batch", "seq")) for t in (4, 5, 6)]
  expected = np.concatenate(
      [np.asarray(o.unwrap("batch", "seq", "vocabulary")) for o in outs], 1
  )

  cached = KVCachingTransformerLM.from_uncached(model, 8, {"batch": 2})
  stateless, state = pz.unbind_state_vars(cached, freeze=True)
  step = jax.jit(lambda s, t: stateless.stateless_call(s, t))
  outs = []
  for chunk in (tokens[:, :4], *[tokens[:, t : t + 1] for t in range(4, 7)]):
    out, state = step(state, _named(chunk, "batch", "seq"))
    outs.append(np.asarray(out.unwrap("batch", "seq", "vocabulary")))
  np.testing.assert_allclose(np.concatenate(outs, 1), expected, atol=1e-5)
  # One compilation per distinct chunk length (prefill 4, then steps of 1).
  assert step._cache_size() == 2


def test_bad_inputs_give_clear_errors():
  model = _model("llama_gqa", True)
  cached = KVCachingTransformerLM.from_uncached(model, 8, {"batch": 2})
  with pytest.raises(ValueError, match="batch axes"):
    cached(_named(random_tokens((3, 2)), "batch", "seq"))
  with pytest.raises(ValueError, match="outside the vocabulary"):
    cached(_named(np.full((2, 2), 1000), "batch", "seq"))
  with pytest.raises(ValueError, match="'seq' axis"):
    cached(_named(random_tokens((2, 2)), "batch", "time"))
  with pytest.raises(ValueError, match="integer dtype"):
    cached(pz.nx.wrap(jnp.zeros((2, 2))).tag("batch", "seq"))
  with pytest.raises(ValueError, match="NamedArray"):
    cached(random_tokens((2, 2)))
  with pytest.raises(ValueError, match="cache_len"):
    KVCachingTransformerLM.from_uncached(model, 0, {"batch": 2})
  with pytest.raises(ValueError, match="used by the model"):
    KVCachingTransformerLM.from_uncached(model, 8, {"seq": 2})
  with pytest.raises(ValueError, match="is_padding must be a boolean"):
    cached(
        _named(random_tokens((2, 2)), "batch", "seq"),
        is_padding=_named(np.zeros((2, 3)), "batch", "seq"),
    )
  with pytest.raises(ValueError, match="pad_id"):
    KVCachingTransformerLM.from_uncached(model, 8, {"batch": 2}, pad_id=-1)
  assert int(cached.cache_end_index.value) == 0


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "unstacked"])
def test_state_keeps_its_structure_so_decode_compiles_once(stacked):
  cached = KVCachingTransformerLM.from_uncached(
      _model("gemma3", stacked), 8, {"batch": 1}
  )
  stateless, state = pz.unbind_state_vars(pz.freeze_params(cached), freeze=True)
  step = jax.jit(lambda s, t: stateless.stateless_call(s, t))
  for _ in range(3):
    _, new_state = step(state, _named(random_tokens((1, 1)), "batch", "seq"))
    assert jax.tree_util.tree_structure(new_state) == (
        jax.tree_util.tree_structure(state)
    )
    state = new_state
  assert step._cache_size() == 1
