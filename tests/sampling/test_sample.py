"""sample_next: greedy equivalences, logprobs, batch invariance, seeds,
compilation behaviour and shape errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from penzai_lm.sampling import SamplingSettings
from penzai_lm.sampling import init_sampler_state
from penzai_lm.sampling import sample_next
from penzai_lm.sampling import top_logprobs
from penzai_lm.sampling import update_sampler_state

_sample = jax.jit(sample_next)


def empty_state(batch, vocab):
  return init_sampler_state(jnp.zeros((batch, 1), jnp.int32),
                            jnp.zeros((batch, 1), bool), vocab_size=vocab)


def random_logits(batch, vocab, seed=0, scale=3.0):
  return jax.random.normal(jax.random.key(seed), (batch, vocab)) * scale


def with_ties(logits):
  """Puts the row maximum at two ids (3 and 7) to test tie-breaking."""
  top = jnp.max(logits, axis=-1) + 1.0
  return logits.at[:, 3].set(top).at[:, 7].set(top)


@pytest.mark.parametrize("ties", [False, True])
def test_temperature_zero_is_argmax_and_ties_go_to_lowest_id(ties):
  logits = random_logits(6, 300)
  if ties:
    logits = with_ties(logits)
  settings = SamplingSettings.make(6, 300, temperature=0.0, seed=range(6))
  for step in range(3):
    tokens, _ = _sample(logits, settings, empty_state(6, 300), step)
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1))
  if ties:
    np.testing.assert_array_equal(tokens, [3] * 6)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("kwargs", [
    dict(top_k=1), dict(top_k=1, top_k_cap=1), dict(top_p=1e-6),
    dict(top_p=1e-6, top_k_cap=2), dict(top_k=1, top_p=0.5, min_p=0.5),
])
def test_top_k_1_and_tiny_top_p_are_greedy(kwargs, ties):
  batch, vocab = 8, 500
  logits = random_logits(batch, vocab, scale=0.5)  # Flat: hard for top-p.
  if ties:
    logits = with_ties(logits)
  settings = SamplingSettings.make(batch, vocab, temperature=1.7,
                                   seed=range(batch), **kwargs)
  for step in range(5):
    tokens, _ = _sample(logits, settings, empty_state(batch, vocab), step)
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1))


def test_logprob_is_raw_log_softmax_of_the_chosen_token():
  logits = random_logits(4, 100)
  settings = SamplingSettings.make(
      4, 100, temperature=[0.0, 0.5, 1.0, 2.0], top_k=[0, 0, 3, 0],
      repetition_penalty=1.5, logit_bias={5: 3.0}, seed=range(4))
  tokens, logprobs = _sample(logits, settings, empty_state(4, 100), 0)
  want = jax.nn.log_softmax(logits)[jnp.arange(4), tokens]
  np.testing.assert_allclose(logprobs, want, rtol=1e-6, atol=1e-6)


def test_top_logprobs():
  logits = with_ties(random_logits(3, 50))
  values, ids = top_logprobs(logits, 4)
  log_probs = np.asarray(jax.nn.log_softmax(logits))
  order = np.argsort(-log_probs, axis=-1, kind="stable")[:, :4]
  np.testing.assert_array_equal(ids, order)
  np.testing.assert_allclose(values, np.take_along_axis(log_probs, order, -1),
                             rtol=1e-6)
  with pytest.raises(ValueError, match=r"n must be in \[1, vocab=50\]"):
    top_logprobs(logits, 51)


# --- Batch invariance ---------------------------------------------------------

VOCAB = 1000
ROW_SETTINGS = [  # One dict per logical row; each exercises another path.
    dict(temperature=0.0, repetition_penalty=1.3, seed=11),
    dict(temperature=0.9, min_p=0.05, presence_penalty=0.7, seed=12),
    dict(temperature=0.8, top_k=20, top_p=0.9, frequency_penalty=0.3, seed=13),
    dict(temperature=1.0, top_p=0.95, seed=14),  # Flat row: bisection path.
    dict(temperature=1.2, top_k=0, top_p=0.6, seed=15),
    dict(temperature=1.0, typical_p=0.8, seed=16),
    dict(temperature=0.7, top_k=30, epsilon_cutoff=1e-3, eta_cutoff=1e-3,
         seed=17),
    dict(temperature=1.0, top_p=0.9, typical_p=0.9, seed=18),  # Flat row.
]


def _row_logits(rows, prev_tokens):
  """Deterministic per-row logits that depend on the previous token."""
  rng = np.random.default_rng(0)
  base = rng.standard_normal((len(ROW_SETTINGS), VOCAB)) * 2.5
  base[[3, 7]] *= 0.2  # Near-uniform: nucleus beyond the 256 candidates.
  table = rng.standard_normal((VOCAB, VOCAB)) * 0.5
  return jnp.asarray(base[rows] + table[prev_tokens], jnp.float32)


def generate(rows, steps=50, step_offsets=None):
  """Decodes ``steps`` tokens for the given logical rows in one batch."""
  rows = np.asarray(rows)
  batch = len(rows)
  per_row = [ROW_SETTINGS[r] for r in rows]
  keys = ["temperature", "top_k", "top_p", "min_p", "typical_p",
          "epsilon_cutoff", "eta_cutoff", "repetition_penalty",
          "presence_penalty", "frequency_penalty", "seed"]
  defaults = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                  typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
                  repetition_penalty=1.0, presence_penalty=0.0,
                  frequency_penalty=0.0)
  settings = SamplingSettings.make(batch, VOCAB, **{
      k: [p.get(k, defaults.get(k)) for p in per_row] for k in keys})
  prompts = jnp.asarray(np.stack([np.arange(5) + 10 * r for r in rows]))
  state = init_sampler_state(prompts, vocab_size=VOCAB)
  offsets = np.zeros(batch, np.int32) if step_offsets is None else step_offsets
  prev = np.asarray(prompts[:, -1])
  tokens, logprobs = [], []
  for step in range(steps):
    logits = _row_logits(rows, prev)
    token, logprob = _sample(logits, settings, state, offsets + step)
    state = update_sampler_state(state, token)
    prev = np.asarray(token)
    tokens.append(prev)
    logprobs.append(np.asarray(logprob))
  return np.stack(tokens, 1), np.stack(logprobs, 1)


def test_rows_are_batch_invariant():
  rows = [0, 1, 2, 3, 5, 6, 7]  # Row 4 joins below.
  batched, batched_lp = generate(rows)
  slot_of = {r: slot for slot, r in enumerate(rows)}
  for r in rows:
    alone, alone_lp = generate([r])
    np.testing.assert_array_equal(alone[0], batched[slot_of[r]],
                                  err_msg=f"row {r}")
    np.testing.assert_allclose(alone_lp[0], batched_lp[slot_of[r]], rtol=1e-5)
  # Other slots, other neighbours (with their own step counters).
  mixed_rows = [4, 2, 0, 7, 3, 1, 5]
  mixed, _ = generate(mixed_rows, step_offsets=np.array([17, 0, 0, 0, 0, 0, 0]))
  for slot, r in enumerate(mixed_rows[1:], start=1):
    np.testing.assert_array_equal(mixed[slot], batched[slot_of[r]],
                                  err_msg=f"row {r}")
  # The rows really are random and take different tokens.
  for r in (1, 5, 7):
    assert len(set(batched[slot_of[r]].tolist())) > 10, f"row {r}"


def test_same_seed_reproduces_and_different_seeds_differ():
  logits = random_logits(1, 400, scale=1.0)
  state = empty_state(1, 400)

  def run(seed):
    settings = SamplingSettings.make(1, 400, top_p=0.9, seed=seed)
    return [int(_sample(logits, settings, state, s)[0][0]) for s in range(30)]

  assert run(5) == run(5)
  assert run(5) != run(6)


# --- Compilation ----------------------------------------------------------------

def test_changing_values_never_recompiles():
  # A fresh function: jit caches are shared by wrappers of the same function.
  fn = jax.jit(lambda *args: sample_next(*args))
  batch, vocab = 3, 200
  logits = random_logits(batch, vocab)
  state = empty_state(batch, vocab)
  variants = [
      dict(), dict(temperature=0.0), dict(top_k=[0, 5, 50]),
      dict(top_p=[0.1, 0.5, 0.99], temperature=0.3), dict(min_p=0.2),
      dict(repetition_penalty=2.0, presence_penalty=-1.0, seed=[4, 5, 6]),
      dict(top_k=7, top_p=0.3, min_p=0.1, frequency_penalty=1.0, seed=99),
      dict(banned_tokens=[1, 2], logit_bias={3: 1.0}),
      dict(typical_p=[0.5, 1.0, 0.9], top_k=[0, 10, 0]),
      dict(epsilon_cutoff=0.01, eta_cutoff=[0.0, 0.001, 0.1], top_p=0.8),
  ]
  for i, kwargs in enumerate(variants):
    settings = SamplingSettings.make(batch, vocab, always_dense=True, **kwargs)
    jax.block_until_ready(fn(logits, settings, state, jnp.full(3, i, jnp.int32)))
    jax.block_until_ready(fn(logits, settings, state, jnp.array([i, 2, 9])))
  assert fn._cache_size() == 1  # pylint: disable=protected-access


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU lowering")
def test_no_full_vocabulary_sort_in_the_compiled_step():
  batch, vocab = 2, 5000
  settings = SamplingSettings.make(batch, vocab)
  hlo = jax.jit(sample_next).lower(
      jnp.zeros((batch, vocab)), settings, empty_state(batch, vocab),
      0).compile().as_text()
  assert not re.search(r"\bsort\(", hlo)
  assert 'custom_call_target="TopK"' in hlo  # Partial sort, not a full one.


def test_runs_inside_a_while_loop():
  batch, vocab = 2, 64
  settings = SamplingSettings.make(batch, vocab, temperature=[0.0, 1.0],
                                   top_p=[1.0, 0.8], repetition_penalty=1.2)
  table = random_logits(vocab, vocab)

  @jax.jit
  def decode(state):
    def body(carry):
      step, prev, state, out = carry
      token, _ = sample_next(table[prev], settings, state, step)
      state = update_sampler_state(state, token)
      return step + 1, token, state, out.at[:, step].set(token)

    init = (0, jnp.zeros(batch, jnp.int32), state,
            jnp.zeros((batch, 12), jnp.int32))
    return jax.lax.while_loop(lambda c: c[0] < 12, body, init)[3]

  out = decode(empty_state(batch, vocab))
  assert out.shape == (batch, 12)
  assert ((out >= 0) & (out < vocab)).all()


# --- Errors -------------------------------------------------------------------------

def test_shape_errors_are_explained():
  settings = SamplingSettings.make(2, 10)
  with pytest.raises(ValueError, match=r"logits must have shape \(batch, vocab\)"):
    sample_next(jnp.zeros(10), settings, empty_state(2, 10), 0)
  with pytest.raises(ValueError, match="settings are for 2 rows but the logits "
                     "have 3"):
    sample_next(jnp.zeros((3, 10)), settings, empty_state(3, 10), 0)
  with pytest.raises(ValueError, match="sampler state has shape"):
    sample_next(jnp.zeros((2, 10)), settings, empty_state(2, 11), 0)
  dense = SamplingSettings.make(2, 12, always_dense=True)
  with pytest.raises(ValueError, match="logit_bias has shape"):
    sample_next(jnp.zeros((2, 10)), dense, empty_state(2, 10), 0)
