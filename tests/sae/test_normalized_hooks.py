"""Autoencoders on TransformerLens's ``ln2.hook_normalized``: the pre-MLP
norm's output *before* its weights, loaded to read penzai_lm's ``mlp_in``
(after them) with the weights folded in.

The reference is transformers on CPU: a tiny random model per family whose
pre-MLP norm weights (and GPT-2's shift) are set to random values far from
1; a forward hook on the Hugging Face norm takes its input ``x`` and the
test computes ``n = x * rsqrt(mean(x^2) + eps)`` (LayerNorm: centred, over
the standard deviation) in numpy, then encodes ``n`` with the file's raw
arrays. penzai_lm's features come from the loaded autoencoder on
``run_with_cache``'s ``mlp_in``.
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
from penzai import pz
import pytest
import torch
import transformers
import yaml

from penzai_lm import interp
from penzai_lm import sae as sae_lib
from penzai_lm.loading import load_model
from penzai_lm.sae import SAEFormatError
from penzai_lm.sae.formats.tensor_files import write_safetensors
from tests.loading.hf_models import logits
from tests.sae.format_files import encode
from tests.sae.format_files import forward
from tests.sae.format_files import jumprelu
from tests.sae.format_files import write_saelens
from tests.sae.random_saes import random_arrays

IDS = [5, 17, 42, 3, 99, 64, 8, 23, 77, 1]
WIDTH, LAYERS, F, LAYER = 32, 3, 64, 1
_COMMON = dict(vocab_size=101, hidden_size=WIDTH, intermediate_size=48,
               num_hidden_layers=LAYERS, num_attention_heads=4,
               max_position_embeddings=64)


def _family(name):
  """(model class, config, pre-MLP norm module, Gemma's 1 + w offset)."""
  t = transformers
  if name == "gemma2":
    return t.Gemma2ForCausalLM, t.Gemma2Config(
        **_COMMON, num_key_value_heads=2, head_dim=16, sliding_window=5,
        query_pre_attn_scalar=12), "pre_feedforward_layernorm", 1.0
  if name == "llama":
    return t.LlamaForCausalLM, t.LlamaConfig(
        **_COMMON, num_key_value_heads=2), "post_attention_layernorm", 0.0
  return t.GPT2LMHeadModel, t.GPT2Config(
      vocab_size=101, n_embd=WIDTH, n_layer=LAYERS, n_head=4,
      n_positions=64), "ln_2", 0.0


def _blocks(hf):
  return hf.transformer.h if hasattr(hf, "transformer") else hf.model.layers


def _build(name, path):
  """A random transformers model whose pre-MLP norm weights are random
  (either sign, |g| in [0.3, 2]) and GPT-2's shifts too, saved to
  ``path``."""
  cls, config, norm_name, offset = _family(name)
  torch.manual_seed(0)
  hf = cls(config).eval()
  rng = np.random.default_rng(7)
  with torch.no_grad():
    for p in hf.parameters():
      p.add_(0.05 * torch.randn_like(p))
    for block in _blocks(hf):
      norm = getattr(block, norm_name)
      g = rng.uniform(0.3, 2.0, WIDTH) * rng.choice([-1, 1], WIDTH)
      norm.weight.copy_(torch.from_numpy(g - offset))
      if getattr(norm, "bias", None) is not None:
        norm.bias.copy_(torch.from_numpy(0.5 * rng.standard_normal(WIDTH)))
  hf.save_pretrained(path, safe_serialization=True)
  return hf


def _before_weights(hf, name):
  """(n, g, b) per block, ``[layers, seq, d]`` / ``[layers, d]``: n from
  the norm's input, computed here; checked against the norm's output."""
  _, config, norm_name, offset = _family(name)
  seen = {}
  hooks = [getattr(b, norm_name).register_forward_hook(
      lambda m, i, o, l=l: seen.__setitem__(l, (i[0][0].double().numpy(),
                                                o[0].double().numpy())))
           for l, b in enumerate(_blocks(hf))]
  with torch.no_grad():
    hf(torch.tensor([IDS]))
  for h in hooks:
    h.remove()
  layer_norm = name == "gpt2"
  eps = config.layer_norm_epsilon if layer_norm else config.rms_norm_eps
  n, scale, shift = [], [], []
  for l, block in enumerate(_blocks(hf)):
    x, out = seen[l]
    if layer_norm:
      x = x - x.mean(-1, keepdims=True)
    n.append(x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps))
    norm = getattr(block, norm_name)
    scale.append(norm.weight.detach().double().numpy() + offset)
    bias = getattr(norm, "bias", None)
    shift.append(np.zeros(WIDTH) if bias is None
                 else bias.detach().double().numpy())
    # n, weighted, is the norm's output: n is computed right.
    np.testing.assert_allclose(n[-1] * scale[-1] + shift[-1], out, atol=1e-4)
  return np.stack(n), np.stack(scale), np.stack(shift)


@pytest.fixture(scope="module", params=["gemma2", "llama", "gpt2"])
def family(request, tmp_path_factory):
  """A random model in transformers and penzai_lm (Llama as a layer
  stack), and per block the values before (``n``) and after (``m``,
  penzai_lm's mlp_in) the pre-MLP norm's weights."""
  torch.set_num_threads(1)
  path = tmp_path_factory.mktemp(request.param)
  hf = _build(request.param, path)
  model = load_model(path, use_layer_stack=request.param == "llama")
  n, scale, shift = _before_weights(hf, request.param)
  with torch.no_grad():
    hf_logits = hf(torch.tensor([IDS])).logits[0].numpy()
  names = [f"blocks.{l}.mlp_in" for l in range(LAYERS)]
  cache = interp.run_with_cache(model, IDS, names, logits=False)
  m = [np.asarray(cache[p].unwrap("batch", "seq", "embedding")[0])
       for p in names]
  return dict(hf=hf, model=model, norm=_family(request.param)[2], n=n,
              m=np.stack(m), scale=scale, shift=shift, logits=hf_logits,
              name=request.param)


def _saelens(directory, arch, arrays, **cfg):
  tensors = {"W_enc": arrays["w_enc"], "b_enc": arrays["b_enc"],
             "W_dec": arrays["w_dec"], "b_dec": arrays["b_dec"]}
  if "threshold" in arrays:
    tensors["threshold"] = arrays["threshold"]
  if "w_skip" in arrays:
    tensors["W_skip"] = arrays["w_skip"].T.copy()
  meta = {"sae_lens_version": "6.0.0",
          "hook_name": f"blocks.{LAYER}.ln2.hook_normalized"}
  if arch.endswith("transcoder"):
    meta["hook_name_out"] = f"blocks.{LAYER}.hook_mlp_out"
    cfg.setdefault("d_out", WIDTH)
  write_saelens(directory, {"architecture": arch, "d_in": WIDTH, "d_sae": F,
                            "metadata": meta, **cfg}, tensors)
  return directory


def test_skip_transcoder_features_and_output(tmp_path, family):
  a = random_arrays(WIDTH, F, WIDTH, threshold=True, skip=True, seed=3)
  path = _saelens(tmp_path, "jumprelu_skip_transcoder", a,
                  apply_b_dec_to_input=False)
  ours = sae_lib.load_sae(path, model=family["model"])
  assert (ours.config.hook_point, ours.config.output_point) == (
      "blocks.1.mlp_in", "blocks.1.mlp_out")
  n, m = family["n"][LAYER][None], family["m"][LAYER][None]
  want = jumprelu(n @ a["w_enc"] + a["b_enc"], a["threshold"])
  assert 0 < (want > 0).mean() < 1
  np.testing.assert_allclose(encode(ours, m), want, atol=1e-4)
  np.testing.assert_allclose(
      forward(ours, m), want @ a["w_dec"] + a["b_dec"] + n @ a["w_skip"],
      atol=1e-4)
  # Before the fix: the raw arrays on mlp_in are far off.
  assert np.abs(jumprelu(m @ a["w_enc"] + a["b_enc"], a["threshold"])
                - want).max() > 0.1


def _sae_np(a, n):
  f = np.maximum((n - a["b_dec"]) @ a["w_enc"] + a["b_enc"], 0)
  return f, f @ a["w_dec"] + a["b_dec"]


def test_sae_reconstruction_and_splice(tmp_path, family):
  """An SAE on ln2.hook_normalized (b_dec subtracted from its input):
  features, its reconstruction written at mlp_in, and the model with it
  spliced in against transformers with the norm's _norm output replaced."""
  a = random_arrays(WIDTH, F, WIDTH, seed=4)
  ours = sae_lib.load_sae(_saelens(tmp_path, "standard", a,
                                   apply_b_dec_to_input=True),
                          model=family["model"])
  g, b = family["scale"][LAYER], family["shift"][LAYER]
  n, m = family["n"][LAYER][None], family["m"][LAYER][None]
  f, recon = _sae_np(a, n)
  np.testing.assert_allclose(encode(ours, m), f, atol=1e-4)
  np.testing.assert_allclose(forward(ours, m), recon * g + b, atol=1e-4)

  def hook(module, inputs, output):
    x = inputs[0].double()
    if family["name"] == "gpt2":
      x = x - x.mean(-1, keepdim=True)
    eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
    n_t = (x / ((x ** 2).mean(-1, keepdim=True) + eps).sqrt()).numpy()
    y = _sae_np(a, n_t)[1] * g + b
    return torch.from_numpy(y).to(output.dtype)

  block = getattr(_blocks(family["hf"])[LAYER], family["norm"])
  handle = block.register_forward_hook(hook)
  try:
    with torch.no_grad():
      want = family["hf"](torch.tensor([IDS])).logits[0].numpy()
  finally:
    handle.remove()
  assert np.abs(want - family["logits"]).max() > 1e-2  # The splice matters.
  spliced = sae_lib.splice(family["model"], ours, mode="replace")
  got = np.asarray(logits(spliced, pz.nx.wrap(jnp.asarray(IDS)).tag("seq"))
                   .unwrap("seq", "vocabulary"))
  np.testing.assert_allclose(got, want, atol=1e-4)


def test_circuit_tracer_transcoder_set(tmp_path, family):
  """circuit-tracer's "gemma" layout (feature_input_hook:
  ln2.hook_normalized), every block folded with its own norm."""
  arrays = [random_arrays(WIDTH, F, WIDTH, threshold=True, skip=True, seed=s)
            for s in range(LAYERS)]
  for l, a in enumerate(arrays):
    write_safetensors(tmp_path / f"layer_{l}.safetensors", {
        "W_enc": a["w_enc"].T.copy(), "W_dec": a["w_dec"],
        "b_enc": a["b_enc"], "b_dec": a["b_dec"],
        "activation_function.threshold": a["threshold"],
        "W_skip": a["w_skip"].T.copy()})
  (tmp_path / "config.yaml").write_text(yaml.safe_dump({
      "model_kind": "transcoder_set",
      "feature_input_hook": "ln2.hook_normalized",
      "feature_output_hook": "hook_mlp_out"}))
  ours = sae_lib.load_transcoders(tmp_path, model=family["model"])
  assert ours.norm_folded and ours.input_hook == "ln2.hook_normalized"
  for l, a in enumerate(arrays):
    n, m = family["n"][l][None], family["m"][l][None]
    want = jumprelu(n @ a["w_enc"] + a["b_enc"], a["threshold"])
    np.testing.assert_allclose(encode(ours[l], m), want, atol=1e-4)
    np.testing.assert_allclose(
        forward(ours[l], m), want @ a["w_dec"] + a["b_dec"] + n @ a["w_skip"],
        atol=1e-4)
  with pytest.raises(SAEFormatError, match="feature_input_hook.*Pass model="):
    sae_lib.load_transcoders(tmp_path)


def test_cross_layer_transcoder(tmp_path, family):
  """circuit-tracer's CLT files with feature_input_hook:
  ln2.hook_normalized: block l's encoder folded with block l's norm."""
  rng = np.random.default_rng(5)
  enc = rng.standard_normal((LAYERS, F, WIDTH)).astype(np.float32) / 6
  b_enc = (0.1 * rng.standard_normal((LAYERS, F))).astype(np.float32)
  thr = rng.uniform(0, 0.3, (LAYERS, F)).astype(np.float32)
  for l in range(LAYERS):
    write_safetensors(tmp_path / f"W_enc_{l}.safetensors", {
        f"W_enc_{l}": enc[l], f"b_enc_{l}": b_enc[l],
        f"b_dec_{l}": np.zeros(WIDTH, np.float32), f"threshold_{l}": thr[l]})
    write_safetensors(tmp_path / f"W_dec_{l}.safetensors", {
        f"W_dec_{l}": rng.standard_normal((F, LAYERS - l, WIDTH)).astype(
            np.float32)})
  (tmp_path / "config.yaml").write_text(yaml.safe_dump({
      "model_kind": "cross_layer_transcoder",
      "feature_input_hook": "ln2.hook_normalized",
      "feature_output_hook": "hook_mlp_out"}))
  clt = sae_lib.load_transcoders(tmp_path, model=family["model"])
  assert clt.input_point == "mlp_in"
  for l in range(LAYERS):
    pre = family["n"][l] @ enc[l].T + b_enc[l]
    want = pre * (pre > thr[l])
    got = clt.encode_layer(pz.nx.wrap(jnp.asarray(family["m"][l])).tag(
        "seq", "embedding"), l).unwrap("seq", "features")
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)


def _zero_scale(model, layer: int, dim: int):
  """``model`` with block ``layer``'s pre-MLP norm scale 0 at ``dim``."""
  def zero(p):
    k = 2 - len(p.value.named_shape)
    axes = ("blocks", "embedding")[k:]
    at = (layer, dim)[k:]
    v = p.value.unwrap(*axes).at[at].set(0.0)
    return dataclasses.replace(p, value=pz.nx.wrap(v).tag(*axes))
  return pz.select(model).at_instances_of(pz.ParameterValue).where(
      lambda p: p.label.endswith((f"block_{layer}/pre_ffw_norm/scale.weights",
                                  "blocks/pre_ffw_norm/scale.weights"))
  ).apply(zero)


def test_refusals_and_opt_outs(tmp_path, family):
  a = random_arrays(WIDTH, F, WIDTH, threshold=True, skip=True, seed=6)
  path = _saelens(tmp_path / "t", "jumprelu_skip_transcoder", a,
                  apply_b_dec_to_input=False)
  model = family["model"]
  with pytest.raises(SAEFormatError,
                     match="'hook_name' is 'blocks.1.ln2.hook_normalized'.*"
                     "no model was given. Pass model="):
    sae_lib.load_sae(path)
  with pytest.raises(SAEFormatError, match="only the model's config"):
    sae_lib.load_sae(path, model=model.config)
  with pytest.raises(SAEFormatError, match=r"block 1's blocks.1.ln2.w is"
                     r" below 1e-06 .* at 1 dimension\(s\) \(first: \[3\]\)"
                     ".*fold_norm=False"):
    sae_lib.load_sae(path, model=_zero_scale(model, LAYER, 3))
  # fold_norm=False, or the caller's point: the arrays as they are.
  m = family["m"][LAYER][None]
  raw = jumprelu(m @ a["w_enc"] + a["b_enc"], a["threshold"])
  for kwargs in ({"fold_norm": False}, {"point": "blocks.1.mlp_in"}):
    as_is = sae_lib.load_sae(path, model=model, **kwargs)
    np.testing.assert_allclose(encode(as_is, m), raw, atol=1e-4)
  # What cannot be folded.
  b = random_arrays(WIDTH, F, WIDTH, seed=7)
  norm = _saelens(tmp_path / "ln", "standard", b,
                  normalize_activations="layer_norm")
  with pytest.raises(SAEFormatError, match="normalize_activations='layer_"):
    sae_lib.load_sae(norm, model=model)
  topk = _saelens(tmp_path / "topk", "topk", b, k=8,
                  rescale_acts_by_decoder_norm=True)
  with pytest.raises(SAEFormatError, match="rescale_acts_by_decoder_norm"):
    sae_lib.load_sae(topk, model=model)


def test_saved_as_mlp_hook_in(tmp_path, family):
  """A folded SAE saved reads mlp_in as it is (``mlp.hook_in``), and loads
  back without a model to the same computation."""
  a = random_arrays(WIDTH, F, WIDTH, seed=8)
  folded = sae_lib.load_sae(_saelens(tmp_path / "in", "standard", a,
                                     apply_b_dec_to_input=True),
                            model=family["model"])
  sae_lib.save_sae(folded, tmp_path / "out")
  cfg = json.loads((tmp_path / "out" / "cfg.json").read_text())
  assert cfg["metadata"]["hook_name"] == "blocks.1.mlp.hook_in"
  again = sae_lib.load_sae(tmp_path / "out")
  assert again.config.hook_point == "blocks.1.mlp_in"
  m = family["m"][LAYER][None]
  np.testing.assert_allclose(forward(again, m), forward(folded, m),
                             atol=1e-5)
