"""`attribute`: the attribution graph of a prompt (circuit-tracer 0.5's).

For each target node (a logit, or an active feature's pre-activation) one
backward pass through the prompt's `LinearizedModel` gives the gradient of
the target with respect to the residual-stream inputs (the ``embed`` point
and every block's ``mlp_out``); dotted with each source's vector there (a
feature's ``a * w_dec`` row at its layer and position, an error vector, a
token embedding) it is the target's row of edges (`penzai_lm.circuits.rows`:
batches of ``batch_size`` targets, one ``jax.vmap`` per batch, one
``jax.jit`` program per prefix length). With ``max_memory_bytes`` the
batches shrink and the feature edges are read out in chunks to fit the
budget (`penzai_lm.circuits.budget`); the graph is the same. Without a
feature cap the rows are written straight into the graph's edges.

Targets, as circuit-tracer: the logit targets (``attribution_targets``,
`penzai_lm.circuits.targets`): by default the logits of the last position
whose cumulative probability first reaches ``desired_logit_prob`` (at most
``max_n_logits``), demeaned (``logit - mean(logits)``, whose gradient is
circuit-tracer's demeaned unembedding vector), or given token ids'
demeaned logits, or `CustomTarget` directions; then the active features,
all of them in order, or, with ``max_feature_nodes``, the most influential
ones, re-ranked by their influence on the logits through the rows computed
so far every ``update_interval`` batches.

Differences from circuit-tracer: prompts are token ids (tokenize first),
taken as given: circuit-tracer prepends a special token (BOS, else pad or
EOS) to a prompt that does not start with one, so prepend the tokenizer's
BOS id to get its graph; ``Graph.vocab_size`` is the model's logit count
(circuit-tracer's is its tokenizer's ``vocab_size``), also the base of the
custom targets' virtual ids; token strings are not taken as targets
(tokenize them); a `CustomTarget`'s vector is logit-space (``[V]``), not
circuit-tracer's ``d_model`` ``vec`` (the same target when ``vec = W_U^T @
vector``).
"""

from __future__ import annotations

import jax
import numpy as np

from penzai_lm.circuits import budget
from penzai_lm.circuits.features import PromptFeatures
from penzai_lm.circuits.features import check_prompt
from penzai_lm.circuits.features import check_transcoders
from penzai_lm.circuits.features import prompt_features
from penzai_lm.circuits.graph import Graph
from penzai_lm.circuits.placement import target_placement
from penzai_lm.circuits.prune import compute_partial_influences
from penzai_lm.circuits.replacement import LinearizedModel
from penzai_lm.circuits.replacement import linearize
from penzai_lm.circuits.rows import Rows
from penzai_lm.circuits.rows import prefix_lengths
from penzai_lm.circuits.targets import check_targets
from penzai_lm.circuits.targets import resolve_targets
from penzai_lm.model.transformer import TransformerLM
from penzai_lm.runtime.host import to_host


def attribute(model: TransformerLM, transcoders, prompt, *,
              attribution_targets=None, max_n_logits: int = 10,
              desired_logit_prob: float = 0.95,
              batch_size: int = 512, max_feature_nodes: int | None = None,
              update_interval: int = 4, zero_positions: int = 1,
              max_memory_bytes: int | None = None,
              prefix_buckets: int | None = None) -> Graph:
  """Computes the attribution graph of ``prompt`` (module docstring).

  Args:
    model: An uncached `TransformerLM` of any family penzai_lm builds
      (`penzai_lm.circuits.replacement` says what is frozen in each).
    transcoders: Per-layer transcoders (`penzai_lm.sae.load_transcoders`'s
      `TranscoderSet`, or a list of `SparseAutoencoder`, one per block)
      reading ``blocks.{i}.mlp_in`` and writing ``blocks.{i}.mlp_out``, or
      a `CrossLayerTranscoder` reading each block's ``mlp_in`` and writing
      its ``mlp_out`` and every later block's
      (`penzai_lm.circuits.cross_layer`).
    prompt: Token ids (a list or a 1-D integer array).
    attribution_targets: The logit nodes (`penzai_lm.circuits.targets`):
      None, the salient logits (``max_n_logits``,
      ``desired_logit_prob``); a 1-D sequence or array of distinct token
      ids, their demeaned logits in that order, weighted by their
      probabilities at the last position; or a sequence of `CustomTarget`,
      each ``vector . logits`` at the last position (not demeaned),
      weighted by its ``probability``, with graph id ``vocab_size + i``
      and its label in `Graph.logit_labels`. Logit targets read the logits
      before any final soft-cap; probabilities come from the model's own
      (capped) logits.
    max_n_logits: Most logit nodes (None targets only).
    desired_logit_prob: Stop adding logit nodes once their total
      probability reaches this (None targets only).
    batch_size: Targets per backward batch.
    max_feature_nodes: Most feature nodes (None: every active feature).
    update_interval: Batches between re-rankings of the features (only
      with ``max_feature_nodes``).
    zero_positions: Leading positions whose features and errors are left
      out (circuit-tracer's 1: the BOS token); 0 keeps every position, and
      then each target's row plus its ``b_dec`` terms adds up to its value.
    max_memory_bytes: A budget for the call's working set
      (`penzai_lm.circuits.budget`): batches are made smaller than
      ``batch_size`` and the feature edges read out in chunks to fit it.
      None: ``batch_size`` targets a batch, all features at once. The graph
      is the same either way.
    prefix_buckets: Feature rows are computed in the model cut after
      their position, in this many prefix lengths (`circuits.rows`): 1
      always uses the whole prompt; None: 1 below 1,024 tokens, 4 below
      2,048, 8 from there on. With more than one, feature rows of the
      first half of the blocks also run in the model cut there
      (`circuits.rows.block_depths`). More lengths: less compute, more
      compiled programs. The graph is the same.

  Returns:
    The unpruned `Graph`.

  Raises:
    TypeError, ValueError: for a bad argument, naming it (checked before
      the forward pass, ``attribution_targets`` against the model's
      ``vocab_size``); ValueError also
      when ``max_memory_bytes`` cannot hold the graph (checked after the
      forward pass, which finds the active features, before any backward
      pass).
  """
  tokens = _check_args(model, prompt, max_n_logits, desired_logit_prob,
                       batch_size, max_feature_nodes, update_interval,
                       zero_positions, max_memory_bytes, prefix_buckets)
  check_targets(attribution_targets, model.config.vocab_size)
  layers = check_transcoders(model, transcoders)
  linear = linearize(model, layers, tokens)
  forward = _forward(linear)
  feats = prompt_features(layers, to_host(forward["mlp_in"]),
                          to_host(forward["mlp_out"]), zero_positions)
  last = to_host(forward["logits"]).astype(np.float32)
  targets = resolve_targets(attribution_targets, last, max_n_logits,
                            desired_logit_prob)
  total = len(feats.layers)
  n_selected = total if max_feature_nodes is None else min(
      max_feature_nodes, total)
  rows = Rows(linear, feats, to_host(forward["embed"]).astype(np.float32),
              last.shape[0], target_placement(model),
              prefix_lengths=prefix_lengths(len(tokens), prefix_buckets))
  seq, config = len(tokens), model.config
  held = feats.errors.nbytes + sum(  # The decoders are the weights.
      a.nbytes for name, a in rows.sources.items() if name != "decoders")
  forward = 4 * (6 * config.num_layers * seq * config.hidden_size
                 + config.num_heads * seq * seq)
  order, edges = _edges(rows, feats, targets.cotangents,
                        targets.probabilities, n_selected,
                        batch_size, update_interval, max_memory_bytes,
                        other_bytes=held + forward)
  return Graph(
      input_tokens=tokens,
      active_features=np.stack([feats.layers, feats.positions, feats.ids],
                               axis=1).reshape(-1, 3),
      activation_values=feats.activations,
      selected_features=np.sort(order).astype(np.int32),
      logit_tokens=targets.ids, logit_probabilities=targets.probabilities,
      edges=edges, num_layers=model.config.num_layers,
      vocab_size=last.shape[0], logit_labels=targets.labels)


def _edges(rows: Rows, feats: PromptFeatures, cotangents, probs,
           n_selected: int, batch_size: int, update_interval: int,
           max_memory_bytes: int | None, other_bytes: int):
  """``(visited feature indices, the graph's edges)``, with the work split
  by `budget.plan`. Without a feature cap the rows are written straight
  into the edges."""
  total, n_logits = len(feats.layers), len(cotangents)
  linear = rows.linear
  rows.plan = budget.plan(
      max_memory_bytes, batch_size=batch_size,
      padded_features=rows.n_features + rows.n_padding, width=rows.width,
      n_targets=n_selected + n_logits,
      n_sources=rows.width - total + n_selected,
      n_held_rows=0 if n_selected == total else n_selected + n_logits,
      other_bytes=other_bytes, num_layers=linear.num_layers,
      seq=linear.tokens.named_shape["seq"], hidden=linear.width,
      vocab=rows.vocab)
  if n_selected == total:
    edges = np.zeros((total + n_logits, rows.width), np.float32)
    rows.logits(cotangents, out=edges[total:])
    rows.features(feats, np.arange(total), out=edges[:total])
    return np.arange(total), edges
  held = np.empty((n_logits + n_selected, rows.width), np.float32)
  rows.logits(cotangents, out=held[:n_logits])
  order = _visit_features(rows, feats, held, probs, n_selected, batch_size,
                          update_interval)
  return order, _assemble(held, order, total, n_logits)


@jax.jit
def _forward(linear: LinearizedModel) -> dict:
  return linear.run(*linear.zero_deltas())


def _visit_features(rows: Rows, feats: PromptFeatures, held: np.ndarray,
                    probs, n_selected: int, batch_size: int,
                    update_interval: int) -> np.ndarray:
  """Computes the rows of the ``n_selected`` most influential features
  into ``held`` (``[n_logits + n_selected, width]``, the logit rows
  already in it), re-ranked every ``update_interval`` batches
  (circuit-tracer's phase 4); returns the features in visiting order (the
  order of their rows in ``held``)."""
  total = len(feats.layers)
  n_logits = len(probs)
  n_nodes = rows.width + n_logits  # Columns, then the logit nodes.
  row_nodes = np.concatenate([rows.width + np.arange(n_logits),
                              np.zeros(n_selected, np.int64)])
  visited = np.zeros(total, bool)
  n_visited = 0
  while n_visited < n_selected:
    filled = n_logits + n_visited
    influence = compute_partial_influences(
        held[:filled], probs, row_nodes[:filled], n_nodes=n_nodes)
    rank = np.argsort(-influence[:total], kind="stable")
    queue = min(update_interval * batch_size, n_selected - n_visited)
    pending = rank[~visited[rank]][:queue]
    rows.features(feats, pending, out=held[filled:filled + len(pending)])
    row_nodes[filled:filled + len(pending)] = pending
    visited[pending] = True
    n_visited += len(pending)
  return row_nodes[n_logits:]


def _assemble(held: np.ndarray, order, total: int,
              n_logits: int) -> np.ndarray:
  """The graph's edges from ``held`` (logit rows, then feature rows in
  visiting ``order``): the selected features' rows in feature order, then
  the logit rows; the columns of unselected features dropped. Copied a
  block of rows at a time (no second copy of ``held``)."""
  selected = np.sort(order)
  keep = np.concatenate([selected, np.arange(total, held.shape[1])])
  source = np.concatenate([n_logits + np.argsort(order),
                           np.arange(n_logits)])
  edges = np.empty((len(source), len(keep)), np.float32)
  step = max(1, (1 << 24) // max(held.shape[1], 1))
  for i in range(0, len(source), step):
    edges[i:i + step] = held[source[i:i + step]][:, keep]
  return edges


def _check_args(model, prompt, max_n_logits, desired_logit_prob,
                batch_size, max_feature_nodes, update_interval,
                zero_positions, max_memory_bytes,
                prefix_buckets) -> np.ndarray:
  """The prompt as int32 ids, after checking every argument."""
  ids = check_prompt(model, prompt, "attribute")
  for name, value, low in (("max_n_logits", max_n_logits, 1),
                           ("batch_size", batch_size, 1),
                           ("update_interval", update_interval, 1),
                           ("zero_positions", zero_positions, 0),
                           ("max_feature_nodes", max_feature_nodes, 1),
                           ("max_memory_bytes", max_memory_bytes, 1),
                           ("prefix_buckets", prefix_buckets, 1)):
    if name in ("max_feature_nodes", "max_memory_bytes",
                "prefix_buckets") and value is None:
      continue
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
      raise ValueError(f"{name} must be an int >= {low}, got {value!r}.")
  if not (isinstance(desired_logit_prob, (int, float))
          and 0.0 < desired_logit_prob <= 1.0):
    raise ValueError("desired_logit_prob must be in (0, 1], got"
                     f" {desired_logit_prob!r}.")
  return ids
