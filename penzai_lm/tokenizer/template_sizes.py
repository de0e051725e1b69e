"""Size estimates for `template_limits`: how large a value an operation
would build, computed from its operands before it runs.

Every estimate is cheap (linear in the operands' lengths, or in the
distinct objects of their graphs, at most) and raises through
``budget.check_size`` / ``budget.check_int`` (a `template_budget.Budget`)
when the value would be over the limit. Operands that are containers are
measured as trees (``budget.unrolled``) or as the text they print
(``budget.text_size``, `template_values.repr_size`), so shared references
do not hide their size.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from penzai_lm.tokenizer import template_values

__all__ = ["FILTER_SIZES", "STR_METHOD_SIZES", "check_binop", "check_format",
           "check_join", "is_sized", "size"]


def size(value: Any) -> int:
  """Characters or items a value holds, one level deep (cheap: O(len))."""
  if isinstance(value, (str, bytes)):
    return len(value)
  if isinstance(value, (list, tuple, set, frozenset, dict)):
    return len(value) + sum(len(v) for v in value
                            if isinstance(v, (str, bytes, list, tuple, dict)))
  return 0


def is_sized(value: Any) -> bool:
  return isinstance(value, (str, bytes, list, tuple))


def _int(value: Any) -> bool:
  return isinstance(value, int)


# A %-format spec, or a {}-format field (with one level of nested fields).
_FORMAT_SPECS = re.compile(r"%[^a-zA-Z%]*|\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}")
_FORMAT_NUMBERS = re.compile(r"(?<![A-Za-z_])\d+")


def check_format(budget: Any, fmt: Any, args: Any, what: str) -> None:
  """Widths and precisions in a format string stay under the size limit
  (``'%10000000000s' % x`` builds a 10 GB string), and so do arguments
  when the format takes its widths from them (``%*s``, ``{:{}}``), and
  the text of the arguments, each printed by every field at most."""
  if not isinstance(fmt, str):
    return
  specs = _FORMAT_SPECS.findall(fmt)
  for spec in specs:
    for number in _FORMAT_NUMBERS.findall(spec):
      budget.check_size(int(number) if len(number) < 20 else 1 << 64, what)
  values = list(args) if isinstance(args, (tuple, list)) else (
      [args, *args.values()] if isinstance(args, dict) else [args])
  if specs:
    biggest = max((template_values.repr_size(v, budget.tick)
                   for v in values), default=0)
    budget.check_size(len(fmt) + len(specs) * biggest, what)
  if not any("*" in spec or spec.count("{") > 1 for spec in specs):
    return
  for v in values:
    if _int(v):
      budget.check_size(abs(v), what)


def check_binop(budget: Any, op: str, left: Any, right: Any) -> None:
  what = f"the operator {op!r}"
  if op == "*":
    if _int(left) and _int(right):
      budget.check_int(left.bit_length() + right.bit_length(), what)
    elif _int(right) and is_sized(left):
      budget.check_size(max(right, 0) * max(budget.unrolled(left), 1), what)
    elif _int(left) and is_sized(right):
      budget.check_size(max(left, 0) * max(budget.unrolled(right), 1), what)
  elif op == "+":
    if is_sized(left) and is_sized(right):
      budget.check_size(budget.unrolled(left) + budget.unrolled(right), what)
  elif op == "**":
    if _int(left) and _int(right) and abs(left) > 1 and right > 0:
      budget.check_int(right * left.bit_length(), what)
  elif op == "%":
    check_format(budget, left, right, what)


def _replace_size(s: Any, old: Any, new: Any) -> int:
  """Most characters of ``s.replace(old, new)``."""
  if not isinstance(s, (str, bytes)) or not isinstance(new, (str, bytes)):
    return 0
  hits = len(s) // max(len(old), 1) + 1 if isinstance(old, (str, bytes)) else 0
  return len(s) + hits * len(new)


def _join_size(sep: Any, items: Any) -> int:
  if not isinstance(items, (list, tuple, str)):
    return 0
  return size(items) + len(items) * (len(sep) if is_sized(sep) else 0)


def check_join(budget: Any, items: Any, args: list[Any],
               kwargs: dict[str, Any], what: str) -> None:
  """The ``join`` filter prints every item, and the separator between."""
  if not isinstance(items, (list, tuple, dict, str)):
    return  # A generator is charged for its items as it yields them.
  sep = args[0] if args else kwargs.get("d", "")
  budget.check_size(budget.text_size(items) + len(items) * budget.text_size(
      sep), what)


def _width(value: Any) -> int:
  return value if _int(value) else (len(value) if is_sized(value) else 0)


# Pre-estimates (characters or items of the result) of the calls that can
# build far more than they are given: str methods by name, filters by name.
STR_METHOD_SIZES: dict[str, Callable[..., int]] = {
    "replace": lambda s, old=None, new=None, *_: _replace_size(s, old, new),
    "join": lambda s, items=(), *_: _join_size(s, items),
    "center": lambda s, width=0, *_: max(len(s), _width(width)),
    "ljust": lambda s, width=0, *_: max(len(s), _width(width)),
    "rjust": lambda s, width=0, *_: max(len(s), _width(width)),
    "zfill": lambda s, width=0, *_: max(len(s), _width(width)),
    "expandtabs": lambda s, tabsize=8, *_: len(s) + s.count(
        "\t" if isinstance(s, str) else b"\t") * max(_width(tabsize), 0),
    "translate": lambda s, table=None, *_: len(s) * (1 + max(
        (size(v) for v in table.values()), default=0)) if isinstance(
            table, dict) else len(s),
}
FILTER_SIZES: dict[str, Callable[..., int]] = {
    "replace": lambda s, old=None, new=None, *_: _replace_size(s, old, new),
    "center": lambda s, width=80, *_: size(s) + _width(width),
    "indent": lambda s, width=4, *_: size(s) + (
        s.count("\n") + 1 if isinstance(s, str) else 1) * _width(width),
    "wordwrap": lambda s, width=79, *a: size(s) * (1 + size(
        a[1] if len(a) > 1 and a[1] else "\n")) // max(_width(width), 1),
    "batch": lambda items, count=1, *_: size(items) + _width(count),
    "slice": lambda items, count=1, *_: size(items) + _width(count),
    "sum": lambda items, *_: sum(size(v) for v in items) if isinstance(
        items, (list, tuple)) else 0,
}
