"""Per-row values given as ``jax.Array``: accepted wherever lists and numpy
arrays are (`SamplingSettings.make`, the request's row options and
``generate``), with the same result; a 0-d array is a scalar; a traced
value is refused with an explanation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from penzai_lm.generation import row_options
from penzai_lm.sampling import FIELDS
from penzai_lm.sampling import SamplingSettings
from penzai_lm.sampling import top_k_cap_for
from penzai_lm.sampling.row_values import host_value

BATCH, VOCAB = 3, 20

# One valid per-row list per numeric setting of the table.
PER_ROW = {
    "repetition_penalty": [1.0, 1.3, 0.8],
    "presence_penalty": [0.0, 0.5, -1.0],
    "frequency_penalty": [0.25, 0.0, 2.0],
    "temperature": [0.0, 0.7, 1.5],
    "top_k": [0, 5, 19],
    "top_p": [1.0, 0.9, 0.25],
    "min_p": [0.0, 0.05, 0.5],
    "typical_p": [1.0, 0.5, 0.9],
    "epsilon_cutoff": [0.0, 1e-3, 0.1],
    "eta_cutoff": [0.0, 3e-4, 0.01],
    "xtc_probability": [0.0, 0.5, 1.0],
    "xtc_threshold": [0.1, 0.0, 0.7],
}


def test_every_numeric_setting_is_covered():
  numeric = {f.name for f in FIELDS if f.kind in ("float", "int")}
  assert set(PER_ROW) == numeric


def _forms(values, dtype):
  """The same per-row values as a list, a tuple, numpy and JAX arrays."""
  return [list(values), tuple(values), np.asarray(values, dtype),
          jnp.asarray(values, dtype)]


def _assert_same(a: SamplingSettings, b: SamplingSettings):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", sorted(PER_ROW))
def test_per_row_arrays_equal_lists(name):
  field = next(f for f in FIELDS if f.name == name)
  dtype = np.int32 if field.kind == "int" else np.float32
  values = PER_ROW[name]
  want = SamplingSettings.make(BATCH, VOCAB, **{name: values})
  for form in _forms(values, dtype):
    _assert_same(SamplingSettings.make(BATCH, VOCAB, **{name: form}), want)
  if field.kind == "float":  # float64 and bfloat16 arrays too.
    _assert_same(SamplingSettings.make(
        BATCH, VOCAB, **{name: np.asarray(values, np.float64)}), want)
    rounded = SamplingSettings.make(BATCH, VOCAB, **{
        name: [float(v) for v in jnp.asarray(values, jnp.bfloat16)]})
    _assert_same(SamplingSettings.make(
        BATCH, VOCAB, **{name: jnp.asarray(values, jnp.bfloat16)}), rounded)


@pytest.mark.parametrize("name", sorted(PER_ROW))
def test_0d_arrays_are_scalars(name):
  field = next(f for f in FIELDS if f.name == name)
  dtype = np.int32 if field.kind == "int" else np.float32
  value = PER_ROW[name][1]
  want = SamplingSettings.make(BATCH, VOCAB, **{name: value})
  for form in (np.asarray(value, dtype), jnp.asarray(value, dtype),
               dtype(value)):
    _assert_same(SamplingSettings.make(BATCH, VOCAB, **{name: form}), want)


def test_seeds_token_sets_and_bias_as_arrays():
  want = SamplingSettings.make(
      BATCH, VOCAB, seed=[1, 2, 2**32 - 1], banned_tokens=[[1, 2], [3], []],
      logit_bias=[{1: 0.5}, {}, {4: -2.0}])
  for seed in _forms([1, 2, 2**32 - 1], np.uint32):
    got = SamplingSettings.make(
        BATCH, VOCAB, seed=seed,
        banned_tokens=[jnp.asarray([1, 2]), np.asarray([3]), []],
        logit_bias=[{1: jnp.float32(0.5)}, {}, {4: jnp.asarray(-2.0)}])
    _assert_same(got, want)
  one_list = SamplingSettings.make(BATCH, VOCAB, banned_tokens=[5, 6])
  for banned in _forms([5, 6], np.int32):
    _assert_same(SamplingSettings.make(BATCH, VOCAB, banned_tokens=banned),
                 one_list)
  per_row = SamplingSettings.make(BATCH, VOCAB,
                                  banned_tokens=[[1, 2], [3, 4], [5, 6]])
  _assert_same(SamplingSettings.make(
      BATCH, VOCAB, banned_tokens=jnp.asarray([[1, 2], [3, 4], [5, 6]])),
               per_row)
  _assert_same(SamplingSettings.make(BATCH, VOCAB, seed=jnp.uint32(9)),
               SamplingSettings.make(BATCH, VOCAB, seed=9))
  assert top_k_cap_for(jnp.asarray([5, 300]), 1000) == top_k_cap_for(
      [5, 300], 1000)


def test_array_values_are_still_checked():
  with pytest.raises(ValueError, match=r"temperature\[1\] = -1.0 is invalid"):
    SamplingSettings.make(2, VOCAB, temperature=jnp.asarray([0.5, -1.0]))
  with pytest.raises(ValueError, match=r"top_k\[0\] must be an integer"):
    SamplingSettings.make(2, VOCAB, top_k=jnp.asarray([1.5, 2.0]))
  with pytest.raises(ValueError, match=r"temperature\[0\] must be a real"):
    SamplingSettings.make(2, VOCAB, temperature=jnp.asarray([True, False]))
  with pytest.raises(ValueError, match="got 3 values for top_p"):
    SamplingSettings.make(2, VOCAB, top_p=jnp.asarray([0.5, 0.6, 0.7]))
  with pytest.raises(ValueError, match="1-D sequence"):
    SamplingSettings.make(2, VOCAB, temperature=jnp.ones((2, 1)))
  with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*32\)"):
    SamplingSettings.make(2, VOCAB, seed=jnp.asarray([-1, 3]))


def test_traced_values_are_refused_with_an_explanation():
  with pytest.raises(ValueError, match="temperature is a traced JAX value"):
    jax.jit(lambda t: SamplingSettings.make(2, VOCAB, temperature=t).top_k)(
        jnp.ones(2))
  with pytest.raises(ValueError, match="max_new_tokens is a traced JAX"):
    jax.jit(lambda n: jnp.asarray(row_options.max_new_rows(n, 2, 1)))(
        jnp.asarray([2, 3]))
  with pytest.raises(ValueError, match="seed is a traced JAX value"):
    jax.jit(lambda s: jnp.asarray(row_options.row_seeds(s, 2, 1)))(
        jnp.asarray([2, 3], jnp.uint32))


def test_host_value_leaves_other_values_alone():
  values = [1, 2.5, "x", None, {3: 1.0}, (4, 5)]
  assert host_value("v", values) is values
  assert host_value("v", np.asarray(2.0)) == 2.0
  assert isinstance(host_value("v", np.asarray(2.0)), float)
  assert host_value("v", [jnp.int32(3)]) == [3]


# --- The request's row options (generation/row_options.py) ------------------


@pytest.mark.parametrize("num_samples", [1, 2])
def test_row_options_accept_arrays(num_samples):
  n = 2
  for form in _forms([3, 5], np.int32):
    assert row_options.max_new_rows(form, n, num_samples) == (
        row_options.max_new_rows([3, 5], n, num_samples))
  for form in _forms([1, 2], np.int32):
    assert row_options.min_new_rows(form, n, num_samples, (3,) * 4) == (
        row_options.min_new_rows([1, 2], n, num_samples, (3,) * 4))
  for form in _forms([7, 11], np.uint32):
    assert row_options.row_seeds(form, n, num_samples) == (
        row_options.row_seeds([7, 11], n, num_samples))
  assert row_options.row_seeds(jnp.uint32(7), n, num_samples) == (
      row_options.row_seeds(7, n, num_samples))
  assert row_options.max_new_rows(jnp.asarray(4), n, num_samples) == (
      (4,) * (n * num_samples))
  for name in ("stop_tokens", "forced_tokens"):
    want = row_options.token_lists(name, [[1, 2], [3, 4]], n, num_samples,
                                   VOCAB)
    for form in _forms([[1, 2], [3, 4]], np.int32):
      assert row_options.token_lists(name, form, n, num_samples,
                                     VOCAB) == want
    assert row_options.token_lists(
        name, [jnp.asarray([1, 2]), np.asarray([3, 4])], n, num_samples,
        VOCAB) == want
    flat = row_options.token_lists(name, [5, 6], n, num_samples, VOCAB)
    assert row_options.token_lists(name, jnp.asarray([5, 6]), n,
                                   num_samples, VOCAB) == flat
  rows = row_options.expand_rows("temperature", jnp.asarray([0.0, 0.5]), n,
                                 num_samples)
  assert rows == row_options.expand_rows("temperature", [0.0, 0.5], n,
                                         num_samples)


def test_generate_takes_jax_arrays_and_xtc():
  """``generate`` with per-row jax.Array values (XTC's included) returns
  what the same values as lists return."""
  # pylint: disable=g-import-not-at-top
  from penzai_lm.generation import generate
  from penzai_lm.model import TransformerConfig
  from penzai_lm.model import build_transformer
  # pylint: enable=g-import-not-at-top
  config = TransformerConfig(
      family="llama", vocab_size=64, hidden_size=16, num_layers=1,
      num_heads=2, num_kv_heads=1, head_dim=8, mlp_hidden_size=32,
      max_position_embeddings=64, use_layer_stack=False)
  model = build_transformer(config, seed=0)
  prompts = [[1, 2, 3], [4, 5, 6]]
  lists = dict(temperature=[0.0, 0.7], max_new_tokens=[2, 3],
               min_new_tokens=[1, 0], seed=[1, 2], top_k=[0, 8],
               xtc_probability=[0.0, 1.0], xtc_threshold=[0.1, 0.05],
               stop_tokens=[[7, 8], [9, 10]])
  arrays = dict(temperature=jnp.asarray([0.0, 0.7]),
                max_new_tokens=jnp.asarray([2, 3]),
                min_new_tokens=jnp.asarray([1, 0]),
                seed=jnp.asarray([1, 2], jnp.uint32),
                top_k=np.asarray([0, 8]),
                xtc_probability=jnp.asarray([0.0, 1.0]),
                xtc_threshold=jnp.asarray([0.1, 0.05]),
                stop_tokens=jnp.asarray([[7, 8], [9, 10]]))
  want = generate(model, prompts, **lists)
  got = generate(model, prompts, **arrays)
  assert got.tokens == want.tokens and got.seeds == want.seeds
