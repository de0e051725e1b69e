"""circuit-tracer files: transcoder sets and cross-layer transcoders
(circuit-tracer's own and Gemma Scope 2's) against numpy references of
circuit-tracer's math. (`test_parity_circuit_tracer.py` compares with
circuit-tracer itself where it is installed.)"""

import numpy as np
import yaml

from penzai_lm import sae as sae_lib
from penzai_lm.sae.formats.tensor_files import write_safetensors
from tests.sae.format_files import D
from tests.sae.format_files import F
from tests.sae.format_files import ct_layer
from tests.sae.format_files import forward
from tests.sae.format_files import jumprelu
from tests.sae.format_files import named
from tests.sae.format_files import inputs


def test_circuit_tracer_transcoder_set(tmp_path):
  layers = [ct_layer(tmp_path / f"layer_{i}.safetensors", i)
            for i in range(3)]
  (tmp_path / "config.yaml").write_text(yaml.safe_dump({
      "model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in",
      "feature_output_hook": "hook_mlp_out", "scan": "test"}))
  tset = sae_lib.load_transcoders(tmp_path)
  assert len(tset) == 3
  x = inputs((2, 3, D))
  for i, (t, a) in enumerate(zip(tset, layers)):
    assert (t.config.hook_point, t.config.output_point) == (
        f"blocks.{i}.mlp_in", f"blocks.{i}.mlp_out")
    f = jumprelu(x @ a["w_enc"] + a["b_enc"], a["threshold"])
    np.testing.assert_allclose(
        forward(t, x), f @ a["w_dec"] + a["b_dec"] + x @ a["w_skip"],
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
  xs = named(x, "layers", "tokens", "embedding")
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
  x = inputs((n, 5, D))
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
  x = inputs((n, 4, D))
  ref = _clt_reference(
      np.stack([t["w_enc"].T for t in per]), np.stack([t["b_enc"] for t in per]),
      [t["w_dec"][:, i:] for i, t in enumerate(per)],
      np.stack([t["b_dec"] for t in per]),
      np.stack([t["threshold"] for t in per]), x,
      np.stack([t["affine_skip_connection"] for t in per]))
  _clt_check(clt, x, *ref)
