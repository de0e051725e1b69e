"""circuit-tracer parity: transcoder files read here compute what
circuit-tracer computes from the same files.

Per-layer transcoders (circuit-tracer's own safetensors with JumpReLU and a
skip connection, or ReLU; Gemma Scope 1 ``.npz`` and Gemma Scope 2
safetensors through circuit-tracer's Gemma loaders) and cross-layer
transcoders (``W_enc_i`` / ``W_dec_i`` files written by circuit-tracer's
``CrossLayerTranscoder.to_safetensors``): encode, decode and forward agree
within 1e-5 (float32), on random weights.

Run with ``-s`` for a table of the measured max absolute differences.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz
import yaml

circuit_tracer = pytest.importorskip("circuit_tracer")
torch = pytest.importorskip("torch")

# pylint: disable=g-import-not-at-top
from circuit_tracer.transcoder import cross_layer_transcoder as ct_clt
from circuit_tracer.transcoder import single_layer_transcoder as ct_plt
from circuit_tracer.transcoder.activation_functions import JumpReLU

from penzai_lm import sae as sae_lib
from penzai_lm.sae.formats.tensor_files import write_safetensors
from tests.sae.random_saes import random_arrays
# pylint: enable=g-import-not-at-top

TOL = 1e-5
D, F, LAYERS = 32, 128, 3
CPU = torch.device("cpu")
_MEASURED: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report():
  yield
  if _MEASURED:
    print("\nmax |penzai_lm - circuit-tracer| (float32):")
    for (case, what), value in sorted(_MEASURED.items()):
      print(f"  {case:<28s} {what:<12s} {value:.2e}")


def _close(case, what, ours, theirs):
  diff = float(np.max(np.abs(np.asarray(ours, np.float64)
                             - np.asarray(theirs, np.float64))))
  _MEASURED[(case, what)] = max(_MEASURED.get((case, what), 0.0), diff)
  assert diff <= TOL, f"{case} {what}: {diff:.3e}"


def _inputs(shape, seed=3):
  rng = np.random.default_rng(seed)
  return (0.2 + rng.standard_normal(shape)).astype(np.float32)


def _named(x, *axes):
  return pz.nx.wrap(jnp.asarray(x)).tag(*axes)


def _np(x, *axes):
  return np.asarray(x.unwrap(*axes))


def _config(directory, kind, files=None, in_hook="mlp.hook_in",
            out_hook="hook_mlp_out"):
  config = {"model_kind": kind, "feature_input_hook": in_hook,
            "feature_output_hook": out_hook, "scan": "test"}
  if files is not None:
    config["transcoders"] = [str(f) for f in files]
  (directory / "config.yaml").write_text(yaml.safe_dump(config))
  return {**config, "repo_id": ""}


def _compare_plt(case, ours, theirs, x):
  """One block: encode, decode (of circuit-tracer's features) and
  forward."""
  xt = torch.from_numpy(x)
  with torch.no_grad():
    f_t = theirs.encode(xt)
    y_t = theirs.decode(f_t, xt)
    out_t = theirs(xt)
  xs = _named(x, "tokens", "embedding")
  _close(case, "encode", _np(ours.encode(xs), "tokens", "features"), f_t)
  f_named = _named(f_t.numpy(), "tokens", "features")
  y = ours.decode(f_named)
  skip = ours.skip(xs)
  y = y if skip is None else y + skip
  _close(case, "decode", _np(y, "tokens", "embedding"), y_t)
  _close(case, "forward", _np(ours.forward(xs), "tokens", "embedding"),
         out_t)
  assert 0 < (f_t > 0).float().mean() < 1


@pytest.mark.parametrize("jumprelu", [True, False], ids=["jumprelu", "relu"])
def test_transcoder_set_written_by_circuit_tracer(tmp_path, jumprelu):
  transcoders = {}
  for layer in range(LAYERS):
    a = random_arrays(D, F, D, seed=layer, threshold=jumprelu,
                      skip=jumprelu)
    act = (JumpReLU(torch.from_numpy(a["threshold"]), 0.1) if jumprelu
           else torch.nn.functional.relu)
    t = ct_plt.SingleLayerTranscoder(D, F, act, layer,
                                     skip_connection=jumprelu, device=CPU,
                                     dtype=torch.float32)
    with torch.no_grad():
      t.W_enc.copy_(torch.from_numpy(a["w_enc"].T))
      t.W_dec.copy_(torch.from_numpy(a["w_dec"]))
      t.b_enc.copy_(torch.from_numpy(a["b_enc"]))
      t.b_dec.copy_(torch.from_numpy(a["b_dec"]))
      if jumprelu:
        t.W_skip.copy_(torch.from_numpy(a["w_skip"].T))
    transcoders[layer] = t
  ct_plt.TranscoderSet(transcoders, "mlp.hook_in", "hook_mlp_out"
                       ).to_safetensors(str(tmp_path))
  files = [tmp_path / f"layer_{i}.safetensors" for i in range(LAYERS)]
  config = _config(tmp_path, "transcoder_set", files)
  # circuit-tracer's own set loader (its hf_utils.load_transcoders wraps
  # it, but imports a huggingface_hub constant that newer hubs dropped).
  theirs = ct_plt.load_transcoder_set(
      dict(enumerate(config["transcoders"])), scan=config["scan"],
      feature_input_hook=config["feature_input_hook"],
      feature_output_hook=config["feature_output_hook"], device=CPU,
      dtype=torch.float32, lazy_decoder=False)
  ours = sae_lib.load_transcoders(tmp_path)
  assert isinstance(ours, sae_lib.TranscoderSet) and len(ours) == LAYERS
  x = _inputs((LAYERS, 7, D))
  name = "set-" + ("jumprelu-skip" if jumprelu else "relu")
  for layer in range(LAYERS):
    assert ours[layer].config.hook_point == f"blocks.{layer}.mlp_in"
    _compare_plt(name, ours[layer], theirs[layer], x[layer])


def test_gemma_scope_transcoders_through_circuit_tracer_loaders(tmp_path):
  """The same files through circuit-tracer's Gemma Scope 1 (``.npz``,
  ``W_enc`` ``[d_model, d_transcoder]``) and Gemma Scope 2 (lower-case,
  ``affine_skip_connection``) loaders."""
  a = random_arrays(D, F, D, seed=7, threshold=True, skip=True)
  np.savez(tmp_path / "params.npz", W_enc=a["w_enc"], W_dec=a["w_dec"],
           b_enc=a["b_enc"], b_dec=a["b_dec"], threshold=a["threshold"])
  theirs = ct_plt.load_gemma_scope_transcoder(str(tmp_path / "params.npz"),
                                              3, device=CPU)
  ours = sae_lib.load_sae(tmp_path / "params.npz", point="blocks.3.mlp_in",
                          output_point="blocks.3.mlp_out")
  x = _inputs((7, D))
  _compare_plt("gemma-scope-1", ours, theirs, x)
  gs2 = tmp_path / "gs2" / "params.safetensors"
  gs2.parent.mkdir()
  write_safetensors(gs2, {
      "w_enc": a["w_enc"], "w_dec": a["w_dec"], "b_enc": a["b_enc"],
      "b_dec": a["b_dec"], "threshold": a["threshold"],
      "affine_skip_connection": a["w_skip"]})
  theirs = ct_plt.load_gemma_scope_2_transcoder(str(gs2), 3, device=CPU)
  ours = sae_lib.load_sae(gs2, point="blocks.3.mlp_in",
                          output_point="blocks.3.mlp_out")
  _compare_plt("gemma-scope-2-affine", ours, theirs, x)


@pytest.mark.parametrize("activation", ["jump_relu", "relu"])
def test_cross_layer_transcoder_written_by_circuit_tracer(tmp_path,
                                                          activation):
  rng = np.random.default_rng(11)
  theirs = ct_clt.CrossLayerTranscoder(
      LAYERS, F, D, activation_function=activation, lazy_decoder=False,
      device=CPU, dtype=torch.float32)
  with torch.no_grad():
    theirs.W_enc.copy_(torch.from_numpy(
        rng.standard_normal((LAYERS, F, D)) / np.sqrt(D)))
    theirs.b_enc.copy_(torch.from_numpy(0.1 * rng.standard_normal((LAYERS, F))))
    theirs.b_dec.copy_(torch.from_numpy(0.1 * rng.standard_normal((LAYERS, D))))
    for w in theirs.W_dec:
      w.copy_(torch.from_numpy(rng.standard_normal(w.shape) / np.sqrt(F)))
    if activation == "jump_relu":
      theirs.activation_function.threshold.copy_(torch.from_numpy(
          rng.uniform(0, 0.3, (LAYERS, 1, F))))
  theirs.to_safetensors(str(tmp_path))
  _config(tmp_path, "cross_layer_transcoder", in_hook="hook_resid_mid")
  ours = sae_lib.load_transcoders(tmp_path)
  reloaded = ct_clt.load_clt(str(tmp_path), lazy_decoder=False, device=CPU,
                             dtype=torch.float32)
  assert (ours.input_point, ours.output_point) == ("resid_mid", "mlp_out")
  case = f"clt-{activation}"
  x = _inputs((LAYERS, 7, D))
  xt = torch.from_numpy(x)
  xs = _named(x, "layers", "tokens", "embedding")
  with torch.no_grad():
    f_t = reloaded.encode(xt)
    y_t = reloaded.decode(f_t.to_sparse())
    forward_t = reloaded(xt)
  assert 0 < (f_t > 0).float().mean() < 1
  f_o = ours.encode(xs)
  _close(case, "encode", _np(f_o, "layers", "tokens", "features"), f_t)
  for layer in range(LAYERS):
    with torch.no_grad():
      want = reloaded.encode_layer(xt[layer], layer)
    _close(case, "encode_layer", _np(ours.encode_layer(
        xs[{"layers": layer}], layer), "tokens", "features"), want)
  f_named = _named(f_t.numpy(), "layers", "tokens", "features")
  _close(case, "decode", _np(ours.decode(f_named), "layers", "tokens",
                             "embedding"), y_t)
  _close(case, "forward", _np(ours.forward(xs), "layers", "tokens",
                              "embedding"), forward_t)
