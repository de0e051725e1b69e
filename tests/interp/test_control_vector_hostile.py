"""Hostile control-vector files: special files, a layer count that does not
match the tensors, and links planted where a vector is saved."""

import os

import numpy as np
import pytest

from penzai_lm.interp import load_control_vector
from penzai_lm.interp import save_control_vector
from tests.interp.conftest import make_cv
from tests.interp.conftest import vec
from tests.interp.conftest import write_cv_gguf
from tests.test_file_access import finishes



def test_a_fifo_is_refused_without_blocking(tmp_path):
  os.mkfifo(tmp_path / "cv.gguf")
  done, out = finishes(lambda: load_control_vector(tmp_path / "cv.gguf"))
  assert done, "load_control_vector blocked on a FIFO"
  assert isinstance(out.get("error"), ValueError), out
  assert "cv.gguf (a control-vector .gguf file) is a FIFO" in str(out["error"])


def test_a_layer_count_that_is_not_the_tensor_count_is_refused(tmp_path):
  path = write_cv_gguf(tmp_path / "cv.gguf", [("direction.1", vec(1))],
                       layer_count=40)
  with pytest.raises(ValueError, match="controlvector.layer_count is 40 but"
                     r" the file has 1 direction tensor\(s\)"):
    load_control_vector(path)
  # What llama.cpp's generator (int32) and repeng (uint32) write loads, and a
  # file without the key too (llama.cpp reads none of these keys).
  for signed, count in ((True, 2), (False, 2), (False, None)):
    path = write_cv_gguf(tmp_path / f"ok{signed}{count}.gguf",
                         [("direction.1", vec(1)), ("direction.2", vec(2))],
                         layer_count=count, signed=signed)
    assert sorted(load_control_vector(path).directions) == [1, 2]


def test_saving_replaces_a_planted_link_not_its_target(tmp_path):
  victim = tmp_path / "victim"
  victim.write_text("keep me")
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "cv.gguf").symlink_to(victim)
  cv = make_cv()
  save_control_vector(cv, tmp_path / "out" / "cv.gguf")
  assert victim.read_text() == "keep me"
  assert not (tmp_path / "out" / "cv.gguf").is_symlink()
  loaded = load_control_vector(tmp_path / "out" / "cv.gguf")
  for block, direction in cv.directions.items():
    np.testing.assert_array_equal(loaded.directions[block], direction)
  assert [p.name for p in (tmp_path / "out").iterdir()] == ["cv.gguf"]
