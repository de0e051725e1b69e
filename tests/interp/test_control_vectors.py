"""ControlVector: validation and arithmetic (as llama.cpp combines files)."""

import numpy as np
import pytest

from penzai_lm.interp import ControlVector
from tests.interp.conftest import HIDDEN
from tests.interp.conftest import make_cv
from tests.interp.conftest import vec


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
