"""`qk_attribution`: which sources drive one head's attention score.

The score of query head ``head`` of block ``layer`` between a query position
``q`` and a key position ``k`` is the pre-softmax logit
``s = query(x_q) . key(x_k)``: ``x`` the residual stream entering the block
(``blocks.{layer}.resid_pre``), ``query`` the pre-attention norm, ``W_Q``
(and bias), the QK norm (Gemma 3), RoPE at ``q`` and the query scaling
(``1 / sqrt(head_dim)``, Gemma's ``query_pre_attn_scalar``), ``key`` the
same with ``W_K`` at ``k``. It is the value before Gemma 2's attention
soft-cap and before the causal or sliding-window mask.

In the prompt's local replacement model (`penzai_lm.circuits.replacement`:
the attention patterns of earlier blocks and every norm denominator frozen
at the run's values, the pre-attention norm's and the QK norms' included,
MLPs replaced by their transcoders' features plus error nodes) ``query``
and ``key`` are affine, and the residual stream is affine in the graph's
sources, so ``s`` is bilinear in them:

    s = sum_{i, j} query_vectors[i] . key_vectors[k][j]

over the terms (rows ``i`` on the query side, ``j`` on the key side, the
same term table for both):

* the active features (the graph's feature nodes: ``a * w_dec`` at their
  layer and position, or a cross-layer transcoder's writes to every later
  block), sorted by ``(layer, position, feature id)``;
* the error nodes, layer-major; the token embeddings, by position;
* each block's ``b_dec`` (at every position from ``zero_positions`` on);
* ``bias``: the rest of the query (key) vector, ``query(x_q)`` minus the
  other terms: the model's own biases (q/k/v, attention output, LayerNorm
  shifts) and what the MLPs write at the first ``zero_positions``
  positions, whose features and errors are left out as in `attribute`.
  Zero for a model without biases and ``zero_positions=0``.

Each term is its total effect through the frozen model, as the graph's
edges are: a source moves ``x_q`` directly and through the frozen
attention of the blocks in between (and transcoder skip connections).
Earlier blocks' attention outputs are not terms of their own: they are
linear in the sources and split among them, so every term is a node of the
prompt's `Graph` (`QKTerms.graph_nodes`). The vectors come from one
reverse-mode pass per output coordinate (``head_dim`` for the query, as
many per key position), read out against each source's vector.

Array conventions (numpy, float32): ``n`` terms, ``K`` key positions,
``d`` the head dimension: ``query_vectors [n, d]``, ``key_vectors
[K, n, d]``, ``contributions(k) [n, n]`` (query term, key term).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from penzai_lm.circuits import qk_engine
from penzai_lm.circuits.features import check_prompt
from penzai_lm.circuits.features import check_transcoders
from penzai_lm.circuits.features import prompt_features
from penzai_lm.circuits.qk_terms import QKTerms
from penzai_lm.circuits.replacement import linearize
from penzai_lm.model.transformer import TransformerLM


@dataclasses.dataclass(frozen=True)
class QKContribution:
  """One entry of a QK attribution: ``value`` is query term ``query``
  (index into `QKAttribution.terms`) times key term ``key`` at key position
  ``key_position``."""

  key_position: int
  query: int
  key: int
  value: float
  query_label: str
  key_label: str


@dataclasses.dataclass(frozen=True, eq=False)
class QKAttribution:
  """Head ``head`` of block ``layer``'s scores from ``query_position`` to
  ``key_positions``, split into pairs of terms (module docstring).

  Attributes:
    layer, head, query_position: What was attributed (head in Hugging Face
      order).
    key_positions: ``[K]`` int32.
    scores: ``[K]`` float32: the model's pre-softmax scores
      ``query(x_q) . key(x_k)``.
    terms: The ``n`` terms of either side.
    query_vectors: ``[n, d]``: each term's part of the query vector.
    key_vectors: ``[K, n, d]``: each term's part of each key vector.
  """

  layer: int
  head: int
  query_position: int
  key_positions: np.ndarray
  scores: np.ndarray
  terms: QKTerms
  query_vectors: np.ndarray
  key_vectors: np.ndarray

  def _key_index(self, key_position: int) -> int:
    found = np.flatnonzero(self.key_positions == key_position)
    if not found.size:
      raise ValueError(
          f"key position {key_position!r} was not attributed; this"
          f" attribution has key positions {self.key_positions.tolist()}.")
    return int(found[0])

  def contributions(self, key_position: int) -> np.ndarray:
    """``[n, n]`` float32: entry ``[i, j]`` is query term ``i`` times key
    term ``j``; they add up to the score at ``key_position``."""
    keys = self.key_vectors[self._key_index(key_position)]
    return self.query_vectors @ keys.T

  def top(self, n: int = 10, key_position: int | None = None
          ) -> list[QKContribution]:
    """The ``n`` largest contributions by magnitude, largest first, at
    ``key_position`` (None: over all key positions)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
      raise ValueError(f"n must be a positive int, got {n!r}.")
    keys = (self.key_positions if key_position is None
            else [self.key_positions[self._key_index(key_position)]])
    found = []  # (|value|, value, key position, i, j)
    for k in keys:
      key_vectors = self.key_vectors[self._key_index(int(k))]
      for start in range(0, len(self.query_vectors), 1024):  # Row blocks.
        block = self.query_vectors[start:start + 1024] @ key_vectors.T
        best = np.argsort(-np.abs(block), axis=None, kind="stable")[:n]
        rows, cols = np.unravel_index(best, block.shape)
        found += [(abs(block[i, j]), float(block[i, j]), int(k), start + i,
                   j) for i, j in zip(rows.tolist(), cols.tolist())]
    found.sort(key=lambda f: -f[0])
    return [QKContribution(k, i, j, v, self.terms.label(i),
                           self.terms.label(j))
            for _, v, k, i, j in found[:n]]


def qk_attribution(model: TransformerLM, transcoders, prompt, *, layer: int,
                   head: int, query_position: int, key_positions=None,
                   zero_positions: int = 1, batch_size: int = 64
                   ) -> QKAttribution:
  """Splits head ``head`` of block ``layer``'s attention scores from
  ``query_position`` into source-pair contributions (module docstring).

  Args:
    model: A `TransformerLM` (stacked or not) of any family
      `build_transformer` makes; with Gemma 2's attention soft-cap the
      score is the value before it.
    transcoders: Per-layer transcoders or a cross-layer transcoder, as
      `penzai_lm.circuits.attribute` takes them (a CLT feature's term is
      what it writes to every block before ``layer``).
    prompt: Token ids (a list or a 1-D integer array).
    layer: The block, in ``[0, num_layers)``.
    head: The query head, in ``[0, num_heads)`` (Hugging Face order; its
      key/value head is ``head // (num_heads // num_kv_heads)``).
    query_position: In ``[0, len(prompt))``.
    key_positions: The key positions to attribute (ints the query attends
      to: at most ``query_position``, inside a local layer's window), or
      None for all of them.
    zero_positions: Leading positions whose features and errors are left
      out, as in `attribute` (their MLP outputs go into the bias term).
    batch_size: Reverse-mode passes per batch.

  Returns:
    The `QKAttribution`.

  Raises:
    TypeError, ValueError: for a bad argument, naming it and the range it
      must be in.
  """
  tokens = check_prompt(model, prompt, "qk_attribution")
  config = model.config
  _check_int("layer", layer, 0, config.num_layers)
  _check_int("head", head, 0, config.num_heads)
  _check_int("query_position", query_position, 0, len(tokens))
  layer, head, query_position = int(layer), int(head), int(query_position)
  keys = _check_keys(config, layer, query_position, key_positions)
  _check_int("zero_positions", zero_positions, 0, None)
  _check_int("batch_size", batch_size, 1, None)
  layers = check_transcoders(model, transcoders)
  linear = linearize(model, layers, tokens)
  paths = qk_engine.head_paths(linear, config, layer, head)
  forward = qk_engine.forward(linear)
  feats = prompt_features(layers, np.asarray(forward["mlp_in"]),
                          np.asarray(forward["mlp_out"]), zero_positions)
  terms, sources = qk_engine.source_terms(
      feats, np.asarray(forward["embed"]), layer, query_position,
      zero_positions)
  positions = np.concatenate([[query_position], keys]).astype(np.int32)
  n_features = int(np.sum(terms.kinds == "feature"))
  vectors, primal = qk_engine.term_vectors(
      linear, paths, sources, positions, n_features, config.head_dim,
      batch_size)
  # The bias term: what the other terms leave of each vector.
  vectors = np.concatenate(
      [vectors, (primal - vectors.sum(1))[:, None]], axis=1)
  query, key_vecs = vectors[0], vectors[1:]
  return QKAttribution(
      layer=layer, head=head, query_position=query_position,
      key_positions=keys, scores=(primal[1:] @ primal[0]).astype(np.float32),
      terms=terms, query_vectors=query, key_vectors=key_vecs)


def _check_int(name: str, value, low: int, high: int | None) -> None:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
    raise TypeError(f"{name} must be an int, got {value!r}.")
  if value < low or (high is not None and value >= high):
    where = f"[{low}, {high})" if high is not None else f">= {low}"
    raise ValueError(f"{name} is {value}, it must be in {where}.")


def _check_keys(config, layer: int, query: int, key_positions) -> np.ndarray:
  """The key positions as int32: distinct, each one the query attends to."""
  local = config.resolved_layer_types[layer] == "local"
  low = max(0, query - config.sliding_window + 1) if local else 0
  if key_positions is None:
    return np.arange(low, query + 1, dtype=np.int32)
  keys = np.asarray(key_positions)
  if (keys.ndim != 1 or keys.size == 0 or len(np.unique(keys)) != keys.size
      or not np.issubdtype(keys.dtype, np.integer)):
    raise ValueError("key_positions must be None or a non-empty 1-D list of"
                     f" distinct ints, got {key_positions!r}.")
  bad = keys[(keys < low) | (keys > query)]
  if bad.size:
    window = (f" (a local block: window {config.sliding_window})" if local
              else "")
    raise ValueError(
        f"key position {int(bad[0])} is not attended to from query position"
        f" {query} in block {layer}{window}: key positions must be in"
        f" [{low}, {query}].")
  return keys.astype(np.int32)
