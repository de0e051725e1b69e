"""`QKTerms`: the terms of a QK attribution, labelled as `Graph` nodes
(`penzai_lm.circuits.qk`'s module docstring gives their order)."""

from __future__ import annotations

import dataclasses

import numpy as np

KINDS = ("feature", "error", "token", "b_dec", "bias")


@dataclasses.dataclass(frozen=True)
class QKTerms:
  """The terms of a QK attribution (``n`` of them, in the module
  docstring's order), labelled as `Graph` nodes.

  Attributes:
    kinds: ``[n]`` str, one of `KINDS`.
    layers: ``[n]`` int32: the block (feature, error, ``b_dec``), -1 for
      tokens and the bias.
    positions: ``[n]`` int32: the position (feature, error, token), -1 for
      ``b_dec`` and the bias.
    feature_ids: ``[n]`` int32: the feature id, -1 for other kinds.
  """

  kinds: np.ndarray
  layers: np.ndarray
  positions: np.ndarray
  feature_ids: np.ndarray

  def __len__(self) -> int:
    return len(self.kinds)

  def label(self, i: int) -> str:
    """A readable name of term ``i``, e.g. ``feature L1 P3 #17``."""
    kind, layer, pos = self.kinds[i], self.layers[i], self.positions[i]
    if kind == "feature":
      return f"feature L{layer} P{pos} #{self.feature_ids[i]}"
    if kind == "error":
      return f"error L{layer} P{pos}"
    if kind == "token":
      return f"token P{pos}"
    return f"b_dec L{layer}" if kind == "b_dec" else "bias"

  def graph_nodes(self, graph) -> np.ndarray:
    """``[n]`` int64: each term's node index in ``graph`` (a `Graph` of
    the same prompt and transcoders), -1 for terms with no node (``b_dec``,
    the bias, features the graph pruned away)."""
    nodes = np.full(len(self), -1, np.int64)
    table = {tuple(f): i for i, f in enumerate(graph.feature_nodes.tolist())}
    for i, kind in enumerate(self.kinds):
      layer, pos = int(self.layers[i]), int(self.positions[i])
      if kind == "feature":
        nodes[i] = table.get((layer, pos, int(self.feature_ids[i])), -1)
      elif kind == "error":
        nodes[i] = graph.error_node(layer, pos)
      elif kind == "token":
        nodes[i] = graph.token_start + pos
    return nodes
