"""attribute with a cross-layer transcoder (CLT): the nodes are the CLT's own
features (numpy arithmetic on the real model's MLP inputs), every edge is
the target's change when its source (a feature writing to every later
block, an error, a token) is added in the frozen replacement model
(forward mode, `jax.jvp`), each target's row adds up to its value in the
real model, a CLT that writes only to its own block gives the per-layer
graph, the chunked read-out equals a plain sum, and a CLT that does not fit
is a clear error."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import penzai_lm
from penzai_lm import circuits
from penzai_lm import interp
from penzai_lm.sae import CrossLayerTranscoder
from penzai_lm.sae import SAEConfig
from penzai_lm.sae import SparseAutoencoder
from penzai_lm.sae import load_transcoders
from penzai_lm.sae.formats.tensor_files import write_safetensors
from tests.circuits.test_attribute import _jvp_all
from tests.model.configs import config

PROMPT = [1, 5, 9, 13, 2, 7]
LAYERS = 3
WIDTH = 32
FEATURES = 48


@functools.cache
def _model(family="llama_gqa"):
  return penzai_lm.build_transformer(config(family, True), seed=3)


@functools.cache
def _arrays(activation="jumprelu", skip=False, own_block_only=False):
  """Random CLT arrays in circuit-tracer's layout (``w_enc`` ``[L, F, D]``,
  ``w_dec[l]`` ``[F, L - l, D]``, ``w_skip`` input-major)."""
  rng = np.random.default_rng(7)
  out = {
      "w_enc": rng.standard_normal((LAYERS, FEATURES, WIDTH)) / np.sqrt(WIDTH),
      "b_enc": 0.1 * rng.standard_normal((LAYERS, FEATURES)),
      "w_dec": [rng.standard_normal((FEATURES, LAYERS - l, WIDTH))
                / np.sqrt(FEATURES) for l in range(LAYERS)],
      "b_dec": 0.1 * rng.standard_normal((LAYERS, WIDTH)),
  }
  if own_block_only:
    for w in out["w_dec"]:
      w[:, 1:] = 0.0
  if activation == "jumprelu":
    out["threshold"] = rng.uniform(0.0, 0.3, (LAYERS, FEATURES))
  if skip:
    out["w_skip"] = rng.standard_normal((LAYERS, WIDTH, WIDTH)) / np.sqrt(
        WIDTH)
  f32 = lambda v: [w.astype(np.float32) for w in v] if isinstance(
      v, list) else v.astype(np.float32)
  return {k: f32(v) for k, v in out.items()}


def _clt(**kw):
  return CrossLayerTranscoder.from_arrays(
      **_arrays(**kw), input_point="mlp_in", output_point="mlp_out")


@functools.cache
def _graph(zero_positions=0, family="llama_gqa", **kw):
  return circuits.attribute(_model(family), _clt(**kw), PROMPT,
                            batch_size=32, zero_positions=zero_positions)


@functools.cache
def _reference(family="llama_gqa"):
  """The real model's values on the prompt (no freezing, no transcoder)."""
  names = ["embed"] + [f"blocks.{i}.{p}" for i in range(LAYERS)
                       for p in ("mlp_in", "mlp_out")]
  cache = interp.run_with_cache(_model(family), PROMPT, names=names)

  def value(name):
    return np.asarray(cache[name].unwrap("batch", "seq", "embedding")[0])

  stacked = lambda p: np.stack([value(f"blocks.{i}.{p}")
                                for i in range(LAYERS)])
  return {"embed": value("embed"), "mlp_in": stacked("mlp_in"),
          "mlp_out": stacked("mlp_out"),
          "logits": np.asarray(cache.logits.unwrap("batch", "seq",
                                                   "vocabulary")[0])}


def _activations(a, zero_positions=0, family="llama_gqa"):
  """``[L, T, F]`` activations by circuit-tracer's arithmetic."""
  pre = np.einsum("ltd,lfd->ltf", _reference(family)["mlp_in"], a["w_enc"])
  pre = pre + a["b_enc"][:, None]
  if "threshold" in a:
    acts = pre * (pre > a["threshold"][:, None])
  else:
    acts = np.maximum(pre, 0)
  acts[:, :zero_positions] = 0
  return acts


def _writes(a, layer, f):
  """``[L, D]``: what feature ``(layer, f)`` writes per unit activation."""
  return np.pad(a["w_dec"][layer][f], ((layer, 0), (0, 0)))


def _sources(graph, a, family):
  """Per source node: the (embed, mlp_out) tangent that adds it."""
  ref, n_pos = _reference(family), len(PROMPT)
  n = graph.n_sources
  embed = np.zeros((n, n_pos, WIDTH), np.float32)
  mlp = np.zeros((n, LAYERS, n_pos, WIDTH), np.float32)
  acts = _activations(a, family=family)
  for node, (layer, pos, f) in enumerate(graph.feature_nodes):
    mlp[node, :, pos] = acts[layer, pos, f] * _writes(a, layer, f)
  recon = np.einsum("tf,fkd->ktd", acts[0], a["w_dec"][0])
  for layer in range(1, LAYERS):
    recon[layer:] += np.einsum("tf,fkd->ktd", acts[layer], a["w_dec"][layer])
  recon += a["b_dec"][:, None]
  if "w_skip" in a:
    recon += np.einsum("ltd,lde->lte", ref["mlp_in"], a["w_skip"])
  for layer in range(LAYERS):
    for pos in range(n_pos):
      mlp[graph.error_node(layer, pos), layer, pos] = (
          ref["mlp_out"][layer, pos] - recon[layer, pos])
  for pos in range(n_pos):
    embed[graph.token_start + pos, pos] = ref["embed"][pos]
  return embed, mlp


def _target_readouts(graph, a):
  """Per row of ``graph.edges``: how it reads (mlp_in, last logits)."""
  rows, vocab = len(graph.edges), graph.vocab_size
  read_in = np.zeros((rows, LAYERS, len(PROMPT), WIDTH), np.float32)
  read_logits = np.zeros((rows, vocab), np.float32)
  for i, (layer, pos, f) in enumerate(graph.feature_nodes):
    read_in[i, layer, pos] = a["w_enc"][layer, f]
  for k, token in enumerate(graph.logit_tokens):
    read_logits[graph.n_features + k] = -1.0 / vocab
    read_logits[graph.n_features + k, token] += 1.0
  return read_in, read_logits


def _through_frozen_model(kw, embed, mlp, family="llama_gqa"):
  """Each target's change for tangents ``embed`` / ``mlp``."""
  graph = _graph(family=family, **kw)
  linear = circuits.linearize(_model(family), _clt(**kw),
                              np.asarray(PROMPT))
  d_in, d_logits = _jvp_all(linear, jnp.asarray(embed), jnp.asarray(mlp))
  read_in, read_logits = _target_readouts(graph, _arrays(**kw))
  return (np.einsum("rlpd,slpd->rs", read_in, np.asarray(d_in))
          + np.einsum("rv,sv->rs", read_logits, np.asarray(d_logits)))


@pytest.mark.parametrize("family, kw", [
    ("llama_gqa", dict(activation="relu")),
    ("llama_gqa", dict(activation="jumprelu", skip=True)),
    # Post-MLP norms, soft-capped logits: CLTs write after the post norm.
    ("gemma2", dict(activation="relu", skip=True))])
def test_every_edge_is_a_forward_mode_derivative(family, kw):
  graph = _graph(family=family, **kw)
  expected = _through_frozen_model(
      kw, *_sources(graph, _arrays(**kw), family), family)
  assert np.abs(expected).max() > 0.1
  np.testing.assert_allclose(graph.edges, expected,
                             atol=2e-5 * np.abs(expected).max(), rtol=1e-4)
  # A feature's edges reach later blocks' features (cross-layer writes),
  # but none from its own block or later, nor from a later position.
  feats = graph.feature_nodes
  later = ((feats[None, :, 0] >= feats[:, None, 0])
           | (feats[None, :, 1] > feats[:, None, 1]))
  block = graph.edges[:graph.n_features, :graph.n_features]
  assert not block[later].any()
  two_up = feats[None, :, 0] + 2 == feats[:, None, 0]
  assert np.abs(block[two_up]).max() > 1e-3


@pytest.mark.parametrize("kw", [dict(activation="relu"),
                                dict(activation="jumprelu", skip=True)])
def test_rows_add_up_to_the_real_models_values(kw):
  """Exact on the prompt: each row's sum plus the b_dec terms (pushed
  through the frozen linear map) is the target's value in the unfrozen
  model: a pre-activation minus b_enc, a logit minus the mean logit."""
  graph, a, ref = _graph(**kw), _arrays(**kw), _reference()
  values = [ref["mlp_in"][l, p] @ a["w_enc"][l, f]
            for l, p, f in graph.feature_nodes]
  last = ref["logits"][-1]
  values = np.array(values + list(last[graph.logit_tokens] - last.mean()))
  tangent = np.broadcast_to(a["b_dec"][:, None], (LAYERS, len(PROMPT), WIDTH))
  bias = _through_frozen_model(kw, np.zeros((1, len(PROMPT), WIDTH)),
                               tangent[None])[:, 0]
  assert np.abs(values).max() > 0.5
  np.testing.assert_allclose(graph.edges.sum(axis=1) + bias, values,
                             atol=2e-5 * np.abs(values).max())


def test_nodes_are_the_clts_features():
  graph, a = _graph(zero_positions=1), _arrays()
  acts = _activations(a, zero_positions=1)
  coords = np.argwhere(acts)  # Sorted by (layer, position, id).
  np.testing.assert_array_equal(graph.active_features, coords)
  np.testing.assert_allclose(graph.activation_values, acts[tuple(coords.T)],
                             rtol=1e-5, atol=1e-6)
  first = [graph.error_node(l, 0) for l in range(LAYERS)]
  assert not graph.edges[:, first].any()
  assert graph.n_sources == len(coords) + LAYERS * len(PROMPT) + len(PROMPT)


def test_own_block_clt_is_the_per_layer_graph():
  """A CLT whose decoders write only to their own block is a per-layer
  transcoder set with the same weights: same graph."""
  a = _arrays(activation="relu", own_block_only=True)
  per_layer = []
  for layer in range(LAYERS):
    cfg = SAEConfig(activation="relu", num_features=FEATURES,
                    input_axes=(("embedding", WIDTH),),
                    output_axes=(("embedding", WIDTH),),
                    hook_point=f"blocks.{layer}.mlp_in",
                    output_point=f"blocks.{layer}.mlp_out")
    per_layer.append(SparseAutoencoder.from_arrays(
        cfg, w_enc=a["w_enc"][layer].T, b_enc=a["b_enc"][layer],
        w_dec=a["w_dec"][layer][:, 0], b_dec=a["b_dec"][layer]))
  expected = circuits.attribute(_model(), per_layer, PROMPT, batch_size=32,
                                zero_positions=0)
  graph = _graph(activation="relu", own_block_only=True)
  np.testing.assert_array_equal(graph.active_features,
                                expected.active_features)
  np.testing.assert_allclose(graph.edges, expected.edges, atol=1e-5)


def test_capped_graph_is_the_full_graph_restricted():
  full = _graph()
  capped = circuits.attribute(_model(), _clt(), PROMPT, batch_size=8,
                              zero_positions=0, max_feature_nodes=20,
                              update_interval=1)
  keep = np.concatenate([capped.selected_features,
                         np.arange(full.n_features, full.n_sources)])
  rows = np.concatenate([capped.selected_features,
                         np.arange(full.n_features, len(full.edges))])
  np.testing.assert_allclose(capped.edges, full.edges[np.ix_(rows, keep)],
                             atol=1e-5)


def test_circuit_tracer_files_give_the_same_graph(tmp_path):
  """A CLT written in circuit-tracer's layout (``W_enc_i`` / ``W_dec_i``
  files) and loaded with `load_transcoders` gives the in-memory graph."""
  a = _arrays()
  for i in range(LAYERS):
    write_safetensors(tmp_path / f"W_enc_{i}.safetensors", {
        f"W_enc_{i}": a["w_enc"][i], f"b_enc_{i}": a["b_enc"][i],
        f"b_dec_{i}": a["b_dec"][i], f"threshold_{i}": a["threshold"][i]})
    write_safetensors(tmp_path / f"W_dec_{i}.safetensors",
                      {f"W_dec_{i}": a["w_dec"][i]})
  (tmp_path / "config.yaml").write_text(yaml.safe_dump({
      "model_kind": "cross_layer_transcoder",
      "feature_input_hook": "mlp.hook_in",
      "feature_output_hook": "hook_mlp_out", "scan": "test"}))
  loaded = load_transcoders(tmp_path, model=_model())
  graph = circuits.attribute(_model(), loaded, PROMPT, batch_size=32,
                             zero_positions=0)
  np.testing.assert_array_equal(graph.active_features,
                                _graph().active_features)
  np.testing.assert_allclose(graph.edges, _graph().edges, atol=1e-5)


def test_clts_that_do_not_fit_are_clear_errors():
  a = _arrays()
  with pytest.raises(ValueError, match="reads 'resid_mid'.*input_point"):
    circuits.attribute(_model(), CrossLayerTranscoder.from_arrays(
        **a, input_point="resid_mid", output_point="mlp_out"), PROMPT)
  short = {**a, "w_enc": a["w_enc"][:2], "b_enc": a["b_enc"][:2],
           "b_dec": a["b_dec"][:2], "threshold": a["threshold"][:2],
           "w_dec": [w[:, :2 - l] for l, w in enumerate(a["w_dec"][:2])]}
  with pytest.raises(ValueError, match="2 blocks, the model 3"):
    circuits.attribute(_model(), CrossLayerTranscoder.from_arrays(
        **short, input_point="mlp_in", output_point="mlp_out"), PROMPT)
