"""`TrainConfig`: how `penzai_lm.sae.train_sae` trains an autoencoder.

These defaults are SAELens 6's: learning rate 3e-4 (constant, no warm-up
or decay), Adam betas 0.9 / 0.999, gradient clip 1, AuxK coefficient 1,
TopK decoder-norm rescaling, JumpReLU bandwidth 0.05, initial threshold
0.01 and L0 coefficient 1, 4096 tokens per batch, 128-token windows, a
1000-step dead-feature window.

These differ from SAELens 6's (`TrainConfig` keeps them: changing them
would change what existing scripts train; set them to SAELens's values to
train as it does):

=========================  ======================  =====================
field                      penzai_lm               SAELens 6
=========================  ======================  =====================
``b_dec_init``             "geometric_median"      "zeros" (its only one)
``normalize_activations``  "expected_average_      "none"
                           only_in"
``max_norm_ratio``         10 (drops sink tokens)  None (no such filter)
``skip_positions``         1 (no BOS prepended)    0 (``seqpos_slice``
                                                   ``(None,)``, with
                                                   ``prepend_bos`` true)
``k``                      32                      100
``l1_coefficient``         5                       1
=========================  ======================  =====================

SAELens also initializes decoder rows to norm 0.1 (``decoder_init_norm``)
and, by default, trains on special tokens too (``exclude_special_tokens``
false). A bad value is a ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from penzai_lm.model import memory

_CHOICES = {
    "activation": ("relu", "topk", "jumprelu"),
    "normalize_activations": ("expected_average_only_in", "none"),
    "b_dec_init": ("geometric_median", "mean", "zeros"),
    "jumprelu_sparsity_loss": ("step", "tanh"),
}
_FLOATS = ("aux_k_coefficient", "l1_coefficient", "l0_coefficient",
           "jumprelu_init_threshold", "jumprelu_bandwidth",
           "jumprelu_tanh_scale", "learning_rate", "grad_clip_norm",
           "max_norm_ratio")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """How to train an autoencoder (defaults: module docstring, which lists
  those that differ from SAELens 6's).

  Attributes:
    activation: "relu" (L1 penalty), "topk" or "jumprelu" (L0 penalty).
    num_features: Dictionary width; None: ``expansion_factor * d_in``.
    expansion_factor: Width as a multiple of the input's.
    k: Active features per token ("topk").
    aux_k_coefficient: Weight of TopK's AuxK loss on dead features (0: off).
    rescale_acts_by_decoder_norm: TopK picks features by pre-activation
      times decoder-row norm (SAELens's training default).
    l1_coefficient: "relu"'s L1 weight (on ``f * |w_dec row|``).
    l0_coefficient: "jumprelu"'s L0 weight.
    sparsity_warmup_steps: The L1 / L0 weight ramps up from 0 over these.
    jumprelu_init_threshold, jumprelu_bandwidth: JumpReLU's threshold start
      and its straight-through estimators' kernel width.
    jumprelu_sparsity_loss: "step" (DeepMind) or "tanh" (Anthropic).
    jumprelu_tanh_scale: The "tanh" loss's scale.
    learning_rate, adam_beta1, adam_beta2: Adam's.
    warmup_steps: Linear learning-rate warm-up.
    decay_steps: Linear decay to 0 over the last steps.
    grad_clip_norm: Global gradient-norm clip (None: off).
    batch_tokens: Activations per step.
    steps, total_tokens: How long (exactly one): steps, or tokens (rounded
      up to whole batches).
    context_length: Tokens per window the model runs on.
    model_batch: Windows per forward pass.
    skip_positions: Leading tokens of each window not trained on (the
      attention sink at position 0).
    max_norm_ratio: Activations longer than this times the median norm of
      the first ones are dropped (None: none are): other attention sinks
      (a window starting with newlines or a run of one token) carry norms
      ~100x the rest and would dominate the MSE.
    buffer_tokens: Shuffle buffer size (at least two batches; at most the
      tokens the run trains on, ``steps * batch_tokens``).
    normalize_activations: "expected_average_only_in" (train on values
      scaled to mean norm ``sqrt(d_in)``, folded out at the end) or "none".
    b_dec_init: "geometric_median", "mean" (of the first batches) or
      "zeros".
    dead_feature_window: Steps without firing after which a feature is dead.
    resample_every: Resample dead features every this many steps (None:
      never; AuxK keeps TopK's alive without it).
    log_every: Steps per `LogEntry` (averaged over them).
    eval_windows: Windows held out of the tokens for `evaluate_sae` (when no
      ``eval_tokens`` are given; 0: no evaluation).
    seed: Initialization, window order and shuffling.
  """

  activation: Literal["relu", "topk", "jumprelu"] = "topk"
  num_features: int | None = None
  expansion_factor: int = 16
  k: int = 32
  aux_k_coefficient: float = 1.0
  rescale_acts_by_decoder_norm: bool = True
  l1_coefficient: float = 5.0
  l0_coefficient: float = 1.0
  sparsity_warmup_steps: int = 0
  jumprelu_init_threshold: float = 0.01
  jumprelu_bandwidth: float = 0.05
  jumprelu_sparsity_loss: Literal["step", "tanh"] = "step"
  jumprelu_tanh_scale: float = 4.0
  learning_rate: float = 3e-4
  adam_beta1: float = 0.9
  adam_beta2: float = 0.999
  warmup_steps: int = 0
  decay_steps: int = 0
  grad_clip_norm: float | None = 1.0
  batch_tokens: int = 4096
  steps: int | None = None
  total_tokens: int | None = None
  context_length: int = 128
  model_batch: int = 16
  skip_positions: int = 1
  max_norm_ratio: float | None = 10.0
  buffer_tokens: int = 65536
  normalize_activations: str = "expected_average_only_in"
  b_dec_init: str = "geometric_median"
  dead_feature_window: int = 1000
  resample_every: int | None = None
  log_every: int = 50
  eval_windows: int = 16
  seed: int = 0

  def __post_init__(self):
    for name, choices in _CHOICES.items():
      if getattr(self, name) not in choices:
        raise ValueError(f"TrainConfig.{name} must be one of {choices}, got"
                         f" {getattr(self, name)!r}.")
    positive = ["expansion_factor", "k", "learning_rate", "batch_tokens",
                "context_length", "model_batch", "buffer_tokens",
                "dead_feature_window", "log_every", "jumprelu_bandwidth",
                "jumprelu_tanh_scale"]
    optional = ["num_features", "steps", "total_tokens", "resample_every",
                "grad_clip_norm", "max_norm_ratio"]
    at_least_zero = ["aux_k_coefficient", "l1_coefficient", "l0_coefficient",
                     "sparsity_warmup_steps", "warmup_steps", "decay_steps",
                     "skip_positions", "eval_windows",
                     "jumprelu_init_threshold"]
    for name in positive + optional + at_least_zero:
      value = getattr(self, name)
      if value is None and name in optional:
        continue
      integral = name not in _FLOATS
      ok = (isinstance(value, int) if integral
            else isinstance(value, (int, float)) and math.isfinite(value))
      if isinstance(value, bool) or not ok or value < 0 or (
          value == 0 and name not in at_least_zero):
        kind = "an int" if integral else "a finite number"
        bound = ">= 0" if name in at_least_zero else "> 0"
        raise ValueError(f"TrainConfig.{name} must be {kind} {bound}, got"
                         f" {value!r}.")
    for name in ("adam_beta1", "adam_beta2"):
      if not 0 <= getattr(self, name) < 1:
        raise ValueError(f"TrainConfig.{name} must be in [0, 1), got"
                         f" {getattr(self, name)!r}.")
    if (self.steps is None) == (self.total_tokens is None):
      raise ValueError("give TrainConfig exactly one of steps= or"
                       " total_tokens=.")
    if self.skip_positions >= self.context_length:
      raise ValueError(
          f"TrainConfig.skip_positions ({self.skip_positions}) leaves no"
          f" token of each context_length={self.context_length} window.")
    if self.warmup_steps + self.decay_steps > self.total_steps:
      raise ValueError(
          f"warmup_steps + decay_steps ({self.warmup_steps} +"
          f" {self.decay_steps}) exceed the {self.total_steps} training"
          " steps.")

  @property
  def total_steps(self) -> int:
    if self.steps is not None:
      return self.steps
    return -(-self.total_tokens // self.batch_tokens)

  def features(self, d_in: int) -> int:
    """The dictionary width for inputs of width ``d_in``.

    Raises:
      ValueError: if ``k`` exceeds the width.
      InsufficientMemoryError: (a ValueError) if the training state (the
        float32 encoder and decoder, their two Adam moments, and one
        batch's ``[batch_tokens, width]`` pre-activations) cannot fit in
        the available memory: checked before anything is allocated.
    """
    width = self.num_features or self.expansion_factor * d_in
    if self.activation == "topk" and self.k > width:
      raise ValueError(f"TrainConfig.k={self.k} exceeds the {width}"
                       " features.")
    needed = 4 * width * (6 * d_in + 2 * self.batch_tokens)
    memory.check_fits(
        f"training an autoencoder of {width:,} features on inputs of width"
        f" {d_in}", needed,
        "Lower TrainConfig.num_features (or expansion_factor) or"
        " batch_tokens.")
    return width
