"""prune_graph and compute_graph_scores: on a graph whose influences are
worked out by hand, and against circuit-tracer 0.5's own functions on
random acyclic graphs."""

import tracemalloc
import types

import numpy as np
import pytest

from penzai_lm import circuits
from penzai_lm.circuits import prune


def _hand_graph():
  """Two layers, one position: nodes f0 (layer 1), f1 (layer 0), error
  (layer 0), error (layer 1), token, logit (probability 1).

  Edges: logit <- f0 3, logit <- e1 1; f0 <- f1 1, f0 <- token -1;
  f1 <- token 2, f1 <- e0 -2. Normalized |A| rows: logit (f0 .75, e1
  .25), f0 (f1 .5, token .5), f1 (token .5, e0 .5). Influence on the
  logit: f0 .75, e1 .25, f1 .75 * .5 = .375, token .375 + .375 * .5 =
  .5625, e0 .375 * .5 = .1875.
  """
  a = np.zeros((6, 6), np.float32)
  f0, f1, e0, e1, tok, logit = range(6)
  a[logit, f0], a[logit, e1] = 3, 1
  a[f0, f1], a[f0, tok] = 1, -1
  a[f1, tok], a[f1, e0] = 2, -2
  return circuits.Graph.from_adjacency(
      input_tokens=np.array([4]),
      active_features=np.array([[0, 0, 7], [1, 0, 3]]),
      activation_values=np.array([1.0, 2.0], np.float32),
      selected_features=np.array([0, 1]),
      logit_tokens=np.array([9]), logit_probabilities=np.array([1.0]),
      adjacency_matrix=a, num_layers=2, vocab_size=10)


def test_influence_by_hand():
  g = _hand_graph()
  influence = prune.compute_node_influence(g.adjacency_matrix,
                                           prune.logit_weights(g))
  np.testing.assert_allclose(influence, [.75, .375, .1875, .25, .5625, 0],
                             rtol=1e-6)


def test_scores_by_hand():
  replacement, completeness = circuits.compute_graph_scores(_hand_graph())
  # Tokens .5625 against errors .1875 + .25.
  assert replacement == pytest.approx(.5625 / 1.0, rel=1e-6)
  # Non-error input fractions: logit .75, f1 .5, others 1; weighted by
  # influence + logit weight (f0 .75, f1 .375, e0 .1875, e1 .25, token
  # .5625, logit 1; total 3.125).
  weighted = .75 + .375 * .5 + .1875 + .25 + .5625 + 1 * .75
  assert completeness == pytest.approx(weighted / 3.125, rel=1e-6)


def test_pruning_by_hand():
  g = _hand_graph()
  # Node influences sorted: f0 .75, token .5625, f1 .375, e1 .25, e0
  # .1875 of 2.125: cumulative .353 .618 .794 .912 1. Keeping 80% keeps
  # down to e1: e0 goes.
  result = circuits.prune_graph(g, node_threshold=0.8, edge_threshold=0.98)
  np.testing.assert_array_equal(result.node_mask,
                                [True, True, False, True, True, True])
  np.testing.assert_allclose(
      result.cumulative_scores,
      np.array([.75, 1.6875, 2.125, 1.9375, 1.3125, 2.125]) / 2.125,
      rtol=1e-6)
  # Without e0, f1's only input is the token. Edge scores: logit<-f0 .75,
  # logit<-e1 .25, f0<-f1 .375, f0<-token .375, f1<-token .375 (total
  # 2.125): 98% keeps all five.
  expected = np.zeros((6, 6), bool)
  expected[5, 0] = expected[5, 3] = expected[0, 1] = True
  expected[0, 4] = expected[1, 4] = True
  np.testing.assert_array_equal(result.dense_edge_mask(g), expected)
  # 80% of edge influence stops at .375: e1's only edge goes, then e1.
  result = circuits.prune_graph(g, node_threshold=0.8, edge_threshold=0.8)
  np.testing.assert_array_equal(result.node_mask,
                                [True, True, False, False, True, True])
  expected[5, 3] = False
  np.testing.assert_array_equal(result.dense_edge_mask(g), expected)
  np.testing.assert_array_equal(  # Rows f0, f1, logit; columns to token.
      result.edge_mask, expected[[0, 1, 5]][:, :5])


@pytest.mark.parametrize("name", ["node_threshold", "edge_threshold"])
def test_thresholds_outside_zero_one_are_errors(name):
  with pytest.raises(ValueError, match=name):
    circuits.prune_graph(_hand_graph(), **{name: 1.5})


def test_a_cycle_is_an_error():
  a = np.zeros((3, 3), np.float32)
  a[0, 1] = a[1, 0] = 1.0
  with pytest.raises(RuntimeError, match="cycle"):
    prune.compute_influence(prune.normalize_matrix(a),
                            np.array([1, 0, 0], np.float32), max_iter=50)


def _random_graph(seed, n_layers=3, n_pos=4, n_features=25, n_logits=3):
  """A random acyclic graph: edges only from shallower to deeper nodes
  (tokens, then by layer, then logits), a third of them present."""
  rng = np.random.default_rng(seed)
  layers = rng.integers(0, n_layers, n_features)
  depth = np.concatenate([layers + 1, np.repeat(np.arange(n_layers) + 1,
                                                n_pos),
                          np.zeros(n_pos), np.full(n_logits, n_layers + 1)])
  n = len(depth)
  allowed = (depth[None, :] < depth[:, None]) & (depth[:, None] > 0)
  allowed[n_features:n_features + n_layers * n_pos + n_pos] = False
  present = rng.random((n, n)) < 0.35
  a = np.where(allowed & present, rng.standard_normal((n, n)), 0)
  probs = rng.dirichlet(np.ones(n_logits)) * 0.9
  return circuits.Graph.from_adjacency(
      input_tokens=np.arange(n_pos),
      active_features=np.stack([layers, np.zeros(n_features, int),
                                np.arange(n_features)], 1),
      activation_values=np.ones(n_features, np.float32),
      selected_features=np.arange(n_features),
      logit_tokens=np.arange(n_logits),
      logit_probabilities=probs.astype(np.float32),
      adjacency_matrix=a.astype(np.float32), num_layers=n_layers,
      vocab_size=50)


def _circuit_tracer_graph():
  try:
    import torch  # pylint: disable=g-import-not-at-top
    # pylint: disable-next=g-import-not-at-top
    from circuit_tracer import graph as ct_graph
  except ImportError as e:
    pytest.skip(f"circuit-tracer 0.5 is not importable ({e}); the parity"
                " tests need it (tests/sae/conftest.py installs it).")
  return torch, ct_graph


def _as_circuit_tracer(torch, g):
  return types.SimpleNamespace(
      input_tokens=torch.tensor(g.input_tokens),
      logit_targets=list(g.logit_tokens),
      selected_features=torch.tensor(g.selected_features),
      adjacency_matrix=torch.tensor(g.adjacency_matrix),
      logit_probabilities=torch.tensor(g.logit_probabilities),
      cfg=types.SimpleNamespace(n_layers=g.num_layers))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("thresholds", [(0.8, 0.98), (0.5, 0.7), (0.99, 0.999)])
def test_matches_circuit_tracer(seed, thresholds):
  torch, ct_graph = _circuit_tracer_graph()
  g = _random_graph(seed)
  theirs = ct_graph.prune_graph(_as_circuit_tracer(torch, g), *thresholds)
  ours = circuits.prune_graph(g, *thresholds)
  np.testing.assert_array_equal(ours.node_mask, theirs.node_mask.numpy())
  dense = theirs.edge_mask.numpy()
  np.testing.assert_array_equal(ours.dense_edge_mask(g), dense)
  np.testing.assert_array_equal(
      ours.edge_mask, dense[g.target_nodes()][:, :g.n_sources])
  np.testing.assert_allclose(ours.cumulative_scores,
                             theirs.cumulative_scores.numpy(), rtol=1e-5)
  assert 0 < ours.node_mask[:g.token_start].sum() < g.token_start
  scores = ct_graph.compute_graph_scores(_as_circuit_tracer(torch, g))
  np.testing.assert_allclose(circuits.compute_graph_scores(g), scores,
                             rtol=1e-5)


def test_partial_influences_match_circuit_tracer():
  torch, ct_graph = _circuit_tracer_graph()
  g = _random_graph(7)
  a = g.adjacency_matrix
  rows = np.concatenate([np.arange(g.logit_start, g.n_nodes),
                         np.arange(g.n_features)])
  ours = prune.compute_partial_influences(a[rows], g.logit_probabilities,
                                          rows)
  theirs = ct_graph.compute_partial_influences(
      torch.tensor(a[rows]), torch.tensor(g.logit_probabilities),
      torch.tensor(rows), device="cpu")
  np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-5, atol=1e-7)
  assert ours[:g.n_features].any()


def test_pruning_and_scoring_hold_few_matrix_copies():
  """prune_graph holds the pruned copy (turned into the edge scores in
  place), their sorted copy and the edge mask; compute_graph_scores one
  normalized copy. Measured with tracemalloc (numpy reports its buffers),
  in units of one float32 n x n matrix."""
  g = _random_graph(1, n_layers=4, n_pos=10, n_features=2400)
  matrix = g.n_nodes ** 2 * 4
  tracemalloc.start()
  try:
    pruned = circuits.prune_graph(g)
    prune_peak = tracemalloc.get_traced_memory()[1] / matrix
    tracemalloc.reset_peak()
    circuits.compute_graph_scores(g)
    scores_peak = tracemalloc.get_traced_memory()[1] / matrix
  finally:
    tracemalloc.stop()
  assert 0 < pruned.edge_mask.sum() < pruned.edge_mask.size
  assert prune_peak < 2.5  # Pruned/scores, sorted, the mask (1/4).
  assert scores_peak < 1.4  # One normalized copy.


def test_threshold_running_sum_in_chunks_is_one_cumsum(monkeypatch):
  """find_threshold's chunked running sum picks the same score as one
  float64 cumsum (rounded to float32) over all the scores."""
  monkeypatch.setattr(prune, "_CHUNK", 7)
  rng = np.random.default_rng(3)
  scores = (np.abs(rng.standard_normal(200)) ** 3).astype(np.float32)
  ordered = np.sort(scores)[::-1]
  cumulative = np.cumsum(ordered, dtype=np.float64).astype(
      np.float32) / ordered.sum(dtype=np.float32)
  for threshold in np.linspace(0, 1, 101):
    index = int(np.searchsorted(cumulative, np.float32(threshold)))
    assert prune.find_threshold(scores, threshold) == ordered[
        min(index, len(ordered) - 1)]


def test_threshold_running_sum_is_torchs_on_a_million_scores():
  """Over a million edge scores a float32 running sum drifts; torch's
  float32 cumsum (circuit-tracer's find_threshold) accumulates in float64
  on the CPU, and so does ours: the same score is picked at every
  threshold (with our total; torch's own sum may differ in the last
  bit, as its summation order is its own)."""
  torch, _ = _circuit_tracer_graph()
  rng = np.random.default_rng(0)
  scores = (np.abs(rng.standard_normal(1_000_000)) ** 3).astype(np.float32)
  ordered = np.sort(scores)[::-1]
  running = torch.cumsum(torch.from_numpy(ordered.copy()), 0).numpy()
  np.testing.assert_array_equal(prune._cumsum_as_torch(ordered), running)
  fractions = running / ordered.sum(dtype=np.float32)
  for threshold in np.linspace(0.5, 0.999, 12):
    index = int(np.searchsorted(fractions, np.float32(threshold)))
    assert prune.find_threshold(scores, threshold) == ordered[index]
