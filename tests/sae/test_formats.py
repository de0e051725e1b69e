"""Autoencoder files: SAELens round trips, Gemma Scope 1 and 2 and
circuit-tracer files against numpy references of their documented math,
and every kind of bad file as an error naming the file and field.

(`test_parity_saelens.py` and `test_parity_circuit_tracer.py` compare with
the libraries themselves where they are installed.)
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz
import yaml

from penzai_lm import sae as sae_lib
from penzai_lm.sae.formats.tensor_files import write_safetensors
from tests.model.configs import config
from tests.sae.random_saes import ARCHITECTURES
from tests.sae.random_saes import random_arrays
from tests.sae.random_saes import random_sae

SAEFormatError = sae_lib.SAEFormatError
D, F = 16, 64


def _x(shape, seed=1):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _named(x, *axes):
  return pz.nx.wrap(jnp.asarray(x)).tag(*axes)


def _forward(sae, x):
  names = ("batch", "seq", *sae.input_names)
  return np.asarray(sae.forward(_named(x, *names)).unwrap(
      "batch", "seq", *sae.output_names))


def _encode(sae, x):
  names = ("batch", "seq", *sae.input_names)
  return np.asarray(sae.encode(_named(x, *names)).unwrap(
      "batch", "seq", "features"))


def _jumprelu(pre, threshold):
  return np.maximum(pre, 0) * (pre > threshold)


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
  x = _x((2, 3, D))
  np.testing.assert_array_equal(_forward(back, x), _forward(sae, x))


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


def _write_saelens(directory, cfg, tensors):
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "cfg.json").write_text(json.dumps(cfg))
  write_safetensors(directory / "sae_weights.safetensors",
                    {k: np.asarray(v) for k, v in tensors.items()})


def _saelens_tensors(arrays):
  out = {"W_enc": arrays["w_enc"], "b_enc": arrays["b_enc"],
         "W_dec": arrays["w_dec"], "b_dec": arrays["b_dec"]}
  if "threshold" in arrays:
    out["threshold"] = arrays["threshold"]
  if "w_skip" in arrays:
    out["W_skip"] = arrays["w_skip"].T.copy()
  return out


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
  _write_saelens(tmp_path, cfg, {**_saelens_tensors(arrays),
                                 "scaling_factor": scale})
  sae = sae_lib.load_sae(tmp_path)
  c = sae.config
  assert (c.activation, c.k, c.hook_point, c.apply_b_dec_to_input,
          c.normalize_activations) == ("topk", 5, "blocks.0.resid_pre", True,
                                       "none")
  x = _x((2, 3, D))
  pre = (x - arrays["b_dec"]) @ arrays["w_enc"] + arrays["b_enc"]
  keep = np.argsort(-pre, axis=-1)[..., :5]
  f = np.zeros_like(pre)
  np.put_along_axis(f, keep, np.maximum(np.take_along_axis(pre, keep, -1), 0),
                    -1)
  expected = (f * scale) @ arrays["w_dec"] + arrays["b_dec"]
  np.testing.assert_allclose(_forward(sae, x), expected, atol=1e-5)


def test_saelens_identity_normalizations_load_as_none_with_a_warning(
    tmp_path):
  arrays = random_arrays(D, F, D)
  cfg = {"architecture": "standard", "d_in": D, "d_sae": F,
         "normalize_activations": "expected_average_only_in",
         "metadata": {"sae_lens_version": "6.5.0",
                      "hook_name": "blocks.2.hook_mlp_out"}}
  _write_saelens(tmp_path, cfg, _saelens_tensors(arrays))
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
    _write_saelens(d, {"architecture": "jumprelu", "d_in": D, "d_sae": F,
                       "metadata": {"sae_lens_version": "6.0.0",
                                    "hook_name": hook}},
                   _saelens_tensors({**arrays, "threshold": arrays["b_enc"]}))
    assert sae_lib.load_sae(d).config.hook_point == point, hook
  # Hugging Face names win (Gemma Scope 2 via SAELens: TransformerLens's
  # hook_mlp_in is before the norm, the transcoder reads after it).
  _write_saelens(tmp_path / "hf", {
      "architecture": "transcoder", "d_in": D, "d_sae": F, "d_out": D,
      "apply_b_dec_to_input": False,
      "metadata": {"sae_lens_version": "6.0.0",
                   "hook_name": "blocks.2.hook_mlp_in",
                   "hook_name_out": "blocks.2.hook_mlp_out",
                   "hf_hook_name":
                       "model.layers.2.pre_feedforward_layernorm.output"}},
      _saelens_tensors(arrays))
  sae = sae_lib.load_sae(tmp_path / "hf")
  assert (sae.config.hook_point, sae.config.output_point) == (
      "blocks.2.mlp_in", "blocks.2.mlp_out")
  # circuit-tracer's mlp.hook_out is before Gemma's post-MLP norm.
  _write_saelens(tmp_path / "out", {
      "architecture": "transcoder", "d_in": 32, "d_sae": F, "d_out": 32,
      "apply_b_dec_to_input": False,
      "metadata": {"sae_lens_version": "6.0.0",
                   "hook_name": "blocks.0.mlp.hook_in",
                   "hook_name_out": "blocks.0.mlp.hook_out"}},
      _saelens_tensors(random_arrays(32, F, 32)))
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
  x = _x((2, 3, D))
  f = _jumprelu(x @ a["w_enc"] + a["b_enc"], a["threshold"])
  assert 0 < (f > 0).mean() < 1
  np.testing.assert_allclose(_encode(sae, x), f, atol=1e-5)
  np.testing.assert_allclose(_forward(sae, x), f @ a["w_dec"] + a["b_dec"],
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
  x = _x((2, 3, D))
  f = _jumprelu(x @ a["w_enc"] + a["b_enc"], a["threshold"])
  np.testing.assert_allclose(
      _forward(sae, x), f @ a["w_dec"] + a["b_dec"] + x @ a["w_skip"],
      atol=1e-5)


def test_gemma_scope_2_points_from_the_folder_name(tmp_path):
  a = random_arrays(D, F, D, threshold=True)
  folder = tmp_path / "resid_post" / "layer_7_width_16k_l0_medium"
  folder.mkdir(parents=True)
  write_safetensors(folder / "params.safetensors", {
      "w_enc": a["w_enc"], "w_dec": a["w_dec"], "b_enc": a["b_enc"],
      "b_dec": a["b_dec"], "threshold": a["threshold"]})
  assert sae_lib.load_sae(folder).config.hook_point == "blocks.7.resid_post"


# --------------------------------------------------------- circuit-tracer


def _ct_layer(path, seed, *, jumprelu=True, skip=True):
  a = random_arrays(D, F, D, seed=seed, threshold=jumprelu, skip=skip)
  tensors = {"W_enc": a["w_enc"].T.copy(), "W_dec": a["w_dec"],
             "b_enc": a["b_enc"], "b_dec": a["b_dec"]}
  if jumprelu:
    tensors["activation_function.threshold"] = a["threshold"]
  if skip:
    tensors["W_skip"] = a["w_skip"].T.copy()
  write_safetensors(path, tensors)
  return a


def test_circuit_tracer_transcoder_set(tmp_path):
  layers = [_ct_layer(tmp_path / f"layer_{i}.safetensors", i)
            for i in range(3)]
  (tmp_path / "config.yaml").write_text(yaml.safe_dump({
      "model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in",
      "feature_output_hook": "hook_mlp_out", "scan": "test"}))
  tset = sae_lib.load_transcoders(tmp_path)
  assert len(tset) == 3
  x = _x((2, 3, D))
  for i, (t, a) in enumerate(zip(tset, layers)):
    assert (t.config.hook_point, t.config.output_point) == (
        f"blocks.{i}.mlp_in", f"blocks.{i}.mlp_out")
    f = _jumprelu(x @ a["w_enc"] + a["b_enc"], a["threshold"])
    np.testing.assert_allclose(
        _forward(t, x), f @ a["w_dec"] + a["b_dec"] + x @ a["w_skip"],
        atol=1e-5)
  one = sae_lib.load_sae(tmp_path / "layer_1.safetensors",
                         point="blocks.1.resid_mid")
  assert one.config.output_point == "blocks.1.mlp_out"


def _clt_reference(w_enc, b_enc, w_dec, b_dec, threshold, x, w_skip=None):
  """circuit-tracer's CLT math in numpy: x [n, tokens, d]."""
  n = len(w_enc)
  pre = np.einsum("ltd,lfd->ltf", x, w_enc) + b_enc[:, None]
  f = pre * (pre > threshold[:, None]) if threshold is not None else (
      np.maximum(pre, 0))
  y = np.repeat(b_dec[:, None], x.shape[1], 1).astype(np.float64)
  for s in range(n):
    for t in range(s, n):
      y[t] += f[s] @ w_dec[s][:, t - s]
  if w_skip is not None:
    y += np.einsum("ltd,lde->lte", x, w_skip)
  return f, y


def _clt_check(clt, x, f_ref, y_ref):
  xs = _named(x, "layers", "tokens", "embedding")
  f = clt.encode(xs)
  np.testing.assert_allclose(np.asarray(f.unwrap("layers", "tokens",
                                                 "features")), f_ref,
                             atol=1e-5)
  for l in range(clt.num_layers):
    np.testing.assert_allclose(
        np.asarray(clt.encode_layer(xs[{"layers": l}], l).unwrap(
            "tokens", "features")), f_ref[l], atol=1e-5)
  y = clt.decode(f, xs)
  np.testing.assert_allclose(np.asarray(y.unwrap("layers", "tokens",
                                                 "embedding")), y_ref,
                             atol=1e-5)


def test_circuit_tracer_cross_layer_transcoder(tmp_path):
  n, rng = 3, np.random.default_rng(0)
  w_enc = (rng.standard_normal((n, F, D)) / 4).astype(np.float32)
  b_enc = (0.1 * rng.standard_normal((n, F))).astype(np.float32)
  b_dec = (0.1 * rng.standard_normal((n, D))).astype(np.float32)
  thr = rng.uniform(0, 0.3, (n, F)).astype(np.float32)
  w_dec = [(rng.standard_normal((F, n - i, D)) / 8).astype(np.float32)
           for i in range(n)]
  for i in range(n):
    write_safetensors(tmp_path / f"W_enc_{i}.safetensors", {
        f"W_enc_{i}": w_enc[i], f"b_enc_{i}": b_enc[i],
        f"b_dec_{i}": b_dec[i], f"threshold_{i}": thr[i]})
    write_safetensors(tmp_path / f"W_dec_{i}.safetensors",
                      {f"W_dec_{i}": w_dec[i]})
  (tmp_path / "config.yaml").write_text(yaml.safe_dump({
      "model_kind": "cross_layer_transcoder",
      "feature_input_hook": "hook_resid_mid",
      "feature_output_hook": "hook_mlp_out"}))
  clt = sae_lib.load_transcoders(tmp_path / "config.yaml")
  assert isinstance(clt, sae_lib.CrossLayerTranscoder)
  assert (clt.input_point, clt.output_point, clt.activation) == (
      "resid_mid", "mlp_out", "jumprelu")
  x = _x((n, 5, D))
  _clt_check(clt, x, *_clt_reference(w_enc, b_enc, w_dec, b_dec, thr, x))


def test_gemma_scope_2_cross_layer_transcoder(tmp_path):
  n, rng = 3, np.random.default_rng(1)
  per = []
  for i in range(n):
    t = {"w_enc": rng.standard_normal((D, F)) / 4,
         "w_dec": rng.standard_normal((F, n, D)) / 8,
         "b_enc": 0.1 * rng.standard_normal(F),
         "b_dec": 0.1 * rng.standard_normal(D),
         "threshold": rng.uniform(0, 0.3, F),
         "affine_skip_connection": rng.standard_normal((D, D)) / 4}
    t = {k: v.astype(np.float32) for k, v in t.items()}
    write_safetensors(tmp_path / f"layer_{i}.safetensors", t)
    per.append(t)
  (tmp_path / "config.yaml").write_text(yaml.safe_dump({
      "model_kind": "cross_layer_transcoder",
      "feature_input_hook": "mlp.hook_in",
      "feature_output_hook": "hook_mlp_out",
      "transcoders": [f"layer_{i}.safetensors" for i in range(n)]}))
  clt = sae_lib.load_transcoders(tmp_path)
  x = _x((n, 4, D))
  ref = _clt_reference(
      np.stack([t["w_enc"].T for t in per]), np.stack([t["b_enc"] for t in per]),
      [t["w_dec"][:, i:] for i, t in enumerate(per)],
      np.stack([t["b_dec"] for t in per]),
      np.stack([t["threshold"] for t in per]), x,
      np.stack([t["affine_skip_connection"] for t in per]))
  _clt_check(clt, x, *ref)


# ----------------------------------------------------------- bad files


def _good_saelens(directory, **cfg_changes):
  arrays = random_arrays(D, F, D, threshold=True)
  cfg = {"architecture": "jumprelu", "d_in": D, "d_sae": F,
         "dtype": "float32",
         "metadata": {"sae_lens_version": "6.0.0",
                      "hook_name": "blocks.0.hook_resid_post"}}
  cfg.update(cfg_changes)
  _write_saelens(directory, cfg, _saelens_tensors(arrays))
  return directory


def _rewrite(directory, change):
  path = directory / "sae_weights.safetensors"
  from penzai_lm.sae.formats.tensor_files import read_safetensors  # pylint: disable=g-import-not-at-top
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
        lambda d: _good_saelens(d, architecture="gated"),
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
        lambda d: _good_saelens(d, architecture="jumprelu_transcoder",
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
  directory = _good_saelens(tmp_path / "sae")
  damage(directory)
  model = config("llama_gqa") if case == "model mismatch" else None
  with pytest.raises(SAEFormatError, match=message):
    sae_lib.load_sae(directory, model=model)


def test_a_point_override_loads_an_unknown_hook(tmp_path):
  directory = _good_saelens(tmp_path)
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
  _ct_layer(ct / "layer_0.safetensors", 0)
  _ct_layer(ct / "layer_2.safetensors", 2)
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
  with pytest.raises(SAEFormatError, match=r"transcoders\[0\]' is hf://.*not"
                     " in the local Hugging Face cache"):
    sae_lib.load_transcoders(ct)
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
