"""`SAEConfig`: what an autoencoder computes besides its weights (the
activation, the axes it reads and writes, the points, the normalization),
checked when made. `penzai_lm.sae.autoencoder` holds the weights and the
computation (its module docstring fixes the axis conventions).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

Activation = Literal["relu", "jumprelu", "topk"]
Normalization = Literal["none", "constant_norm_rescale", "layer_norm"]
ACTIVATIONS = ("relu", "jumprelu", "topk")
NORMALIZATIONS = ("none", "constant_norm_rescale", "layer_norm")
FEATURES = "features"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SAEConfig:
  """What an autoencoder computes, besides its weights.

  Attributes:
    activation: "relu", "jumprelu" (needs ``threshold``) or "topk" (needs
      ``k``).
    num_features: Width of the dictionary (``d_sae``).
    input_axes: Axes of the value read, as ``((name, size), ...)``.
    output_axes: Axes of the value written (same as ``input_axes`` for an
      SAE).
    k: Active features per token, for "topk".
    apply_b_dec_to_input: Subtract ``b_dec`` from the input first (SAEs
      only: a transcoder's ``b_dec`` lives on the output side).
    normalize_activations: "none", "constant_norm_rescale" or "layer_norm".
    rescale_acts_by_decoder_norm: Scale pre-activations by the decoder
      rows' norms (and features back before decoding), as SAELens's TopK
      SAEs may.
    hook_point: The point read, in penzai_lm's names (e.g.
      ``"blocks.6.resid_post"``), if known.
    output_point: The point written, for a transcoder (None: an SAE, which
      writes where it reads).
  """

  activation: Activation = "relu"
  num_features: int
  input_axes: tuple[tuple[str, int], ...]
  output_axes: tuple[tuple[str, int], ...]
  k: int | None = None
  apply_b_dec_to_input: bool = False
  normalize_activations: Normalization = "none"
  rescale_acts_by_decoder_norm: bool = False
  hook_point: str | None = None
  output_point: str | None = None

  def __post_init__(self):
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation must be one of {ACTIVATIONS}, got"
                       f" {self.activation!r}.")
    if self.normalize_activations not in NORMALIZATIONS:
      raise ValueError(
          f"normalize_activations must be one of {NORMALIZATIONS}, got"
          f" {self.normalize_activations!r}.")
    if not _positive_int(self.num_features):
      raise ValueError(f"num_features must be a positive int, got"
                       f" {self.num_features!r}.")
    for what in ("input_axes", "output_axes"):
      axes = getattr(self, what)
      if not axes or not all(
          isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str)
          and _positive_int(a[1]) for a in axes):
        raise ValueError(f"{what} must be ((name, size), ...) with positive"
                         f" sizes, got {axes!r}.")
      names = [a for a, _ in axes]
      if FEATURES in names or len(set(names)) != len(names):
        raise ValueError(
            f"{what} {axes!r} repeat a name or use {FEATURES!r}, the"
            " dictionary's own axis (an autoencoder reads a model point,"
            " not another autoencoder's features).")
    if self.activation == "topk" and not (
        _positive_int(self.k) and self.k <= self.num_features):
      raise ValueError(f"a topk autoencoder needs 1 <= k <= num_features"
                       f" ({self.num_features}), got k={self.k!r}.")
    if self.apply_b_dec_to_input and self.input_axes != self.output_axes:
      raise ValueError(
          "apply_b_dec_to_input needs the input and output axes to match"
          " (b_dec lives on the output side of a transcoder).")

  @property
  def is_transcoder(self) -> bool:
    return self.output_point is not None or self.input_axes != self.output_axes

  @property
  def input_size(self) -> int:
    return math.prod(n for _, n in self.input_axes)

  @property
  def output_size(self) -> int:
    return math.prod(n for _, n in self.output_axes)


def _positive_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value > 0
