"""Attribution graphs of penzai_lm and circuit-tracer, compared from their
safetensors files (`benchmarks/attribution_graphs.py`).

penzai_lm's file holds the graph's compact ``edges`` rows (targets by
sources) and edge mask; circuit-tracer's its square ``[nodes, nodes]``
adjacency and edge mask, read `ROW_BLOCK` rows at a time (4 GB at 1,024
tokens of SmolLM2). No pickle.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

ROW_BLOCK = 1024  # Rows of circuit-tracer's adjacency read at a time.


def compare(ours_path: Path, theirs_path: Path, tc_dir: Path) -> dict:
  """Checks penzai_lm's graph against circuit-tracer's; ``"same"`` is
  False with ``"why"`` naming the first difference. Features active on one
  side only (float rounding at a threshold) are counted, with their
  largest margin over the threshold, and do not make the graphs differ
  unless the graphs' feature nodes differ. The square matrices are
  compared in blocks of `ROW_BLOCK` rows."""
  ours, _ = read(ours_path)
  keys = ("active_features", "activation_values", "logit_tokens",
          "logit_probabilities", "selected_features", "node_mask",
          "cumulative_scores")
  theirs, _ = read(theirs_path, keys)
  out = {"n_active": len(theirs["active_features"])}
  key_of = lambda a: (a.astype(np.int64) @ np.array([2**40, 2**20, 1]))
  mine, peer = key_of(ours["active_features"]), key_of(
      theirs["active_features"])
  _, i, j = np.intersect1d(mine, peer, return_indices=True)
  only = [(np.delete(side["active_features"], k, axis=0),
           np.delete(side["activation_values"], k))
          for side, k in ((ours, i), (theirs, j))]
  out["active_differ"] = sum(len(a) for a, _ in only)
  out["active_margin"] = max(_margin(*side, tc_dir) for side in only)
  out["activation_rel"] = float(
      np.abs(ours["activation_values"][i] - theirs["activation_values"][j])
      .max() / np.abs(theirs["activation_values"]).max())
  if not np.array_equal(mine[ours["selected_features"]],
                        peer[theirs["selected_features"]]):
    return {**out, "same": False, "why": "feature nodes differ"}
  if not np.array_equal(ours["logit_tokens"], theirs["logit_tokens"]):
    return {**out, "same": False, "why": "logit nodes differ"}
  edges, mask = ours["edges"], ours["edge_mask"].astype(bool)
  n_sources, n_features = edges.shape[1], len(ours["selected_features"])
  n_nodes = n_sources + len(ours["logit_tokens"])
  stats = {"diff": 0.0, "scale": 0.0, "slack": -np.inf, "edges_differ": 0}
  with safe_open(str(theirs_path), framework="np") as f:
    adjacency, their_mask = (f.get_slice("adjacency_matrix"),
                             f.get_slice("edge_mask"))
    if tuple(adjacency.get_shape()) != (n_nodes, n_nodes):
      return {**out, "same": False, "why": f"adjacency {adjacency.get_shape()}"
              f" vs {n_nodes} nodes"}
    for start in range(0, n_nodes, ROW_BLOCK):
      stop = min(start + ROW_BLOCK, n_nodes)
      rows = np.arange(start, stop)
      ours_a = np.zeros((stop - start, n_nodes), np.float32)
      ours_m = np.zeros((stop - start, n_nodes), bool)
      target = np.where(rows < n_features, rows, rows - n_sources + n_features)
      has = (rows < n_features) | (rows >= n_sources)
      ours_a[has, :n_sources] = edges[target[has]]
      ours_m[has, :n_sources] = mask[target[has]]
      b = adjacency[start:stop]
      diff = np.abs(ours_a - b)
      stats["diff"] = max(stats["diff"], float(diff.max()))
      stats["scale"] = max(stats["scale"], float(np.abs(b).max()))
      stats["slack"] = max(stats["slack"], float(
          (diff - 1e-4 * np.abs(b)).max()))
      stats["edges_differ"] += int((ours_m != their_mask[start:stop]
                                    .astype(bool)).sum())
  out["adjacency_rel"] = stats["diff"] / stats["scale"]
  out["adjacency_close"] = stats["slack"] <= 1e-4 * stats["scale"]
  out["edges_kept"] = int(mask.sum())
  out["edges_differ"] = stats["edges_differ"]
  nodes = ours["node_mask"].astype(bool), theirs["node_mask"].astype(bool)
  out["nodes_kept"] = int(nodes[1].sum())
  out["nodes_differ"] = int((nodes[0] != nodes[1]).sum())
  out["cumulative_diff"] = float(np.abs(
      np.sort(ours["cumulative_scores"])
      - np.sort(theirs["cumulative_scores"])).max())
  out["same"] = bool(out["adjacency_close"] and out["activation_rel"] < 1e-4)
  out["why"] = None if out["same"] else "adjacency or activations differ"
  return out


def _margin(features: np.ndarray, values: np.ndarray,
            tc_dir: Path) -> float:
  """The largest ``(activation - threshold) / threshold`` of ``features``
  (``[n, 3]`` layer, position, id; a JumpReLU activation is its
  pre-activation), 0 for none."""
  margin = 0.0
  for layer in np.unique(features[:, 0]):
    with safe_open(str(tc_dir / f"layer_{layer}.safetensors"), "np") as f:
      threshold = f.get_tensor("activation_function.threshold")[
          features[features[:, 0] == layer, 2]]
    margin = max(margin, float(np.max(
        (values[features[:, 0] == layer] - threshold) / threshold)))
  return margin


def read(path: Path, keys=None) -> tuple[dict, dict]:
  with safe_open(str(path), framework="np") as f:
    arrays = {k: f.get_tensor(k) for k in (
        f.keys() if keys is None else keys)}
    return arrays, json.loads(f.metadata()["result"])
