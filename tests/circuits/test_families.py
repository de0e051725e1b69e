"""attribute on Gemma 2 (post norms, soft-capped attention and logits),
Gemma 3 (post norms, query and key norms, embeddings scaled inside the
lookup) and Qwen3 (query and key norms): random Hugging Face models built
with transformers on the CPU and loaded with penzai_lm, random per-layer
ReLU transcoders with skip connections from ``mlp_in`` to ``mlp_out``.
Reference values come from transformers' model, read with hooks at the
locations circuit-tracer's nnsight backend reads (the pre-MLP norm's
output; the post-MLP norm's output, or the MLP's without one; the residual
entering block 0).

* every edge is the target's change when its source is added to the frozen
  replacement model (`jax.jvp` of `LinearizedModel.targets`);
* the nodes are the transcoders' active features on transformers' MLP
  inputs, and each row plus its ``b_dec`` terms adds up to the target's
  value in transformers' unfrozen model: a feature's pre-activation, or a
  logit before the soft-cap minus the mean of those (circuit-tracer's logit
  target), the probabilities being the capped logits';
* the replacement model's linear map equals transformers' model frozen as
  circuit-tracer freezes it, with hooks: attention weights detached after
  the softmax, the ``rsqrt`` of the norms circuit-tracer lists for the
  architecture (Qwen3's query and key norms left live, as there), and at
  the MLP's output point ``skip + (out - skip).detach()`` with the skip
  read from the pre-MLP norm's output.
"""

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from penzai_lm import circuits  # pylint: disable=g-import-not-at-top
from penzai_lm.loading import load_model  # pylint: disable=g-import-not-at-top
from penzai_lm.sae import SAEConfig  # pylint: disable=g-import-not-at-top
from penzai_lm.sae import SparseAutoencoder  # pylint: disable=g-import-not-at-top
from tests.circuits.test_attribute import _jvp_all  # pylint: disable=g-import-not-at-top
from tests.loading.hf_models import save_perturbed  # pylint: disable=g-import-not-at-top
from tests.sae.random_saes import random_arrays  # pylint: disable=g-import-not-at-top

PROMPT = [2, 17, 40, 5, 88, 61, 9]
WIDTH, LAYERS, VOCAB, FEATURES = 32, 3, 101, 64
_COMMON = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=48,
               num_hidden_layers=LAYERS, num_attention_heads=4,
               max_position_embeddings=64)
# Norms whose rsqrt circuit-tracer's nnsight backend freezes, per block.
_FROZEN_NORMS = {
    "gemma2": ("input_layernorm", "post_attention_layernorm",
               "pre_feedforward_layernorm", "post_feedforward_layernorm"),
    "gemma3": ("input_layernorm", "self_attn.q_norm", "self_attn.k_norm",
               "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm"),
    "qwen3": ("input_layernorm", "post_attention_layernorm"),
}
# (MLP input, MLP output) modules: "mlp.hook_in" and "hook_mlp_out" /
# "mlp.hook_out" in circuit-tracer's nnsight mapping.
_GEMMA_POINTS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")
_POINTS = {"gemma2": _GEMMA_POINTS, "gemma3": _GEMMA_POINTS,
           "qwen3": ("post_attention_layernorm", "mlp")}


def _hf_config(family):
  t = transformers
  if family == "gemma2":
    return t.Gemma2ForCausalLM, t.Gemma2Config(
        **_COMMON, num_key_value_heads=2, head_dim=16, sliding_window=4,
        query_pre_attn_scalar=12, attn_logit_softcapping=5.0,
        final_logit_softcapping=1.0)
  if family == "gemma3":
    return t.Gemma3ForCausalLM, t.Gemma3TextConfig(
        **_COMMON, num_key_value_heads=1, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention",
                     "sliding_attention"],
        query_pre_attn_scalar=16, rope_local_base_freq=1e4,
        final_logit_softcapping=None, attn_logit_softcapping=None)
  return t.Qwen3ForCausalLM, t.Qwen3Config(
      **_COMMON, num_key_value_heads=2, head_dim=12, rope_theta=5e4,
      tie_word_embeddings=False)


def _transcoders():
  out = []
  for layer in range(LAYERS):
    cfg = SAEConfig(
        activation="relu", num_features=FEATURES,
        input_axes=(("embedding", WIDTH),), output_axes=(("embedding", WIDTH),),
        hook_point=f"blocks.{layer}.mlp_in",
        output_point=f"blocks.{layer}.mlp_out")
    out.append(SparseAutoencoder.from_arrays(
        cfg, **random_arrays(WIDTH, FEATURES, WIDTH, seed=20 + layer,
                             skip=True)))
  return out


def _flat(tc):
  return {k: np.asarray(v, np.float32) for k, v in tc.flat().items()}


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "qwen3"])
def case(request, tmp_path_factory):
  """One family's models (same weights), transcoders, graph (every
  position kept), replacement model, transformers' values and the jvps of
  `_sources`."""
  family = request.param
  cls, config = _hf_config(family)
  config._attn_implementation = "eager"  # pylint: disable=protected-access
  path = tmp_path_factory.mktemp(family)
  hf = save_perturbed(cls, config, path)
  model = load_model(path)
  transcoders = _transcoders()
  graph = circuits.attribute(model, transcoders, PROMPT, batch_size=128,
                             zero_positions=0)
  linear = circuits.linearize(model, transcoders, np.asarray(PROMPT))
  out = dict(family=family, hf=hf, transcoders=transcoders, graph=graph,
             linear=linear, ref=_hf_run(hf, family, transcoders))
  out["jvp"] = _jvp_all(linear, *_sources(out))
  return out


def _frozen_attention(module, query, key, value, attention_mask,
                      dropout=0.0, scaling=None, softcap=None, **_):
  """transformers' eager attention with the weights detached after the
  softmax."""
  del dropout
  groups = module.num_key_value_groups
  key, value = (key.repeat_interleave(groups, 1),
                value.repeat_interleave(groups, 1))
  scores = query @ key.transpose(2, 3) * scaling
  if softcap is not None:
    scores = torch.tanh(scores / softcap) * softcap
  if attention_mask is not None:
    scores = scores + attention_mask[..., :key.shape[-2]]
  weights = torch.softmax(scores.float(), -1).to(query.dtype).detach()
  return (weights @ value).transpose(1, 2).contiguous(), weights


def _frozen_norm(module, args, output):
  """A norm's output recomputed with its rsqrt detached."""
  del output
  x = args[0].float()
  if hasattr(module, "variance_epsilon"):  # Qwen3: w * normalized.
    scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                        + module.variance_epsilon)
    return module.weight * (x * scale.detach())
  scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps)
  return x * scale.detach() * (1.0 + module.weight.float())


def _module(root, dotted):
  for part in dotted.split("."):
    root = getattr(root, part)
  return root


def _hf_run(hf, family, transcoders, embed_delta=None, mlp_delta=None,
            freeze=False) -> dict:
  """transformers' values (torch tensors) at the graph's points, the
  deltas added at ``embed`` and ``mlp_out``, frozen as circuit-tracer
  freezes it if ``freeze``."""
  seen = {"mlp_in": [None] * LAYERS, "mlp_out": [None] * LAYERS}
  hooks = _hooks(hf, family, transcoders, seen, embed_delta, mlp_delta,
                 freeze)
  module = {"gemma2": transformers.models.gemma2.modeling_gemma2,
            "gemma3": transformers.models.gemma3.modeling_gemma3,
            "qwen3": transformers.models.qwen3.modeling_qwen3}[family]
  attention = (mock.patch.object(module, "eager_attention_forward",
                                 _frozen_attention) if freeze
               else contextlib.nullcontext())
  ids = torch.tensor([PROMPT])
  try:
    with attention:
      raw = hf.lm_head(hf.model(ids).last_hidden_state)[0]
      capped = None if freeze else hf(ids).logits[0]
  finally:
    for h in hooks:
      h.remove()
  return {"embed": seen["embed"], "mlp_in": torch.stack(seen["mlp_in"]),
          "mlp_out": torch.stack(seen["mlp_out"]), "raw_logits": raw,
          "logits": capped}


def _hooks(hf, family, transcoders, seen, embed_delta, mlp_delta, freeze):
  """Registers `_hf_run`'s hooks (values into ``seen``); their handles."""
  read, write = _POINTS[family]

  def embed_hook(module, args, kwargs):
    del module
    x = args[0] if args else kwargs["hidden_states"]
    seen["embed"] = x[0]
    if embed_delta is not None:
      x = x + embed_delta[None]
    return ((x, *args[1:]), kwargs) if args else (args, {**kwargs,
                                                         "hidden_states": x})

  def in_hook(layer, module, args, output):
    del module, args
    seen["mlp_in"][layer] = output[0]

  def out_hook(layer, module, args, output):
    del module, args
    seen["mlp_out"][layer] = output[0]
    if freeze:
      skip = seen["mlp_in"][layer] @ torch.tensor(
          _flat(transcoders[layer])["w_skip"])
      output = skip[None] + (output - skip[None]).detach()
    if mlp_delta is not None:
      output = output + mlp_delta[layer][None]
    return output

  blocks = hf.model.layers
  hooks = [blocks[0].register_forward_pre_hook(embed_hook, with_kwargs=True)]
  for layer, block in enumerate(blocks):
    if freeze:  # Registered first: the hooks below see the frozen outputs.
      for name in _FROZEN_NORMS[family]:
        hooks.append(_module(block, name).register_forward_hook(_frozen_norm))
    hooks.append(_module(block, read).register_forward_hook(
        lambda *a, layer=layer: in_hook(layer, *a)))
    hooks.append(_module(block, write).register_forward_hook(
        lambda *a, layer=layer: out_hook(layer, *a)))
  if freeze:
    hooks.append(hf.model.norm.register_forward_hook(_frozen_norm))
  return hooks


def _np(x):
  return x.detach().float().numpy()


def _sources(case):
  """Tangents (embed [S, T, D], mlp_out [S, L, T, D]): each source node in
  graph order adds itself (from the transcoders' weights and transformers'
  values), and a last one adds every block's ``b_dec`` at every
  position."""
  graph, ref = case["graph"], case["ref"]
  n_pos = len(PROMPT)
  mlp_in, mlp_out = _np(ref["mlp_in"]), _np(ref["mlp_out"])
  n = graph.n_features + LAYERS * n_pos + n_pos
  embed = np.zeros((n + 1, n_pos, WIDTH), np.float32)
  mlp = np.zeros((n + 1, LAYERS, n_pos, WIDTH), np.float32)
  weights = [_flat(t) for t in case["transcoders"]]
  for node, ((layer, pos, f), a) in enumerate(zip(
      graph.feature_nodes, graph.activation_values[graph.selected_features])):
    mlp[node, layer, pos] = a * weights[layer]["w_dec"][f]
  node = graph.n_features
  for layer, w in enumerate(weights):
    acts = np.maximum(mlp_in[layer] @ w["w_enc"] + w["b_enc"], 0)
    recon = acts @ w["w_dec"] + w["b_dec"] + mlp_in[layer] @ w["w_skip"]
    for pos in range(n_pos):
      mlp[node, layer, pos] = mlp_out[layer, pos] - recon[pos]
      node += 1
  embed[node:n] = np.eye(n_pos)[:, :, None] * _np(ref["embed"])[None]
  mlp[n] = np.stack([w["b_dec"] for w in weights])[:, None]
  return jnp.asarray(embed), jnp.asarray(mlp)


def _readout(case, d_in, d_logits):
  """Each target row's value (features, then logits) for target changes
  ``d_in`` (``[S, L, T, D]``) and ``d_logits`` (``[S, V]``): ``[targets,
  S]``."""
  graph = case["graph"]
  rows = []
  for layer, pos, f in graph.feature_nodes:
    w_enc = _flat(case["transcoders"][layer])["w_enc"][:, f]
    rows.append(d_in[:, layer, pos] @ w_enc)
  demeaned = d_logits - d_logits.mean(axis=-1, keepdims=True)
  rows.extend(demeaned[:, graph.logit_tokens].T)
  return np.stack(rows)


@jax.jit
def _run_and_vjps(linear, u_in, u_logits):
  """The patched forward pass at zero deltas, and the targets' vector-
  Jacobian products for cotangents ``u_in`` ``[K, L, T, D]`` and
  ``u_logits`` ``[K, V]``."""
  seq = linear.tokens.named_shape["seq"]
  zeros = (jnp.zeros((seq, linear.width)),
           jnp.zeros((linear.num_layers, seq, linear.width)))
  _, pullback = jax.vjp(linear.targets, *zeros)
  return linear.run(*zeros), jax.vmap(pullback)((u_in, u_logits))


def test_every_edge_is_a_forward_mode_derivative(case):
  graph = case["graph"]
  d_in, d_logits = case["jvp"]
  expected = _readout(case, np.asarray(d_in[:-1]), np.asarray(d_logits[:-1]))
  assert graph.edges.shape == expected.shape
  assert np.abs(expected).max() > 0.1
  np.testing.assert_allclose(graph.edges, expected,
                             atol=3e-5 * np.abs(expected).max(), rtol=1e-4)


def test_nodes_and_rows_add_up_to_transformers_values(case):
  """The active features and logit nodes are the transcoders' and
  transformers' own; each row plus its b_dec terms is the target's value
  in the unfrozen model (logits before the cap, demeaned)."""
  graph, ref = case["graph"], case["ref"]
  mlp_in = _np(ref["mlp_in"])
  weights = [_flat(t) for t in case["transcoders"]]
  expected = [(l, p, f) for l, w in enumerate(weights) for p, f in zip(
      *np.nonzero(mlp_in[l] @ w["w_enc"] + w["b_enc"] > 0))]
  np.testing.assert_array_equal(graph.active_features, np.array(expected))
  capped = _np(ref["logits"])[-1]
  probs = np.exp(capped - capped.max()) / np.exp(capped - capped.max()).sum()
  top = np.argsort(-probs)[:graph.n_logits]
  np.testing.assert_array_equal(graph.logit_tokens, top)
  np.testing.assert_allclose(graph.logit_probabilities, probs[top],
                             rtol=1e-4)
  raw = _np(ref["raw_logits"])
  if case["family"] == "gemma2":  # The cap moves the logits.
    assert np.abs(raw[-1] - capped).max() > 0.1
  # Pre-activations without b_enc; logits before the cap, demeaned.
  values = _readout(case, mlp_in[None], raw[-1:])[:, 0]
  d_in, d_logits = case["jvp"]  # The last tangent adds the b_dec terms.
  bias = _readout(case, np.asarray(d_in[-1:]), np.asarray(d_logits[-1:]))[:, 0]
  assert np.abs(values).max() > 0.5
  np.testing.assert_allclose(graph.edges.sum(axis=1) + bias, values,
                             atol=3e-5 * np.abs(values).max())


def test_frozen_map_equals_transformers_frozen_as_circuit_tracer(case):
  """Forward values at zero deltas, and vector-Jacobian products for random
  cotangents on (mlp_in, last position's logits before the cap)."""
  hf, family, linear = case["hf"], case["family"], case["linear"]
  n_pos = len(PROMPT)
  embed_delta = torch.zeros(n_pos, WIDTH, requires_grad=True)
  mlp_delta = torch.zeros(LAYERS, n_pos, WIDTH, requires_grad=True)
  theirs = _hf_run(hf, family, case["transcoders"], embed_delta, mlp_delta,
                   freeze=True)
  rng = np.random.default_rng(0)
  u_in = rng.standard_normal((3, LAYERS, n_pos, WIDTH)).astype(np.float32)
  u_logits = rng.standard_normal((3, VOCAB)).astype(np.float32)
  ours, got = _run_and_vjps(linear, jnp.asarray(u_in), jnp.asarray(u_logits))
  for name, key in (("mlp_in", "mlp_in"), ("mlp_out", "mlp_out"),
                    ("embed", "embed"), ("target_logits", "raw_logits")):
    want = _np(theirs[key])
    if "logits" in name:  # The replacement model's: last position only.
      want = want[-1]
    np.testing.assert_allclose(np.asarray(ours[name]), want, atol=2e-4,
                               err_msg=name)
  np.testing.assert_allclose(np.asarray(ours["logits"]),
                             _np(case["ref"]["logits"])[-1], atol=2e-4)
  for i in range(len(u_in)):
    total = ((theirs["mlp_in"] * torch.tensor(u_in[i])).sum()
             + (theirs["raw_logits"][-1] * torch.tensor(u_logits[i])).sum())
    want = torch.autograd.grad(total, (embed_delta, mlp_delta),
                               retain_graph=True)
    for g, w in zip(got, want):
      w = _np(w)
      assert np.abs(w).max() > 0.1
      np.testing.assert_allclose(np.asarray(g[i]), w,
                                 atol=2e-5 * np.abs(w).max())
