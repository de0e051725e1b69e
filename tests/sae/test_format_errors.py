"""Bad autoencoder files are errors naming the file and the field or
tensor (and saying how to fix it); what SAELens cannot hold is not
written."""

import json

import numpy as np
import pytest
import yaml

from penzai_lm import sae as sae_lib
from penzai_lm.sae.formats.tensor_files import read_safetensors
from penzai_lm.sae.formats.tensor_files import write_safetensors
from tests.model.configs import config
from tests.sae.format_files import D
from tests.sae.format_files import F
from tests.sae.format_files import ct_layer
from tests.sae.format_files import saelens_dir
from tests.sae.random_saes import random_arrays
from tests.sae.random_saes import random_sae

SAEFormatError = sae_lib.SAEFormatError



def _rewrite(directory, change):
  path = directory / "sae_weights.safetensors"
  tensors = read_safetensors(path)
  change(tensors)
  write_safetensors(path, tensors)


BAD_SAELENS = {
    "missing tensor": (lambda d: _rewrite(d, lambda t: t.pop("threshold")),
                       r"sae_weights.safetensors has no tensor 'threshold'"),
    "wrong shape": (
        lambda d: _rewrite(d, lambda t: t.update(W_dec=t["W_dec"][:, :8])),
        r"sae_weights.safetensors: tensor 'W_dec' has shape \[64, 8\],"
        r" expected \[d_sae, d_out\] = \[64, 16\]"),
    "integer dtype": (lambda d: _int_tensor(d),
                      r"tensor 'threshold' has dtype I32"),
    "NaN": (lambda d: _rewrite(d, lambda t: t["b_enc"].__setitem__(3, np.nan)),
            r"sae_weights.safetensors: tensor 'b_enc' holds 1 NaN"),
    "truncated": (lambda d: _truncate(d / "sae_weights.safetensors"),
                  r"sae_weights.safetensors.*truncated"),
    "unknown architecture": (
        lambda d: saelens_dir(d, architecture="gated"),
        r"cfg.json: field 'architecture' is 'gated'; supported"),
    "missing field": (lambda d: _edit_cfg(d, lambda c: c.pop("d_sae")),
                      r"cfg.json: field 'd_sae' is missing"),
    "bad field": (lambda d: _edit_cfg(d, lambda c: c.update(d_in="16")),
                  r"cfg.json: field 'd_in' is '16'; it must be a positive"),
    "unknown hook": (
        lambda d: _edit_cfg(d, lambda c: c["metadata"].update(
            hook_name="blocks.0.attn.hook_q")),
        r"cfg.json: field 'hook_name' is 'blocks.0.attn.hook_q'.*pass point="),
    "head index": (
        lambda d: _edit_cfg(d, lambda c: c["metadata"].update(
            hook_head_index=2)),
        r"cfg.json: field 'hook_head_index' is 2"),
    "extra tensor": (
        lambda d: _rewrite(d, lambda t: t.update(b_mag=t["b_enc"])),
        r"holds tensors \['b_mag'\] that a 'jumprelu' autoencoder does not"),
    "not json": (lambda d: (d / "cfg.json").write_text("{'d_in': 16"),
                 r"Cannot parse .*cfg.json"),
    "normalized transcoder": (
        lambda d: saelens_dir(d, architecture="jumprelu_transcoder",
                                d_out=D, apply_b_dec_to_input=False,
                                normalize_activations="layer_norm"),
        r"field 'normalize_activations' is 'layer_norm' on a transcoder"),
    "model mismatch": (
        lambda d: None,  # d_in 16, but the model's hidden size is 32.
        r"cfg.json: d_in is 16, but the model's value at blocks.0.resid_post"),
}


def _int_tensor(directory):
  """Stores ``threshold`` as int32 (a valid file, a wrong dtype)."""
  path = directory / "sae_weights.safetensors"
  _rewrite(directory, lambda t: t.update(
      threshold=t["threshold"].astype(np.float16)))
  raw = path.read_bytes()
  n = int.from_bytes(raw[:8], "little")
  header = json.loads(raw[8:8 + n])
  header["threshold"]["dtype"] = "I32"
  header["threshold"]["shape"] = [F // 2]  # Same bytes as F float16s.
  blob = json.dumps(header).encode()
  blob += b" " * (-len(blob) % 8)
  path.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n:])


def _truncate(path):
  path.write_bytes(path.read_bytes()[:-100])


def _edit_cfg(directory, change):
  cfg = json.loads((directory / "cfg.json").read_text())
  change(cfg)
  (directory / "cfg.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("case", sorted(BAD_SAELENS))
def test_bad_saelens_files_name_file_and_field(tmp_path, case):
  damage, message = BAD_SAELENS[case]
  directory = saelens_dir(tmp_path / "sae")
  damage(directory)
  model = config("llama_gqa") if case == "model mismatch" else None
  with pytest.raises(SAEFormatError, match=message):
    sae_lib.load_sae(directory, model=model)


def test_a_point_override_loads_an_unknown_hook(tmp_path):
  directory = saelens_dir(tmp_path)
  _edit_cfg(directory, lambda c: c["metadata"].update(hook_name="hook_embed"))
  with pytest.raises(SAEFormatError, match="'hook_embed'.*pass point="):
    sae_lib.load_sae(directory)
  sae = sae_lib.load_sae(directory, point="blocks.0.resid_pre")
  assert sae.config.hook_point == "blocks.0.resid_pre"
  with pytest.raises(ValueError, match="'blocks.0.attn.pattern' is not a"):
    sae_lib.load_sae(directory, point="blocks.0.attn.pattern")


def test_bad_gemma_scope_and_circuit_tracer_files(tmp_path):
  a = random_arrays(D, F, D, threshold=True)
  (tmp_path / "npz").mkdir()
  np.savez(tmp_path / "npz" / "params.npz", W_enc=a["w_enc"],
           W_dec=a["w_dec"], b_enc=a["b_enc"], b_dec=a["b_dec"])
  with pytest.raises(SAEFormatError, match="params.npz has no tensor"
                     " 'threshold'"):
    sae_lib.load_sae(tmp_path / "npz")
  (tmp_path / "npz" / "params.npz").write_bytes(b"PK\x03\x04broken")
  with pytest.raises(SAEFormatError, match="params.npz is not a readable"):
    sae_lib.load_sae(tmp_path / "npz")
  np.savez(tmp_path / "npz" / "params.npz", W_enc=a["w_enc"].astype(int),
           W_dec=a["w_dec"], b_enc=a["b_enc"], b_dec=a["b_dec"],
           threshold=a["threshold"])
  with pytest.raises(SAEFormatError, match="array 'W_enc' has dtype int"):
    sae_lib.load_sae(tmp_path / "npz")
  (tmp_path / "gs2").mkdir()
  write_safetensors(tmp_path / "gs2" / "params.safetensors", {
      "w_enc": a["w_enc"], "w_dec": a["w_dec"], "b_enc": a["b_enc"],
      "b_dec": a["b_dec"], "threshold": a["threshold"]})
  (tmp_path / "gs2" / "config.json").write_text(json.dumps(
      {"architecture": "topk"}))
  with pytest.raises(SAEFormatError, match="config.json: field"
                     " 'architecture' is 'topk'"):
    sae_lib.load_sae(tmp_path / "gs2")
  ct = tmp_path / "ct"
  ct.mkdir()
  ct_layer(ct / "layer_0.safetensors", 0)
  ct_layer(ct / "layer_2.safetensors", 2)
  (ct / "config.yaml").write_text(yaml.safe_dump({
      "model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in",
      "feature_output_hook": "hook_mlp_out"}))
  with pytest.raises(SAEFormatError, match=r"are blocks \[0, 2\]"):
    sae_lib.load_transcoders(ct)
  with pytest.raises(SAEFormatError, match="circuit-tracer directory"):
    sae_lib.load_sae(ct)
  with pytest.raises(SAEFormatError, match="names no points: pass point="):
    sae_lib.load_sae(ct / "layer_0.safetensors")
  (ct / "config.yaml").write_text(yaml.safe_dump({
      "model_kind": "sparse_autoencoder", "feature_input_hook": "x",
      "feature_output_hook": "y"}))
  with pytest.raises(SAEFormatError, match="config.yaml: field 'model_kind'"):
    sae_lib.load_transcoders(ct)
  (ct / "config.yaml").write_text(yaml.safe_dump({
      "model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in",
      "feature_output_hook": "hook_mlp_out",
      "transcoders": ["hf://org/repo/layer_0.safetensors"]}))
  with pytest.raises(SAEFormatError, match=r"transcoders\[0\]' .*hf://.*"
                     "outside the config's folder; pass allow_outside=True"):
    sae_lib.load_transcoders(ct)
  with pytest.raises(SAEFormatError, match=r"transcoders\[0\]' is hf://.*not"
                     " in the local Hugging Face cache"):
    sae_lib.load_transcoders(ct, allow_outside=True)
  with pytest.raises(FileNotFoundError):
    sae_lib.load_sae(tmp_path / "nothing")


def test_save_refuses_what_saelens_cannot_hold(tmp_path):
  skip_sae = random_sae("standard")
  arrays = {**skip_sae.flat(), "w_skip": np.zeros((D, D), np.float32)}
  with_skip = sae_lib.SparseAutoencoder.from_arrays(skip_sae.config, **arrays)
  with pytest.raises(ValueError, match="no SAE architecture with a skip"):
    sae_lib.save_sae(with_skip, tmp_path)
  topk = random_sae("topk")
  cfg = sae_lib.SAEConfig(
      activation="topk", k=4, num_features=F, input_axes=topk.config.input_axes,
      output_axes=topk.config.output_axes, hook_point="blocks.0.mlp_in",
      output_point="blocks.0.mlp_out")
  flat = {k: v for k, v in topk.flat().items()}
  with pytest.raises(ValueError, match="no TopK transcoder"):
    sae_lib.save_sae(sae_lib.SparseAutoencoder.from_arrays(cfg, **flat),
                     tmp_path)
  assert not list(tmp_path.iterdir())
