"""`CrossLayerTranscoder`: features read at one block, written to every
later block (circuit-tracer's CLTs, Gemma Scope 2's ``clt`` releases).

Axes: ``layers`` (the block: the source block of a feature in `encode`'s
output, the target block in `decode`'s), ``embedding`` (the residual width
``d_model``, read and written), ``features`` (``d_transcoder`` per block).
The computation is circuit-tracer's (``CrossLayerTranscoder``)::

    pre[l] = x[l] @ w_enc[l] + b_enc[l]
    f[l]   = relu(pre[l])                      "relu"
           = pre[l] * (pre[l] > threshold[l])   "jumprelu" (no relu: a
                                                negative threshold lets
                                                negative values through)
    y[t]   = sum over l <= t of f[l] @ w_dec[l][:, t - l] + b_dec[t]
             + x[t] @ w_skip[t]                 (when there is a skip)

``w_dec[l]`` holds block ``l``'s decoders to blocks ``l .. n_layers - 1``
(axis ``targets``), as the files store them, so memory is the files' size.
Splicing one into a model is not supported yet; `encode` / `decode` give
its features and its predictions of every block's output.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from penzai import pz

LAYERS, FEATURES, EMBEDDING, TARGETS = ("layers", "features", "embedding",
                                        "targets")


def _contract(x, w, axis: str):
  return pz.nx.nmap(lambda a, b: jnp.tensordot(a, b, axes=1))(
      x.untag(axis), w.untag(axis))


@pz.pytree_dataclass
class CrossLayerTranscoder(pz.Struct):
  """A cross-layer transcoder (see the module docstring).

  Attributes:
    activation: "relu" or "jumprelu" (static).
    input_point: The point each block's features read, without the block
      (e.g. ``"resid_mid"``), or None if unknown (static).
    output_point: The point each block's output is written to (e.g.
      ``"mlp_out"``), or None (static).
    w_enc: ``(layers, embedding, features)``.
    b_enc: ``(layers, features)``.
    w_dec: One ``(features, targets, embedding)`` array per source block
      ``l``, ``targets`` of size ``n_layers - l``.
    b_dec: ``(layers, embedding)``.
    threshold: ``(layers, features)`` for "jumprelu", else None.
    w_skip: ``(layers, embedding_in, embedding)`` or None.
  """

  activation: Literal["relu", "jumprelu"] = dataclasses.field(
      metadata={"pytree_node": False})
  input_point: str | None = dataclasses.field(metadata={"pytree_node": False})
  output_point: str | None = dataclasses.field(
      metadata={"pytree_node": False})
  w_enc: pz.nx.NamedArray
  b_enc: pz.nx.NamedArray
  w_dec: tuple[pz.nx.NamedArray, ...]
  b_dec: pz.nx.NamedArray
  threshold: pz.nx.NamedArray | None = None
  w_skip: pz.nx.NamedArray | None = None

  @classmethod
  def from_arrays(cls, *, w_enc, b_enc, w_dec, b_dec, threshold=None,
                  w_skip=None, input_point=None, output_point=None,
                  dtype=jnp.float32) -> CrossLayerTranscoder:
    """From arrays in circuit-tracer's layout: ``w_enc`` ``[n_layers,
    d_transcoder, d_model]``, ``b_enc`` ``[n_layers, d_transcoder]``,
    ``w_dec[l]`` ``[d_transcoder, n_layers - l, d_model]``, ``b_dec``
    ``[n_layers, d_model]``, ``threshold`` ``[n_layers, d_transcoder]``,
    ``w_skip`` ``[n_layers, d_model, d_model]`` (input-major: ``x @
    w_skip[l]``).

    Raises:
      ValueError: naming the array whose shape is wrong.
    """
    w_enc = jnp.asarray(w_enc, dtype)
    if w_enc.ndim != 3:
      raise ValueError(f"w_enc must be [n_layers, d_transcoder, d_model],"
                       f" got shape {w_enc.shape}.")
    n, f, d = w_enc.shape
    if len(w_dec) != n:
      raise ValueError(f"w_dec has {len(w_dec)} source blocks, w_enc {n}.")

    def checked(name, value, shape):
      value = jnp.asarray(value, dtype)
      if value.shape != shape:
        raise ValueError(f"{name} has shape {value.shape}, expected {shape}"
                         f" (n_layers={n}, d_transcoder={f}, d_model={d}).")
      return pz.nx.wrap(value)

    return cls(
        activation="relu" if threshold is None else "jumprelu",
        input_point=input_point, output_point=output_point,
        w_enc=pz.nx.wrap(jnp.swapaxes(w_enc, 1, 2)).tag(
            LAYERS, EMBEDDING, FEATURES),
        b_enc=checked("b_enc", b_enc, (n, f)).tag(LAYERS, FEATURES),
        w_dec=tuple(checked(f"w_dec[{l}]", w, (f, n - l, d)).tag(
            FEATURES, TARGETS, EMBEDDING) for l, w in enumerate(w_dec)),
        b_dec=checked("b_dec", b_dec, (n, d)).tag(LAYERS, EMBEDDING),
        threshold=(None if threshold is None else checked(
            "threshold", threshold, (n, f)).tag(LAYERS, FEATURES)),
        w_skip=(None if w_skip is None else checked(
            "w_skip", w_skip, (n, d, d)).tag(LAYERS, "embedding_in",
                                             EMBEDDING)))

  @property
  def num_layers(self) -> int:
    return self.w_enc.named_shape[LAYERS]

  @property
  def num_features(self) -> int:
    return self.w_enc.named_shape[FEATURES]

  def _activate(self, pre, threshold):
    if self.activation == "relu":
      return pz.nx.nmap(jax.nn.relu)(pre)
    return pz.nx.nmap(lambda p, t: p * (p > t).astype(p.dtype))(pre, threshold)

  def encode_layer(self, x: pz.nx.NamedArray, layer: int) -> pz.nx.NamedArray:
    """Features of block ``layer`` from its input ``x`` (``embedding`` and
    any batch axes)."""
    at = {LAYERS: layer}
    pre = _contract(x.astype(self.w_enc.dtype), self.w_enc[at], EMBEDDING)
    pre = pre + self.b_enc[at]
    return self._activate(pre, None if self.threshold is None
                          else self.threshold[at])

  def encode(self, x: pz.nx.NamedArray) -> pz.nx.NamedArray:
    """Features of every block: ``x`` has ``layers`` and ``embedding`` (each
    block's input), the result ``layers`` and ``features``."""
    pre = _contract(x.astype(self.w_enc.dtype), self.w_enc, EMBEDDING)
    return self._activate(pre + self.b_enc, self.threshold)

  def decode(self, features: pz.nx.NamedArray,
             inputs: pz.nx.NamedArray | None = None) -> pz.nx.NamedArray:
    """Every block's output (``layers``: the target block, and
    ``embedding``) from all blocks' features; ``inputs`` (as for
    `encode`) feeds the skip connection, which needs them."""
    total = self.b_dec
    for source, w in enumerate(self.w_dec):
      part = _contract(features[{LAYERS: source}].astype(w.dtype), w,
                       FEATURES)
      part = pz.nx.nmap(lambda a, s=source: jnp.pad(a, (s, 0)))(
          part.untag(TARGETS)).tag(LAYERS)
      total = total + part
    if self.w_skip is not None:
      if inputs is None:
        raise ValueError("this transcoder has a skip connection: pass"
                         " inputs= (each block's input) to decode.")
      renamed = inputs.astype(self.w_skip.dtype).untag(EMBEDDING).tag(
          "embedding_in")
      total = total + _contract(renamed, self.w_skip, "embedding_in")
    return total

  def forward(self, x: pz.nx.NamedArray) -> pz.nx.NamedArray:
    """``decode(encode(x), x)``."""
    return self.decode(self.encode(x), x)
