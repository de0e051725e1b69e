"""ControlVector: validation, arithmetic (as llama.cpp combines files) and
applying one to a model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

import penzai_lm
from penzai_lm import generation
from penzai_lm import interp
from penzai_lm.interp import ControlVector
from penzai_lm.runtime.unstack import unstack_layers
from tests.interp.conftest import HIDDEN
from tests.interp.conftest import make_cv
from tests.interp.conftest import vec
from tests.model.configs import config


# --- Arithmetic -------------------------------------------------------------


def test_scaled():
  cv = make_cv()
  s = cv.scaled(-2.5)
  assert s.model_hint == cv.model_hint and s.blocks == cv.blocks
  for i, v in cv.directions.items():
    assert s.directions[i].dtype == np.float32
    np.testing.assert_array_equal(s.directions[i], v * np.float32(-2.5))
  with pytest.raises(ValueError, match="finite"):
    cv.scaled(float("nan"))
  with pytest.raises(ValueError, match="real number"):
    cv.scaled("2")


def test_add_sums_per_block_like_llama_cpp():
  a = make_cv(blocks=(1, 2))
  b = ControlVector(directions={2: vec(20), 4: vec(40)}, model_hint=None)
  c = a + b
  assert c.blocks == (1, 2, 4)
  assert c.model_hint == "llama"
  np.testing.assert_array_equal(c.directions[1], a.directions[1])
  np.testing.assert_array_equal(c.directions[2], vec(2) + vec(20))
  np.testing.assert_array_equal(c.directions[4], vec(40))
  # --control-vector-scaled A 0.5 --control-vector-scaled B 2 == sum of scaled.
  combo = a.scaled(0.5) + b.scaled(2)
  np.testing.assert_array_equal(
      combo.directions[2],
      vec(2) * np.float32(0.5) + vec(20) * np.float32(2))
  assert sum([a, b]) == a + b


def test_add_rejects_size_mismatch_and_warns_on_hints():
  with pytest.raises(ValueError, match="hidden sizes 8 and 4"):
    make_cv() + make_cv(size=4)
  with pytest.warns(UserWarning, match="different model hints"):
    c = make_cv(hint="llama") + make_cv(hint="gemma")
  assert c.model_hint == "llama"
  with pytest.raises(TypeError):
    make_cv() + 1


def test_restricted_matches_layer_range_numbering():
  cv = make_cv(blocks=(1, 2, 5, 9))
  # --control-vector-layer-range 2 5: inclusive, same numbers.
  assert cv.restricted(2, 5).blocks == (2, 5)
  assert cv.restricted(0, 100).blocks == (1, 2, 5, 9)
  assert cv.restricted(9, 9).blocks == (9,)
  with pytest.raises(ValueError, match=r"no direction in blocks 3\.\.4"):
    cv.restricted(3, 4)
  with pytest.raises(ValueError, match="start 5 > end 2"):
    cv.restricted(5, 2)
  with pytest.raises(ValueError, match=">= 0"):
    cv.restricted(-1, 2)


def test_for_layers():
  cv = make_cv(blocks=(0, 3))
  stacked = cv.for_layers(4)
  assert stacked.shape == (4, HIDDEN) and stacked.dtype == np.float32
  np.testing.assert_array_equal(stacked[0], cv.directions[0])
  np.testing.assert_array_equal(stacked[3], cv.directions[3])
  assert not stacked[1].any() and not stacked[2].any()
  with pytest.raises(ValueError, match=r"blocks \[3\].*only 3 blocks"):
    cv.for_layers(3)
  with pytest.raises(ValueError, match="positive int"):
    cv.for_layers(0)


# --- ControlVector validation ------------------------------------------------


def test_directions_are_normalized_and_read_only():
  cv = ControlVector(directions={np.int64(3): [1, 2, 3], 1: np.ones(3)})
  assert list(cv.directions) == [1, 3]
  assert all(type(k) is int for k in cv.directions)
  assert cv.directions[3].dtype == np.float32
  assert cv.hidden_size == 3
  assert cv.model_hint is None
  with pytest.raises(ValueError):
    cv.directions[1][0] = 5.0
  assert "blocks=[1, 3]" in repr(cv)


@pytest.mark.parametrize("directions,match", [
    ({1: np.ones(4), 2: np.ones(5)}, "same size.*size 4: blocks \\[1\\]"),
    ({1: np.array([1.0, np.nan])}, "block 1 has 1 non-finite"),
    ({1: np.array([1.0, np.inf])}, "non-finite"),
    ({1: np.array([1e39])}, "non-finite"),  # Overflows float32.
    ({-1: np.ones(4)}, "negative"),
    ({1: np.ones((2, 4))}, r"shape \(2, 4\).*1-D"),
    ({1: np.ones(())}, "1-D"),
    ({1: np.ones(0)}, "empty"),
    ({1: np.array(["a"])}, "dtype"),
    ({1.0: np.ones(4)}, "integer block indices"),
    ({True: np.ones(4)}, "integer block indices"),
    ({}, "at least one direction"),
])
def test_invalid_control_vectors(directions, match):
  with pytest.raises(ValueError, match=match):
    ControlVector(directions=directions)


def test_invalid_model_hint():
  with pytest.raises(ValueError, match="model_hint"):
    ControlVector(directions={1: np.ones(2)}, model_hint=3)


# --- Applying to a model ----------------------------------------------------

WIDTH = 32  # The tiny llama_gqa model: hidden size 32, 3 blocks.
IDS = [1, 2, 3, 4, 5, 6]


@functools.cache
def _models():
  """The same weights as a layer stack and as per-layer blocks."""
  stacked = penzai_lm.build_transformer(config("llama_gqa", True), seed=3)
  return stacked, unstack_layers(stacked)


@jax.jit
def _jit_logits(model, tokens):
  return model(tokens)


def _logits(model):
  tokens = pz.nx.wrap(jnp.asarray([IDS], jnp.int32)).tag("batch", "seq")
  out = _jit_logits(pz.freeze_params(model), tokens)
  return np.asarray(out.unwrap("batch", "seq", "vocabulary"))


def _add_vectors(model):
  return pz.select(model).at_instances_of(interp.AddVector).get_sequence()


def test_apply_equals_inserting_add_vectors():
  cv = make_cv(blocks=(0, 2), size=WIDTH)
  for model in _models():
    manual = model
    for i, v in cv.directions.items():
      manual = interp.insert_at(manual, f"blocks.{i}.resid_post",
                                interp.AddVector.build(v, 2.5))
    steered = _logits(cv.apply(model, strength=2.5))
    np.testing.assert_allclose(steered, _logits(manual), rtol=1e-5,
                               atol=1e-5)
    assert np.abs(steered - _logits(model)).max() > 1e-2


def test_apply_is_the_same_on_both_layouts():
  stacked, unstacked = _models()
  cv = make_cv(blocks=(1, 2), size=WIDTH)
  a, b = cv.apply(stacked, -3.0), cv.apply(unstacked, -3.0)
  np.testing.assert_allclose(_logits(a), _logits(b), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(_logits(a), _logits(cv.scaled(-3.0).apply(
      stacked)), rtol=1e-5, atol=1e-5)
  # A stack gets one layer with a direction per block (zero for block 0);
  # per-layer blocks one per steered block.
  (layer,) = _add_vectors(a)
  assert dict(layer.vector.named_shape) == {"blocks": 3, "embedding": WIDTH}
  assert not np.asarray(layer.vector.unwrap("blocks", "embedding"))[0].any()
  assert len(_add_vectors(b)) == 2
  # Which blocks is data: any vector gives the stack the same structure.
  other = make_cv(blocks=(0,), size=WIDTH).apply(stacked)
  assert (jax.tree_util.tree_structure(pz.freeze_params(other))
          == jax.tree_util.tree_structure(pz.freeze_params(a)))
  # A cached model is steered alike.
  cached = penzai_lm.KVCachingTransformerLM.from_uncached(
      stacked, 8, {"batch": 1})
  assert len(_add_vectors(cv.apply(cached))) == 1


def test_apply_errors():
  stacked, unstacked = _models()
  for model in (stacked, unstacked):
    with pytest.raises(ValueError, match="has size 8 but the model's hidden"
                       " size is 32.*model_hint='llama'"):
      make_cv(size=8).apply(model)
    with pytest.raises(ValueError, match=r"blocks \[3, 5\] but the model has"
                       r" only 3 blocks \(0\.\.2\).*restricted\(0, 2\)"):
      make_cv(blocks=(1, 3, 5), size=WIDTH).apply(model)
    with pytest.raises(ValueError, match="strength must be finite"):
      make_cv(blocks=(1,), size=WIDTH).apply(model, float("inf"))
    with pytest.raises(ValueError, match=r"strength\[1\] must be finite"):
      make_cv(blocks=(1,), size=WIDTH).apply(model, [1.0, float("nan")])
    for bad in ([[1.0, 2.0]], [], ["4"], [True, False]):
      with pytest.raises(ValueError, match="strength must be a real number"
                         " or a non-empty 1-D list"):
        make_cv(blocks=(1,), size=WIDTH).apply(model, bad)
    with pytest.raises(ValueError, match="where must be 'all', 'prompt'"):
      make_cv(blocks=(1,), size=WIDTH).apply(model, 1.0, where="everywhere")
  with pytest.raises(TypeError, match="expected a penzai_lm TransformerLM"):
    make_cv().apply(object())


PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
STEERED = "blocks.2.resid_post"


@pytest.mark.parametrize("layout", ["stacked", "unstacked"])
def test_apply_per_row_strengths_with_where_equal_separate_runs(layout):
  """Issue 28's probe: ``apply(model, [0, 4, 8], where=...)`` steers three
  rows of one generate call as three calls with one strength each do (the
  tokens, and the steered point's values at every position)."""
  model = dict(zip(["stacked", "unstacked"], _models()))[layout]
  cv = make_cv(blocks=(0, 2), size=WIDTH)
  strengths = [0.0, 4.0, 8.0]
  engine = generation.Engine()
  run = dict(max_new_tokens=5, capture=[STEERED], temperature=0.0,
             stop_tokens=[])
  plain = engine.generate(model, PROMPTS, **run)
  for where in ("generated", interp.TokenRule.positions([1, 0, 2], 5)):
    batched = engine.generate(cv.apply(model, strengths, where=where),
                              PROMPTS, **run)
    for row, strength in enumerate(strengths):
      rule = where if isinstance(where, str) else interp.TokenRule.positions(
          int(where.start.data_array[row]), 5)
      alone = engine.generate(cv.apply(model, strength, where=rule),
                              [PROMPTS[row]], **run)
      assert alone.tokens[0] == batched.tokens[row], (where, row)
      got, want = batched.captures[STEERED][row], alone.captures[STEERED][0]
      np.testing.assert_allclose(
          np.asarray(got.unwrap(*want.named_shape)),
          np.asarray(want.unwrap(*want.named_shape)), atol=1e-5)
    assert batched.tokens[0] == plain.tokens[0]  # Strength 0.
    assert len(set(map(tuple, batched.tokens))) == 3  # Steering acted.
    if where == "generated":
      # The prompt is not steered: its values are the plain model's.
      for row, prompt in enumerate(PROMPTS):
        got = batched.captures[STEERED][row]
        base = plain.captures[STEERED][row]
        sl = {"seq": pz.slice[:len(prompt)]}
        np.testing.assert_allclose(
            np.asarray(got[sl].unwrap(*got.named_shape)),
            np.asarray(base[sl].unwrap(*got.named_shape)), atol=1e-6)
