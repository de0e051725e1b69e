"""Cross-layer transcoders (CLTs) in attribution graphs, as circuit-tracer.

A `CrossLayerTranscoder` feature ``(l, p, f)`` with activation ``a`` reads
``blocks.{l}.mlp_in[p]`` through ``w_enc[l][:, f]`` and writes ``a *
w_dec[l][f, t - l]`` to ``blocks.{t}.mlp_out[p]`` for every block ``t >=
l``. On the prompt, each block's MLP output is split exactly as::

    mlp_out[t, p] = sum over l <= t, f of a[l, p, f] * w_dec[l][f, t - l]
                    + b_dec[t] + mlp_in[t, p] @ w_skip[t] + error[t, p]

(the skip only when the CLT has one; it stays a linear path of the
replacement model, as a per-layer transcoder's). A feature's edge to a
target is the sum over ``t >= l`` of the target's gradient at
``mlp_out[t, p]`` dotted with ``a * w_dec[l][f, t - l]``; an error's and a
token's are as for per-layer transcoders.

Array conventions (float32, one prompt): ``N`` active features, ``L``
blocks, ``T`` positions, ``D`` the residual width. A feature's decoder
vectors (`FeatureWeights.decoder_rows`) are ``[L, D]``: block ``t``'s is
what it writes to ``mlp_out[t]`` (zero for ``t`` before its own block); a
per-layer transcoder feature's are ``[D]``. Active features are sorted by
``(layer, position, id)`` (circuit-tracer's coalesced sparse order), the
first ``zero_positions`` positions' features dropped and their errors set
to zero. The ``[N, L, D]`` decoder vectors are never stored whole: they
are gathered from the CLT's weights (`feature_weights`).

Inside the graph code a CLT travels as a tuple of `CrossLayerBlock`, one
per block (`check_clt`), so that the per-block replacement model reads
each block's skip matrix as it reads a per-layer transcoder's.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.circuits.feature_weights import FeatureWeights
from penzai_lm.sae.formats.cross_layer import FEATURES
from penzai_lm.sae.formats.cross_layer import LAYERS
from penzai_lm.sae.formats.cross_layer import CrossLayerTranscoder

_STEP = 4096  # Features whose decoder rows `_reconstruction` gathers at once.


@dataclasses.dataclass(frozen=True)
class CrossLayerBlock:
  """Block ``layer``'s view of a CLT (what the MLP freeze reads).

  Attributes:
    clt: The whole transcoder (shared by every block's view).
    layer: The block.
  """

  clt: CrossLayerTranscoder
  layer: int

  @property
  def w_skip(self) -> pz.nx.NamedArray | None:
    """This block's skip matrix (axes ``embedding_in``, ``embedding``:
    ``x @ w_skip``), or None."""
    if self.clt.w_skip is None:
      return None
    return self.clt.w_skip[{LAYERS: self.layer}]


def as_clt(transcoders) -> CrossLayerTranscoder | None:
  """The CLT of ``transcoders`` (a `CrossLayerTranscoder`, or the blocks
  `check_clt` returns), or None for anything else."""
  if isinstance(transcoders, CrossLayerTranscoder):
    return transcoders
  if (isinstance(transcoders, tuple) and transcoders
      and all(isinstance(b, CrossLayerBlock) for b in transcoders)):
    return transcoders[0].clt
  return None


def check_clt(model, clt: CrossLayerTranscoder
              ) -> tuple[CrossLayerBlock, ...]:
  """``clt``'s blocks, after checking that it fits ``model``.

  Raises:
    ValueError: naming what does not fit: the number of blocks, the
      residual width, the points read and written (features must read
      ``mlp_in``, circuit-tracer's ``ln2.hook_normalized`` or
      ``mlp.hook_in``, and write ``mlp_out``).
  """
  config = model.config
  if clt.num_layers != config.num_layers:
    raise ValueError(f"the cross-layer transcoder has {clt.num_layers}"
                     f" blocks, the model {config.num_layers}: pass a CLT"
                     " trained on this model.")
  width = clt.w_enc.named_shape["embedding"]
  if width != config.hidden_size:
    raise ValueError(f"the cross-layer transcoder reads width {width}, the"
                     f" model's residual is {config.hidden_size}.")
  if clt.input_point != "mlp_in" or clt.output_point != "mlp_out":
    raise ValueError(
        f"the cross-layer transcoder reads {clt.input_point!r} and writes"
        f" {clt.output_point!r}; penzai_lm.circuits needs features that"
        " read 'mlp_in' (circuit-tracer's ln2.hook_normalized or"
        " mlp.hook_in) and write 'mlp_out'; CLTs reading 'resid_mid'"
        " (circuit-tracer's default hook_resid_mid) are not supported yet."
        " If the files name other hooks but mean these points, load them"
        " with load_transcoders(..., input_point='mlp_in',"
        " output_point='mlp_out').")
  return tuple(CrossLayerBlock(clt, layer)
               for layer in range(clt.num_layers))


def prompt_arrays(clt: CrossLayerTranscoder, mlp_in: np.ndarray,
                  mlp_out: np.ndarray, zero_positions: int = 1) -> dict:
  """The fields of `penzai_lm.circuits.features.PromptFeatures` for a CLT
  on one prompt (``mlp_in``, ``mlp_out``: ``[L, T, D]``); its vectors are
  gathered from the CLT's weights (`FeatureWeights`, ``cross_layer``)."""
  n_layers = mlp_in.shape[0]
  coords = []
  for layer in range(n_layers):
    acts = _activations(clt, mlp_in[layer], layer)
    acts[:zero_positions] = 0.0
    positions, ids = np.nonzero(acts)
    coords.append((np.full(len(ids), layer), positions, ids,
                   acts[positions, ids]))
  layers, positions, ids, values = (np.concatenate(c) for c in zip(*coords))
  weights = FeatureWeights(
      encoders=clt.w_enc.unwrap(LAYERS, "embedding", FEATURES),
      decoders=tuple(w.unwrap(FEATURES, "targets", "embedding")
                     for w in clt.w_dec), cross_layer=True)
  layers, positions = layers.astype(np.int32), positions.astype(np.int32)
  ids, values = ids.astype(np.int32), values.astype(np.float32)
  biases = np.asarray(clt.b_dec.unwrap(LAYERS, "embedding"), np.float32)
  errors = np.asarray(mlp_out, np.float32) - _reconstruction(
      clt, weights, layers, positions, ids, values, biases, mlp_in)
  errors[:, :zero_positions] = 0.0
  return dict(layers=layers, positions=positions, ids=ids,
              activations=values, coefficients=values, weights=weights,
              errors=errors, biases=biases)


def _reconstruction(clt: CrossLayerTranscoder, weights: FeatureWeights,
                    layers, positions, ids, values, biases: np.ndarray,
                    mlp_in: np.ndarray) -> np.ndarray:
  """The CLT's reconstruction of every block's MLP output (the active
  features' writes, ``b_dec`` and the skip): ``[L, T, D]`` float32. The
  writes are gathered `_STEP` features at a time (features are sorted by
  position within a block, so each step's writes are summed per position
  with ``reduceat``)."""
  n_layers, seq, _ = mlp_in.shape
  recon = np.broadcast_to(biases[:, None], mlp_in.shape).astype(np.float32)
  for start in range(0, len(ids), _STEP):
    part = slice(start, start + _STEP)
    for layer in np.unique(layers[part]):
      at = start + np.nonzero(layers[part] == layer)[0]
      rows = weights.decoder_rows(layers[at], ids[at], values[at])
      cells = positions[at]
      first = np.concatenate([[0], np.nonzero(np.diff(cells))[0] + 1])
      summed = np.add.reduceat(rows, first, axis=0)  # [cells, L, D]
      recon[:, cells[first]] += summed.transpose(1, 0, 2)
  if clt.w_skip is not None:
    w_skip = np.asarray(clt.w_skip.unwrap(LAYERS, "embedding_in",
                                          "embedding"), np.float32)
    recon += np.einsum("ltd,lde->lte", np.asarray(mlp_in, np.float32),
                       w_skip)
  return recon


def _activations(clt: CrossLayerTranscoder, x: np.ndarray,
                 layer: int) -> np.ndarray:
  """Block ``layer``'s feature activations ``[T, F]`` (float32) from its
  inputs ``x`` ``[T, D]``, by the CLT's own `encode_layer`."""
  named = pz.nx.wrap(jnp.asarray(x, jnp.float32)).tag("seq", "embedding")
  acts = clt.encode_layer(named, layer).unwrap("seq", FEATURES)
  return np.array(acts, np.float32)
