"""Hostile autoencoder and transcoder files: confinement, special files,
zip bombs, deep YAML, values that overflow, sizes and layers that do not
fit the model, and what save_sae refuses to write."""

import dataclasses
import json
import os
import zipfile

import ml_dtypes
import numpy as np
import pytest
import yaml

from penzai_lm import sae as sae_lib
from penzai_lm.sae.formats.tensor_files import write_safetensors
from tests.model.configs import config
from tests.sae.format_files import D
from tests.sae.format_files import F
from tests.sae.format_files import ct_layer
from tests.sae.format_files import saelens_dir
from tests.sae.format_files import saelens_tensors
from tests.sae.random_saes import random_arrays
from tests.sae.random_saes import random_sae
from tests.test_file_access import finishes

SAEFormatError = sae_lib.SAEFormatError
SET = {"model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in",
       "feature_output_hook": "hook_mlp_out"}


def _config_yaml(directory, **fields):
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "config.yaml").write_text(yaml.safe_dump({**SET, **fields}))
  return directory



# -- circuit-tracer configs are confined to their folder ------------------


def test_config_paths_are_confined_to_the_config_folder(tmp_path):
  (tmp_path / "x").mkdir()
  ct_layer(tmp_path / "x" / "layer_0.safetensors", 0)
  ct = tmp_path / "ct"
  _config_yaml(ct, transcoders=["../x/layer_0.safetensors"])
  with pytest.raises(SAEFormatError, match=r"ct/config.yaml: field"
                     r" 'transcoders\[0\]' .*leads out of the config's folder"
                     ".*allow_outside=True"):
    sae_lib.load_transcoders(ct)
  assert len(sae_lib.load_transcoders(ct, allow_outside=True)) == 1
  outside = str(tmp_path / "x" / "layer_0.safetensors")
  _config_yaml(ct, transcoders=[outside])
  with pytest.raises(SAEFormatError, match=r"field 'transcoders\[0\]' .*an"
                     " absolute path outside the config's folder"):
    sae_lib.load_transcoders(ct)
  assert len(sae_lib.load_transcoders(ct, allow_outside=True)) == 1
  # An absolute path into the folder (what circuit-tracer writes) loads.
  ct_layer(ct / "layer_0.safetensors", 0)
  _config_yaml(ct, transcoders=[str(ct / "layer_0.safetensors")])
  assert len(sae_lib.load_transcoders(ct)) == 1


def test_links_out_of_the_config_folder_are_outside(tmp_path):
  (tmp_path / "x").mkdir()
  ct_layer(tmp_path / "x" / "layer_0.safetensors", 0)
  ct = _config_yaml(tmp_path / "ct", transcoders=["layer_0.safetensors"])
  (ct / "layer_0.safetensors").symlink_to(tmp_path / "x" / "layer_0.safetensors")
  with pytest.raises(SAEFormatError, match="is a link that leads out of the"):
    sae_lib.load_transcoders(ct)
  _config_yaml(ct)  # No list: the folder's layer_{i} files, the link too.
  with pytest.raises(SAEFormatError, match="is a link that leads out of the"):
    sae_lib.load_transcoders(ct)
  assert len(sae_lib.load_transcoders(ct, allow_outside=True)) == 1


def test_links_into_the_hugging_face_blobs_are_inside(tmp_path):
  repo = tmp_path / "models--org--tc"
  snapshot = repo / "snapshots" / "abc123"
  (repo / "blobs").mkdir(parents=True)
  ct_layer(repo / "blobs" / "f00d", 0)
  _config_yaml(snapshot, transcoders=["layer_0.safetensors"])
  (snapshot / "layer_0.safetensors").symlink_to(repo / "blobs" / "f00d")
  assert len(sae_lib.load_transcoders(snapshot)) == 1


def test_two_files_for_one_block_are_ambiguous(tmp_path):
  ct = _config_yaml(tmp_path)
  ct_layer(ct / "layer_0.safetensors", 0)
  ct_layer(ct / "layer_00.safetensors", 1)
  with pytest.raises(SAEFormatError, match="layer_0.safetensors and"
                     " layer_00.safetensors are both block 0; .*ambiguous"):
    sae_lib.load_transcoders(ct)


# -- special files, bombs, deep nesting -----------------------------------


@pytest.mark.parametrize("name", ["cfg.json", "sae_weights.safetensors",
                                  "params.npz", "layer_0.safetensors"])
def test_a_fifo_is_refused_without_blocking(tmp_path, name):
  if name == "cfg.json":
    saelens_dir(tmp_path)
    (tmp_path / name).unlink()
  os.mkfifo(tmp_path / name)
  point = "blocks.0.mlp_in" if name.startswith("layer") else None
  done, out = finishes(lambda: sae_lib.load_sae(tmp_path / name, point=point))
  assert done, f"load_sae blocked on a FIFO {name}"
  assert isinstance(out.get("error"), SAEFormatError), out
  assert f"{name} (" in str(out["error"]) and "is a FIFO (named pipe)" in str(
      out["error"])


def test_a_fifo_config_yaml_is_refused_without_blocking(tmp_path):
  os.mkfifo(tmp_path / "config.yaml")
  done, out = finishes(lambda: sae_lib.load_transcoders(tmp_path))
  assert done and isinstance(out.get("error"), SAEFormatError), out
  assert "config.yaml (a circuit-tracer config) is a FIFO" in str(out["error"])


def _npy_header(shape, dtype="<f4"):
  header = {"descr": dtype, "fortran_order": False, "shape": shape}
  body = repr(header).encode() + b" "
  body += b" " * (-(10 + len(body) + 1) % 64) + b"\n"
  return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body


def test_an_npz_header_claiming_more_than_its_member_is_refused(tmp_path):
  a = random_arrays(D, F, D, threshold=True)
  path = tmp_path / "params.npz"
  with zipfile.ZipFile(path, "w") as z:
    for key in ("W_dec", "b_enc", "b_dec", "threshold"):
      z.writestr(f"{key}.npy", _npy_header(a[key.lower()].shape)
                 + a[key.lower()].tobytes())
    # 2**31 float32 (8 GiB) claimed; 1 KiB present.
    z.writestr("W_enc.npy", _npy_header((2**31,)) + bytes(1024))
  with pytest.raises(SAEFormatError, match=r"params.npz: member 'W_enc.npy':"
                     r" its .npy header claims shape \[2147483648\] of"
                     " float32 .* holds 1024 bytes"):
    sae_lib.load_sae(path, point="blocks.0.resid_post")


def test_an_npz_zip_bomb_is_refused_before_decompressing(tmp_path):
  path = tmp_path / "params.npz"
  n = 2**24  # 64 MiB of zeros deflate to ~64 KiB.
  with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
    with z.open("W_enc.npy", "w", force_zip64=True) as member:
      member.write(_npy_header((n // 64, 64)))
      for _ in range(64):
        member.write(bytes(n * 4 // 64))
  assert path.stat().st_size < 1 << 20
  with pytest.raises(SAEFormatError, match=r"member 'W_enc.npy' inflates"
                     r" \d+ bytes to \d+ .*zip bomb"):
    sae_lib.load_sae(path, point="blocks.0.resid_post")


def test_deeply_nested_yaml_is_a_clear_error(tmp_path):
  (tmp_path / "config.yaml").write_text("[" * 50_000)
  with pytest.raises(SAEFormatError, match="config.yaml: it nests YAML"):
    sae_lib.load_transcoders(tmp_path)


# -- values and sizes ------------------------------------------------------


def test_an_overflowing_log_threshold_is_refused(tmp_path):
  directory = saelens_dir(tmp_path)
  path = directory / "sae_weights.safetensors"
  a = random_arrays(D, F, D, threshold=True)
  tensors = saelens_tensors(a)
  tensors["log_threshold"] = np.full(F, 100.0, np.float32)
  del tensors["threshold"]
  write_safetensors(path, tensors)
  with pytest.raises(SAEFormatError, match="sae_weights.safetensors: tensor"
                     " 'log_threshold' gives 64 infinite thresholds"):
    sae_lib.load_sae(directory)


def test_points_must_exist_in_the_model(tmp_path):
  model = config("llama_gqa")  # 3 blocks, hidden size 32.
  for layer in (99, 3):
    directory = saelens_dir(tmp_path / str(layer), d=32, metadata={
        "sae_lens_version": "6.0.0",
        "hook_name": f"blocks.{layer}.hook_resid_post"})
    with pytest.raises(SAEFormatError, match=rf"cfg.json: the point it reads:"
                       rf" 'blocks.{layer}.resid_post' does not exist: the"
                       " model has 3 blocks"):
      sae_lib.load_sae(directory, model=model)
  assert sae_lib.load_sae(saelens_dir(tmp_path / "ok", d=32), model=model)


def test_a_transcoder_set_must_fit_the_model(tmp_path):
  model = dataclasses.replace(config("llama_gqa"), hidden_size=D)
  ct = _config_yaml(tmp_path)
  for i in range(4):
    ct_layer(ct / f"layer_{i}.safetensors", i)
  with pytest.raises(SAEFormatError, match=r"layer_3.safetensors: the point"
                     r" it reads: 'blocks.3.mlp_in' does not exist: the model"
                     " has 3 blocks"):
    sae_lib.load_transcoders(ct, model=model)
  (ct / "layer_3.safetensors").unlink()
  assert len(sae_lib.load_transcoders(ct, model=model)) == 3


def test_a_transcoder_set_has_one_width(tmp_path):
  ct = _config_yaml(tmp_path)
  ct_layer(ct / "layer_0.safetensors", 0)
  a = random_arrays(D, 2 * F, D, seed=1)
  write_safetensors(ct / "layer_1.safetensors", {
      "W_enc": a["w_enc"].T.copy(), "W_dec": a["w_dec"], "b_enc": a["b_enc"],
      "b_dec": a["b_dec"]})
  with pytest.raises(SAEFormatError, match=r"layer_1.safetensors is a"
                     r" transcoder of .* = \(16, 128, 16\) but .*layer_0"
                     r".safetensors of \(16, 64, 16\)"):
    sae_lib.load_transcoders(ct)


def _clt(directory, n, d, f):
  directory.mkdir(exist_ok=True)
  rng = np.random.default_rng(0)
  for i in range(n):
    fi = f(i) if callable(f) else f
    write_safetensors(directory / f"W_enc_{i}.safetensors", {
        f"W_enc_{i}": rng.standard_normal((fi, d)).astype(np.float32),
        f"b_enc_{i}": np.zeros(fi, np.float32),
        f"b_dec_{i}": np.zeros(d, np.float32)})
    write_safetensors(directory / f"W_dec_{i}.safetensors", {
        f"W_dec_{i}": rng.standard_normal((fi, n - i, d)).astype(np.float32)})
  _config_yaml(directory, model_kind="cross_layer_transcoder")


def test_a_cross_layer_transcoder_must_fit_the_model(tmp_path):
  _clt(tmp_path / "narrow", 3, 8, F)
  with pytest.raises(SAEFormatError, match=r"config.yaml: the CLT's d_model"
                     r" is 8, but the model's value at blocks.2.mlp_in has"
                     r" \{'embedding': 32\}"):
    sae_lib.load_transcoders(tmp_path / "narrow", model=config("llama_gqa"))
  _clt(tmp_path / "deep", 4, 32, F)
  with pytest.raises(SAEFormatError, match=r"the CLT's 4 blocks: 'blocks.3"
                     r".mlp_in' does not exist"):
    sae_lib.load_transcoders(tmp_path / "deep", model=config("llama_gqa"))
  _clt(tmp_path / "ok", 3, 32, F)
  sae_lib.load_transcoders(tmp_path / "ok", model=config("llama_gqa"))


def test_a_cross_layer_transcoder_has_one_width(tmp_path):
  _clt(tmp_path, 3, D, lambda i: F if i != 1 else F // 2)
  with pytest.raises(SAEFormatError, match=r"W_enc_1.safetensors has"
                     r" d_transcoder=32, d_model=16 but .*W_enc_0.safetensors"
                     " has d_transcoder=64"):
    sae_lib.load_transcoders(tmp_path)


@pytest.mark.parametrize("stored, message", [
    ("torch.float8_e4m3fn", r"field 'dtype' is 'torch.float8_e4m3fn', not one"
     r" of .* \(8-bit floats keep too little"),
    ("float128", r"field 'dtype' is 'float128', not one of float32,"),
    ("int8", r"field 'dtype' is 'int8', not one of"),
])
def test_unusable_dtypes_are_refused(tmp_path, stored, message):
  directory = saelens_dir(tmp_path, dtype=stored)
  with pytest.raises(SAEFormatError, match=message):
    sae_lib.load_sae(directory)
  with pytest.raises(ValueError, match="dtype must be one of"):
    sae_lib.load_sae(saelens_dir(tmp_path / "ok"), dtype=ml_dtypes.float8_e4m3fn)


def test_activation_fn_kwargs_must_be_an_object(tmp_path):
  directory = saelens_dir(tmp_path, sae_lens_version="5.0.0",
                       activation_fn_kwargs=[32], metadata={
                           "hook_name": "blocks.0.hook_resid_post"})
  with pytest.raises(SAEFormatError, match=r"cfg.json: field"
                     r" 'activation_fn_kwargs' is \[32\]; it must be an"
                     " object"):
    sae_lib.load_sae(directory)


def test_shape_errors_name_the_odd_tensor(tmp_path):
  a = random_arrays(D, F, D, threshold=True)
  (tmp_path / "gs").mkdir()
  np.savez(tmp_path / "gs" / "params.npz", W_enc=a["w_enc"],
           W_dec=a["w_dec"][:, :8], b_enc=a["b_enc"], b_dec=a["b_dec"],
           threshold=a["threshold"])
  with pytest.raises(SAEFormatError, match=r"tensor 'W_dec' has shape"
                     r" \[64, 8\], expected \[d_sae, d_out\] = \[64, 16\]"):
    sae_lib.load_sae(tmp_path / "gs", point="blocks.0.resid_post")
  write_safetensors(tmp_path / "layer_0.safetensors", {
      "W_enc": a["w_enc"].T.copy(), "W_dec": a["w_dec"], "b_enc": a["b_enc"],
      "b_dec": a["b_dec"][:8]})
  with pytest.raises(SAEFormatError, match=r"tensor 'b_dec' has shape \[8\],"
                     r" expected \[d_model\] = \[16\]"):
    sae_lib.load_sae(tmp_path / "layer_0.safetensors", point="blocks.0.mlp_in")


# -- save_sae ---------------------------------------------------------------


def test_save_sae_never_writes_through_a_planted_link(tmp_path):
  victims = {name: tmp_path / f"victim_{name}" for name in (
      "cfg.json", "sae_weights.safetensors")}
  out = tmp_path / "out"
  out.mkdir()
  for name, victim in victims.items():
    victim.write_text("keep me")
    (out / name).symlink_to(victim)
  sae = random_sae("jumprelu")
  sae_lib.save_sae(sae, out)
  for name, victim in victims.items():
    assert victim.read_text() == "keep me"
    assert not (out / name).is_symlink()
  loaded = sae_lib.load_sae(out)
  np.testing.assert_array_equal(np.asarray(loaded.flat()["w_enc"]),
                                np.asarray(sae.flat()["w_enc"]))
  assert sorted(p.name for p in out.iterdir()) == sorted(victims)


def test_save_sae_metadata_must_be_json_and_not_its_own_keys(tmp_path):
  sae = random_sae("jumprelu")
  with pytest.raises(ValueError, match=r"metadata sets \['hook_name'\], which"
                     " save_sae writes itself"):
    sae_lib.save_sae(sae, tmp_path / "a", metadata={
        "hook_name": "blocks.5.hook_resid_post"})
  with pytest.raises(TypeError, match=r"metadata\['x'\] is <object .*not a"
                     " JSON value"):
    sae_lib.save_sae(sae, tmp_path / "b", metadata={"x": object()})
  with pytest.raises(TypeError, match=r"metadata must be a dict with str"):
    sae_lib.save_sae(sae, tmp_path / "c", metadata={1: "a"})
  assert not list(tmp_path.iterdir())
  sae_lib.save_sae(sae, tmp_path / "d", metadata={"run": [1, "a"]})
  cfg = json.loads((tmp_path / "d" / "cfg.json").read_text())
  assert cfg["metadata"]["run"] == [1, "a"]
  assert cfg["metadata"]["hook_name"] == "blocks.1.hook_resid_post"
