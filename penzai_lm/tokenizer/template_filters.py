"""Serializing filters whose output is bounded before it is built.

``tojson`` and ``pprint`` print a whole value graph: a list that shares
its items prints exponentially many of them, and indentation multiplies
with depth (``tojson(indent=3000)`` of a value 900 levels deep prints
over a billion spaces). Both measure what they would print first
(`template_values`) and refuse with `template_budget.TemplateLimitError`
past the rendering's size limit; ``pprint``, pure Python and quadratic in
depth, also charges the clock for every object it formats and every chunk
it writes. Their output equals ``json.dumps`` (as transformers'
``tojson`` calls it) and ``pprint.pformat`` (as jinja's ``pprint`` does).
"""

from __future__ import annotations

import json
import pprint as pprint_lib
from typing import Any

from penzai_lm.tokenizer import template_budget
from penzai_lm.tokenizer import template_values

__all__ = ["pprint", "tojson"]


def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
           separators: Any = None, sort_keys: bool = False) -> str:
  """``json.dumps`` with transformers' defaults, bounded in size."""
  budget = template_budget.current_budget()
  what = "the filter 'tojson'"
  if isinstance(indent, int):
    # json.dumps builds the indent string before looking at the value.
    budget.check_size(indent, "the indent of " + what)
  budget.check_size(template_values.json_size(
      value, budget.tick, indent=indent, separators=separators,
      ensure_ascii=bool(ensure_ascii)), what)
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                    separators=separators, sort_keys=sort_keys)


class _Output:
  """pformat's stream: counts what is written and stops past the limit."""

  def __init__(self, budget: template_budget.Budget):
    self._budget = budget
    self._parts: list[str] = []
    self._chars = 0

  def write(self, text: str) -> None:
    self._budget.tick()
    self._chars += len(text)
    self._budget.check_size(self._chars, "the output of the filter 'pprint'")
    self._parts.append(text)

  def getvalue(self) -> str:
    return "".join(self._parts)


class _BoundedPrinter(pprint_lib.PrettyPrinter):
  """`pprint.PrettyPrinter` that charges the budget for its work."""

  def __init__(self, budget: template_budget.Budget):
    super().__init__()
    self._budget = budget
    self._formatted = 0

  def format(self, obj, context, maxlevels, level):
    # Called for every object, again at every level it is nested in.
    self._budget.tick()
    self._formatted += 1
    if self._formatted > self._budget.limits.max_iterations:
      raise self._budget.fail(
          f"the filter 'pprint' formatted more than"
          f" {self._budget.limits.max_iterations:,} objects")
    return super().format(obj, context, maxlevels, level)

  def pformat(self, obj) -> str:
    out = _Output(self._budget)
    self._format(obj, out, 0, 0, {}, 0)
    return out.getvalue()


def pprint(value: Any) -> str:
  """``pprint.pformat(value)`` (jinja's ``pprint``), bounded."""
  budget = template_budget.current_budget()
  # Every subtree's repr is built while formatting: bound the largest.
  budget.check_size(template_values.text_size(value, budget.tick),
                    "the filter 'pprint'")
  return _BoundedPrinter(budget).pformat(value)
