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
blocks, ``T`` positions, ``D`` the residual width. The features'
``decoder_vecs`` are ``[N, L, D]``: row ``i``'s block ``t`` is what the
feature writes to ``mlp_out[t]`` (zero for ``t`` before its own block);
per-layer transcoders' are ``[N, D]``, and `read_feature_edges` is the
read-out for the ``[N, L, D]`` form. Active features are sorted by
``(layer, position, id)`` (circuit-tracer's coalesced sparse order), the
first ``zero_positions`` positions' features dropped and their errors set
to zero.

Inside the graph code a CLT travels as a tuple of `CrossLayerBlock`, one
per block (`check_clt`), so that the per-block replacement model reads
each block's skip matrix as it reads a per-layer transcoder's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.sae.formats.cross_layer import FEATURES
from penzai_lm.sae.formats.cross_layer import LAYERS
from penzai_lm.sae.formats.cross_layer import CrossLayerTranscoder


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
  on one prompt (``mlp_in``, ``mlp_out``: ``[L, T, D]``), with
  ``decoder_vecs`` ``[N, L, D]`` (module docstring)."""
  n_layers, _, width = mlp_in.shape
  coords, encoders, decoders = [], [], []
  for layer in range(n_layers):
    acts = _activations(clt, mlp_in[layer], layer)
    acts[:zero_positions] = 0.0
    positions, ids = np.nonzero(acts)
    values = acts[positions, ids]
    coords.append((np.full(len(ids), layer), positions, ids, values))
    w_enc = clt.w_enc[{LAYERS: layer}].unwrap("embedding", FEATURES)
    encoders.append(np.asarray(w_enc[:, ids], np.float32).T)
    w_dec = clt.w_dec[layer].unwrap(FEATURES, "targets", "embedding")
    dec = np.asarray(w_dec[ids], np.float32) * values[:, None, None]
    decoders.append(np.pad(dec, ((0, 0), (layer, 0), (0, 0))))
  layers, positions, ids, values = (np.concatenate(c) for c in zip(*coords))
  decoder_vecs = np.concatenate(decoders).reshape(-1, n_layers, width)
  biases = np.asarray(clt.b_dec.unwrap(LAYERS, "embedding"), np.float32)
  errors = _errors(clt, decoder_vecs, positions, biases, mlp_in, mlp_out)
  errors[:, :zero_positions] = 0.0
  return dict(
      layers=layers.astype(np.int32), positions=positions.astype(np.int32),
      ids=ids.astype(np.int32), activations=values.astype(np.float32),
      encoder_vecs=np.concatenate(encoders).reshape(-1, width),
      decoder_vecs=decoder_vecs, errors=errors, biases=biases)


def _errors(clt: CrossLayerTranscoder, decoder_vecs: np.ndarray,
            positions: np.ndarray, biases: np.ndarray, mlp_in: np.ndarray,
            mlp_out: np.ndarray) -> np.ndarray:
  """``mlp_out`` minus the CLT's reconstruction of every block (the active
  features' writes, ``b_dec`` and the skip): ``[L, T, D]`` float32."""
  recon = np.array(jax.ops.segment_sum(
      jnp.asarray(decoder_vecs), jnp.asarray(positions, jnp.int32),
      num_segments=mlp_in.shape[1]), np.float32).transpose(1, 0, 2)
  recon += biases[:, None]
  if clt.w_skip is not None:
    w_skip = np.asarray(clt.w_skip.unwrap(LAYERS, "embedding_in",
                                          "embedding"), np.float32)
    recon += np.einsum("ltd,lde->lte", np.asarray(mlp_in, np.float32),
                       w_skip)
  return np.asarray(mlp_out, np.float32) - recon


def _activations(clt: CrossLayerTranscoder, x: np.ndarray,
                 layer: int) -> np.ndarray:
  """Block ``layer``'s feature activations ``[T, F]`` (float32) from its
  inputs ``x`` ``[T, D]``, by the CLT's own `encode_layer`."""
  named = pz.nx.wrap(jnp.asarray(x, jnp.float32)).tag("seq", "embedding")
  acts = clt.encode_layer(named, layer).unwrap("seq", FEATURES)
  return np.array(acts, np.float32)


def read_feature_edges(grad_mlp: jax.Array, layers: jax.Array,
                       positions: jax.Array, decoder: jax.Array,
                       chunk: int) -> jax.Array:
  """The CLT features' edges ``[B, N]`` from a batch's gradients at the MLP
  outputs (``grad_mlp`` ``[B, L, T, D]``), for features at ``layers``,
  ``positions`` (``[N]``) writing ``decoder`` (``[N, L, D]``).

  Features go ``chunk`` at a time (``chunk`` divides ``N``), and within a
  chunk one target block at a time, from the chunk's first block that any
  of its features writes: a step gathers ``[B, chunk, D]``, as the
  per-layer read-out does. Chunks of padding (all-zero decoders) do no
  steps.
  """
  batch, n_layers, seq, width = grad_mlp.shape
  flat = grad_mlp.reshape(batch, n_layers * seq, width)

  def one_chunk(step):
    source_layers, source_positions, vectors = step
    writes = jnp.any(vectors != 0, axis=(1, 2))
    first = jnp.min(jnp.where(writes, source_layers, n_layers))

    def one_block(t, acc):
      gathered = flat[:, t * seq + source_positions]  # [B, chunk, D]
      return acc + jnp.einsum("bcd,cd->bc", gathered, vectors[:, t])

    return jax.lax.fori_loop(first, n_layers, one_block,
                             jnp.zeros((batch, chunk), flat.dtype))

  steps = (layers.reshape(-1, chunk), positions.reshape(-1, chunk),
           decoder.reshape(-1, chunk, n_layers, width))
  by_chunk = jax.lax.map(one_chunk, steps)  # [n_chunks, B, chunk]
  return jnp.moveaxis(by_chunk, 0, 1).reshape(batch, -1)
