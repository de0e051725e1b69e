"""Penalties against a NumPy reference, and the sampler state helpers."""

import jax
import jax.numpy as jnp
import numpy as np

from penzai_lm.sampling import SamplingSettings
from penzai_lm.sampling import apply_penalties
from penzai_lm.sampling import init_sampler_state
from penzai_lm.sampling import penalize
from penzai_lm.sampling import sample_next
from penzai_lm.sampling import update_sampler_state
from tests.sampling import reference


def test_penalize_matches_reference():
  rng = np.random.default_rng(0)
  batch, vocab = 3, 50
  logits = rng.standard_normal((batch, vocab)).astype(np.float32) * 3
  logits[:, :5] = [0.0, 2.0, -2.0, 1e-3, -1e-3]  # Exact zero and signs.
  counts = rng.integers(0, 4, (batch, vocab)) * (rng.random((batch, vocab)) < .3)
  seen = (counts > 0) | (rng.random((batch, vocab)) < 0.2)
  seen[:, :5] = True
  rep = np.array([1.3, 0.8, 1.0], np.float32)
  pres = np.array([0.5, 0.0, -0.4], np.float32)
  freq = np.array([0.25, 1.0, 0.0], np.float32)
  got = penalize(jnp.asarray(logits), jnp.asarray(counts, jnp.int32),
                 jnp.asarray(seen), rep, pres, freq)
  want = reference.penalize(logits, counts, seen, rep, pres, freq)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  # HF semantics on row 0: positive divided, negative multiplied, zero kept.
  np.testing.assert_allclose(got[0, :3], [0.0, 2.0 / 1.3, -2.0 * 1.3],
                             rtol=1e-6)


def test_apply_penalties_is_identity_when_neutral():
  logits = jax.random.normal(jax.random.key(0), (2, 20))
  state = init_sampler_state(jnp.array([[1, 2], [3, 4]]), vocab_size=20)
  state = update_sampler_state(state, jnp.array([5, 6]))
  settings = SamplingSettings.make(2, 20)
  np.testing.assert_array_equal(apply_penalties(logits, settings, state),
                                logits)
  settings = SamplingSettings.make(2, 20, repetition_penalty=[1.0, 2.0])
  out = apply_penalties(logits, settings, state)
  np.testing.assert_array_equal(out[0], logits[0])
  assert not np.array_equal(out[1], logits[1])


def test_init_state_uses_mask_and_ignores_padding():
  tokens = jnp.array([[1, 2, 0, 0], [3, 3, 99, -1]])
  mask = jnp.array([[True, True, False, False], [True, True, True, True]])
  state = init_sampler_state(tokens, mask, vocab_size=10)
  want = np.zeros((2, 10), bool)
  want[0, [1, 2]] = True
  want[1, 3] = True  # 99 and -1 are out of range and dropped.
  np.testing.assert_array_equal(state.seen, want)
  np.testing.assert_array_equal(state.counts, np.zeros((2, 10)))


def test_update_counts_generated_tokens_only_for_active_rows():
  state = init_sampler_state(jnp.array([[1], [2]]), vocab_size=5)
  for tokens in ([4, 4], [4, 0]):
    state = update_sampler_state(state, jnp.array(tokens))
  state = update_sampler_state(state, jnp.array([3, 3]),
                               active=jnp.array([True, False]))
  np.testing.assert_array_equal(state.counts, [[0, 0, 0, 1, 2], [1, 0, 0, 0, 1]])
  np.testing.assert_array_equal(
      state.seen, [[0, 1, 0, 1, 1], [1, 0, 1, 0, 1]])


def test_penalties_steer_greedy_decoding():
  logits = jnp.array([[3.0, 2.0, 0.5, -3.0]] * 4 + [[-1.0, -2.5, -1.8, -4.0]])
  state = init_sampler_state(jnp.array([[1]] * 5), vocab_size=4)  # Prompt: 1.
  state = update_sampler_state(state, jnp.array([0] * 5))  # Generated: 0.
  settings = SamplingSettings.make(
      5, 4, temperature=0.0,
      repetition_penalty=[1.0, 8.0, 1.0, 1.0, 2.0],
      frequency_penalty=[0.0, 0.0, 2.0, 0.0, 0.0],
      presence_penalty=[0.0, 0.0, 0.0, 1.5, 0.0])
  tokens, logprobs = sample_next(logits, settings, state, 0)
  # 0: neutral. 1: 3/8, 2/8 < 0.5 (prompt tokens count too). 2 and 3: only
  # the generated token 0 is hit (3-2, 3-1.5 < 2). 4: negative logits are
  # multiplied: -2, -5 < -1.8.
  np.testing.assert_array_equal(tokens, [0, 2, 1, 1, 2])
  # The returned logprob is under the raw, unpenalised distribution.
  raw = jax.nn.log_softmax(logits)
  np.testing.assert_allclose(logprobs, raw[jnp.arange(5), tokens], rtol=1e-6)
