"""Feature attribution: which features of a spliced autoencoder move a metric.

`feature_attribution(model, tokens, point, metric)` runs the spliced model
once forward and once backward, in one compiled call, and returns per row,
token and feature:

* ``activations``: the feature activations ``f``;
* ``gradients``: ``d metric / d f``;
* ``attributions``: ``f * d metric / d f``, the first-order estimate of how
  much the metric drops when the feature is zeroed at that token
  (attribution patching on features, as circuit-tracer's and
  Marks et al.'s "indirect effect" estimates).

The gradient flows through the splice's error-term path: the splice adds
``(f_edited - f) @ w_dec`` to the model's own value, so ``d metric / d f`` is
the decoder row dotted with the gradient at the point, the model left
exactly as it runs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.interp.activation_cache import token_batch
from penzai_lm.interp.metric_checks import check_finite_metric
from penzai_lm.interp.metric_checks import check_metric
from penzai_lm.interp.metric_checks import metric_scalar
from penzai_lm.model import points as points_lib
from penzai_lm.model.stateless import stateless_call
from penzai_lm.model.transformer import positions_from_padding
from penzai_lm.runtime.shared_traces import share_block_traces
from penzai_lm.sae.autoencoder import FEATURES


@pz.pytree_dataclass
class _AddDelta(pz.nn.Layer):
  """Adds a zero-valued ``delta`` (whose gradient is the attribution)."""

  delta: pz.nx.NamedArray

  def __call__(self, f, /, **_side_inputs):
    return f + self.delta.astype(f.dtype)


@dataclasses.dataclass(frozen=True)
class FeatureAttribution:
  """The result of `feature_attribution`.

  Attributes:
    activations: ``(batch, seq, features)`` float32 (left-padded rows).
    gradients: ``d metric / d activations``, same shape.
    attributions: ``activations * gradients``.
    metric: The metric's value.
    lengths: Real tokens per row (rows are left-padded to the longest).
  """

  activations: np.ndarray
  gradients: np.ndarray
  attributions: np.ndarray
  metric: float
  lengths: tuple[int, ...]

  def top(self, n: int = 10, row: int = 0) -> list[tuple[int, int, float]]:
    """The ``n`` largest attributions of a row by magnitude, as
    ``(token index counted from the row's first real token, feature,
    attribution)``.

    Raises:
      ValueError: for ``n`` not an int >= 1, or a row that does not exist.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
      raise ValueError(f"n must be an int >= 1 (how many attributions),"
                       f" got {n!r}.")
    rows = len(self.lengths)
    if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or (
        not 0 <= row < rows):
      raise ValueError(f"row {row!r} does not exist: the attribution has"
                       f" {rows} row(s) (0-{rows - 1}).")
    pad = self.attributions.shape[1] - self.lengths[row]
    values = self.attributions[row, pad:]
    order = np.argsort(-np.abs(values), axis=None)[:n]
    return [(int(i // values.shape[1]), int(i % values.shape[1]),
             float(values.flat[i])) for i in order]


def feature_attribution(model, tokens, point: str,
                        metric: Callable[[pz.nx.NamedArray], jax.Array],
                        ) -> FeatureAttribution:
  """Gradients and attributions of a metric with respect to features.

  Args:
    model: A `TransformerLM` with an autoencoder spliced in
      (`penzai_lm.sae.splice`).
    tokens: One list of ids, a (ragged) list of lists, or a named array with
      ``seq`` (and batch axes).
    point: The features point, e.g. ``"blocks.6.resid_post.sae.features"``.
    metric: A function of the logits (``batch``, ``seq``, ``vocabulary``)
      returning a scalar, e.g. `penzai_lm.interp.LogitDiff`.

  Returns:
    A `FeatureAttribution`.

  Raises:
    ValueError: for a point that is not a splice's features point, a
      metric that is not callable, a `LogitDiff` outside the vocabulary or
      the tokens, or a metric (or gradient) that is NaN or inf.
    TypeError: for a metric returning something other than numbers.
  """
  if not callable(metric):
    raise ValueError(
        f"metric must be callable (logits -> scalar), got {metric!r}.")
  parsed = points_lib.parse_point(model, point)
  if not parsed.point.endswith(".features"):
    raise ValueError(f"{point!r} is not an autoencoder's features point"
                     " ('blocks.{i}.P.NAME.features', added by"
                     " penzai_lm.sae.splice).")
  hook = next(h for h in points_lib.hook_points(model, parsed.point)
              .get_sequence() if int(h.layer.data_array) == parsed.layer)
  width = dict(hook.value_axes)[FEATURES]
  ids, padding, lengths = token_batch(model, tokens)
  positions = None if padding is None else positions_from_padding(padding)
  if "batch" not in ids.named_shape:
    ids = pz.nx.stack([ids], "batch")
    positions = None if positions is None else pz.nx.stack([positions],
                                                           "batch")
  check_metric(metric, model.config.vocab_size, ids.named_shape["seq"])
  shape = {**ids.named_shape, FEATURES: width}
  side = {} if positions is None else {"token_positions": positions}
  recorded = pz.StateVariable(pz.nx.zeros(shape, jnp.float32),
                              label="feature_attribution")
  probe = points_lib.insert_at(
      model, point, pz.nn.Sequential([_Record(recorded),
                                      _AddDelta(pz.nx.zeros(shape))]),
      after_hook=True)
  stateless, variables = pz.unbind_state_vars(probe, freeze=True)
  total, saved, grad = _attribute(stateless, variables, ids, side,
                                  metric=metric)
  axes = ("batch", "seq", FEATURES)
  values = np.asarray(saved.unwrap(*axes))
  grads = np.asarray(grad.unwrap(*axes))
  check_finite_metric(metric, {"its value": total,
                               "its gradient at the features": grads})
  return FeatureAttribution(activations=values, gradients=grads,
                            attributions=values * grads, metric=float(total),
                            lengths=tuple(lengths))


@pz.pytree_dataclass
class _Record(pz.nn.Layer):
  """Saves the features (before the delta) into a state variable."""

  saved: pz.StateVariable

  def __call__(self, f, /, **_side_inputs):
    self.saved.value = f.astype(jnp.float32)
    return f


@functools.partial(jax.jit, static_argnames=("metric",))
def _attribute(stateless, variables, ids, side, *, metric):
  """metric, features and d metric / d features in one program (the
  metric is static: equal metrics, e.g. equal `LogitDiff`s, share it)."""
  (delta,) = [layer.delta for layer in pz.select(stateless)
              .at_instances_of(_AddDelta).get_sequence()]

  def loss(delta):
    model = share_block_traces(pz.select(stateless).at_instances_of(
        _AddDelta).apply(lambda _: _AddDelta(delta)))
    logits, new_vars = stateless_call(model, variables, ids, **side)
    (saved,) = [v for v in new_vars if v.label == "feature_attribution"]
    return metric_scalar(metric, metric(logits)), saved.value

  (total, saved), grad = jax.value_and_grad(loss, has_aux=True)(delta)
  return total, saved, grad
