"""Checks of the metrics that attribution differentiates
(`penzai_lm.interp.attribution_patching`,
`penzai_lm.sae.feature_attribution`): a `LogitDiff` inside the vocabulary
and the prompts, an output that is a number, a value and a gradient that
are finite. Each is a clear error naming the metric, where the traced
program would otherwise clamp an index or return NaN scores silently.
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import numpy as np
from penzai import pz

from penzai_lm.interp.metrics import AnswerProb
from penzai_lm.interp.metrics import LogitDiff
from penzai_lm.interp.metrics import scalar


def _metric_name(metric) -> str:
  return getattr(metric, "__qualname__", None) or repr(metric)


def check_metric(metric, vocab: int, seq: int) -> None:
  """Checks a `LogitDiff`'s (or `AnswerProb`'s) token ids against the vocabulary and its
  position against the prompts' ``seq`` tokens (indexing under ``jax.jit``
  would clamp them silently).

  Raises:
    ValueError: naming the field, its value and the valid range.
  """
  if not isinstance(metric, (LogitDiff, AnswerProb)):
    return
  name = type(metric).__name__
  for field in ("answer", "wrong"):
    token = getattr(metric, field, 0)
    if not 0 <= token < vocab:
      raise ValueError(f"{name}.{field}={token} is outside the model's"
                       f" vocabulary [0, {vocab}).")
  if not -seq <= metric.position < seq:
    raise ValueError(f"{name}.position={metric.position} is outside the"
                     f" prompts' {seq} tokens ({-seq} to {seq - 1}).")


def metric_scalar(metric, out) -> jax.Array:
  """``metric``'s output ``out`` as a float32 scalar.

  Raises:
    TypeError: for an output that is not a number or array (a string,
      None, ...), naming the metric.
    ValueError: for an array that is not a scalar.
  """
  if isinstance(out, (bool, np.bool_)) or not isinstance(
      out, (numbers.Number, np.generic, np.ndarray, jax.Array,
            pz.nx.NamedArrayBase)):
    raise TypeError(f"the metric {_metric_name(metric)} must return a scalar"
                    " number (a float, a 0-d array or named array), got"
                    f" {type(out).__name__}.")
  return scalar(out)


def check_finite_metric(metric, values: dict[str, Any]) -> None:
  """Raises unless every array of ``values`` (``{what: metric value or
  gradient}``) is finite.

  Raises:
    ValueError: naming the metric, what is not finite and how much of it.
  """
  for what, value in values.items():
    array = np.asarray(value)
    bad = int((~np.isfinite(array)).sum())
    if bad:
      shown = f" is {float(array)}" if not array.ndim else (
          f" holds {bad} NaN or inf value(s) of {array.size}")
      raise ValueError(
          f"the metric {_metric_name(metric)}: {what}{shown}. Attribution"
          " needs a metric finite on both runs, with a finite gradient.")
