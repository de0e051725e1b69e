"""Folding a norm's weights into an autoencoder trained before them.

TransformerLens's ``blocks.{i}.ln2.hook_normalized`` is the pre-MLP norm's
output before its weights: ``n = x * rsqrt(mean(x^2) + eps)`` for RMSNorm,
``(x - mean(x)) / sqrt(var(x) + eps)`` for LayerNorm. circuit-tracer loads
TransformerLens models with ``fold_ln=False`` (and maps the hook to the
Hugging Face norm's ``_norm`` output), SAELens with ``fold_ln=True`` (the
weights folded into the next matrix): either way the hook holds ``n``.
penzai_lm's ``blocks.{i}.mlp_in`` is after the weights: ``m = n * g + b``,
``g`` the scale the model applies (Gemma's ``1 + w``, as
`penzai_lm.interp.weights` reads ``blocks.{i}.ln2.w``), ``b`` LayerNorm's
shift (``ln2.b``; 0 for RMSNorm). Arrays in `SparseAutoencoder.from_arrays`'s
layout (``w_enc`` ``[d_in, d_sae]``, ``w_dec`` ``[d_sae, d_out]``,
``w_skip`` ``[d_in, d_out]``; ``d`` the ``embedding`` index) move from ``n``
to ``m`` exactly:

* read at ``n`` (``n = (m - b) / g``): ``w_enc[d, :] /= g[d]``, ``b_enc -=
  (b / g) @ w_enc``; ``w_skip[d, :] /= g[d]``, ``b_dec -= (b / g) @ w_skip``;
  with ``apply_b_dec_to_input`` (an SAE, folded on both sides) ``b_enc`` is
  kept: ``(n - b_dec) = (m - (g * b_dec + b)) / g``;
* written at ``n`` (an SAE; the value written becomes ``y * g + b``):
  ``w_dec[:, d] *= g[d]``, ``w_skip[:, d] *= g[d]``, ``b_dec = b_dec * g +
  b``.

Refused: a scale with ``|g| < 1e-6`` (the dimension is lost at ``mlp_in``),
an input normalization (``normalize_activations`` other than "none": it
reads ``n``'s statistics) and, when the decoder is folded,
``rescale_acts_by_decoder_norm`` (the decoder's row norms change).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from penzai import pz

from penzai_lm.interp.weights import WeightTable
from penzai_lm.sae.autoencoder import SparseAutoencoder
from penzai_lm.sae.formats import hook_names
from penzai_lm.sae.formats.errors import SAEFormatError

TINY = 1e-6


@dataclasses.dataclass(frozen=True)
class NormWeights:
  """One norm's weights: the point after it is ``n * scale + shift``.

  Attributes:
    scale: ``[d_model]`` float32.
    shift: ``[d_model]`` float32 (zeros for RMSNorm).
  """

  scale: np.ndarray
  shift: np.ndarray


class NormReader:
  """Reads the norm weights a file's hooks need, from one model walk.

  Args:
    model: The model given to the loader (or its config, or None; a model
      of unfrozen `pz.Parameter` weights is read as its values).
    fold_norm: The loader's ``fold_norm``.
  """

  def __init__(self, model, fold_norm: bool):
    if not isinstance(fold_norm, bool):
      raise TypeError(f"fold_norm must be True or False, got {fold_norm!r}.")
    self._model, self._fold = model, fold_norm
    self._table = None

  def weights(self, hook: str | None, point: str | None, field: str
              ) -> NormWeights | None:
    """The weights between ``hook`` (a TransformerLens name) and its
    penzai_lm ``point``, or None when the point is the hook's value (or
    ``fold_norm`` is False).

    Args:
      hook: The file's hook name, or None (the caller named the point).
      point: The point it maps to (``blocks.{i}.mlp_in``).
      field: Where the hook came from (``where(path, key)``), for messages.

    Raises:
      SAEFormatError: naming ``field`` when the model is missing (or only
        a config) or a scale is nearly zero.
    """
    norm = None if hook is None else hook_names.normalized_norm(hook)
    if norm is None or not self._fold:
      return None
    layer = hook_names.split_point(point)[0]
    at = f"{field} is {hook!r}"
    if self._model is None or getattr(self._model, "config", None) is None:
      got = "no model" if self._model is None else "only the model's config"
      raise SAEFormatError(
          f"{at}, the norm's output before its weights; penzai_lm's"
          f" mlp_in is after them, so loading needs the model's {norm}"
          f" weights to fold in, and {got} was given. Pass model= (the"
          " model itself), or fold_norm=False to use the arrays as they are"
          " (right only if the norm's weights are all 1).")
    if self._table is None:
      self._table = WeightTable(pz.freeze_params(self._model))
    name = f"blocks.{layer}.{norm}"
    scale = np.asarray(self._table[f"{name}.w"].unwrap("embedding"),
                       np.float32)
    shift = (np.asarray(self._table[f"{name}.b"].unwrap("embedding"),
                        np.float32) if f"{name}.b" in self._table
             else np.zeros_like(scale))
    tiny = np.flatnonzero(~(np.abs(scale) >= TINY))
    if tiny.size:
      raise SAEFormatError(
          f"{at}, before the norm's weights; block {layer}'s {name}.w is"
          f" below {TINY} in magnitude at {tiny.size} dimension(s) (first:"
          f" {tiny[:5].tolist()}), which mlp_in loses, so the autoencoder"
          " cannot be moved there. Check that model= is the model it was"
          " trained on, or pass fold_norm=False to use the arrays as they"
          " are.")
    return NormWeights(scale, shift)


def _check_foldable(sae: SparseAutoencoder, decoder: bool, path) -> None:
  c = sae.config
  if c.normalize_activations != "none":
    raise SAEFormatError(
        f"{path}: normalize_activations={c.normalize_activations!r}"
        " normalizes the value before the norm's weights, which cannot be"
        " folded into the arrays; pass fold_norm=False to use them as they"
        " are.")
  if decoder and c.rescale_acts_by_decoder_norm:
    raise SAEFormatError(
        f"{path}: rescale_acts_by_decoder_norm uses the decoder's row norms,"
        " which folding the norm's weights into the decoder changes; pass"
        " fold_norm=False to use the arrays as they are.")


def fold_autoencoder(sae: SparseAutoencoder, read: NormWeights | None,
                     write: NormWeights | None, path) -> SparseAutoencoder:
  """``sae`` moved from reading / writing the norm's output before its
  weights to after them (module docstring); None leaves that side as is.

  Raises:
    SAEFormatError: for an autoencoder that cannot be folded.
  """
  if read is None and write is None:
    return sae
  _check_foldable(sae, write is not None, path)
  if sae.config.apply_b_dec_to_input and read is not write:
    raise SAEFormatError(
        f"{path}: apply_b_dec_to_input subtracts the output's b_dec from the"
        " input, so both must be before the same norm's weights; pass"
        " fold_norm=False to use the arrays as they are.")
  a = {k: np.asarray(v, np.float32) for k, v in sae.flat().items()}
  skip = a.get("w_skip")
  if read is not None:
    inv = 1.0 / read.scale
    if not sae.config.apply_b_dec_to_input:
      a["b_enc"] = a["b_enc"] - (read.shift * inv) @ a["w_enc"]
    a["w_enc"] = a["w_enc"] * inv[:, None]
    if skip is not None:
      a["b_dec"] = a["b_dec"] - (read.shift * inv) @ skip
      skip = skip * inv[:, None]
  if write is not None:
    a["w_dec"] = a["w_dec"] * write.scale[None, :]
    a["b_dec"] = a["b_dec"] * write.scale + write.shift
    if skip is not None:
      skip = skip * write.scale[None, :]
  if skip is not None:
    a["w_skip"] = skip
  return SparseAutoencoder.from_arrays(sae.config, dtype=sae.dtype, **a)


def fold_clt_inputs(arrays: dict, per_layer: list[NormWeights]) -> dict:
  """A cross-layer transcoder's arrays (`CrossLayerTranscoder.from_arrays`
  layout) moved to read after block ``l``'s norm weights ``per_layer[l]``
  (the skip of target ``t`` reads block ``t``'s input)."""
  inv = np.stack([1.0 / w.scale for w in per_layer])  # [n, d]
  shift = np.stack([w.shift for w in per_layer]) * inv
  w_enc = np.asarray(arrays["w_enc"], np.float32)  # [n, f, d]
  out = dict(arrays)
  out["b_enc"] = arrays["b_enc"] - np.einsum("lfd,ld->lf", w_enc, shift)
  out["w_enc"] = w_enc * inv[:, None, :]
  if arrays.get("w_skip") is not None:
    skip = np.asarray(arrays["w_skip"], np.float32)  # [n, d_in, d]
    out["b_dec"] = arrays["b_dec"] - np.einsum("ld,lde->le", shift, skip)
    out["w_skip"] = skip * inv[:, :, None]
  return out
