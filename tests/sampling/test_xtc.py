"""XTC ("exclude top choices"): the JAX sampler and the CPU kernel against a
reference written from llama.cpp's definition (`reference.xtc`), from the
same Gumbel noise and coins; edge cases, the distribution, greedy rows,
seeds and per-row values without recompiling."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from penzai_lm.sampling import SamplingSettings
from penzai_lm.sampling import init_sampler_state
from penzai_lm.sampling import sample_next
from penzai_lm.sampling import filters
from penzai_lm.sampling import sample as sample_lib
from tests.sampling import reference
from tests.sampling.test_distribution import SAMPLERS
from tests.sampling.test_distribution import assert_draws_follow
from tests.sampling.test_distribution import draw_counts

_SAMPLE = {False: jax.jit(sample_next),
           True: jax.jit(functools.partial(sample_next, kernel=True))}


def _state(batch, vocab):
  return init_sampler_state(jnp.zeros((batch, 1), jnp.int32),
                            jnp.zeros((batch, 1), bool), vocab_size=vocab)


def _two_level_draw(logp: np.ndarray, noise: np.ndarray) -> int:
  """`sample.sample_full_vocab` for one row, in numpy."""
  vocab = logp.shape[0]
  num_chunks, chunk = filters.chunk_shape(vocab)
  padded = np.full(num_chunks * chunk, -np.inf)
  padded[:vocab] = logp
  padded = padded.reshape(num_chunks, chunk)
  with np.errstate(divide="ignore"):
    mass = np.log(np.exp(padded - logp.max()).sum(-1))
  which = int(np.argmax(mass + noise[:num_chunks]))
  pick = int(np.argmax(padded[which] + noise[num_chunks:num_chunks + chunk]))
  return which * chunk + pick


def _reference_token(logits, row, settings, noise, coin, cap):
  """Row ``row``'s token: the reference distribution (HF filters, then
  llama.cpp's XTC), drawn as the sampler draws from the same noise."""
  def get(name):
    return float(np.asarray(getattr(settings, name))[row])

  top_k = int(np.asarray(settings.top_k)[row])
  base = reference.filtered_probs(logits, temperature=get("temperature"),
                                  top_k=top_k, min_p=get("min_p"))
  probs = reference.xtc(base, probability=get("xtc_probability"),
                        threshold=get("xtc_threshold"), coin=coin)
  with np.errstate(divide="ignore"):
    logp = np.log(probs)
  if top_k > 0:  # Over the candidates: value descending, ties to lower ids.
    order = np.argsort(-np.asarray(logits, np.float64), kind="stable")
    order = order[:min(cap, len(order))]
    return int(order[np.argmax(logp[order] + noise[:len(order)])])
  return _two_level_draw(logp, noise)


# Rows: (temperature, top_k, min_p, xtc_probability, xtc_threshold).
ROWS = [
    (1.0, 0, 0.0, 1.0, 0.1), (0.7, 0, 0.0, 1.0, 0.05),
    (1.5, 0, 0.02, 0.5, 0.1), (1.0, 20, 0.0, 1.0, 0.1),
    (0.8, 10, 0.0, 0.5, 0.02), (1.0, 5, 0.0, 1.0, 0.0),
    (1.0, 0, 0.0, 0.0, 0.1), (1.0, 20, 0.0, 1.0, 0.5),
    (1.0, 0, 0.0, 1.0, 0.6), (1.0, 0, 0.05, 1.0, 0.0),
    (1.2, 30, 0.01, 0.3, 0.2), (1.0, 3, 0.0, 1.0, 1.0),
]


@SAMPLERS
def test_choices_match_the_llama_cpp_reference(kernel):
  """Same tokens as the reference for the same noise and coins: rows over
  the vocabulary and over top-k candidates, probability 0 / 0.3 / 0.5 / 1,
  thresholds 0 to 1 (0.5 included, above it off)."""
  rng = np.random.default_rng(0)
  batch, vocab, cap = len(ROWS), 300, 256
  columns = list(zip(*ROWS))
  settings = SamplingSettings.make(
      batch, vocab, seed=list(range(100, 100 + batch)),
      temperature=list(columns[0]), top_k=list(columns[1]),
      min_p=list(columns[2]), xtc_probability=list(columns[3]),
      xtc_threshold=list(columns[4]))
  state = _state(batch, vocab)
  changed = 0
  for step in range(25):
    logits = rng.standard_normal((batch, vocab)) * rng.uniform(1, 3)
    # A few likely tokens per row: several reach the thresholds.
    for r in range(batch):
      top = rng.choice(vocab, rng.integers(1, 6), replace=False)
      logits[r, top] += rng.uniform(3, 7, len(top))
    logits = logits.astype(np.float32)
    steps = jnp.full((batch,), step, jnp.int32)
    keys = sample_lib.row_keys(settings.seed, steps)
    noise = np.asarray(sample_lib.row_gumbels(
        keys, sample_lib.noise_size(vocab, cap)), np.float64)
    coins = np.asarray(sample_lib.row_coins(keys))
    tokens, _ = _SAMPLE[kernel](logits, settings, state, steps)
    want = [_reference_token(logits[r], r, settings, noise[r], coins[r], cap)
            for r in range(batch)]
    np.testing.assert_array_equal(np.asarray(tokens), want,
                                  err_msg=f"step {step}")
    for r, row in enumerate(ROWS):
      base = reference.filtered_probs(logits[r], temperature=row[0],
                                      top_k=row[1], min_p=row[2])
      xtc = reference.xtc(base, probability=row[3], threshold=row[4],
                          coin=coins[r])
      changed += not np.array_equal(base, xtc)
  assert changed > 50  # The test is not vacuous: XTC acted often.


def _tied_logits(vocab, ids, value=6.0, seed=0):
  logits = np.random.default_rng(seed).standard_normal(vocab)
  logits[list(ids)] = value
  return logits.astype(np.float32)


@SAMPLERS
@pytest.mark.parametrize("top_k,threshold,expect_only", [
    (4, 0.25, 40),   # Four ties at p = 0.25 exactly: the last (highest id).
    (2, 0.5, 40),    # Two ties at p = 0.5: threshold 0.5 still applies.
    (5, 0.0, None),  # Threshold 0: only the least likely kept token stays.
])
def test_threshold_edges_keep_the_last_top_choice(top_k, threshold,
                                                  expect_only, kernel):
  vocab, batch = 100, 64
  tied = [3, 10, 20, 40][-min(top_k, 4):]
  logits = _tied_logits(vocab, tied)
  if expect_only is None:
    order = np.argsort(-logits.astype(np.float64), kind="stable")
    expect_only = int(order[top_k - 1])
  settings = SamplingSettings.make(batch, vocab, seed=list(range(batch)),
                                   top_k=top_k, xtc_probability=1.0,
                                   xtc_threshold=threshold)
  rows = np.broadcast_to(logits, (batch, vocab))
  for step in range(3):
    tokens, _ = _SAMPLE[kernel](rows, settings, _state(batch, vocab), step)
    assert set(np.asarray(tokens).tolist()) == {expect_only}


@SAMPLERS
@pytest.mark.parametrize("top_k,threshold", [
    (4, float(np.nextafter(np.float32(0.25), np.float32(1)))),  # Just above.
    (2, float(np.nextafter(np.float32(0.5), np.float32(1)))),  # Off (> 0.5).
])
def test_just_above_the_ties_nothing_is_removed(top_k, threshold, kernel):
  vocab, batch = 100, 256
  tied = [3, 10, 20, 40][-top_k:]
  logits = _tied_logits(vocab, tied)
  base = SamplingSettings.make(batch, vocab, seed=list(range(batch)),
                               top_k=top_k)
  xtc = SamplingSettings.make(batch, vocab, seed=list(range(batch)),
                              top_k=top_k, xtc_probability=1.0,
                              xtc_threshold=threshold)
  rows = np.broadcast_to(logits, (batch, vocab))
  want, _ = _SAMPLE[kernel](rows, base, _state(batch, vocab), 0)
  got, _ = _SAMPLE[kernel](rows, xtc, _state(batch, vocab), 0)
  np.testing.assert_array_equal(got, want)
  assert set(np.asarray(got).tolist()) == set(tied)


@SAMPLERS
@pytest.mark.parametrize("kwargs", [
    dict(xtc_probability=0.0, xtc_threshold=0.1),  # Off.
    dict(xtc_probability=1.0, xtc_threshold=0.1),  # One token above 0.1.
    dict(xtc_probability=1.0, xtc_threshold=0.6),  # Above 0.5: off.
    dict(xtc_probability=1.0, xtc_threshold=0.0, temperature=0.0),  # Greedy.
])
def test_rows_xtc_leaves_alone_choose_as_without_it(kwargs, kernel):
  """Same noise, same tokens: probability 0, fewer than two tokens above
  the threshold, a threshold above 0.5, greedy rows."""
  kwargs = dict(kwargs)  # Shared by the parametrized runs.
  vocab, batch = 500, 16
  rng = np.random.default_rng(1)
  logits = rng.standard_normal((batch, vocab)).astype(np.float32)
  logits[:, 7] += 9.0  # One dominant token (p ~ 0.94), the rest tiny.
  temperature = kwargs.pop("temperature", 1.0)
  for top_k in (0, 50):
    base = SamplingSettings.make(batch, vocab, seed=list(range(batch)),
                                 temperature=temperature, top_k=top_k)
    xtc = SamplingSettings.make(batch, vocab, seed=list(range(batch)),
                                temperature=temperature, top_k=top_k, **kwargs)
    for step in range(4):
      want, _ = _SAMPLE[kernel](logits, base, _state(batch, vocab), step)
      got, _ = _SAMPLE[kernel](logits, xtc, _state(batch, vocab), step)
      np.testing.assert_array_equal(got, want)


def _three_top_choices(vocab=100):
  """p = 0.4, 0.3, 0.2 for ids 0, 1, 2 and 0.1 spread over the others."""
  probs = np.full(vocab, 0.1 / (vocab - 3))
  probs[:3] = [0.4, 0.3, 0.2]
  return np.log(probs).astype(np.float32), probs


@SAMPLERS
@pytest.mark.parametrize("probability", [1.0, 0.5])
def test_distribution(probability, kernel):
  """With probability 1 the two most likely tokens (above the threshold
  0.1 with the third) are never drawn; with 0.5 the draws follow the
  mixture of the distributions with and without XTC."""
  logits, probs = _three_top_choices()
  excluded = reference.xtc(probs, probability=1.0, threshold=0.1, coin=0.0)
  assert excluded[0] == excluded[1] == 0 and excluded[2] > 0
  want = probability * excluded + (1 - probability) * probs
  assert_draws_follow(want, logits, kernel=kernel, xtc_probability=probability,
                      xtc_threshold=0.1)


@SAMPLERS
def test_top_token_never_drawn_over_candidates(kernel):
  logits, _ = _three_top_choices()
  counts = draw_counts(logits, kernel=kernel, top_k=10, xtc_probability=1.0,
                       xtc_threshold=0.1)
  assert counts[0] == counts[1] == 0 and counts[2] > 0


def test_coins_come_from_the_row_key_and_do_not_change_the_noise():
  seeds = jnp.asarray([5, 6, 5], jnp.uint32)
  steps = jnp.asarray([0, 0, 1], jnp.int32)
  keys = sample_lib.row_keys(seeds, steps)
  coins = np.asarray(sample_lib.row_coins(keys))
  assert coins.shape == (3,) and ((coins >= 0) & (coins < 1)).all()
  assert len(set(coins.tolist())) == 3
  alone = sample_lib.row_coins(sample_lib.row_keys(seeds[2:], steps[2:]))
  assert float(alone[0]) == coins[2]  # Batch invariant.
  noise = sample_lib.row_gumbels(keys, 8)
  plain = jax.vmap(lambda k: jax.random.gumbel(k, (8,), jnp.float32))(keys)
  np.testing.assert_array_equal(noise, plain)


@SAMPLERS
def test_same_seed_reproduces_and_coins_vary_by_step(kernel):
  logits, _ = _three_top_choices()
  batch = 8
  rows = np.broadcast_to(logits, (batch, logits.shape[0]))
  settings = SamplingSettings.make(batch, logits.shape[0],
                                   seed=list(range(batch)),
                                   xtc_probability=0.5)
  state = _state(batch, logits.shape[0])
  runs = [np.stack([np.asarray(_SAMPLE[kernel](rows, settings, state, s)[0])
                    for s in range(40)]) for _ in range(2)]
  np.testing.assert_array_equal(runs[0], runs[1])
  # The top token is drawn at some steps (coin > 0.5) and not others.
  assert 0 < np.mean(runs[0] == 0) < 0.4


@SAMPLERS
def test_per_row_values_never_recompile(kernel):
  fn = jax.jit(lambda *a: sample_next(*a, kernel=kernel))
  batch, vocab = 3, 200
  logits, _ = _three_top_choices(vocab)
  rows = np.broadcast_to(logits, (batch, vocab))
  state = _state(batch, vocab)
  variants = [
      dict(), dict(xtc_probability=1.0), dict(xtc_probability=[0.0, 0.5, 1.0]),
      dict(xtc_probability=1.0, xtc_threshold=[0.0, 0.1, 0.7]),
      dict(xtc_probability=0.3, xtc_threshold=0.2, top_k=[0, 5, 50]),
      dict(xtc_probability=1.0, typical_p=0.9, temperature=[0.0, 1.0, 2.0]),
  ]
  for i, kwargs in enumerate(variants):
    settings = SamplingSettings.make(batch, vocab, always_dense=True, **kwargs)
    jax.block_until_ready(fn(rows, settings, state, jnp.full(3, i, jnp.int32)))
  assert fn._cache_size() == 1  # pylint: disable=protected-access


@pytest.mark.parametrize("kwargs,message", [
    (dict(xtc_probability=1.5), r"xtc_probability\[0\] = 1.5 is invalid"),
    (dict(xtc_probability=-0.1), r"must be in \[0, 1\] \(0 turns XTC off\)"),
    (dict(xtc_threshold=-0.1), r"xtc_threshold\[0\] = -0.1 is invalid"),
    (dict(xtc_threshold=[0.1, 2.0]), r"xtc_threshold\[1\] = 2.0 is invalid"),
])
def test_bad_values_are_explained(kwargs, message):
  with pytest.raises(ValueError, match=message):
    SamplingSettings.make(2, 10, **kwargs)


def test_defaults_and_padding():
  s = SamplingSettings.make(2, 10, xtc_probability=[0.5, 1.0])
  np.testing.assert_allclose(s.xtc_probability, [0.5, 1.0])
  np.testing.assert_allclose(s.xtc_threshold, [0.1, 0.1])  # llama.cpp's.
  padded = s.pad_rows(3)
  np.testing.assert_allclose(padded.xtc_probability, [0.5, 1.0, 0.0])
