"""Control vectors in llama.cpp's GGUF format (shared with repeng)."""

import os
import warnings

import gguf
import numpy as np
import pytest

from penzai_lm.interp import ControlVector
from penzai_lm.interp import control_vector_files
from penzai_lm.interp import load_control_vector
from penzai_lm.interp import save_control_vector
from tests.interp.conftest import HIDDEN
from tests.interp.conftest import make_cv
from tests.interp.conftest import vec
from tests.interp.conftest import write_cv_gguf



def _repeng_export_gguf(directions, model_type, path):
  """repeng's ControlVector.export_gguf (vgel/repeng, repeng/extract.py)."""
  arch = "controlvector"
  writer = gguf.GGUFWriter(path, arch)
  writer.add_string(f"{arch}.model_hint", model_type)
  writer.add_uint32(f"{arch}.layer_count", len(directions))
  for layer in directions.keys():
    writer.add_tensor(f"direction.{layer}", directions[layer])
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def _repeng_import_gguf(path):
  """repeng's ControlVector.import_gguf, returning (model_type, directions)."""
  reader = gguf.GGUFReader(path)
  archf = reader.get_field("general.architecture")
  assert archf and len(archf.parts)
  arch = str(bytes(archf.parts[-1]), encoding="utf-8", errors="replace")
  assert arch == "controlvector"
  modelf = reader.get_field("controlvector.model_hint")
  if not modelf or not len(modelf.parts):
    raise ValueError(".gguf file missing controlvector.model_hint field")
  model_hint = str(bytes(modelf.parts[-1]), encoding="utf-8")
  directions = {}
  for tensor in reader.tensors:
    if not tensor.name.startswith("direction."):
      continue
    directions[int(tensor.name.split(".")[1])] = np.array(tensor.data)
  return model_hint, directions


# --- Round trips and the file layout -----------------------------------------


def test_round_trip_is_exact(tmp_path):
  cv = make_cv()
  path = tmp_path / "v.gguf"
  save_control_vector(cv, path)
  back = load_control_vector(path)
  assert back == cv
  assert back.model_hint == "llama"
  assert list(back.directions) == [1, 2, 5]
  for i, v in cv.directions.items():
    assert back.directions[i].dtype == np.float32
    np.testing.assert_array_equal(back.directions[i], v)


def test_round_trip_model_hint_override_and_none(tmp_path):
  cv = make_cv(hint=None)
  save_control_vector(cv, tmp_path / "a.gguf")
  assert load_control_vector(tmp_path / "a.gguf").model_hint is None
  save_control_vector(cv, tmp_path / "b.gguf", model_hint="gemma3")
  assert load_control_vector(tmp_path / "b.gguf").model_hint == "gemma3"
  save_control_vector(make_cv(hint="x"), tmp_path / "c.gguf", model_hint="y")
  assert load_control_vector(tmp_path / "c.gguf").model_hint == "y"


def test_file_matches_llama_cpp_expectations(tmp_path):
  cv = make_cv(blocks=(7, 1, 3))
  path = tmp_path / "v.gguf"
  save_control_vector(cv, path)
  reader = gguf.GGUFReader(path)

  arch = reader.fields["general.architecture"]
  assert arch.types == [gguf.GGUFValueType.STRING]
  assert arch.contents() == "controlvector"
  hint = reader.fields["controlvector.model_hint"]
  assert hint.types == [gguf.GGUFValueType.STRING]
  assert hint.contents() == "llama"
  count = reader.fields["controlvector.layer_count"]
  assert count.types == [gguf.GGUFValueType.UINT32]  # As repeng writes it.
  assert count.contents() == 3

  # direction.N keeps the 0-based block index (N == i), ascending; N >= 1.
  assert [t.name for t in reader.tensors] == [
      "direction.1", "direction.3", "direction.7"]
  size = os.path.getsize(path)
  expected_offset = reader.data_offset
  for t in reader.tensors:
    assert t.tensor_type == gguf.GGMLQuantizationType.F32
    assert list(t.shape) == [HIDDEN]  # ne: 1-D, n_embd elements.
    assert t.n_bytes == 4 * HIDDEN
    # gguf.cpp requires contiguous, aligned offsets and reads the padded blob.
    assert t.data_offset == expected_offset
    expected_offset += -(-t.n_bytes // reader.alignment) * reader.alignment
    block = int(t.name.split(".")[1])
    np.testing.assert_array_equal(np.asarray(t.data), cv.directions[block])
  assert expected_offset <= size


def test_saved_file_reads_with_repeng_import_logic(tmp_path):
  cv = make_cv(hint=None)
  path = tmp_path / "v.gguf"
  save_control_vector(cv, path)
  hint, directions = _repeng_import_gguf(path)  # Needs the hint key.
  assert hint == ""
  assert directions.keys() == cv.directions.keys()
  for i in directions:
    np.testing.assert_array_equal(directions[i], cv.directions[i])


def test_repeng_written_file_loads_with_same_indices(tmp_path):
  # repeng's default layers: range(-1, -num_layers, -1) normalized to
  # num_layers-1 .. 1, keyed by the 0-based layer whose output was read.
  num_layers = 6
  directions = {
      layer: vec(layer) for layer in range(num_layers - 1, 0, -1)}
  path = tmp_path / "repeng.gguf"
  _repeng_export_gguf(directions, "mistral", path)
  cv = load_control_vector(path)
  assert cv.model_hint == "mistral"
  assert list(cv.directions) == [1, 2, 3, 4, 5]
  for layer, v in directions.items():
    np.testing.assert_array_equal(cv.directions[layer], v)
  stacked = cv.for_layers(num_layers)
  np.testing.assert_array_equal(stacked[0], np.zeros(HIDDEN, np.float32))
  np.testing.assert_array_equal(stacked[3], directions[3])


def test_llama_cpp_generator_style_file_loads(tmp_path):
  # llama-cvector-generator: layer_count as int32, direction.1..n_layer-1.
  path = tmp_path / "gen.gguf"
  w = gguf.GGUFWriter(path, "controlvector")
  w.add_string("controlvector.model_hint", "llama")
  w.add_int32("controlvector.layer_count", 3)
  for n in (1, 2, 3):
    w.add_tensor(f"direction.{n}", vec(n))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  cv = load_control_vector(path)
  assert list(cv.directions) == [1, 2, 3]
  np.testing.assert_array_equal(cv.directions[2], vec(2))


def test_row_shaped_tensor_is_accepted_like_ggml_n_dims(tmp_path):
  # numpy (1, n) is ggml ne = [n, 1]: ggml_n_dims == 1, llama.cpp accepts it.
  path = write_cv_gguf(tmp_path / "row.gguf", [("direction.2", vec(2)[None, :])])
  cv = load_control_vector(path)
  np.testing.assert_array_equal(cv.directions[2], vec(2))


def test_duplicate_layer_indices_are_summed_like_llama_cpp(tmp_path):
  path = write_cv_gguf(tmp_path / "dup.gguf", [
      ("direction.1", vec(1)), ("direction.01", vec(2))])
  cv = load_control_vector(path)
  np.testing.assert_array_equal(cv.directions[1], vec(1) + vec(2))


def test_save_is_atomic(tmp_path, monkeypatch):
  path = tmp_path / "v.gguf"
  save_control_vector(make_cv(), path)
  save_control_vector(make_cv(blocks=(3,)), path)  # Overwrites.
  assert list(load_control_vector(path).directions) == [3]
  assert sorted(os.listdir(tmp_path)) == ["v.gguf"]

  def boom(self, **kwargs):
    raise OSError("disk full")

  save_control_vector(make_cv(), path)
  before = path.read_bytes()
  monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)
  with pytest.raises(OSError, match="disk full"):
    save_control_vector(make_cv(blocks=(4,)), path)
  assert path.read_bytes() == before
  assert sorted(os.listdir(tmp_path)) == ["v.gguf"]


def test_save_refuses_block_zero_and_bad_arguments(tmp_path):
  with pytest.raises(ValueError, match=r"block 0.*direction\.0.*restricted"):
    save_control_vector(make_cv(blocks=(0, 1)), tmp_path / "v.gguf")
  with pytest.raises(ValueError, match="ControlVector"):
    save_control_vector({1: vec(1)}, tmp_path / "v.gguf")
  with pytest.raises(ValueError, match="model_hint"):
    save_control_vector(make_cv(), tmp_path / "v.gguf", model_hint=3)
  assert not os.listdir(tmp_path)
  # Block 0 dropped with restricted() saves fine.
  save_control_vector(
      make_cv(blocks=(0, 1)).restricted(1, 1), tmp_path / "v.gguf")


# --- Bad files --------------------------------------------------------------


def _good_bytes(tmp_path):
  path = tmp_path / "good.gguf"
  save_control_vector(make_cv(), path)
  return path.read_bytes()


@pytest.mark.parametrize("keep", [0, 2, 4, 7, 12, 30, 60, 100, 200, -4, -1])
def test_truncated_file(tmp_path, keep):
  data = _good_bytes(tmp_path)
  path = tmp_path / "bad.gguf"
  path.write_bytes(data[:keep])
  with pytest.raises(ValueError) as e:
    load_control_vector(path)
  msg = str(e.value)
  assert "bad.gguf" in msg
  assert "truncated" in msg or "not a GGUF file" in msg
  assert "re-" in msg  # Says how to fix it.


def test_random_bytes(tmp_path):
  rng = np.random.default_rng(0)
  path = tmp_path / "random.gguf"
  path.write_bytes(rng.bytes(1000))
  with pytest.raises(ValueError, match="not a GGUF file"):
    load_control_vector(path)
  for seed in range(5):  # GGUF magic, then garbage.
    path.write_bytes(b"GGUF" + np.random.default_rng(seed).bytes(400))
    with pytest.raises(ValueError, match="truncated or corrupt"):
      load_control_vector(path)
  path.write_bytes(b"GGUF" + (3).to_bytes(4, "little")
                   + np.random.default_rng(1).bytes(400))
  with pytest.raises(ValueError, match="truncated or corrupt"):
    load_control_vector(path)


def test_missing_file_is_an_os_error(tmp_path):
  with pytest.raises(FileNotFoundError):
    load_control_vector(tmp_path / "nope.gguf")


def test_wrong_architecture(tmp_path):
  path = write_cv_gguf(tmp_path / "model.gguf", [("direction.1", vec(1))],
                arch="llama")
  with pytest.raises(ValueError,
                     match="general.architecture 'llama', not 'controlvector'"):
    load_control_vector(path)
  path = write_cv_gguf(tmp_path / "noarch.gguf", [("direction.1", vec(1))],
                drop_arch=True)
  with pytest.raises(ValueError, match="has no general.architecture"):
    load_control_vector(path)


def test_direction_zero(tmp_path):
  path = write_cv_gguf(tmp_path / "zero.gguf",
                [("direction.0", vec(0)), ("direction.1", vec(1))])
  with pytest.raises(ValueError,
                     match="direction.0 is invalid: llama.cpp numbers"
                     " control-vector layers from 1"):
    load_control_vector(path)


def test_nan_values(tmp_path):
  v = vec(1)
  v[3] = np.nan
  path = write_cv_gguf(tmp_path / "nan.gguf", [("direction.1", v)])
  with pytest.raises(ValueError, match=r"direction.1 has 1 NaN/inf value"):
    load_control_vector(path)


def test_mixed_lengths(tmp_path):
  path = write_cv_gguf(tmp_path / "mixed.gguf",
                [("direction.1", vec(1)), ("direction.2", vec(2, size=4))])
  with pytest.raises(ValueError,
                     match="direction.2 has 4 values but direction.1 has 8"):
    load_control_vector(path)


def test_two_dimensional_tensor(tmp_path):
  path = write_cv_gguf(tmp_path / "2d.gguf",
                [("direction.1", np.ones((2, HIDDEN), np.float32))])
  with pytest.raises(ValueError, match=r"shape \(2, 8\).*1-D"):
    load_control_vector(path)


def test_non_f32_tensor(tmp_path):
  path = write_cv_gguf(tmp_path / "f16.gguf",
                [("direction.1", vec(1).astype(np.float16))])
  with pytest.raises(ValueError, match="F16; llama.cpp accepts only F32"):
    load_control_vector(path)


@pytest.mark.parametrize("name", [
    "token_embd.weight", "direction", "direction.x", "direction.-1",
    "direction.1.weight"])
def test_bad_tensor_name(tmp_path, name):
  path = write_cv_gguf(tmp_path / "name.gguf", [(name, vec(1))])
  with pytest.raises(ValueError, match="only tensors named direction.N"):
    load_control_vector(path)


def test_no_tensors(tmp_path):
  path = write_cv_gguf(tmp_path / "empty.gguf", [])
  with pytest.raises(ValueError, match="no direction tensors"):
    load_control_vector(path)


def test_truncated_padding(tmp_path):
  # gguf.cpp reads the padded data blob, so llama.cpp rejects this file even
  # though every value is present.
  path = tmp_path / "v.gguf"
  save_control_vector(ControlVector(directions={1: np.ones(3)}), path)
  data = path.read_bytes()
  path.write_bytes(data[:-4])
  with pytest.raises(ValueError, match="truncated: tensor direction.1"):
    load_control_vector(path)


def test_non_string_model_hint_warns(tmp_path):
  path = tmp_path / "hint.gguf"
  w = gguf.GGUFWriter(path, "controlvector")
  w.add_uint32("controlvector.model_hint", 7)
  w.add_tensor("direction.1", vec(1))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.warns(UserWarning, match="model_hint is not a string"):
    cv = load_control_vector(path)
  assert cv.model_hint is None


def test_loading_a_good_file_emits_no_warnings(tmp_path):
  path = tmp_path / "v.gguf"
  save_control_vector(make_cv(), path)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    load_control_vector(path)


def test_module_constants():
  assert control_vector_files.ARCHITECTURE == "controlvector"
  assert control_vector_files.MODEL_HINT_KEY == "controlvector.model_hint"
  assert control_vector_files.LAYER_COUNT_KEY == "controlvector.layer_count"
