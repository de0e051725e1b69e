"""Active features' vectors, gathered from the transcoders' own weights.

A graph reads two vectors of each active feature ``(l, p, f)`` with
activation ``a``: its **encoder** vector (its pre-activation is that vector
dotted with ``blocks.{l}.mlp_in[p]``, plus a constant: the seed of its
row's backward pass) and its **decoder** vector ``a * w_dec[l][f]`` (what
it writes to ``blocks.{l}.mlp_out[p]``; a cross-layer transcoder's feature
writes ``a * w_dec[l][f, t - l]`` to every block ``t >= l``). With ``N``
active features, tens per block and position, those are ``N * D`` floats
each: past a few hundred tokens more than the transcoders' weights (13 GB
at 4,096 tokens of SmolLM2 with 16 features per block and position). So
they are never stored: `FeatureWeights` holds each block's weights as the
transcoders hold them (the same arrays: no copy), and a feature's vectors
are gathered by ``(layer, id)`` when needed: `encoder_rows` for a batch of
targets, `feature_edges` on the device a chunk of sources at a time,
`decoder_rows` for a few features.

Array conventions: ``D`` the residual width, ``F`` features per block,
``L`` blocks, ``N`` active features sorted by ``(layer, position, id)``, so
that block ``l``'s features are one range, ``starts[l]:starts[l + 1]``.

* Per-layer transcoders: ``encoders`` a tuple of ``[D, F]`` (each block's
  ``w_enc``), ``decoders`` a tuple of ``[F, D]``; transcoders that rescale
  their activations by the decoder norm have ``scales`` (``[F]`` norms per
  block): the encoder column is multiplied by the norm and the decoder row
  divided by it (the pre-activation is ``x @ w_enc * norm``).
* A cross-layer transcoder: ``encoders`` one ``[L, D, F]`` array,
  ``decoders`` a tuple of ``[F, L - l, D]``.

A feature's ``coefficient`` is what its (raw) decoder row is multiplied by:
its activation, over the norm when rescaled.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class FeatureWeights:
  """Each block's transcoder weights as the graph reads them (module
  docstring).

  Attributes:
    encoders: ``[D, F]`` per block, or a CLT's ``[L, D, F]``.
    decoders: ``[F, D]`` per block, or a CLT's ``[F, L - l, D]`` per
      block.
    scales: ``[F]`` decoder norms per block (per-layer transcoders that
      rescale activations by them), or None.
    cross_layer: Whether these are a CLT's.
  """

  encoders: tuple[jax.Array, ...] | jax.Array
  decoders: tuple[jax.Array, ...]
  scales: tuple[np.ndarray, ...] | None = None
  cross_layer: bool = False

  def coefficients(self, layers: np.ndarray, ids: np.ndarray,
                   activations: np.ndarray) -> np.ndarray:
    """``[N]`` float32: what each feature's raw decoder row is multiplied
    by."""
    coef = np.asarray(activations, np.float32).copy()
    if self.scales is not None:
      for layer, norms in enumerate(self.scales):
        at = layers == layer
        coef[at] /= norms[ids[at]]
    return coef

  def encoder_rows(self, layers: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``[n, D]`` float32: the encoder vectors of features ``(layers[i],
    ids[i])``."""
    width = self.decoders[0].shape[-1]
    out = np.zeros((len(ids), width), np.float32)
    for layer in np.unique(layers):
      at = np.nonzero(layers == layer)[0]
      chosen = jnp.asarray(ids[at])
      if self.cross_layer:
        columns = self.encoders[int(layer), :, chosen]  # [n, D]
      else:
        columns = self.encoders[int(layer)][:, chosen].T
      out[at] = np.asarray(columns, np.float32)
      if self.scales is not None:
        out[at] *= self.scales[int(layer)][ids[at], None]
    return out

  def decoder_rows(self, layers: np.ndarray, ids: np.ndarray,
                   coefficients: np.ndarray) -> np.ndarray:
    """The decoder vectors of features ``(layers[i], ids[i])``, times
    ``coefficients``: ``[n, D]``, or for a CLT ``[n, L, D]`` (zero before
    each feature's own block) float32."""
    n_layers = len(self.decoders)
    width = self.decoders[0].shape[-1]
    shape = (len(ids), n_layers, width) if self.cross_layer else (
        len(ids), width)
    out = np.zeros(shape, np.float32)
    for layer in np.unique(layers):
      at = np.nonzero(layers == layer)[0]
      rows = np.asarray(self.decoders[int(layer)][jnp.asarray(ids[at])],
                        np.float32) * coefficients[at].reshape(
                            -1, *[1] * (len(shape) - 1))
      if self.cross_layer:
        out[at, int(layer):] = rows
      else:
        out[at] = rows
    return out


def feature_sources(weights: FeatureWeights, layers: np.ndarray,
                    positions: np.ndarray, ids: np.ndarray,
                    coefficients: np.ndarray, padded: int, place) -> dict:
  """The device arrays `feature_edges` reads for features sorted by
  layer: ``layers``, ``positions``, ``ids``, ``coef`` padded with zeros to
  ``padded`` entries, ``starts`` (``[L + 1]``: block ``l``'s features are
  ``starts[l]:starts[l + 1]``) and the ``decoders``; ``place`` puts each
  array on the device(s)."""
  n_layers = len(weights.decoders)
  pad = padded - len(layers)

  def padded_array(a, dtype):
    return place(np.concatenate([np.asarray(a, dtype),
                                 np.zeros(pad, dtype)]))

  starts = np.searchsorted(layers, np.arange(n_layers + 1)).astype(np.int32)
  return {"layers": padded_array(layers, np.int32),
          "positions": padded_array(positions, np.int32),
          "ids": padded_array(ids, np.int32),
          "coef": padded_array(coefficients, np.float32),
          "starts": place(starts),
          "decoders": tuple(place(d) for d in weights.decoders)}


def feature_edges(grad_mlp: jax.Array, sources: dict,
                  chunk: int) -> jax.Array:
  """The feature sources' edges ``[B, padded]`` from a batch's gradients
  at the MLP outputs (``grad_mlp`` ``[B, L, T, D]``), with ``sources``
  from `feature_sources` (zero for padding, and for features at positions
  the gradients do not hold: a prefix's).

  Block by block, ``chunk`` features at a time: a step gathers ``chunk``
  decoder rows and the batch's ``[B, chunk, D]`` gradient entries at their
  cells (for a CLT, once per block the features write). The number of
  steps is data (``starts``), so prompts with the same padded number of
  features share one program.
  """
  batch, n_layers, seq, width = grad_mlp.shape
  flat = grad_mlp.reshape(batch, n_layers * seq, width)
  padded = sources["positions"].shape[0]
  inside = sources["positions"] < seq
  positions = jnp.where(inside, sources["positions"], 0)
  coef = jnp.where(inside, sources["coef"], 0.0)
  starts = sources["starts"]
  out = jnp.zeros((batch, padded), flat.dtype)
  for layer, decoder in enumerate(sources["decoders"]):
    start, stop = starts[layer], starts[layer + 1]

    def step(k, out, layer=layer, decoder=decoder, start=start, stop=stop):
      index = start + k * chunk + jnp.arange(chunk)
      valid = index < stop
      safe = jnp.where(valid, index, 0)
      rows = decoder[sources["ids"][safe]].astype(flat.dtype)
      scale = jnp.where(valid, coef[safe], 0.0)
      cells = positions[safe]
      if decoder.ndim == 2:
        values = jnp.einsum("bcd,cd->bc", flat[:, layer * seq + cells],
                            rows * scale[:, None])
      else:  # A CLT's rows [chunk, L - layer, D]: one step per block.
        def block(t, acc):
          written = jax.lax.dynamic_index_in_dim(rows, t, 1, keepdims=False)
          gathered = flat[:, (layer + t) * seq + cells]
          return acc + jnp.einsum("bcd,cd->bc", gathered, written)

        values = jax.lax.fori_loop(
            0, n_layers - layer, block,
            jnp.zeros((batch, chunk), flat.dtype)) * scale[None]
      return out.at[:, jnp.where(valid, index, padded)].set(values,
                                                            mode="drop")

    out = jax.lax.fori_loop(0, (stop - start + chunk - 1) // chunk, step,
                            out)
  return out
