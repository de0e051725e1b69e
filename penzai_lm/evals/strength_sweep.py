"""Scoring several strengths of one intervention as rows of one batch.

``sweep(lm, pairs, strengths, intervene)`` answers the loglikelihood
requests ``pairs`` (lm-eval's ``(context, continuation)``) once per
strength, e.g. a steering vector at strengths 0, 2, 4, 8::

    result = sweep(LM(model, tokenizer), pairs, [0, 2, 4, 8],
                   lambda m, s: insert_at(m, "blocks.3.resid_post",
                                          AddVector.build(vector, s)))
    result.loglikelihoods  # (strengths, pairs)

Instead of one model (and one pass over the requests) per strength, each
batch holds every strength of a few requests: row ``k * P + p`` is request
``p`` of the batch at ``strengths[k]``. ``intervene(model, row_strengths)``
builds the model once per batch with a strength per row of the ``batch``
axis (a list, as `AddVector.build`, `FeatureEdit.clamp` and the other
interventions take one); strengths are data, so new strengths run the same
compiled program.

Requests are encoded and scored as `LM.loglikelihood` does (the same
context/continuation split, prefix token and ``max_length`` truncation),
so ``loglikelihoods[k]`` equals ``LM(intervene(model, [strengths[k]] *
rows), ...).loglikelihood(pairs)``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import numpy as np

from penzai_lm.evals.scoring import score_rows


@dataclasses.dataclass(frozen=True)
class SweepResult:
  """The outcome of `sweep`.

  Attributes:
    strengths: The strengths, in the order given.
    loglikelihoods: float64 ``(strengths, pairs)``: the continuation's
      summed log-probability of each request at each strength.
    greedy: bool ``(strengths, pairs)``: whether every continuation token
      was the model's top prediction.
  """

  strengths: tuple[float, ...]
  loglikelihoods: np.ndarray
  greedy: np.ndarray


def _check_strengths(strengths) -> tuple[float, ...]:
  if isinstance(strengths, (str, bytes)) or not isinstance(
      strengths, Sequence):
    raise ValueError(f"strengths must be a list of numbers, got"
                     f" {strengths!r}.")
  bad = [s for s in strengths if isinstance(s, bool) or not isinstance(
      s, numbers.Real) or not math.isfinite(s)]
  if not strengths or bad:
    raise ValueError(f"strengths must be one or more finite numbers, got"
                     f" {list(strengths)!r}.")
  return tuple(float(s) for s in strengths)


def _pairs(requests) -> list[tuple[str, str]]:
  pairs = [getattr(r, "args", r) for r in requests]
  for pair in pairs:
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2
            and all(isinstance(t, str) for t in pair)):
      raise ValueError(
          "pairs must be (context, continuation) strings or lm-eval"
          f" loglikelihood Instances, got {pair!r}.")
  if not pairs:
    raise ValueError("pairs is empty: give at least one (context,"
                     " continuation) request.")
  return [tuple(p) for p in pairs]


def sweep(lm, pairs, strengths: Sequence[float],
          intervene: Callable[[Any, list[float]], Any]) -> SweepResult:
  """Scores ``pairs`` at every strength, the strengths as rows of each
  batch (module docstring).

  Args:
    lm: A `penzai_lm.evals.LM` over the model without the intervention:
      its tokenizer, ``batch_size``, ``max_length`` and engine are used.
    pairs: ``(context, continuation)`` strings, or lm-eval
      ``loglikelihood`` Instances.
    strengths: One or more finite numbers.
    intervene: ``intervene(model, row_strengths) -> model``: ``model``
      with the intervention at the strength of each row of the ``batch``
      axis (``row_strengths`` has one float per row).

  Returns:
    A `SweepResult`. Each batch is every strength of ``max(1, batch_size
    // len(strengths))`` requests (longest first; the last batch repeats
    its last request to keep one shape).

  Raises:
    ValueError: for no or malformed pairs, no or non-finite strengths, an
      ``intervene`` that is not callable.
  """
  strengths = _check_strengths(strengths)
  pairs = _pairs(pairs)
  if not callable(intervene):
    raise ValueError(f"intervene must be callable (model, row strengths) ->"
                     f" model, got {intervene!r}.")
  encoded = [lm.encode_request(c, t) for c, t in pairs]
  rows = [(ctx + cont)[-(lm.max_length + 1):] for ctx, cont in encoded]
  order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
  per_batch = max(1, lm.batch_size // len(strengths))
  scores = np.zeros((len(strengths), len(rows)))
  greedy = np.zeros((len(strengths), len(rows)), bool)
  for start in range(0, len(order), per_batch):
    chunk = order[start:start + per_batch]
    filled = chunk + [chunk[-1]] * (per_batch - len(chunk))
    model = intervene(lm.model, [s for s in strengths for _ in filled])
    scored = score_rows(model, [rows[i] for _ in strengths for i in filled],
                        engine=lm.engine)
    for k in range(len(strengths)):
      for j, i in enumerate(chunk):
        logprobs, top = scored[k * per_batch + j]
        n = len(encoded[i][1])
        tail = max(0, len(logprobs) - n)  # All of it when truncated.
        scores[k, i] = float(logprobs[tail:].sum())
        greedy[k, i] = bool(top[tail:].all())
  return SweepResult(strengths=strengths, loglikelihoods=scores,
                     greedy=greedy)
