"""attribute: every edge is the target's change when its source is added in
the frozen replacement model (forward mode, `jax.jvp`), each target's row
adds up to its value in the real model (with the ``b_dec`` terms), the
nodes are the transcoders' own features and errors, the capped graph is
the full one restricted, and bad arguments are clear errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import penzai_lm
from penzai_lm import circuits
from penzai_lm import interp
from penzai_lm.circuits import rows
from penzai_lm.runtime.unstack import unstack_layers
from penzai_lm.sae import SAEConfig
from penzai_lm.sae import SparseAutoencoder
from penzai_lm.sae import load_transcoders
from penzai_lm.sae.formats.tensor_files import write_safetensors
from tests.model.configs import config
from tests.sae.random_saes import random_arrays

PROMPT = [1, 5, 9, 13, 2, 7]
LAYERS = 3
WIDTH = 32
FEATURES = 64


@functools.cache
def _model(stacked=True):
  model = penzai_lm.build_transformer(config("llama_gqa", True), seed=3)
  return model if stacked else unstack_layers(model)


@functools.cache
def _transcoders(activation="jumprelu", skip=False, b_dec=True):
  out = []
  for layer in range(LAYERS):
    cfg = SAEConfig(
        activation=activation, num_features=FEATURES,
        input_axes=(("embedding", WIDTH),), output_axes=(("embedding", WIDTH),),
        k=8 if activation == "topk" else None,
        hook_point=f"blocks.{layer}.mlp_in",
        output_point=f"blocks.{layer}.mlp_out")
    arrays = random_arrays(WIDTH, FEATURES, WIDTH, seed=10 + layer,
                           threshold=activation == "jumprelu", skip=skip)
    if not b_dec:
      arrays["b_dec"] = np.zeros_like(arrays["b_dec"])
    out.append(SparseAutoencoder.from_arrays(cfg, **arrays))
  return tuple(out)


@functools.cache
def _graph(stacked=True, zero_positions=0, **tc):
  return circuits.attribute(_model(stacked), list(_transcoders(**tc)), PROMPT,
                            batch_size=32, zero_positions=zero_positions)


@functools.cache
def _reference():
  """The real model's values on the prompt (no freezing, no transcoders)."""
  names = ["embed"] + [f"blocks.{i}.{p}" for i in range(LAYERS)
                       for p in ("mlp_in", "mlp_out")]
  cache = interp.run_with_cache(_model(), PROMPT, names=names)

  def value(name):
    return np.asarray(cache[name].unwrap("batch", "seq", "embedding")[0])

  return {"embed": value("embed"),
          "mlp_in": np.stack([value(f"blocks.{i}.mlp_in")
                              for i in range(LAYERS)]),
          "mlp_out": np.stack([value(f"blocks.{i}.mlp_out")
                               for i in range(LAYERS)]),
          "logits": np.asarray(cache.logits.unwrap("batch", "seq",
                                                   "vocabulary")[0])}


def _flat(tc):
  return {k: np.asarray(v) for k, v in tc.flat().items()}


def _expected_features(transcoders, zero_positions=0):
  """(layer, position, id) and activations from the transcoders' own
  arithmetic on the real model's MLP inputs."""
  ref = _reference()
  coords, values = [], []
  for layer, tc in enumerate(transcoders):
    w = _flat(tc)
    pre = ref["mlp_in"][layer] @ w["w_enc"] + w["b_enc"]
    acts = np.where(pre > w.get("threshold", 0.0), np.maximum(pre, 0), 0)
    if tc.config.activation == "topk":
      kth = -np.sort(-pre, axis=1)[:, tc.config.k - 1:tc.config.k]
      acts = np.where(pre >= kth, acts, 0)
    acts[:zero_positions] = 0
    for p, f in zip(*np.nonzero(acts)):
      coords.append((layer, p, f))
      values.append(acts[p, f])
  return np.array(coords), np.array(values)


def _sources(graph, transcoders):
  """Per source node: the (embed, mlp_out) tangent that adds it, computed
  from the transcoders' weights and the real model's values."""
  ref = _reference()
  n_pos = len(PROMPT)
  embed = np.zeros((graph.n_pos + graph.n_errors + graph.n_features, n_pos,
                    WIDTH), np.float32)
  mlp = np.zeros((len(embed), LAYERS, n_pos, WIDTH), np.float32)
  node = 0
  for (layer, pos, f), a in zip(graph.feature_nodes, graph.activation_values[
      graph.selected_features]):
    mlp[node, layer, pos] = a * _flat(transcoders[layer])["w_dec"][f]
    node += 1
  coords, values = _expected_features(transcoders)
  for layer, tc in enumerate(transcoders):
    w = _flat(tc)
    acts = np.zeros((n_pos, FEATURES), np.float32)
    here = coords[:, 0] == layer
    acts[coords[here, 1], coords[here, 2]] = values[here]
    recon = acts @ w["w_dec"] + w["b_dec"]
    if "w_skip" in w:
      recon = recon + ref["mlp_in"][layer] @ w["w_skip"]
    for pos in range(n_pos):
      mlp[node, layer, pos] = ref["mlp_out"][layer, pos] - recon[pos]
      node += 1
  for pos in range(n_pos):
    embed[node, pos] = ref["embed"][pos]
    node += 1
  return embed, mlp


def _target_readouts(graph, transcoders):
  """Per target row (features, then logits): how it reads (mlp_in [L, T,
  D], last logits [V])."""
  n_pos, vocab = len(PROMPT), graph.vocab_size
  rows = graph.n_features + graph.n_logits
  read_in = np.zeros((rows, LAYERS, n_pos, WIDTH), np.float32)
  read_logits = np.zeros((rows, vocab), np.float32)
  for i, (layer, pos, f) in enumerate(graph.feature_nodes):
    read_in[i, layer, pos] = _flat(transcoders[layer])["w_enc"][:, f]
  for k, token in enumerate(graph.logit_tokens):
    read_logits[graph.n_features + k] = -1.0 / vocab
    read_logits[graph.n_features + k, token] += 1.0
  return read_in, read_logits


def _target_rows(graph):
  """Rows over every node (the logit columns zero), as the jvp gives."""
  return np.pad(graph.edges, ((0, 0), (0, graph.n_logits)))


@jax.jit
def _jvp_all(linear, embed_tangents, mlp_tangents):
  """The targets' forward-mode derivatives (`LinearizedModel.targets`)
  along each pair of tangents (``[S, T, D]``, ``[S, L, T, D]``)."""
  forward = linear.forward_mode()
  zeros = (jnp.zeros(embed_tangents.shape[1:]),
           jnp.zeros(mlp_tangents.shape[1:]))

  def one(te, tm):
    return jax.jvp(forward.targets, zeros, (te, tm))[1]

  return jax.vmap(one)(embed_tangents, mlp_tangents)


@pytest.mark.parametrize("stacked", [True, False])
def test_every_edge_is_a_forward_mode_derivative(stacked):
  transcoders = _transcoders()
  graph = _graph(stacked)
  linear = circuits.linearize(_model(stacked), transcoders,
                              np.asarray(PROMPT))
  embed, mlp = _sources(graph, transcoders)
  d_in, d_logits = _jvp_all(linear, jnp.asarray(embed), jnp.asarray(mlp))
  read_in, read_logits = _target_readouts(graph, transcoders)
  expected = (np.einsum("tlpd,slpd->ts", read_in, np.asarray(d_in))
              + np.einsum("tv,sv->ts", read_logits, np.asarray(d_logits)))
  got = _target_rows(graph)[:, :graph.logit_start]
  assert np.abs(expected).max() > 0.1
  np.testing.assert_allclose(got, expected, atol=2e-5 * np.abs(expected).max(),
                             rtol=1e-4)
  # Causality: no edge from a later layer's MLP or a later position.
  feats = graph.feature_nodes
  errors = np.array([(l, p) for l in range(LAYERS) for p in range(len(PROMPT))])
  source_layer = np.concatenate([feats[:, 0], errors[:, 0]])
  source_pos = np.concatenate([feats[:, 1], errors[:, 1]])
  later = ((source_layer[None, :] >= feats[:, :1])
           | (source_pos[None, :] > feats[:, 1:2]))
  assert not got[:graph.n_features, :graph.token_start][later].any()


@pytest.mark.parametrize("tc", [
    dict(activation="relu"), dict(activation="jumprelu"),
    dict(activation="topk"), dict(activation="relu", skip=True),
    dict(activation="jumprelu", b_dec=False)])
def test_rows_add_up_to_the_real_models_values(tc):
  """Replacement model exact on the prompt (errors included): a feature's
  pre-activation minus b_enc, and a logit minus the mean logit, equal the
  sum of the target's row plus the b_dec terms (each block's b_dec pushed
  through the frozen linear map), with values from the unfrozen model."""
  transcoders = _transcoders(**tc)
  graph = _graph(**tc)
  ref = _reference()
  values = []
  for layer, pos, f in graph.feature_nodes:
    values.append(ref["mlp_in"][layer, pos] @ _flat(
        transcoders[layer])["w_enc"][:, f])
  last = ref["logits"][-1]
  values.extend(last[graph.logit_tokens] - last.mean())
  values = np.array(values)
  b_dec = np.stack([_flat(t)["b_dec"] for t in transcoders])
  if tc.get("b_dec", True):
    linear = circuits.linearize(_model(), transcoders, np.asarray(PROMPT))
    tangent = np.broadcast_to(b_dec[:, None], (LAYERS, len(PROMPT), WIDTH))
    d_in, d_logits = _jvp_all(linear, jnp.zeros((1, len(PROMPT), WIDTH)),
                              jnp.asarray(tangent)[None])
    read_in, read_logits = _target_readouts(graph, transcoders)
    bias = (np.einsum("tlpd,lpd->t", read_in, np.asarray(d_in[0]))
            + read_logits @ np.asarray(d_logits[0]))
  else:
    bias = np.zeros(len(values))
  sums = _target_rows(graph).sum(axis=1)
  assert np.abs(values).max() > 0.5
  np.testing.assert_allclose(sums + bias, values,
                             atol=2e-5 * np.abs(values).max())


def test_nodes_are_the_transcoders_features_and_salient_logits():
  transcoders = _transcoders()
  graph = _graph(zero_positions=1)
  coords, values = _expected_features(transcoders, zero_positions=1)
  np.testing.assert_array_equal(graph.active_features, coords)
  np.testing.assert_allclose(graph.activation_values, values, rtol=1e-5,
                             atol=1e-5)
  assert not (graph.active_features[:, 1] == 0).any()
  # Errors at the zeroed first position have no edges.
  first = [graph.error_node(l, 0) for l in range(LAYERS)]
  assert not graph.edges[:, first].any()
  last = _reference()["logits"][-1]
  probs = np.exp(last - last.max()) / np.exp(last - last.max()).sum()
  order = np.argsort(-probs)
  cutoff = np.argmax(np.cumsum(probs[order]) >= 0.95) + 1
  np.testing.assert_array_equal(graph.logit_tokens, order[:min(cutoff, 10)])
  np.testing.assert_allclose(graph.logit_probabilities,
                             probs[graph.logit_tokens], rtol=1e-5)
  assert graph.n_nodes == graph.adjacency_matrix.shape[0] == (
      len(coords) + LAYERS * len(PROMPT) + len(PROMPT) + graph.n_logits)


def test_capped_graph_is_the_full_graph_restricted():
  transcoders = _transcoders()
  full = _graph()
  capped = circuits.attribute(_model(), list(transcoders), PROMPT,
                              batch_size=8, zero_positions=0,
                              max_feature_nodes=20, update_interval=1)
  assert capped.n_features == 20
  np.testing.assert_array_equal(capped.active_features, full.active_features)
  keep = np.concatenate([capped.selected_features,
                         np.arange(full.n_features, full.n_nodes)])
  np.testing.assert_allclose(capped.adjacency_matrix,
                             full.adjacency_matrix[np.ix_(keep, keep)],
                             atol=1e-5)
  rows = np.concatenate([capped.selected_features,
                         np.arange(full.n_features, len(full.edges))])
  np.testing.assert_allclose(capped.edges, full.edges[np.ix_(rows, keep[
      :capped.n_sources])], atol=1e-5)
  # The first batch visited is the top of the logits' direct influence.
  logit_rows = full.edges[full.n_features:]
  weights = full.logit_probabilities
  direct = weights @ (np.abs(logit_rows[:, :full.n_features]) / np.abs(
      logit_rows).sum(1, keepdims=True))
  top = set(np.argsort(-direct)[:8])
  assert top <= set(capped.selected_features)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompt="hello"), "token ids"),
    (dict(prompt=[1, 500]), "outside the vocabulary"),
    (dict(prompt=[]), "non-empty"),
    (dict(max_n_logits=0), "max_n_logits"),
    (dict(desired_logit_prob=1.5), "desired_logit_prob"),
    (dict(batch_size=2.0), "batch_size"),
    (dict(max_feature_nodes=0), "max_feature_nodes"),
])
def test_bad_arguments_are_clear_errors(kwargs, match):
  args = {"prompt": PROMPT, **kwargs}
  prompt = args.pop("prompt")
  with pytest.raises((TypeError, ValueError), match=match):
    circuits.attribute(_model(), list(_transcoders()), prompt, **args)


def test_transcoders_that_do_not_fit_are_clear_errors():
  transcoders = list(_transcoders())
  with pytest.raises(ValueError, match="one per block"):
    circuits.attribute(_model(), transcoders[:2], PROMPT)
  with pytest.raises(ValueError, match="transcoder 1 reads"):
    circuits.attribute(_model(), [transcoders[0], transcoders[0],
                                  transcoders[2]], PROMPT)
  with pytest.raises(TypeError, match="TranscoderSet"):
    circuits.attribute(_model(), "transcoders", PROMPT)


def test_circuit_tracer_files_give_the_same_graph(tmp_path):
  """A transcoder set written in circuit-tracer's layout and loaded with
  `load_transcoders` is taken as is, and gives the graph of the same
  weights built in memory."""
  for layer in range(LAYERS):
    a = random_arrays(WIDTH, FEATURES, WIDTH, seed=10 + layer, threshold=True)
    write_safetensors(tmp_path / f"layer_{layer}.safetensors", {
        "W_enc": a["w_enc"].T.copy(), "W_dec": a["w_dec"],
        "b_enc": a["b_enc"], "b_dec": a["b_dec"],
        "activation_function.threshold": a["threshold"]})
  (tmp_path / "config.yaml").write_text(yaml.safe_dump({
      "model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in",
      "feature_output_hook": "hook_mlp_out", "scan": "test"}))
  loaded = load_transcoders(tmp_path, model=_model())
  graph = circuits.attribute(_model(), loaded, PROMPT, batch_size=32,
                             zero_positions=0)
  expected = _graph()
  np.testing.assert_array_equal(graph.active_features,
                                expected.active_features)
  np.testing.assert_allclose(graph.edges, expected.edges, atol=1e-5)


@pytest.mark.parametrize("buckets", [2, len(PROMPT)])
def test_prefix_buckets_give_the_same_graph(buckets):
  """Feature rows computed in the model cut after their position (2
  lengths, and one per position) equal the whole prompt's; with a cap the
  same features are visited."""
  for kwargs in (dict(), dict(max_feature_nodes=20, update_interval=1)):
    whole = circuits.attribute(_model(), list(_transcoders()), PROMPT,
                               batch_size=8, zero_positions=0, **kwargs)
    programs = rows._batch_rows._cache_size()
    cut = circuits.attribute(_model(), list(_transcoders()), PROMPT,
                             batch_size=8, zero_positions=0,
                             prefix_buckets=buckets, **kwargs)
    if not kwargs:  # Shorter models ran (their programs are new).
      assert rows._batch_rows._cache_size() > programs
    np.testing.assert_array_equal(cut.selected_features,
                                  whole.selected_features)
    np.testing.assert_allclose(cut.edges, whole.edges, rtol=1e-5,
                               atol=1e-6 * np.abs(whole.edges).max())


def test_prefix_lengths():
  assert rows.prefix_lengths(100, None) == (100,)
  assert rows.prefix_lengths(1000, 1) == (1000,)
  assert rows.prefix_lengths(1024, None) == (256, 512, 768, 1024)
  assert rows.prefix_lengths(4096, None) == tuple(range(512, 4097, 512))
  assert rows.prefix_lengths(3, 8) == (1, 2, 3)
