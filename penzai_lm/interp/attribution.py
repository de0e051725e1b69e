"""Attribution patching: every (layer, position) of a patching sweep at once,
to first order, from one forward pass and one backward pass.

`patching_sweep` reruns the corrupted prompt once per cell with the clean
activation patched in. Attribution patching (Nanda, "Attribution Patching:
Activation Patching At Industrial Scale", 2023; TransformerLens's
attribution-patching demo) estimates all of those runs from gradients::

    score[layer, position] = (clean_act - corrupted_act) . d metric / d act

with the gradient taken on the *corrupted* run, at the point
``blocks.{layer}.{point}`` and that position (summed over the value's unit
axes: ``embedding``, a head's ``projection``; not over heads or neurons,
which get a score each). It is the first-order Taylor estimate of
``metric(corrupted run with the clean value patched in) - metric(corrupted
run)``, i.e. of ``patching_sweep(...).values - corrupted_metric`` with the
same clean/corrupted roles and sign: positive where patching the clean value
in moves the metric towards the clean run (for a metric that is larger on
the clean run, such as `LogitDiff` of the clean answer).

How it runs: the clean and corrupted prompts are one batch, rows of a
``run`` axis. At every requested point of every block a `_Probe` layer
replaces the corrupted row's value ``x`` by ``x + s * (clean - x)``, with
``s`` an array of zeros over (``blocks``,) the token axes and the scored
unit axes: at ``s = 0`` nothing changes, ``s = 1`` at one cell is that
cell's patch, and ``d metric / d s`` at 0 is exactly the score above. One
jitted program runs the forward pass, the metric and the gradient with
respect to every ``s``; a later call with the same shapes, points and
metric reuses it. In a layer stack the ``blocks`` axis of ``s`` is sliced by
the stack's scan, so the whole thing is one loop.

Prompts may be ragged: pair ``i`` (``clean[i]``, ``corrupted[i]``) has one
length, pairs may differ; rows are left-padded as in `run_with_cache`, and
padding scores 0 (`AttributionResult.row` drops it).

Causal tracing's corruption (Meng et al., 2022; `penzai_lm.interp.tracing`):
with ``corrupt=GaussianNoise(positions)`` the corrupted run is the corrupted
tokens (default: the clean ones) with Gaussian noise added to the
embeddings at ``positions``, its samples a ``noise`` axis of the one
program, as in `patching_sweep`. ``s`` has no ``noise`` axis, so the score
is the gradient of the metric over all samples at once: with a metric that
averages over batch axes (`LogitDiff`, `AnswerProb`) it is the average over
samples of each noised run's ``(clean - noised) . d metric / d act``. The
clean row carries the (unused) axis too; its metric is the clean run's.
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

from penzai_lm.interp.attribution_inputs import check_points
from penzai_lm.interp.attribution_inputs import DEFAULT_POINTS
from penzai_lm.interp.attribution_inputs import noise_layer
from penzai_lm.interp.attribution_inputs import pair_tokens
from penzai_lm.interp.attribution_inputs import PER_POSITION
from penzai_lm.interp.attribution_inputs import POINTS
from penzai_lm.interp.attribution_inputs import RUN_AXIS
from penzai_lm.interp.metric_checks import check_finite_metric
from penzai_lm.interp.metric_checks import check_metric
from penzai_lm.interp.metric_checks import metric_scalar
from penzai_lm.interp.metrics import static_metric
from penzai_lm.interp.patching import _default_metric
from penzai_lm.interp.patching import _traced_metric
from penzai_lm.interp.patching import PatchingResult
from penzai_lm.interp.patching_inputs import check_corrupt
from penzai_lm.interp.tracing import GaussianNoise
from penzai_lm.model import points as points_lib
from penzai_lm.model import TransformerLM
from penzai_lm.model.hooks import head_coordinates

__all__ = ["AttributionResult", "DEFAULT_POINTS", "PER_POSITION", "POINTS",
           "RUN_AXIS", "attribution_patching"]


@pz.pytree_dataclass
class _Probe(pz.nn.Layer):
  """``x + s * (clean - x)`` on the corrupted row (see the module docstring).

  Attributes:
    scale: ``s``: float32 zeros over the token axes (without ``run``), the
      scored unit axes, and ``blocks`` in a layer stack.
    point: The point's name in the block, e.g. ``"resid_pre"``.
    layer: The block (None in a layer stack: one probe for every block).
  """

  scale: pz.nx.NamedArray
  point: str = dataclasses.field(metadata={"pytree_node": False})
  layer: int | None = dataclasses.field(metadata={"pytree_node": False})

  def __call__(self, x, /, **_side_inputs):
    clean = x[{RUN_AXIS: 0}]
    corrupted_row = pz.nx.wrap(jnp.asarray([0.0, 1.0])).tag(RUN_AXIS)
    moved = corrupted_row * self.scale * (clean - x).astype(jnp.float32)
    return pz.nx.order_like(x + moved.astype(x.dtype), x)


def _scored_axes(config, point: str) -> dict[str, int]:
  """The unit axes that get a score each (the rest are summed over)."""
  if point == "attn.head_out":
    common, query_only = config.head_axes
    return {**common, **query_only}
  if point == "mlp.neurons":
    return {"neurons": config.mlp_hidden_size}
  return {}


def _probed(model, names, token_shape: dict[str, int]):
  """``model`` with a zero `_Probe` before every hook point of ``names``."""
  config = model.config
  for point in names:
    units = _scored_axes(config, point)
    hooks = points_lib.hook_points(model, point)
    if points_lib.is_stacked(hooks.get_sequence()[0]):
      scale = pz.nx.zeros({"blocks": config.num_layers, **token_shape,
                           **units}, jnp.float32)
      model = hooks.insert_before(_Probe(scale, point, None))
      continue
    for layer in range(config.num_layers):
      scale = pz.nx.zeros({**token_shape, **units}, jnp.float32)
      model = points_lib.insert_at(model, f"blocks.{layer}.{point}",
                                   _Probe(scale, point, layer))
  return model


@functools.partial(jax.jit, static_argnums=3)
def _attribute(probed, tokens, positions, metric, seed):
  """(clean metric, corrupted metric, {point: scores over blocks}) in one
  program: the forward pass of both runs, the metric, the backward pass.

  ``seed`` is the backward pass's starting cotangent, 1.0, as an argument:
  with `jax.grad`'s constant 1.0 the gradient of a metric that indexes the
  logits (`LogitDiff`) is a constant scatter over (runs, seq, vocabulary),
  which XLA constant-folds at compile time, slowly for a large
  vocabulary."""
  probes = pz.select(probed).at_instances_of(_Probe)
  side = {} if positions is None else {"token_positions": positions}

  def corrupted_metric(scales):
    model = probes.set_sequence([
        dataclasses.replace(p, scale=s)
        for p, s in zip(probes.get_sequence(), scales)])
    logits = model(tokens, **side)
    clean = metric_scalar(metric, metric(logits[{RUN_AXIS: 0}]))
    return metric_scalar(metric, metric(logits[{RUN_AXIS: 1}])), clean

  scales = [p.scale for p in probes.get_sequence()]
  corrupted, backward, clean = jax.vjp(corrupted_metric, scales, has_aux=True)
  grads, = backward(seed.astype(corrupted.dtype))
  by_point: dict[str, list] = {}
  for probe, grad in zip(probes.get_sequence(), grads):
    by_point.setdefault(probe.point, []).append((probe.layer, grad))
  real = 1.0 if positions is None else (
      positions[{RUN_AXIS: 0}] >= 0).astype(jnp.float32)
  scores = {}
  for point, found in by_point.items():
    if found[0][0] is None:  # A layer stack: one probe over ``blocks``.
      (_, stacked), = found
    else:
      stacked = pz.nx.stack([g for _, g in sorted(found, key=lambda f: f[0])],
                            "blocks")
    scores[point] = stacked * real  # Padding scores 0.
  return clean, corrupted, scores


def _hugging_face_heads(config, scores: pz.nx.NamedArray) -> pz.nx.NamedArray:
  """Head axes -> one ``heads`` axis in Hugging Face order."""
  return pz.nx.stack([scores[head_coordinates(config, h)]
                      for h in range(config.num_heads)], "heads")


@dataclasses.dataclass(frozen=True)
class AttributionResult:
  """The outcome of `attribution_patching`.

  Attributes:
    scores: ``{point: named array}`` over ``blocks`` (every block), the
      tokens' axes (the batch axes and ``seq``, rows left-padded) and
      ``heads`` (``attn.head_out``, Hugging Face order) or ``neurons``
      (``mlp.neurons``): the estimated change of the metric when the clean
      value replaces the corrupted one at that cell (module docstring).
    clean_metric: The metric of the clean run.
    corrupted_metric: The metric of the corrupted run.
    lengths: Real tokens of each row (pairs of ragged prompts; rows are
      left-padded to the longest, padding scores 0).
  """

  scores: dict[str, pz.nx.NamedArray]
  clean_metric: float
  corrupted_metric: float
  lengths: tuple[int, ...]

  def __getitem__(self, point: str) -> pz.nx.NamedArray:
    if point not in self.scores:
      raise KeyError(f"{point!r} was not scored; scored: {list(self.scores)}"
                     ". Pass it in attribution_patching(..., names=[...]).")
    return self.scores[point]

  def _units(self, point):
    return tuple(a for a in ("heads", "neurons")
                 if a in self[point].named_shape)

  def values(self, point: str) -> np.ndarray:
    """``(blocks, seq[, heads | neurons])``: the scores summed over the
    batch axes, i.e. the estimate of patching a cell in every prompt at
    once (``patching_sweep(...).values - corrupted_metric``).

    Raises:
      ValueError: for ragged prompts (positions differ per row: use `row`).
    """
    if len(set(self.lengths)) > 1:
      raise ValueError(
          f"the prompts are ragged (lengths {list(self.lengths)}): a column"
          " is not one position in every row; use row(point, r).")
    scores = self[point]
    batch = [a for a in scores.named_shape
             if a not in ("blocks", "seq", *self._units(point))]
    if batch:  # Summed: one column patches a position in every row.
      scores = pz.nx.nmap(jnp.sum)(scores.untag(*batch))
    return np.asarray(scores.unwrap("blocks", "seq", *self._units(point)))

  def normalized(self, point: str) -> np.ndarray:
    """`values` divided by ``clean_metric - corrupted_metric`` (1: the
    estimate restores the clean metric), as `PatchingResult.normalized`."""
    span = self.clean_metric - self.corrupted_metric
    if span == 0:
      raise ValueError(
          f"the clean and corrupted runs have the same metric"
          f" ({self.clean_metric}): the normalised score is undefined.")
    return self.values(point) / span

  def row(self, point: str, r: int, batch_axis: str = "batch"
          ) -> np.ndarray:
    """``(blocks, length[, heads | neurons])`` scores of row ``r`` without
    its padding."""
    value = self[point][{batch_axis: r}]
    pad = value.named_shape["seq"] - self.lengths[r]
    value = value[{"seq": pz.slice[pad:]}]
    return np.asarray(value.unwrap("blocks", "seq", *self._units(point)))

  def as_patching_result(self, point: str) -> PatchingResult:
    """The estimate in `patching_sweep`'s form (``values``: the estimated
    patched metric, ``corrupted_metric + score``) for a per-position point,
    to compare or plot alike."""
    if point not in PER_POSITION:
      raise ValueError(
          f"{point!r} has a score per head or neuron; a PatchingResult has"
          f" one per position (points {', '.join(PER_POSITION)}).")
    values = self.values(point)
    return PatchingResult(
        values=self.corrupted_metric + values,
        layers=tuple(range(values.shape[0])),
        positions=tuple(range(values.shape[1])), point=point,
        clean_metric=self.clean_metric,
        corrupted_metric=self.corrupted_metric)


def attribution_patching(
    model,
    clean_tokens,
    corrupted_tokens=None,
    metric: Callable[[pz.nx.NamedArray], Any] | None = None,
    *,
    names: str | Sequence[str] = DEFAULT_POINTS,
    corrupt: GaussianNoise | None = None,
) -> AttributionResult:
  """Scores every (block, position) -- and head or neuron -- by attribution
  patching (the gradient estimate of `patching_sweep`; module docstring).

  Args:
    model: An uncached `TransformerLM` (either layout; patched or not).
    clean_tokens: One prompt (a list of ids, or a named array with ``seq``),
      a batch of equally long prompts, or a list of ragged prompts.
    corrupted_tokens: As ``clean_tokens``; ``corrupted_tokens[i]`` as long
      as ``clean_tokens[i]``. None: the clean tokens, corrupted by
      ``corrupt``.
    metric: ``metric(logits) -> scalar`` on one run's logits (``seq``,
      ``vocabulary`` and the batch axes, rows left-padded), e.g.
      `LogitDiff`; traced and differentiated, so written with jax / named
      operations. Default: `LogitDiff` of the two runs' top predictions at
      the last token (one prompt only), as in `patching_sweep`; with
      ``corrupt`` and no corrupted tokens, `AnswerProb` of the clean top
      prediction.
    names: Points scored: any of ``resid_pre``, ``resid_mid``,
      ``resid_post``, ``attn_out``, ``mlp_out`` (one score per block and
      position), ``attn.head_out`` (per head), ``mlp.neurons`` (per
      neuron). Default: ``resid_pre``, ``attn_out``, ``mlp_out``.
    corrupt: Noise on the corrupted run's embeddings (`GaussianNoise`:
      causal tracing), on top of ``corrupted_tokens``; prompts of one
      length. Its samples are a ``noise`` axis the metric sees as a batch
      axis (module docstring).

  Returns:
    An `AttributionResult`.

  Raises:
    ValueError: for neither corrupted tokens nor ``corrupt``, a ``corrupt``
      that is not a `GaussianNoise` or with positions outside the prompts,
      ragged prompts with ``corrupt``, mismatched or malformed tokens, an
      unknown point, a
      metric that is not callable or does not return a scalar, a
      `LogitDiff` outside the vocabulary or the prompts, or a metric (or
      its gradient) that is NaN or inf.
    TypeError: for a metric returning something other than numbers.
  """
  if not isinstance(model, TransformerLM):
    raise ValueError(
        "attribution_patching needs an uncached TransformerLM, got"
        f" {type(model).__name__}.")
  names = check_points(names)
  if metric is not None and not callable(metric):
    raise ValueError(
        f"metric must be callable (logits -> scalar), got {metric!r}.")
  check_corrupt(corrupt, corrupted_tokens)
  tokens, axes, positions, lengths = pair_tokens(
      model, clean_tokens,
      clean_tokens if corrupted_tokens is None else corrupted_tokens)
  noise = None if corrupt is None else noise_layer(model, corrupt, tokens,
                                                   positions)
  check_metric(metric, model.config.vocab_size, tokens.named_shape["seq"])
  if metric is None and corrupted_tokens is None:
    metric = _traced_metric(model, tokens[{RUN_AXIS: 0}])
  elif metric is None:
    metric = _default_metric(model, tokens[{RUN_AXIS: 0}],
                             tokens[{RUN_AXIS: 1}])
  token_shape = {a: tokens.named_shape[a] for a in axes}
  probed = _probed(model, names, token_shape)
  if noise is not None:
    probed = points_lib.insert_at(probed, "embed", noise)
  probed = pz.freeze_params(probed)
  clean, corrupted, scores = _attribute(probed, tokens, positions,
                                        static_metric(metric), jnp.float32(1.0))
  check_finite_metric(metric, {
      "its value on the clean run": clean,
      "its value on the corrupted run": corrupted,
      **{f"its gradient at {n}": scores[n].data_array for n in names}})
  if "attn.head_out" in scores:
    scores["attn.head_out"] = _hugging_face_heads(
        model.config, scores["attn.head_out"])
  return AttributionResult(
      scores={n: scores[n] for n in names}, clean_metric=float(clean),
      corrupted_metric=float(corrupted), lengths=lengths)
