"""Activation patching sweeps: every (layer, position) in one batched run.

Activation patching runs a *clean* prompt and a *corrupted* one of the same
length (``"The Eiffel Tower is in the city of"`` / ``"The Colosseum is in
the city of"``), then reruns the corrupted prompt with one activation taken
from the clean run, and measures how much of the clean behaviour comes back
(TransformerLens's ``patching.get_act_patch_resid_pre`` and friends)::

    result = patching_sweep(model, clean_ids, corrupted_ids,
                            point="resid_pre",
                            metric=LogitDiff(paris_id, rome_id))
    result.values      # (layers, positions) metric of each patched run
    result.normalized  # 0 = corrupted behaviour, 1 = clean behaviour

How it runs: the clean values at ``blocks.{layer}.{point}`` are captured
with `run_with_cache`; then every patched variant runs at once, as rows of a
``sweep`` batch axis (``len(layers) * len(positions)`` rows, plus the clean
and corrupted runs for the baselines, or chunks of ``batch_size`` rows).
One `SweepPatch` layer at the point of every swept block holds the clean
value and a boolean mask over (``blocks``, ``sweep``, ``seq``) saying where
it replaces the corrupted value; named-axis broadcasting applies it to the
right row. In a layer stack the stack's scan hands each block its slice of
the value and the mask, so the whole sweep is one compiled loop. The masks
are arguments of one jitted program and chunks are padded to the same size,
so every chunk (and a later sweep of the same shapes and metric) reuses one
compilation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.interp.activation_cache import run_with_cache
from penzai_lm.interp.patching_inputs import check_batch_size
from penzai_lm.interp.patching_inputs import check_corrupt
from penzai_lm.interp.patching_inputs import check_layers
from penzai_lm.interp.patching_inputs import check_point
from penzai_lm.interp.patching_inputs import check_positions
from penzai_lm.interp.patching_inputs import check_tokens_arg
from penzai_lm.interp.patching_inputs import check_window
from penzai_lm.interp.patching_inputs import Position
from penzai_lm.interp.patching_inputs import SWEEP_AXIS
from penzai_lm.interp.metric_checks import check_metric
from penzai_lm.interp.metrics import AnswerProb
from penzai_lm.interp.metrics import LogitDiff
from penzai_lm.interp.metrics import row_metric
from penzai_lm.interp.metrics import static_metric
from penzai_lm.interp.tracing import AddNoise
from penzai_lm.interp.tracing import GaussianNoise
from penzai_lm.interp.weights import weights
from penzai_lm.model import points as points_lib
from penzai_lm.model import TransformerLM


@pz.pytree_dataclass
class SweepPatch(pz.nn.Layer):
  """Patches a clean value into some rows and positions of a sweep batch.

  Attributes:
    value: The clean run's value at the point (its axes, including ``seq``;
      with ``blocks`` in a layer stack, one slice per block).
    where: Bool named array over ``sweep`` and ``seq`` (and ``blocks`` in a
      layer stack): True where row ``sweep`` takes the clean value.
  """

  value: pz.nx.NamedArray
  where: pz.nx.NamedArray

  def __call__(self, x, /, **_side_inputs):
    out = pz.nx.nmap(jnp.where)(self.where, self.value.astype(x.dtype), x)
    return pz.nx.order_like(out, x)


@dataclasses.dataclass(frozen=True)
class PatchingResult:
  """The outcome of `patching_sweep`.

  Attributes:
    values: float array ``(len(layers), len(positions))``: the metric of the
      corrupted run with the clean value patched in at
      ``blocks.{layers[i]}.{point}``, positions ``positions[j]``.
    layers: The block index of each row of ``values``.
    positions: The patched position(s) of each column: an int, or a tuple
      of ints patched together.
    point: The patched point, e.g. ``"resid_pre"``.
    clean_metric: The metric of the clean run.
    corrupted_metric: The metric of the corrupted run (nothing patched).
  """

  values: np.ndarray
  layers: tuple[int, ...]
  positions: tuple[Position, ...]
  point: str
  clean_metric: float
  corrupted_metric: float

  @property
  def normalized(self) -> np.ndarray:
    """``(values - corrupted) / (clean - corrupted)``: 0 where the patch
    changes nothing, 1 where it restores the clean metric.

    Raises:
      ValueError: if the clean and corrupted metrics are equal.
    """
    span = self.clean_metric - self.corrupted_metric
    if span == 0:
      raise ValueError(
          f"the clean and corrupted runs have the same metric"
          f" ({self.clean_metric}): the normalised score is undefined; use a"
          " metric that tells the runs apart.")
    return (self.values - self.corrupted_metric) / span

  def value(self, layer: int, position: Position) -> float:
    """The metric at one (layer, position) cell, by block and position."""
    if layer not in self.layers:
      raise KeyError(f"layer {layer} was not swept; layers: {self.layers}.")
    if position not in self.positions:
      raise KeyError(
          f"position {position!r} was not swept; positions:"
          f" {self.positions}.")
    return float(self.values[self.layers.index(layer),
                             self.positions.index(position)])


# ------------------------------------------------------------ programs


@functools.partial(jax.jit, static_argnums=2)
def _capture_stacked(model, tokens, point):
  """The clean values at ``point`` of every block of a layer stack, as one
  array over ``blocks`` (compiled: a repeated sweep reuses it; per-layer
  blocks capture eagerly, as `insert_at` reads their block indices)."""
  names = [f"blocks.{l}.{point}" for l in range(model.config.num_layers)]
  cache = run_with_cache(model, tokens, names=names)
  return pz.nx.stack([cache[n] for n in names], "blocks")


@jax.jit
def _last_logits(model, tokens):
  return model(tokens)[{"seq": -1}]


@functools.partial(jax.jit, static_argnums=2)
def _sweep_chunk(model, tokens, metric):
  """Metric of each ``sweep`` row of a patched model (one compilation per
  structure and shape: chunks pass the same model with other masks)."""
  logits = model(tokens)  # A corruption may add axes (noise samples).
  axes = tuple(a for a in logits.named_shape if a != SWEEP_AXIS)
  return jax.vmap(row_metric(metric, axes))(logits.unwrap(SWEEP_AXIS, *axes))


def _patched(model, point, layers, stacked, clean, where):
  """``model`` with a `SweepPatch` at ``point`` in the swept blocks.

  Args:
    clean: The clean values: ``{layer: value}``, or in a layer stack one
      array over ``blocks``.
    where: bool ``(num_layers, rows, seq)``.
  """
  if stacked:
    value = clean
    mask = pz.nx.wrap(jnp.asarray(where)).tag("blocks", SWEEP_AXIS, "seq")
    return points_lib.hook_points(model, point).insert_before(
        SweepPatch(value=value, where=mask))
  for layer in layers:
    mask = pz.nx.wrap(jnp.asarray(where[layer])).tag(SWEEP_AXIS, "seq")
    model = points_lib.insert_at(model, f"blocks.{layer}.{point}",
                                 SweepPatch(value=clean[layer], where=mask))
  return model


def _default_metric(model, clean, corrupted):
  if set(clean.named_shape) != {"seq"}:
    raise ValueError(
        "with a batch of prompts, pass metric= (e.g. LogitDiff(answer,"
        " wrong), averaged over the batch).")
  frozen = pz.freeze_params(model)
  answer, wrong = (
      int(jnp.argmax(_last_logits(frozen, t).unwrap("vocabulary")))
      for t in (clean, corrupted))
  if answer == wrong:
    raise ValueError(
        f"the clean and corrupted prompts both predict token {answer} last;"
        " the default metric (the logit difference of their predictions)"
        " is then zero: pass metric=.")
  return LogitDiff(answer, wrong)


def _traced_metric(model, clean):
  if set(clean.named_shape) != {"seq"}:
    raise ValueError(
        "with a batch of prompts, pass metric= (e.g. AnswerProb(answer),"
        " averaged over the batch).")
  frozen = pz.freeze_params(model)
  return AnswerProb(int(jnp.argmax(_last_logits(frozen, clean).unwrap(
      "vocabulary"))))


def patching_sweep(
    model,
    clean_tokens,
    corrupted_tokens=None,
    *,
    corrupt: GaussianNoise | None = None,
    point: str = "resid_pre",
    layers: int | Sequence[int] | None = None,
    positions: Any = None,
    window: int = 1,
    metric: Callable[[pz.nx.NamedArray], Any] | None = None,
    batch_size: int | None = None,
) -> PatchingResult:
  """Patches the clean value into the corrupted run at every (layer,
  position) and measures ``metric`` (TransformerLens's
  ``get_act_patch_resid_pre`` and siblings, as one batched run).

  Args:
    model: An uncached `TransformerLM` (either layout; patched or not).
    clean_tokens: One prompt (a list of ids, or a named array with ``seq``)
      or a batch of prompts (a list of equally long lists, or a named array
      with ``seq`` and batch axes).
    corrupted_tokens: As ``clean_tokens``, with the same shape; None: the
      clean tokens, corrupted by ``corrupt``.
    corrupt: A corruption of the corrupted runs' embeddings
      (`GaussianNoise`: causal tracing), applied to every run but the
      clean baseline, on top of ``corrupted_tokens``. Its samples are a
      ``noise`` axis the metric sees as a batch axis.
    point: The block point patched (`penzai_lm.model.hooks`): e.g.
      ``"resid_pre"``, ``"attn_out"``, ``"mlp_out"``, ``"resid_post"``,
      ``"attn.head_out"`` (all heads at a position).
    layers: Block indices (default: all).
    positions: ``None`` (default: each token position on its own), ``"all"``
      (one column: every position patched together, i.e. whole-layer
      patching), or a list whose entries are positions or tuples of
      positions patched together.
    window: Restore ``window`` consecutive blocks at once around each
      swept block (blocks ``layer - window // 2`` up to ``layer + (window -
      1) // 2 + 1``, clipped to the model; Meng et al. restore 10 at
      ``mlp_out`` and ``attn_out``); 1: the block alone.
    metric: ``metric(logits) -> scalar``, with ``logits`` one run's named
      array over ``seq``, ``vocabulary`` (and the batch axes of the tokens);
      traced under `jax.jit` and `jax.vmap`, so written with jax / named
      operations. Default: `LogitDiff` between the clean and the corrupted
      run's top prediction at the last position (one prompt only); with
      ``corrupt`` and no corrupted tokens, `AnswerProb` of the clean top
      prediction.
    batch_size: Runs per compiled call (the patched runs, plus the clean
      and corrupted baselines, which run as two more rows of the first
      chunk); default all at once. Memory grows with it: the logits alone
      are ``rows x batch x seq x vocabulary`` floats. Every chunk runs the
      same compiled program (the last is padded).

  Returns:
    A `PatchingResult`.

  Raises:
    ValueError: for mismatched or malformed tokens, a point, layer or
      position that does not exist, a metric that is not callable or does
      not return a scalar, a bad ``batch_size``.
  """
  if not isinstance(model, TransformerLM):
    raise ValueError(
        "patching_sweep needs an uncached TransformerLM, got"
        f" {type(model).__name__}.")
  clean = check_tokens_arg(model, clean_tokens, "clean_tokens")
  check_corrupt(corrupt, corrupted_tokens)
  corrupted = (clean if corrupted_tokens is None else
               check_tokens_arg(model, corrupted_tokens, "corrupted_tokens"))
  if dict(clean.named_shape) != dict(corrupted.named_shape):
    raise ValueError(
        f"clean_tokens has shape {dict(clean.named_shape)} but"
        f" corrupted_tokens has {dict(corrupted.named_shape)}; patching"
        " compares runs of the same length (pick a corrupted prompt with as"
        " many tokens).")
  corrupted = pz.nx.wrap(corrupted.unwrap(*clean.named_shape)).tag(
      *clean.named_shape)
  point = check_point(model, point)
  layers = check_layers(model, layers)
  num_layers = model.config.num_layers
  seq = clean.named_shape["seq"]
  positions = check_positions(positions, seq)
  if metric is not None and not callable(metric):
    raise ValueError(
        f"metric must be callable (logits -> scalar), got {metric!r}.")
  rows = len(layers) * len(positions)
  batch_size = check_batch_size(batch_size)
  window = check_window(window)
  noise = None if corrupt is None else corrupt.noise(
      model, weights(model, "embed.W_E"), seq)

  check_metric(metric, model.config.vocab_size, seq)
  if metric is None and corrupted_tokens is None:
    metric = _traced_metric(model, clean)
  elif metric is None:
    metric = _default_metric(model, clean, corrupted)
  metric = static_metric(metric)
  frozen = pz.freeze_params(model)
  touched = sorted({t for l in layers for t in range(
      max(0, l - window // 2), min(num_layers, l + (window - 1) // 2 + 1))})
  stacked = points_lib.is_stacked(
      points_lib.hook_points(model, point).get_sequence()[0])
  if stacked:
    clean_values = _capture_stacked(frozen, clean, point)
  else:
    cache = run_with_cache(model, clean,
                           names=[f"blocks.{l}.{point}" for l in touched])
    clean_values = {l: cache[f"blocks.{l}.{point}"] for l in touched}

  # Rows: 0 the clean run, 1 the corrupted run (the baselines, by the same
  # program), then 2 + i * P + j patches layers[i] at positions[j] into the
  # corrupted run. Padding rows (filling the last chunk) patch nothing.
  total = rows + 2
  batch_size = min(batch_size, total)
  chunks = -(-total // batch_size)
  where = np.zeros((num_layers, chunks * batch_size, seq), bool)
  for i, layer in enumerate(layers):
    near = slice(max(0, layer - window // 2), layer + (window - 1) // 2 + 1)
    for j, p in enumerate(positions):
      where[near, 2 + i * len(positions) + j, list(np.atleast_1d(p))] = True
  token_axes = tuple(clean.named_shape)
  ids = np.broadcast_to(np.asarray(corrupted.unwrap(*token_axes)),
                        (chunks * batch_size, *clean.named_shape.values())
                        ).copy()
  ids[0] = np.asarray(clean.unwrap(*token_axes))
  out = []
  for c in range(chunks):
    rows_c = slice(c * batch_size, (c + 1) * batch_size)
    base = frozen
    if noise is not None:  # Every row but the clean baseline (row 0).
      rows_mask = np.arange(rows_c.start, rows_c.stop) > 0
      base = points_lib.insert_at(base, "embed", AddNoise(
          noise=noise, rows=pz.nx.wrap(jnp.asarray(rows_mask)).tag(
              SWEEP_AXIS)))
    patched = _patched(base, point, touched, stacked, clean_values,
                       where[:, rows_c])
    tokens = pz.nx.wrap(jnp.asarray(ids[rows_c])).tag(SWEEP_AXIS,
                                                      *token_axes)
    out.append(np.asarray(_sweep_chunk(patched, tokens, metric)))
  out = np.concatenate(out)
  clean_metric, corrupted_metric = float(out[0]), float(out[1])
  values = out[2:total].reshape(len(layers), len(positions))
  return PatchingResult(
      values=values, layers=layers, positions=positions, point=point,
      clean_metric=clean_metric, corrupted_metric=corrupted_metric)
