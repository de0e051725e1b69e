"""SamplingSettings.make: broadcasting, dense masks, pytree, validation."""

import jax
import numpy as np
import pytest

from penzai_lm.sampling import DEFAULT_TOP_K_CAP
from penzai_lm.sampling import SamplingSettings


def test_scalars_broadcast_and_dtypes():
  s = SamplingSettings.make(3, 10, temperature=0.5, top_k=4, seed=9)
  assert s.batch_size == 3
  np.testing.assert_allclose(s.temperature, [0.5] * 3)
  np.testing.assert_array_equal(s.top_k, [4] * 3)
  np.testing.assert_array_equal(s.seed, [9] * 3)
  assert s.temperature.dtype == np.float32
  assert s.top_k.dtype == np.int32
  assert s.seed.dtype == np.uint32
  assert s.logit_bias is None and s.banned_tokens is None
  assert s.top_k_cap == DEFAULT_TOP_K_CAP


def test_per_row_values():
  s = SamplingSettings.make(2, 10, temperature=[0.0, 1.0], top_p=(0.5, 1.0),
                            min_p=np.array([0.0, 0.1]), seed=[1, 2**32 - 1])
  np.testing.assert_allclose(s.temperature, [0.0, 1.0])
  np.testing.assert_allclose(s.top_p, [0.5, 1.0])
  np.testing.assert_allclose(s.min_p, [0.0, 0.1], rtol=1e-6)
  np.testing.assert_array_equal(s.seed, [1, 2**32 - 1])


def test_none_seed_draws_and_records_random_seeds():
  a = SamplingSettings.make(4, 10, seed=None)
  b = SamplingSettings.make(4, 10, seed=None)
  assert not np.array_equal(a.seed, b.seed)
  assert len(set(np.asarray(a.seed).tolist())) > 1  # Independent per row.
  mixed = SamplingSettings.make(2, 10, seed=[5, None])
  assert int(mixed.seed[0]) == 5


def test_logit_bias_and_banned_tokens_are_dense():
  s = SamplingSettings.make(2, 6, logit_bias={1: 2.5, 4: -1.0},
                            banned_tokens=[0, 5])
  np.testing.assert_allclose(s.logit_bias, [[0, 2.5, 0, 0, -1, 0]] * 2)
  np.testing.assert_array_equal(s.banned_tokens, [[1, 0, 0, 0, 0, 1]] * 2)
  s = SamplingSettings.make(2, 4, logit_bias=[{0: 1.0}, {}],
                            banned_tokens=[[3], []])
  np.testing.assert_allclose(s.logit_bias, [[1, 0, 0, 0], [0, 0, 0, 0]])
  np.testing.assert_array_equal(s.banned_tokens, [[0, 0, 0, 1], [0, 0, 0, 0]])


def test_always_dense_keeps_one_pytree_structure():
  a = SamplingSettings.make(2, 5, always_dense=True)
  b = SamplingSettings.make(2, 5, banned_tokens=[1], logit_bias={2: 1.0},
                            always_dense=True)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  assert a.logit_bias.shape == (2, 5) and a.banned_tokens.dtype == bool


def test_pytree_leaves_and_static_cap():
  from penzai_lm.sampling import FIELDS  # pylint: disable=g-import-not-at-top
  s = SamplingSettings.make(2, 5)
  # One array per numeric setting, and the seeds (no bias or bans: None).
  numeric = [f for f in FIELDS if f.kind in ("float", "int")]
  assert len(jax.tree.leaves(s)) == len(numeric) + 1
  other = SamplingSettings.make(2, 5, top_k_cap=8)
  assert jax.tree.structure(s) != jax.tree.structure(other)
  doubled = jax.tree.map(lambda x: x, other)
  assert doubled.top_k_cap == 8


BAD = [
    (dict(temperature=-0.1), r"temperature\[0\] = -0.1 is invalid: temperature "
     r"must be >= 0"),
    (dict(temperature=float("nan")), r"temperature\[0\] must be finite"),
    (dict(temperature=[1.0, 1.0, 1.0]),
     "got 3 values for temperature but the batch has 4 rows"),
    (dict(temperature="hot"), r"temperature\[0\] must be a real number"),
    (dict(top_p=0.0), r"top_p\[0\] = 0.0 is invalid: top_p must be in \(0, 1\]"),
    (dict(top_p=[1.0, 1.0, 1.5, 1.0]), r"top_p\[2\] = 1.5 is invalid"),
    (dict(top_p=float("nan")), r"top_p\[0\] must be finite"),
    (dict(top_k=-1), r"top_k\[0\] = -1 is invalid: top_k must be in \[0, "),
    (dict(top_k=2.5), r"top_k\[0\] must be an integer, got 2.5"),
    (dict(top_k=300), r"top_k_cap=256\] .*pass a larger top_k_cap"),
    (dict(top_k=[1, 2]), "got 2 values for top_k but the batch has 4 rows"),
    (dict(min_p=1.0), r"min_p\[0\] = 1.0 is invalid: min_p must be in \[0, 1\)"),
    (dict(min_p=-0.5), r"min_p\[0\] = -0.5 is invalid"),
    (dict(typical_p=0.0),
     r"typical_p\[0\] = 0.0 is invalid: typical_p must be in \(0, 1\]"),
    (dict(typical_p=[0.9, 0.9, 0.9, 1.2]), r"typical_p\[3\] = 1.2 is invalid"),
    (dict(epsilon_cutoff=1.0),
     r"epsilon_cutoff\[0\] = 1.0 is invalid: epsilon_cutoff must be in \[0, 1\)"),
    (dict(eta_cutoff=-1e-4), r"eta_cutoff\[0\] = -0.0001 is invalid"),
    (dict(eta_cutoff=float("nan")), r"eta_cutoff\[0\] must be finite"),
    (dict(repetition_penalty=0.0),
     r"repetition_penalty\[0\] = 0.0 is invalid: repetition_penalty must be > 0"),
    (dict(repetition_penalty=-1.2), r"repetition_penalty\[0\] = -1.2"),
    (dict(presence_penalty=float("inf")), r"presence_penalty\[0\] must be finite"),
    (dict(frequency_penalty=[0.0] * 5),
     "got 5 values for frequency_penalty but the batch has 4 rows"),
    (dict(seed=1.5), r"seed\[0\] must be an integer, got 1.5"),
    (dict(seed=True), r"seed\[0\] must be an integer, got True"),
    (dict(seed=-1), r"seed\[0\] = -1 is invalid: seed must be in \[0, 2\*\*32\)"),
    (dict(seed=2**32), r"seed must be in \[0, 2\*\*32\)"),
    (dict(seed=[1, 2, 3]), "got 3 values for seed but the batch has 4 rows"),
    (dict(logit_bias={10: 1.0}),
     r"logit_bias\[0\]: token id 10 is outside the vocabulary \[0, 10\)"),
    (dict(logit_bias={-1: 1.0}), r"token id -1 is outside the vocabulary"),
    (dict(logit_bias={"a": 1.0}), "token ids must be integers"),
    (dict(logit_bias={1: float("nan")}), "must be finite"),
    (dict(logit_bias=[{1: 1.0}] * 3),
     "got 3 values for logit_bias but the batch has 4 rows"),
    (dict(logit_bias=[1, 2]), "logit_bias must be a dict"),
    (dict(banned_tokens=[3, 12]),
     r"banned_tokens\[0\]: token id 12 is outside the vocabulary \[0, 10\)"),
    (dict(banned_tokens=[[1], [2], [3]]),
     "got 3 values for banned_tokens but the batch has 4 rows"),
    (dict(banned_tokens=[1, [2]]), "mixes token ids and lists"),
    (dict(banned_tokens=5), "banned_tokens must be a list"),
    (dict(banned_tokens=list(range(10))), "bans the whole vocabulary"),
    (dict(top_k_cap=0), "top_k_cap must be a positive integer"),
]


@pytest.mark.parametrize("kwargs,message", BAD)
def test_bad_values_raise_helpful_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    SamplingSettings.make(4, 10, **kwargs)


@pytest.mark.parametrize("batch,vocab", [(0, 10), (2, 0), (2.0, 10)])
def test_bad_shapes(batch, vocab):
  with pytest.raises(ValueError, match="must be a positive integer"):
    SamplingSettings.make(batch, vocab)


def test_2d_per_row_array_is_rejected():
  with pytest.raises(ValueError, match="1-D sequence"):
    SamplingSettings.make(2, 10, temperature=np.ones((2, 1)))


def test_pad_rows_appends_neutral_rows():
  s = SamplingSettings.make(2, 6, temperature=[0.0, 0.5], top_k=3,
                            repetition_penalty=1.5, seed=[4, 5],
                            logit_bias={1: 2.0}, always_dense=True)
  padded = s.pad_rows(4)
  assert padded.batch_size == 4 and padded.top_k_cap == s.top_k_cap
  np.testing.assert_allclose(padded.temperature, [0.0, 0.5, 1.0, 1.0])
  np.testing.assert_array_equal(padded.top_k, [3, 3, 0, 0])
  np.testing.assert_allclose(padded.repetition_penalty, [1.5, 1.5, 1, 1])
  np.testing.assert_array_equal(padded.seed, [4, 5, 0, 0])
  np.testing.assert_allclose(padded.logit_bias[:, 1], [2, 2, 0, 0])
  assert not np.asarray(padded.banned_tokens).any()
  assert jax.tree.structure(padded) == jax.tree.structure(s)
  assert s.pad_rows(2) is s
  with pytest.raises(ValueError, match="cannot pad 2 rows down to 1"):
    s.pad_rows(1)


def test_every_field_is_a_make_keyword_and_unknown_ones_are_refused():
  from penzai_lm.sampling import FIELDS  # pylint: disable=g-import-not-at-top
  s = SamplingSettings.make(1, 5, **{f.name: f.neutral for f in FIELDS})
  assert all(hasattr(s, f.name) for f in FIELDS)
  with pytest.raises(TypeError, match=r"unknown sampling setting\(s\)"
                     r" \['temprature'\]"):
    SamplingSettings.make(1, 5, temprature=0.5)


def test_top_k_cap_for_large_top_k():
  from penzai_lm.sampling import top_k_cap_for  # pylint: disable=g-import-not-at-top
  assert top_k_cap_for(0, 1000) == DEFAULT_TOP_K_CAP
  assert top_k_cap_for([5, 300], 1000) == 512
  assert top_k_cap_for(900, 600) == 1024  # The sampler takes min(cap, vocab).
