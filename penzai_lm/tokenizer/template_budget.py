"""What one chat-template rendering may spend, and the errors it raises.

Every failure of a chat template is a `ChatTemplateError` (a
``ValueError``) whose message names the template's source (the file and
field it came from, when known) and what went wrong; one that went over a
limit is the subclass `TemplateLimitError`. A `Budget` holds a rendering's
`Limits` and what it has spent; `using_budget` makes it the current one,
which the sandbox's hooks (`template_limits`) and bounded filters
(`template_filters`) charge.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import time
from typing import Any

from penzai_lm.tokenizer import template_values

__all__ = ["Budget", "ChatTemplateError", "Limits", "TemplateLimitError",
           "current_budget", "using_budget"]


class ChatTemplateError(ValueError):
  """A chat template failed: it is too large, cannot be compiled, raised,
  or went over a rendering limit. The message names the template."""


class TemplateLimitError(ChatTemplateError):
  """A template went over a limit (size, time, iterations, output)."""


@dataclasses.dataclass(frozen=True)
class Limits:
  """Bounds on one rendering (compiling included).

  Attributes:
    max_chars: Most characters of the output, of all values output along
      the way (macros, ``set`` blocks; 4x this), and of any single value,
      counted as a tree (a value that holds another twice holds it twice)
      and as the text ``str``, ``tojson`` or ``pprint`` would print.
    max_iterations: Most loop iterations in all.
    timeout_s: Wall-clock seconds, compiling included.
    max_int_bits: Largest integer an operator may build.
    max_template_chars: Longest template source. The largest chat template
      we know of (GigaChat 3.5's, in llama.cpp's models/templates) is
      about 40,000 characters; compiling 128 KiB of jinja takes seconds.
  """

  max_chars: int = 1 << 20
  max_iterations: int = 1_000_000
  timeout_s: float = 5.0
  max_int_bits: int = 1 << 16
  max_template_chars: int = 128 << 10


class Budget:
  """What one rendering has spent; raises once a limit is passed."""

  def __init__(self, limits: Limits, source: str = "a chat template"):
    self.limits = limits
    self.source = source
    self.start = time.monotonic()
    self.deadline = self.start + limits.timeout_s
    self.iterations = 0
    self.output_chars = 0
    self.unrolled = template_values.Unrolled(self.tick)

  def fail(self, what: str) -> TemplateLimitError:
    return TemplateLimitError(
        f"Rendering {self.source} went over a limit: {what}. It was stopped"
        f" after {time.monotonic() - self.start:.2f} s; a chat template"
        " renders a prompt in milliseconds, so this one is broken or"
        " hostile.")

  def tick(self) -> None:
    if time.monotonic() > self.deadline:
      raise self.fail(f"it ran longer than {self.limits.timeout_s:g} s")

  def iteration(self, chars: int) -> None:
    self.iterations += 1
    if self.iterations > self.limits.max_iterations:
      raise self.fail(
          f"more than {self.limits.max_iterations:,} loop iterations")
    self.output(chars)

  def output(self, chars: int) -> None:
    """Charges output written anywhere (macros and blocks included)."""
    self.tick()
    self.output_chars += chars
    if self.output_chars > 4 * self.limits.max_chars:
      raise self.fail(
          f"more than {4 * self.limits.max_chars:,} characters output"
          " (macros and blocks included)")

  def check_size(self, n: int, what: str) -> None:
    if n > self.limits.max_chars:
      raise self.fail(f"{what} would build a value of {n:,} characters (or"
                      f" items), more than the limit of"
                      f" {self.limits.max_chars:,}")

  def check_int(self, bits: int, what: str) -> None:
    if bits > self.limits.max_int_bits:
      raise self.fail(f"{what} would build an integer of about {bits:,}"
                      f" bits, more than {self.limits.max_int_bits:,}")

  def check_value(self, value: Any, what: str) -> None:
    """Refuses a value larger than the limit counted as a tree."""
    self.check_size(self.unrolled(value), what)

  def text_size(self, value: Any) -> int:
    """At least ``len(str(value))`` (see `template_values.text_size`)."""
    return template_values.text_size(value, self.tick)

  def check_source(self, source: str) -> None:
    if len(source) > self.limits.max_template_chars:
      raise self.fail(
          f"its source is {len(source):,} characters long, more than the"
          f" limit of {self.limits.max_template_chars:,} (the largest real"
          " chat templates have about 40,000)")


_BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar(
    "penzai_lm_template_budget", default=None)


@contextlib.contextmanager
def using_budget(budget: Budget):
  """Charges what templates do in this block (compiling and rendering, in
  this thread or task) to ``budget``."""
  token = _BUDGET.set(budget)
  try:
    yield budget
  finally:
    _BUDGET.reset(token)


def current_budget() -> Budget:
  """The rendering's budget (a default one outside `using_budget`, e.g.
  while jinja folds constants outside a rendering)."""
  budget = _BUDGET.get()
  return budget if budget is not None else Budget(Limits())


def current_budget_or_none() -> Budget | None:
  return _BUDGET.get()
