"""Autoencoder files: SAELens round trips and hand-written SAELens (v5 and
v6) and Gemma Scope 1 and 2 files against numpy references of their
documented math.

(`test_parity_saelens.py` compares with SAELens itself where it is
installed; `test_formats_circuit_tracer.py` and `test_format_errors.py`
cover circuit-tracer's files and bad files.)
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from penzai_lm import sae as sae_lib
from penzai_lm.sae.formats.tensor_files import write_safetensors
from tests.model.configs import config
from tests.sae.format_files import D
from tests.sae.format_files import F
from tests.sae.format_files import encode
from tests.sae.format_files import forward
from tests.sae.format_files import jumprelu
from tests.sae.format_files import saelens_tensors
from tests.sae.format_files import write_saelens
from tests.sae.format_files import inputs
from tests.sae.random_saes import ARCHITECTURES
from tests.sae.random_saes import random_arrays
from tests.sae.random_saes import random_sae

SAEFormatError = sae_lib.SAEFormatError


# ------------------------------------------------------------ SAELens


ROUND_TRIPS = [(arch, "none") for arch in ARCHITECTURES] + [
    ("standard", "constant_norm_rescale"), ("jumprelu", "layer_norm"),
    ("topk", "layer_norm")]


@pytest.mark.parametrize("arch,norm", ROUND_TRIPS)
def test_saelens_round_trip(tmp_path, arch, norm):
  sae = random_sae(arch, norm=norm, rescale=arch == "topk")
  sae_lib.save_sae(sae, tmp_path, model_name="tiny")
  cfg = json.loads((tmp_path / "cfg.json").read_text())
  assert cfg["architecture"] == arch
  assert cfg["metadata"]["model_name"] == "tiny"
  back = sae_lib.load_sae(tmp_path)
  assert back.config == sae.config
  for key, value in sae.flat().items():
    np.testing.assert_array_equal(back.flat()[key], value, err_msg=key)
  x = inputs((2, 3, D))
  np.testing.assert_array_equal(forward(back, x), forward(sae, x))


def test_saelens_round_trip_hook_z_and_bfloat16(tmp_path):
  model_config = config("llama_gqa")  # 2 groups x 2 query heads x 12.
  axes = (("head_groups", 2), ("query_heads", 2), ("projection", 12))
  sae = random_sae("jumprelu", input_axes=axes, point="blocks.2.attn.head_out",
                   dtype=jnp.bfloat16)
  sae_lib.save_sae(sae, tmp_path)
  cfg = json.loads((tmp_path / "cfg.json").read_text())
  assert (cfg["d_in"], cfg["dtype"], cfg["reshape_activations"]) == (
      48, "bfloat16", "hook_z")
  assert cfg["metadata"]["hook_name"] == "blocks.2.attn.hook_z"
  with pytest.raises(SAEFormatError, match="attn.hook_z.*pass model="):
    sae_lib.load_sae(tmp_path)
  back = sae_lib.load_sae(tmp_path, model=model_config)
  assert back.config == sae.config and back.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
      np.asarray(back.flat()["w_enc"], np.float32),
      np.asarray(sae.flat()["w_enc"], np.float32))


def test_saelens_v5_config_topk_and_scaling_factor(tmp_path):
  """A pre-6.0 config (top-level ``hook_point``, ``activation_fn_str`` /
  ``activation_fn_kwargs``, boolean ``normalize_activations``, no
  version) and a ``scaling_factor`` folded into ``W_dec``."""
  arrays = random_arrays(D, F, D)
  scale = np.linspace(0.5, 1.5, F).astype(np.float32)
  cfg = {"d_in": D, "d_sae": F, "dtype": "torch.float32",
         "hook_point": "blocks.0.hook_resid_pre", "hook_point_layer": 0,
         "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 5},
         "normalize_activations": False, "finetuning_scaling_factor": True}
  write_saelens(tmp_path, cfg, {**saelens_tensors(arrays),
                                 "scaling_factor": scale})
  sae = sae_lib.load_sae(tmp_path)
  c = sae.config
  assert (c.activation, c.k, c.hook_point, c.apply_b_dec_to_input,
          c.normalize_activations) == ("topk", 5, "blocks.0.resid_pre", True,
                                       "none")
  x = inputs((2, 3, D))
  pre = (x - arrays["b_dec"]) @ arrays["w_enc"] + arrays["b_enc"]
  keep = np.argsort(-pre, axis=-1)[..., :5]
  f = np.zeros_like(pre)
  np.put_along_axis(f, keep, np.maximum(np.take_along_axis(pre, keep, -1), 0),
                    -1)
  expected = (f * scale) @ arrays["w_dec"] + arrays["b_dec"]
  np.testing.assert_allclose(forward(sae, x), expected, atol=1e-5)


def test_saelens_identity_normalizations_load_as_none_with_a_warning(
    tmp_path):
  arrays = random_arrays(D, F, D)
  cfg = {"architecture": "standard", "d_in": D, "d_sae": F,
         "normalize_activations": "expected_average_only_in",
         "metadata": {"sae_lens_version": "6.5.0",
                      "hook_name": "blocks.2.hook_mlp_out"}}
  write_saelens(tmp_path, cfg, saelens_tensors(arrays))
  with pytest.warns(UserWarning, match="expected_average_only_in"):
    sae = sae_lib.load_sae(tmp_path)
  assert sae.config.normalize_activations == "none"
  assert sae.config.hook_point == "blocks.2.mlp_out"


def test_hook_names_map_to_points(tmp_path):
  arrays = random_arrays(D, F, D)
  names = {"blocks.3.hook_resid_mid": "blocks.3.resid_mid",
           "blocks.0.hook_attn_out": "blocks.0.attn_out",
           "blocks.1.ln2.hook_normalized": "blocks.1.mlp_in",
           "blocks.1.mlp.hook_in": "blocks.1.mlp_in",
           "blocks.2.hook_mlp_in": "blocks.2.resid_mid"}
  for i, (hook, point) in enumerate(names.items()):
    d = tmp_path / str(i)
    write_saelens(d, {"architecture": "jumprelu", "d_in": D, "d_sae": F,
                       "metadata": {"sae_lens_version": "6.0.0",
                                    "hook_name": hook}},
                   saelens_tensors({**arrays, "threshold": arrays["b_enc"]}))
    # No model: ln2.hook_normalized's arrays taken as they are.
    loaded = sae_lib.load_sae(d, fold_norm=False)
    assert loaded.config.hook_point == point, hook
  # Hugging Face names win (Gemma Scope 2 via SAELens: TransformerLens's
  # hook_mlp_in is before the norm, the transcoder reads after it).
  write_saelens(tmp_path / "hf", {
      "architecture": "transcoder", "d_in": D, "d_sae": F, "d_out": D,
      "apply_b_dec_to_input": False,
      "metadata": {"sae_lens_version": "6.0.0",
                   "hook_name": "blocks.2.hook_mlp_in",
                   "hook_name_out": "blocks.2.hook_mlp_out",
                   "hf_hook_name":
                       "model.layers.2.pre_feedforward_layernorm.output"}},
      saelens_tensors(arrays))
  sae = sae_lib.load_sae(tmp_path / "hf")
  assert (sae.config.hook_point, sae.config.output_point) == (
      "blocks.2.mlp_in", "blocks.2.mlp_out")
  # circuit-tracer's mlp.hook_out is before Gemma's post-MLP norm.
  write_saelens(tmp_path / "out", {
      "architecture": "transcoder", "d_in": 32, "d_sae": F, "d_out": 32,
      "apply_b_dec_to_input": False,
      "metadata": {"sae_lens_version": "6.0.0",
                   "hook_name": "blocks.0.mlp.hook_in",
                   "hook_name_out": "blocks.0.mlp.hook_out"}},
      saelens_tensors(random_arrays(32, F, 32)))
  with pytest.raises(SAEFormatError, match="hook_name_out.*post-MLP norm"):
    sae_lib.load_sae(tmp_path / "out", model=config("gemma2"))
  assert sae_lib.load_sae(tmp_path / "out", model=config("llama_gqa")
                          ).config.output_point == "blocks.0.mlp_out"


# ---------------------------------------------------------- Gemma Scope


def test_gemma_scope_1_params_npz(tmp_path):
  a = random_arrays(D, F, D, threshold=True)
  folder = tmp_path / "gemma-scope-2b-pt-res" / "layer_2" / "width_16k"
  folder.mkdir(parents=True)
  np.savez(folder / "params.npz", W_enc=a["w_enc"], W_dec=a["w_dec"],
           b_enc=a["b_enc"], b_dec=a["b_dec"], threshold=a["threshold"])
  sae = sae_lib.load_sae(folder)
  assert (sae.config.activation, sae.config.hook_point,
          sae.config.apply_b_dec_to_input) == ("jumprelu",
                                               "blocks.2.resid_post", False)
  x = inputs((2, 3, D))
  f = jumprelu(x @ a["w_enc"] + a["b_enc"], a["threshold"])
  assert 0 < (f > 0).mean() < 1
  np.testing.assert_allclose(encode(sae, x), f, atol=1e-5)
  np.testing.assert_allclose(forward(sae, x), f @ a["w_dec"] + a["b_dec"],
                             atol=1e-5)


def test_gemma_scope_2_affine_transcoder_with_sidecar(tmp_path):
  a = random_arrays(D, F, D, threshold=True, skip=True)
  write_safetensors(tmp_path / "params.safetensors", {
      "w_enc": a["w_enc"], "w_dec": a["w_dec"], "b_enc": a["b_enc"],
      "b_dec": a["b_dec"], "threshold": a["threshold"],
      "affine_skip_connection": a["w_skip"]})
  (tmp_path / "config.json").write_text(json.dumps({
      "architecture": "jump_relu", "model_name": "gemma-v3-270m-pt",
      "hf_hook_point_in": "model.layers.5.pre_feedforward_layernorm.output",
      "hf_hook_point_out": "model.layers.5.post_feedforward_layernorm.output",
      "affine_connection": True}))
  sae = sae_lib.load_sae(tmp_path)
  assert (sae.config.hook_point, sae.config.output_point) == (
      "blocks.5.mlp_in", "blocks.5.mlp_out")
  x = inputs((2, 3, D))
  f = jumprelu(x @ a["w_enc"] + a["b_enc"], a["threshold"])
  np.testing.assert_allclose(
      forward(sae, x), f @ a["w_dec"] + a["b_dec"] + x @ a["w_skip"],
      atol=1e-5)


def test_gemma_scope_2_points_from_the_folder_name(tmp_path):
  a = random_arrays(D, F, D, threshold=True)
  folder = tmp_path / "resid_post" / "layer_7_width_16k_l0_medium"
  folder.mkdir(parents=True)
  write_safetensors(folder / "params.safetensors", {
      "w_enc": a["w_enc"], "w_dec": a["w_dec"], "b_enc": a["b_enc"],
      "b_dec": a["b_dec"], "threshold": a["threshold"]})
  assert sae_lib.load_sae(folder).config.hook_point == "blocks.7.resid_post"
