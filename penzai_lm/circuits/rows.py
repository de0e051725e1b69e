"""`Rows`: the graph's rows (a target's direct effects from every source),
from batched backward passes through the prompt's `LinearizedModel`.

A target is a feature's pre-activation (``vector . mlp_in[layer,
position]``) or a logit-space direction at the last position
(``cotangent . logits``: a demeaned one-hot for a token's demeaned logit,
`penzai_lm.circuits.targets`). One backward pass
(`jax.vjp`, vmapped over a batch of targets) gives its gradient at the
``embed`` point and at every block's ``mlp_out``; dotted with each source's
vector there (a feature's ``a * w_dec`` at its layer and position, an
error vector, a token embedding) it is the row. One ``jax.jit`` program
serves every batch of a shape: batches are padded to the plan's size, the
feature sources to a power of two.

Prefixes. A feature target at position ``p`` reads nothing after ``p``
(attention is causal), so its row is the same in the model cut after
position ``p``. With several ``prefix_lengths``, targets are sorted by
position and each batch runs in the shortest prefix that holds its last
target: the backward pass through attention costs ``T^2`` per block, so a
long prompt's feature rows cost about half (eight lengths) of the full
model's; one more compiled program per length. Logit targets read the last
position: the whole prompt.

Depths. Likewise a feature target at block ``l`` reads nothing after block
``l``: with several prefix lengths, batches whose targets all sit in the
first half of the blocks run in the model cut there
(`LinearizedModel.first_blocks`), half the backward pass; one more program
per length.

Rows are ``[features (padded away), errors (layer-major: (layer 0, pos 0),
(layer 0, pos 1), ...), tokens]`` over the whole prompt; a smaller model's
rows are zero for the positions and blocks it does not hold.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from penzai_lm.circuits.feature_weights import feature_edges
from penzai_lm.circuits.feature_weights import feature_sources
from penzai_lm.circuits.features import PromptFeatures
from penzai_lm.circuits.placement import TargetPlacement
from penzai_lm.circuits.replacement import LinearizedModel
from penzai_lm.runtime.host import to_host


def prefix_lengths(seq: int, buckets: int | None) -> tuple[int, ...]:
  """The prefix lengths for a prompt of ``seq`` tokens: ``buckets`` evenly
  spaced lengths ending at ``seq`` (at most ``seq``), or with None one
  below 1,024 tokens, four below 2,048 and eight from there on."""
  if buckets is None:
    buckets = 1 if seq < 1024 else 4 if seq < 2048 else 8
  buckets = max(1, min(buckets, seq))
  return tuple(sorted({-(-seq * k // buckets) for k in range(1, buckets + 1)}))


def block_depths(num_layers: int,
                 prefix_lengths: tuple[int, ...]) -> tuple[int, ...]:
  """The depths (blocks) feature rows run in: every block with one prefix
  length; with several, also the first half of the blocks."""
  if len(prefix_lengths) == 1:
    return (num_layers,)
  return tuple(sorted({-(-num_layers // 2), num_layers}))


@functools.partial(jax.jit, static_argnames=("chunk",))
def _batch_rows(linear: LinearizedModel, sources: dict, layers, positions,
                vectors, logit_cotangents, *, chunk: int):
  """``[B, n_sources]`` rows for a batch of targets: target ``b`` is
  ``vectors[b] . mlp_in[layers[b], positions[b]] + logit_cotangents[b] .
  logits`` (``[D]``, ``[V]``; the logits the last position's before any
  soft-cap): a feature target has a zero cotangent, a logit target a zero
  vector. Feature sources are read out ``chunk`` at a time."""
  (mlp_in, last), pullback = jax.vjp(linear.targets, *linear.zero_deltas())

  def one(layer, position, vector, cotangent):
    return pullback((jnp.zeros_like(mlp_in).at[layer, position].set(vector),
                     cotangent.astype(last.dtype)))

  grad_embed, grad_mlp = jax.vmap(one)(layers, positions, vectors,
                                       logit_cotangents)
  return _read_out(grad_embed, jnp.stack(grad_mlp, axis=1), sources, chunk)


def _read_out(grad_embed, grad_mlp, sources, chunk: int) -> jax.Array:
  """Rows ``[B, features + errors (layer-major) + tokens]`` from the
  batch's gradients (``[B, T, D]`` at the embeddings, ``[B, L, T, D]`` at
  the MLP outputs); the features by `feature_weights.feature_edges`,
  ``chunk`` at a time."""
  batch = grad_mlp.shape[0]
  features = feature_edges(grad_mlp, sources, chunk)
  errors = jnp.einsum("bltd,ltd->blt", grad_mlp,
                      sources["errors"]).reshape(batch, -1)
  token_edges = jnp.einsum("btd,td->bt", grad_embed, sources["embed"])
  return jnp.concatenate([features, errors, token_edges], axis=1)


class Rows:
  """Computes rows in fixed-size batches (``plan``, a `budget.Plan`, set
  before the first rows), each in the shortest of ``prefix_lengths`` and
  the fewest blocks (`block_depths`) that hold its targets (module
  docstring).

  Attributes:
    sources: The source arrays on device (features padded).
    width: Columns of a row: features, errors, tokens.
    n_features, n_padding: Active features, and padding after them.
    plan: Set by the caller.
  """

  def __init__(self, linear: LinearizedModel, feats: PromptFeatures,
               embed: np.ndarray, vocab: int,
               placement: TargetPlacement | None,
               prefix_lengths: tuple[int, ...]):
    n = len(feats.layers)
    pad = max(64, 1 << (n - 1).bit_length()) - n
    self._place = jnp.asarray if placement is None else placement.replicate
    self.sources = {**feature_sources(
        feats.weights, feats.layers, feats.positions, feats.ids,
        feats.coefficients, n + pad, self._place),
                    "errors": self._place(feats.errors),
                    "embed": self._place(embed)}
    self.linear, self.plan, self.vocab = linear, None, vocab
    self.placement = placement
    self.n_features, self.n_padding = n, pad
    self.n_layers, self.seq = feats.errors.shape[:2]
    self.width = n + (self.n_layers + 1) * self.seq
    self._lengths = prefix_lengths
    self._depths = block_depths(self.n_layers, prefix_lengths)
    self._host = (feats.errors, embed)  # Sliced for smaller models.
    self._models = {(self.seq, self.n_layers): (linear, self.sources)}
    self._zeros = {}  # Zero logit cotangents by shape (`_zero_cotangents`).

  def _model(self, length: int, depth: int):
    """``(model, sources)`` of the prompt's first ``length`` positions and
    first ``depth`` blocks."""
    key = (length, depth)
    if key not in self._models:
      errors = self._place(self._host[0][:depth, :length])
      embed = self._place(self._host[1][:length])
      sources = dict(self.sources, errors=errors, embed=embed,
                     decoders=self.sources["decoders"][:depth])
      self._models[key] = (
          self.linear.prefix(length).first_blocks(depth), sources)
    return self._models[key]

  def _batches(self, layers: np.ndarray, positions: np.ndarray,
               is_logit: np.ndarray):
    """``(target indices, prefix length, depth, size)`` of each batch:
    sorted by the prefix length, then the depth, then the position their
    targets need, so that a batch's targets share the smallest model that
    holds them."""
    size = self.plan.batch
    if self.placement is not None:  # A whole number of targets per device.
      size = -(-size // self.placement.ways) * self.placement.ways
    reads = np.where(is_logit, self.seq - 1, positions)
    blocks = np.where(is_logit, self.n_layers, layers + 1)
    length_at = np.searchsorted(self._lengths, reads, side="right")
    depth_at = np.searchsorted(self._depths, blocks)
    order = np.lexsort((reads, depth_at, length_at))
    for start in range(0, len(order), size):
      index = order[start:start + size]
      yield (index, self._lengths[length_at[index].max()],
             self._depths[depth_at[index].max()], size)

  def _run(self, layers, positions, vectors, cotangents, is_logit, out):
    """Rows of the targets (``vectors(index)``: the ``[len(index), D]``
    vectors of targets ``index``; ``cotangents``: the ``[n, V]`` logit
    cotangents of logit targets, or None for feature targets), into
    ``out``."""
    split = jnp.asarray if self.placement is None else self.placement.split
    if out is None:
      out = np.zeros((len(layers), self.width), np.float32)
    for index, length, depth, size in self._batches(layers, positions,
                                                    is_logit):
      linear, sources = self._model(length, depth)
      def padded(a):
        return split(np.concatenate([a[index], np.zeros(
            (size - len(index), *a.shape[1:]), a.dtype)]))
      rows = to_host(_batch_rows(
          linear, sources, padded(layers), padded(positions),
          split(np.concatenate([vectors(index), np.zeros(
              (size - len(index), self.linear.width), np.float32)])),
          self._zero_cotangents(size, linear.cut) if cotangents is None
          else padded(cotangents),
          chunk=self.plan.chunk))[:len(index)]
      self._write(out, index, rows, length, depth)
    return out

  def _zero_cotangents(self, size: int, cut: bool) -> jax.Array:
    """``[size, V]`` zero logit cotangents on device (``[size, 1]`` for a
    cut model, whose logits are one zero), made once per shape: feature
    batches ship no logit cotangents."""
    key = (size, 1 if cut else self.vocab)
    if key not in self._zeros:
      split = jnp.asarray if self.placement is None else self.placement.split
      self._zeros[key] = split(np.zeros(key, np.float32))
    return self._zeros[key]

  def _write(self, out: np.ndarray, index: np.ndarray, rows: np.ndarray,
             length: int, depth: int) -> None:
    """Writes a batch's rows (over the sources of a ``length`` prefix's
    first ``depth`` blocks) into the rows ``index`` of ``out`` (over the
    whole prompt's)."""
    n, start = self.n_features, self.n_features + self.n_padding
    block = np.zeros((len(index), self.width), np.float32)
    block[:, :n] = rows[:, :n]
    errors = rows[:, start:start + depth * length]
    block[:, n:n + self.n_layers * self.seq].reshape(
        len(index), self.n_layers, self.seq)[:, :depth, :length] = (
            errors.reshape(len(index), depth, length))
    block[:, n + self.n_layers * self.seq:][:, :length] = rows[
        :, start + depth * length:]
    out[index] = block

  def logits(self, cotangents: np.ndarray, out=None) -> np.ndarray:
    """Rows of the logit targets ``cotangents . logits`` (``[K, V]``
    float32, the last position's logits before any soft-cap; a demeaned
    one-hot for a token's demeaned logit), written into ``out`` (``[K,
    width]``) if given."""
    zeros = np.zeros(len(cotangents), np.int32)
    width = self.linear.width
    return self._run(zeros, zeros,
                     lambda index: np.zeros((len(index), width), np.float32),
                     np.asarray(cotangents, np.float32),
                     np.ones(len(cotangents), bool), out)

  def features(self, feats: PromptFeatures, index: np.ndarray,
               out=None) -> np.ndarray:
    """Rows of the pre-activations of features ``index``, written into
    ``out`` if given."""
    return self._run(feats.layers[index], feats.positions[index],
                     lambda batch: feats.encoder_rows(index[batch]),
                     None, np.zeros(len(index), bool), out)
