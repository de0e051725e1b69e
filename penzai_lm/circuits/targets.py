"""Attribution targets: which logit nodes a graph explains (circuit-tracer
0.5's ``attribution_targets``).

`check_targets` checks `attribute`'s ``attribution_targets`` before the
forward pass; `resolve_targets` turns them into `LogitTargets`: per target
node a graph id, a probability (its weight in pruning and influence), a
label and a logit-space cotangent ``c`` (``[V]``, float32): the target is
``c . logits`` at the last position, the logits before any final soft-cap
(`penzai_lm.circuits.replacement`). Three kinds:

* None: the salient logits (`salient_logits`), demeaned: the cotangent
  ``c = one_hot(id) - 1 / V``, the target ``logit[id] - mean(logits)``;
* token ids (a 1-D sequence or array of ints): those tokens' demeaned
  logits, in the order given, with their softmax probabilities at the last
  position (from the model's own logits, soft-capped if it caps them);
* custom targets (`CustomTarget`): ``c = target.vector`` as given (not
  demeaned), with the probability given; graph id ``V + i`` for the
  ``i``-th (a virtual id, as circuit-tracer's) and the target's label.

Token strings are not taken (penzai_lm's circuits take token ids:
tokenize first).
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class CustomTarget:
  """A custom attribution target: ``vector . logits`` at the last position.

  circuit-tracer 0.5's ``CustomTarget(token_str, prob, vec)`` takes ``vec``
  in the residual stream (``d_model``, an unembedding direction); this one
  takes a logit-space ``vector`` (``[V]``): the same target as
  circuit-tracer's with ``vec = W_U^T @ vector`` (``W_U`` the
  ``[V, d_model]`` unembedding; ``W_U @ vector`` with TransformerLens'
  ``[d_model, V]`` ``W_U``), e.g. ``one_hot(x) - one_hot(y)`` for
  ``logit(x) - logit(y)``. Like circuit-tracer's, the vector is used as
  given (not demeaned).

  Attributes:
    label: The node's label (circuit-tracer's ``token_str``), shown by the
      Neuronpedia export and the graph page.
    vector: ``[V]`` real logit-space direction (V: the model's logit
      count).
    probability: The node's weight in pruning and influence (circuit-
      tracer's ``prob``): any finite real number, as circuit-tracer takes
      any int or float (it also takes NaN and infinities; these are
      refused here, since they make every influence NaN).
  """

  label: str
  vector: np.ndarray
  probability: float


@dataclasses.dataclass(frozen=True)
class LogitTargets:
  """The resolved logit targets of a graph.

  Attributes:
    ids: ``[K]`` int32 graph ids: token ids, or ``V + i`` for the ``i``-th
      custom target.
    probabilities: ``[K]`` float32 weights.
    labels: ``K`` labels, ``""`` for token targets.
    cotangents: ``[K, V]`` float32 logit-space directions (module
      docstring).
  """

  ids: np.ndarray
  probabilities: np.ndarray
  labels: tuple[str, ...]
  cotangents: np.ndarray


def salient_logits(logits: np.ndarray, max_n_logits: int,
                   desired_logit_prob: float
                   ) -> tuple[np.ndarray, np.ndarray]:
  """``(token ids, probabilities)`` of the most probable tokens, in
  decreasing probability, until their total reaches ``desired_logit_prob``
  (the token reaching it included), at most ``max_n_logits``."""
  probs = _softmax(logits)
  top = np.argsort(-probs, kind="stable")[:max_n_logits]
  cumulative = np.cumsum(probs[top], dtype=np.float32)
  cutoff = int(np.searchsorted(cumulative, np.float32(desired_logit_prob))) + 1
  top = top[:cutoff]
  return top.astype(np.int32), probs[top].astype(np.float32)


def resolve_targets(attribution_targets, logits: np.ndarray,
                    max_n_logits: int, desired_logit_prob: float
                    ) -> LogitTargets:
  """The `LogitTargets` of ``attribution_targets`` (module docstring).

  Args:
    attribution_targets: None, token ids, or a sequence of `CustomTarget`.
    logits: ``[V]`` the model's logits at the last position (soft-capped
      if it caps them): the token targets' probabilities.
    max_n_logits, desired_logit_prob: `salient_logits`'s (None only).

  Raises:
    TypeError: for strings, a sequence that mixes kinds or holds
      something else, or a custom target whose label is not a str or
      whose probability is not a real number; naming the argument.
    ValueError: for empty targets, ids out of the vocabulary or repeated
      (circuit-tracer does not check repeats), a custom vector of the
      wrong shape or not finite, or a probability that is not finite.
  """
  vocab = logits.shape[0]
  checked = check_targets(attribution_targets, vocab)
  if checked is None:
    ids, probs = salient_logits(logits, max_n_logits, desired_logit_prob)
    return _token_targets(ids, probs, vocab)
  if isinstance(checked, LogitTargets):
    return checked
  return _token_targets(checked, _softmax(logits)[checked].astype(
      np.float32), vocab)


def check_targets(attribution_targets, vocab: int
                  ) -> np.ndarray | LogitTargets | None:
  """``attribution_targets`` checked against a ``vocab``-token vocabulary
  (before any forward pass): None, the token ids (``[K]`` int32), or the
  custom targets' `LogitTargets`.

  Raises:
    TypeError, ValueError: as `resolve_targets`.
  """
  if attribution_targets is None:
    return None
  items = _as_items(attribution_targets)
  if all(isinstance(t, CustomTarget) for t in items):
    return _custom_targets(items, vocab)
  return _token_ids(items, vocab)


def _softmax(logits: np.ndarray) -> np.ndarray:
  shifted = logits - logits.max()
  return np.exp(shifted) / np.exp(shifted).sum()


def _token_targets(ids: np.ndarray, probs: np.ndarray,
                   vocab: int) -> LogitTargets:
  cotangents = np.full((len(ids), vocab), -1.0 / vocab, np.float32)
  cotangents[np.arange(len(ids)), ids] += 1.0
  return LogitTargets(ids.astype(np.int32), probs.astype(np.float32),
                      ("",) * len(ids), cotangents)


def _as_items(attribution_targets) -> list:
  """The targets as a non-empty list, strings refused."""
  if isinstance(attribution_targets, (str, bytes, CustomTarget)):
    raise TypeError(
        "attribution_targets must be None, a sequence of token ids or a"
        " sequence of circuits.CustomTarget, got"
        f" {type(attribution_targets).__name__}; token strings are not"
        " taken: tokenize them and pass the ids.")
  if isinstance(attribution_targets, np.ndarray) or hasattr(
      attribution_targets, "__array__"):
    array = np.asarray(attribution_targets)
    if array.ndim != 1:
      raise ValueError("attribution_targets must be 1-D token ids, got an"
                       f" array of shape {array.shape}.")
    items = array.tolist()
  elif isinstance(attribution_targets, Sequence):
    items = list(attribution_targets)
  else:
    raise TypeError(
        "attribution_targets must be None, a sequence of token ids or a"
        " sequence of circuits.CustomTarget, got"
        f" {type(attribution_targets).__name__}.")
  if not items:
    raise ValueError("attribution_targets is empty; give at least one"
                     " target, or None for the salient logits.")
  if any(isinstance(t, (str, bytes)) for t in items):
    raise TypeError("attribution_targets holds strings; penzai_lm.circuits"
                    " takes token ids (tokenize first: tokenizer.encode)"
                    " or circuits.CustomTarget.")
  return items


def _token_ids(items: list, vocab: int) -> np.ndarray:
  for t in items:
    if not isinstance(t, (int, np.integer)) or isinstance(t, bool):
      raise TypeError(
          "attribution_targets must be all token ids (ints) or all"
          f" circuits.CustomTarget, got an element {t!r} of type"
          f" {type(t).__name__}.")
  ids = np.array([int(t) for t in items], np.int64)
  bad = ids[(ids < 0) | (ids >= vocab)]
  if bad.size:
    raise ValueError(f"attribution_targets ids {bad.tolist()} are outside"
                     f" the model's vocabulary [0, {vocab}).")
  unique, counts = np.unique(ids, return_counts=True)
  if (counts > 1).any():
    raise ValueError("attribution_targets repeats the ids"
                     f" {unique[counts > 1].tolist()}; give each once.")
  return ids.astype(np.int32)


def _custom_targets(items: list, vocab: int) -> LogitTargets:
  vectors, probs, labels = [], [], []
  for i, t in enumerate(items):
    where = f"attribution_targets[{i}]"
    if not isinstance(t.label, str):
      raise TypeError(f"{where}.label must be a str, got"
                      f" {type(t.label).__name__}.")
    p = t.probability
    if (not isinstance(p, (int, float, np.integer, np.floating))
        or isinstance(p, bool)):
      raise TypeError(f"{where}.probability must be a real number (the"
                      f" node's weight), got {type(p).__name__} {p!r}.")
    if not math.isfinite(float(p)):
      raise ValueError(f"{where}.probability must be a finite real number"
                       f" (the node's weight), got {p!r}.")
    try:
      vector = np.asarray(t.vector, np.float32)
    except (TypeError, ValueError) as e:
      raise TypeError(f"{where}.vector must be a real [V] array: {e}") from e
    if vector.shape != (vocab,):
      raise ValueError(
          f"{where}.vector has shape {vector.shape}; it must be [{vocab}]"
          " (a logit-space direction over the model's vocabulary; for"
          " circuit-tracer's d_model vec, solve vec = W_U^T @ vector).")
    if not np.isfinite(vector).all():
      raise ValueError(f"{where}.vector is not finite.")
    vectors.append(vector)
    probs.append(float(p))
    labels.append(t.label)
  return LogitTargets(vocab + np.arange(len(items), dtype=np.int32),
                      np.array(probs, np.float32), tuple(labels),
                      np.stack(vectors))
