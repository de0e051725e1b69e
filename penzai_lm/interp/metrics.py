"""Metrics of patching and attribution: a run's logits -> one number.

`LogitDiff` (the logit difference of two answers) and `AnswerProb` (the
probability of one answer, causal tracing's measure) average over any
batch axes. Equal instances hash alike, so reusing one across sweeps
reuses their compiled programs; `static_metric` makes any other callable
a static argument of ``jax.jit`` (by identity).
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
from penzai import pz


@dataclasses.dataclass(frozen=True)
class LogitDiff:
  """Metric: ``logit[answer] - logit[wrong]`` at one token position.

  Averaged over any batch axes (a batch of prompts with the same answers).
  Equal instances hash alike, so reusing one across sweeps reuses their
  compiled programs.

  Attributes:
    answer: Token id of the clean answer (e.g. " Paris").
    wrong: Token id of the corrupted answer (e.g. " Rome").
    position: The ``seq`` index read (default -1, the last token).
  """

  answer: int
  wrong: int
  position: int = -1

  def __post_init__(self):
    for name in ("answer", "wrong", "position"):
      value = getattr(self, name)
      if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"LogitDiff.{name} must be an int, got {value!r}.")
      object.__setattr__(self, name, int(value))

  def __call__(self, logits: pz.nx.NamedArray):
    at = logits[{"seq": self.position}]
    diff = (at[{"vocabulary": self.answer}]
            - at[{"vocabulary": self.wrong}])
    return jnp.mean(diff.unwrap(*diff.named_shape))


@dataclasses.dataclass(frozen=True)
class AnswerProb:
  """Metric: the probability of ``answer`` at one position, averaged over
  any batch axes (and noise samples): causal tracing's measure.

  Attributes:
    answer: Token id of the answer (e.g. " Paris").
    position: The ``seq`` index read (default -1, the last token).
  """

  answer: int
  position: int = -1

  def __post_init__(self):
    for name in ("answer", "position"):
      value = getattr(self, name)
      if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"AnswerProb.{name} must be an int, got {value!r}.")
      object.__setattr__(self, name, int(value))

  def __call__(self, logits: pz.nx.NamedArray):
    at = logits[{"seq": self.position}]
    probs = pz.nx.nmap(jax.nn.softmax)(at.untag("vocabulary")).tag(
        "vocabulary")
    p = probs[{"vocabulary": self.answer}]
    return jnp.mean(p.unwrap(*p.named_shape))


class ByIdentity:
  """Wraps an unhashable metric for jit's static arguments."""

  def __init__(self, fn):
    self.fn = fn

  def __hash__(self):
    return id(self.fn)

  def __eq__(self, other):
    return isinstance(other, ByIdentity) and other.fn is self.fn

  def __call__(self, *args):
    return self.fn(*args)


def static_metric(metric):
  """``metric`` as a static argument of ``jax.jit`` (hashed by identity
  when it cannot be hashed)."""
  try:
    hash(metric)
  except TypeError:
    return ByIdentity(metric)
  return metric


def scalar(out) -> jax.Array:
  """A metric's output as a float32 scalar (an error for anything else)."""
  if isinstance(out, pz.nx.NamedArrayBase):
    if out.named_shape or out.positional_shape:
      raise ValueError(
          "the metric must return a scalar per run; it returned a named"
          f" array with axes {dict(out.named_shape)} and positional shape"
          f" {out.positional_shape} (reduce the batch axes, e.g. a mean).")
    out = out.unwrap()
  try:
    out = jnp.asarray(out)
  except TypeError as e:
    raise ValueError(
        "the metric must return a scalar (a float or 0-d array), got"
        f" {type(out).__name__}.") from e
  if out.shape:
    raise ValueError(
        f"the metric must return a scalar per run, got shape {out.shape}"
        " (reduce the batch axes, e.g. a mean).")
  if not jnp.issubdtype(out.dtype, jnp.number) or jnp.issubdtype(
      out.dtype, jnp.complexfloating):
    raise ValueError(f"the metric must return a real number, got dtype"
                     f" {out.dtype}.")
  return out.astype(jnp.float32)


def row_metric(metric, axes):
  """``metric`` of one run's logits given as a raw array over ``axes``."""
  return lambda data: scalar(metric(pz.nx.wrap(data).tag(*axes)))
