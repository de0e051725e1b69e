"""Pruning and scoring attribution graphs (circuit-tracer 0.5's ``graph``).

`prune_graph` and `compute_graph_scores` read a `Graph`'s ``edges`` (its
rows: the feature and logit targets; its columns: the feature, error and
token sources), never circuit-tracer's square matrix, whose other rows and
columns are zero: the results are the same and the memory grows linearly
with the prompt. The matrix functions below take any row = target, column =
source matrix. All compute in float32 numpy, as circuit-tracer does in
float32 torch:

* ``normalize_matrix``: ``|A|`` with each row divided by its sum (rows
  summing to 0 stay 0): each target's inputs as fractions.
* ``compute_influence(A, w)``: ``w @ (A + A^2 + A^3 + ...)``, the
  influence of every node on the weighted targets ``w`` through paths of
  any length (the series ends: the graph is acyclic).
* node influence: ``compute_influence(normalize(A), logit_weights)`` with
  the logit nodes weighted by their probabilities.
* edge influence: ``normalize(A)[t, s] * (influence[t] + w[t])`` on the
  matrix pruned to the kept nodes.

Running sums (the thresholds' cumulative fractions) are accumulated in
float64 and rounded to float32, as torch's float32 ``cumsum`` is on the
CPU, so that the same scores give circuit-tracer's thresholds; a float32
running sum over millions of edge scores would drift and move the edge
threshold. Memory: `prune_graph` holds about two float32 copies of
``edges`` besides it (the pruned rows, turned into the edge scores in
place, and their sorted copy) and the edge mask; `compute_graph_scores`
one.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from penzai_lm.circuits.graph import Graph

_CHUNK = 1 << 18  # Scores per step of find_threshold's running sum.


def normalize_matrix(matrix: np.ndarray) -> np.ndarray:
  """``|matrix|`` with rows scaled to sum to 1 (zero rows stay zero), as a
  new array."""
  return _normalize_in_place(np.array(matrix, np.float32))


def _normalize_in_place(matrix: np.ndarray) -> np.ndarray:
  """`normalize_matrix` overwriting ``matrix`` (float32), with no second
  n x n array."""
  np.abs(matrix, out=matrix)
  matrix /= np.maximum(matrix.sum(axis=1, keepdims=True), np.float32(1e-10))
  return matrix


def compute_influence(matrix: np.ndarray, weights: np.ndarray,
                      max_iter: int = 1000,
                      row_nodes: np.ndarray | None = None) -> np.ndarray:
  """``weights @ (M + M^2 + ...)`` for a nilpotent ``matrix`` M.

  With ``row_nodes``, ``matrix`` holds only M's non-zero rows: row ``i``
  is node ``row_nodes[i]``'s, and its columns are the first nodes (the
  columns after them are zero); the result covers ``len(weights)`` nodes.

  Raises:
    RuntimeError: if the series has not ended after ``max_iter`` terms
      (the matrix has a cycle).
  """
  weights = np.asarray(weights, np.float32)
  if row_nodes is None:
    row_nodes = np.arange(matrix.shape[0])
  influence = np.zeros(len(weights), np.float32)
  current = np.zeros_like(influence)
  current[:matrix.shape[1]] = weights[row_nodes] @ matrix
  influence += current
  iterations = 0
  while current.any():
    if iterations >= max_iter:
      raise RuntimeError(f"influence did not converge after {iterations}"
                         " iterations: the adjacency matrix has a cycle.")
    current[:matrix.shape[1]] = current[row_nodes] @ matrix
    influence += current
    iterations += 1
  return influence


def compute_node_influence(adjacency: np.ndarray,
                           logit_weights: np.ndarray) -> np.ndarray:
  return compute_influence(normalize_matrix(adjacency), logit_weights)


def compute_edge_influence(pruned: np.ndarray,
                           logit_weights: np.ndarray) -> np.ndarray:
  """``[n, n]`` scores of every edge (see the module docstring)."""
  return _edge_influence_in_place(np.array(pruned, np.float32),
                                  logit_weights, np.arange(len(pruned)))


def _edge_influence_in_place(pruned: np.ndarray, logit_weights: np.ndarray,
                             row_nodes: np.ndarray) -> np.ndarray:
  """`compute_edge_influence` overwriting ``pruned`` (float32 rows of
  nodes ``row_nodes``, as `compute_influence`)."""
  normalized = _normalize_in_place(pruned)
  influence = compute_influence(normalized, logit_weights,
                                row_nodes=row_nodes) + logit_weights
  normalized *= influence[row_nodes, None]
  return normalized


def find_threshold(scores: np.ndarray, threshold: float) -> np.float32:
  """The smallest score among the largest ones that together make up the
  fraction ``threshold`` of the total (running sum as `_cumsum_as_torch`)."""
  ordered = np.sort(np.asarray(scores, np.float32).ravel())[::-1]
  total = ordered.sum(dtype=np.float32)
  carry = np.zeros(1, np.float64)
  # The running sum _CHUNK scores at a time (the same additions in the same
  # order as one cumsum, without a second n x n array), in float64 rounded
  # to float32 as torch's float32 cumsum on the CPU.
  for start in range(0, len(ordered), _CHUNK):
    running = np.cumsum(np.concatenate([carry,
                                        ordered[start:start + _CHUNK]]))
    cumulative = running[1:].astype(np.float32) / total
    index = int(np.searchsorted(cumulative, np.float32(threshold)))
    if index < len(cumulative):
      return ordered[start + index]
    carry = running[-1:]
  return ordered[-1]


def _cumsum_as_torch(values: np.ndarray) -> np.ndarray:
  """torch's float32 cumsum on the CPU: accumulated in float64, each
  partial sum rounded to float32."""
  return np.cumsum(values, dtype=np.float64).astype(np.float32)


def logit_weights(graph: Graph) -> np.ndarray:
  """``[n_nodes]`` weights: the logit probabilities on the logit nodes,
  zero elsewhere."""
  weights = np.zeros(graph.n_nodes, np.float32)
  weights[graph.logit_start:] = graph.logit_probabilities
  return weights


class PruneResult(NamedTuple):
  """The result of `prune_graph`.

  Attributes:
    node_mask: ``[n_nodes]`` bool: nodes kept.
    edge_mask: bool, the shape of the graph's ``edges``: edges kept
      (`dense_edge_mask` gives circuit-tracer's ``[n_nodes, n_nodes]``).
    cumulative_scores: ``[n_nodes]`` float32: for each node, the fraction
      of the total node influence held by the nodes at least as
      influential (a node's rank as a fraction of influence).
  """

  node_mask: np.ndarray
  edge_mask: np.ndarray
  cumulative_scores: np.ndarray

  def dense_edge_mask(self, graph: Graph) -> np.ndarray:
    """The edge mask as circuit-tracer's ``[n_nodes, n_nodes]`` (row =
    target, column = source)."""
    dense = np.zeros((graph.n_nodes, graph.n_nodes), bool)
    dense[graph.target_nodes(), :graph.n_sources] = self.edge_mask
    return dense


def prune_graph(graph: Graph, node_threshold: float = 0.8,
                edge_threshold: float = 0.98) -> PruneResult:
  """Keeps the nodes and edges that carry most of the influence on the
  logits, as circuit-tracer's ``prune_graph``.

  Nodes are kept by influence until ``node_threshold`` of the total is
  covered (tokens and logits always), edges of the pruned matrix likewise
  with ``edge_threshold``; then feature and error nodes without a kept
  outgoing edge, and feature nodes without a kept incoming edge, are
  dropped (with their edges) until nothing changes.

  Raises:
    ValueError: for a threshold outside [0, 1].
  """
  for name, value in (("node_threshold", node_threshold),
                      ("edge_threshold", edge_threshold)):
    if not 0.0 <= value <= 1.0:
      raise ValueError(f"{name} must be between 0.0 and 1.0, got {value!r}.")
  weights = logit_weights(graph)
  rows = graph.target_nodes()
  influence = compute_influence(normalize_matrix(graph.edges), weights,
                                row_nodes=rows)
  node_mask = influence >= find_threshold(influence, node_threshold)
  inner = graph.token_start  # Features and errors: [0, inner).
  node_mask[inner:] = True
  pruned = graph.edges.copy()
  pruned[~node_mask[rows]] = 0
  pruned[:, ~node_mask[:graph.n_sources]] = 0
  scores = _edge_influence_in_place(pruned, weights, rows)
  del pruned  # Now the scores.
  edge_mask = scores >= find_threshold(scores, edge_threshold)
  n_features = graph.n_features

  def drop_unconnected():
    node_mask[:inner] &= edge_mask[:, :inner].any(axis=0)
    node_mask[:n_features] &= edge_mask[:n_features].any(axis=1)

  before = node_mask.copy()
  drop_unconnected()
  while not np.array_equal(node_mask, before):
    before = node_mask.copy()
    edge_mask[~node_mask[rows]] = False
    edge_mask[:, ~node_mask[:graph.n_sources]] = False
    drop_unconnected()
  order = np.argsort(-influence, kind="stable")
  cumulative = _cumsum_as_torch(influence[order]) / influence.sum(
      dtype=np.float32)
  final = np.zeros_like(influence)
  final[order] = cumulative
  return PruneResult(node_mask, edge_mask, final)


def compute_graph_scores(graph: Graph) -> tuple[float, float]:
  """``(replacement score, completeness score)``, circuit-tracer's.

  Replacement: of the influence on the logits that starts at token or
  error nodes, the fraction that starts at tokens. Completeness: the
  fraction of each node's (normalized) inputs that come from non-error
  nodes, averaged with weights ``influence + logit weight``.
  """
  weights = logit_weights(graph)
  rows = graph.target_nodes()
  normalized = normalize_matrix(graph.edges)
  influence = compute_influence(normalized, weights, row_nodes=rows)
  errors = slice(graph.error_start, graph.token_start)
  token_influence = influence[graph.token_start:graph.logit_start].sum()
  error_influence = influence[errors].sum()
  replacement = token_influence / (token_influence + error_influence)
  non_error = np.ones(graph.n_nodes, np.float32)  # Nodes without inputs.
  non_error[rows] = 1 - normalized[:, errors].sum(axis=-1)
  output = influence + weights
  completeness = (non_error * output).sum() / output.sum()
  return float(replacement), float(completeness)


def compute_partial_influences(edge_rows: np.ndarray,
                               logit_probabilities: np.ndarray,
                               row_nodes: np.ndarray,
                               max_iter: int = 128,
                               n_nodes: int | None = None) -> np.ndarray:
  """Influence of every node on the logits from the rows computed so far
  (``edge_rows[i]`` is node ``row_nodes[i]``'s row over the first
  ``edge_rows.shape[1]`` nodes; the ``n_nodes`` nodes end with the logit
  nodes, which feed nothing), as circuit-tracer's
  ``compute_partial_influences`` (used to visit features in influence
  order). Reads ``edge_rows`` in place: besides it, at most `_CHUNK` * 64
  floats.

  Raises:
    RuntimeError: if the series has not ended after ``max_iter`` terms.
  """
  width = edge_rows.shape[1]
  n = width if n_nodes is None else n_nodes
  step = max(1, (_CHUNK * 64) // max(width, 1))  # Rows per |rows| chunk.
  sums = np.concatenate([np.abs(edge_rows[i:i + step]).sum(axis=1)
                         for i in range(0, len(edge_rows), step)])
  inverse = np.float32(1) / np.maximum(sums.astype(np.float32),
                                       np.float32(1e-8))
  influences = np.zeros(n, np.float32)
  prod = np.zeros(n, np.float32)
  prod[n - len(logit_probabilities):] = logit_probabilities
  for _ in range(max_iter):
    scaled = prod[row_nodes] * inverse
    prod = np.zeros(n, np.float32)
    for i in range(0, len(edge_rows), step):
      prod[:width] += scaled[i:i + step] @ np.abs(edge_rows[i:i + step])
    if not prod.any():
      return influences
    influences += prod
  raise RuntimeError("partial influences did not converge after"
                     f" {max_iter} iterations.")
