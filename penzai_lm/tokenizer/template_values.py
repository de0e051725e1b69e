"""Sizes of template values counted as trees, computed on their graphs.

A template can share references: forty ``{% set ns.x = [ns.x, ns.x] %}``
build a list of 41 objects that hashes, compares and prints as a tree of
2**40 leaves, so checking a value one level deep, or after printing it,
is too late. Each measure here is an upper bound computed by one walk over
the value's *graph*: iterative (any depth, no ``RecursionError``),
memoized by object identity (linear in the distinct objects, however
often they are shared), charging the budget's clock as it goes. A
reference back to an object being walked (a cycle, through a namespace)
counts as the few characters Python prints for it.

* `Unrolled`: items of every container plus characters of every string,
  each shared object counted every time it is reached: the cost of
  hashing, comparing or copying the value as a tree. Kept per rendering
  for values that cannot change (namespaces can), so checking each value
  a template builds costs about that value's own length.
* `text_size`: characters of ``str(value)`` (a container prints its
  ``repr``).
* `json_size`: characters of ``json.dumps(value, ...)`` with the given
  indent, separators and ``ensure_ascii``; indentation is counted per
  line and depth.
"""

from __future__ import annotations

import collections
import json
from typing import Any, Callable, Iterable

import jinja2
import jinja2.utils

__all__ = ["Unrolled", "json_size", "repr_size", "text_size"]

_CONTAINERS = (list, tuple, set, frozenset, dict, type({}.keys()),
               type({}.values()), type({}.items()))
# Strings longer than this are memoized (their escaped length costs a pass).
_SHORT = 64
# Escaped lengths of long strings are measured this many characters at a
# time, so measuring never holds more than a chunk's escaped copy.
_CHUNK = 1 << 16
_TICK_EVERY = 1024


def _namespace_attrs(value: Any) -> dict[str, Any]:
  return object.__getattribute__(value, "_Namespace__attrs")


def _walk(root: Any, leaf: Callable[[Any], Any],
          children: Callable[[Any], Iterable[Any] | None],
          combine: Callable[[Any, list[Any]], Any], cycle: Any,
          tick: Callable[[], None],
          known: Callable[[Any], Any] = lambda v: None,
          store: Callable[[Any, Any], None] = lambda v, r: None) -> Any:
  """Post-order walk of a value graph; see the module docstring.

  Args:
    root: The value.
    leaf: The measure of a value without children.
    children: A value's children (None for a leaf).
    combine: A container's measure from its children's measures.
    cycle: The measure of a reference back to a value being walked.
    tick: Called every `_TICK_EVERY` objects (raises past the deadline).
    known: A measure kept from an earlier walk, or None.
    store: Called with each container and its measure once computed.

  Returns:
    The root's measure.
  """
  memo: dict[int, tuple[Any, Any]] = {}  # id -> (value kept alive, measure)
  active: set[int] = set()  # Containers on the current path.
  stack: list[tuple[Any, list[Any] | None]] = [(root, None)]
  steps = 0
  while stack:
    value, kids = stack.pop()
    key = id(value)
    if kids is None:  # First visit.
      steps += 1
      if steps % _TICK_EVERY == 0:
        tick()
      if key in memo:
        continue
      measure = known(value)
      if measure is None:
        found = children(value)
        if found is not None:
          kids = list(found)
          active.add(key)
          stack.append((value, kids))
          stack.extend((k, None) for k in kids
                       if id(k) not in memo and id(k) not in active)
          continue
        measure = leaf(value)
      memo[key] = (value, measure)
      continue
    active.discard(key)  # Second visit: the children are measured.
    measure = combine(value, [memo[id(k)][1] if id(k) in memo else cycle
                              for k in kids])
    memo[key] = (value, measure)
    store(value, measure)
  return memo[id(root)][1]


def _items_of(value: Any) -> Iterable[Any] | None:
  """Children for the unrolled and text measures (dict keys included)."""
  if isinstance(value, (str, bytes)):
    return None
  if isinstance(value, (dict, type({}.items()))):
    pairs = value.items() if isinstance(value, dict) else value
    return [x for pair in pairs for x in pair]
  if isinstance(value, _CONTAINERS):
    return value
  if isinstance(value, jinja2.utils.Namespace):
    return [_namespace_attrs(value)]
  return None


class Unrolled:
  """`Unrolled` sizes (see the module docstring), kept for one rendering.

  Only containers without namespaces anywhere inside are kept (the
  sandbox's lists, tuples and dicts cannot change; namespaces can), and
  only large ones (small ones are cheap to walk again), at most
  ``max_kept`` of them, oldest dropped first.
  """

  def __init__(self, tick: Callable[[], None], max_kept: int = 1 << 14):
    self._tick = tick
    self._max_kept = max_kept
    self._kept: collections.OrderedDict[int, tuple[Any, int]] = (
        collections.OrderedDict())

  def __call__(self, value: Any) -> int:
    if isinstance(value, (str, bytes)):
      return len(value)
    if _items_of(value) is None:
      return self._leaf(value)[0]
    size, _ = _walk(value, self._leaf, _items_of, self._combine, (1, True),
                    self._tick, self._known, self._store)
    return size

  @staticmethod
  def _leaf(value: Any) -> tuple[int, bool]:
    if isinstance(value, (str, bytes, range)):
      return len(value), False
    if isinstance(value, int):  # Hashing and printing grow with its digits.
      return 1 + value.bit_length() // 16, False
    return 1, False

  @staticmethod
  def _combine(value: Any, kids: list[tuple[int, bool]]) -> tuple[int, bool]:
    mutable = isinstance(value, jinja2.utils.Namespace) or any(
        m for _, m in kids)
    return len(kids) + sum(s for s, _ in kids), mutable

  def _known(self, value: Any) -> tuple[int, bool] | None:
    kept = self._kept.get(id(value))
    if kept is not None and kept[0] is value:
      return kept[1], False
    return None

  def _store(self, value: Any, measure: tuple[int, bool]) -> None:
    size, mutable = measure
    if mutable or size < _SHORT:
      return
    self._kept[id(value)] = (value, size)
    if len(self._kept) > self._max_kept:
      self._kept.popitem(last=False)


def _repr_len(s: str | bytes) -> int:
  """``len(repr(s))``, or a little more (quotes of huge strings)."""
  if isinstance(s, bytes):
    return 4 * len(s) + 3
  if s.isprintable():  # Only quotes and backslashes are escaped.
    return len(s) + 2 + s.count("\\") + s.count("'")
  return 2 + s.count("'") + sum(len(repr(s[i:i + _CHUNK])) - 2
                                for i in range(0, len(s), _CHUNK))


def _int_len(value: int) -> int:
  return int(value.bit_length() * 0.30103) + 2


def _repr_leaf(value: Any) -> int:
  if isinstance(value, (str, bytes)):
    return _repr_len(value)
  if isinstance(value, bool) or value is None:
    return 5
  if isinstance(value, int):
    return _int_len(value)
  if isinstance(value, float):
    return len(repr(value))
  # Undefined, macros, loops, ranges, ...: short reprs of their own; a
  # caller's own object may print longer, and is checked once printed.
  return 64


_VIEW_PREFIX = {type({}.keys()): 13, type({}.values()): 15,
                type({}.items()): 14}


def _repr_combine(value: Any, kids: list[int]) -> int:
  n, total = len(kids), sum(kids)
  if isinstance(value, jinja2.utils.Namespace):
    return 12 + total
  if isinstance(value, (dict, type({}.items()))):
    pairs = n // 2  # "k: v" in a dict, "(k, v)" in an items view.
    total += 4 * pairs + 2 * max(pairs - 1, 0) + 2
  else:
    total += 2 * max(n - 1, 0) + 2 + (1 if n == 1 else 0)
  if isinstance(value, (set, frozenset)):
    total += 11
  return total + _VIEW_PREFIX.get(type(value), 0)


def text_size(value: Any, tick: Callable[[], None]) -> int:
  """At least ``len(str(value))``, computed without building it."""
  if isinstance(value, str):
    return len(value)
  if isinstance(value, jinja2.Undefined):
    return 0
  if _items_of(value) is None:
    return _repr_leaf(value)
  return _walk(value, _repr_leaf, _items_of, _repr_combine, 16, tick)


def repr_size(value: Any, tick: Callable[[], None]) -> int:
  """At least ``len(repr(value))`` and ``len(str(value))``."""
  if isinstance(value, (str, bytes)) or _items_of(value) is None:
    return _repr_leaf(value)
  return _walk(value, _repr_leaf, _items_of, _repr_combine, 16, tick)


def _json_str_len(s: str, ensure_ascii: bool) -> int:
  if s.isascii() and s.isprintable():
    return len(s) + 2 + s.count("\\") + s.count('"')
  return 2 + sum(len(json.dumps(s[i:i + _CHUNK], ensure_ascii=ensure_ascii))
                 - 2 for i in range(0, len(s), _CHUNK))


def json_size(value: Any, tick: Callable[[], None], *, indent: Any = None,
              separators: Any = None, ensure_ascii: bool = True) -> int:
  """At least ``len(json.dumps(value, ...))`` (0 if it would fail early).

  Args:
    value: The value.
    tick: Called as the walk goes (see `_walk`).
    indent: ``json.dumps``'s indent (a count of spaces or a string).
    separators: ``json.dumps``'s (item, key) separators.
    ensure_ascii: Whether non-ASCII characters are escaped.
  """
  if isinstance(indent, str):
    unit = len(indent)
  elif isinstance(indent, int):
    unit = max(indent, 0)
  else:
    unit = None  # One line (an invalid indent fails in json.dumps).
  try:
    item_sep, key_sep = (map(len, separators) if separators is not None
                         else (1 if unit is not None else 2, 2))
  except (TypeError, ValueError):
    return 0  # json.dumps rejects them.

  def leaf(v: Any) -> tuple[int, int]:
    if isinstance(v, str):
      return _json_str_len(v, ensure_ascii), 0
    if isinstance(v, float):
      return len(repr(v)), 0
    if isinstance(v, int) and not isinstance(v, bool):
      return _int_len(v), 0
    return 5, 0  # true, false, null; anything else fails in json.dumps.

  def key_len(k: Any) -> int:
    return leaf(k)[0] + (0 if isinstance(k, str) else 2)

  def children(v: Any) -> Iterable[Any] | None:
    if isinstance(v, dict):
      return v.values()
    return v if isinstance(v, (list, tuple)) else None

  def combine(v: Any, kids: list[tuple[int, int]]) -> tuple[int, int]:
    n = len(kids)
    # Each child's own lines are indented one level deeper here.
    chars = 2 + sum(c + (unit or 0) * lines for c, lines in kids)
    chars += item_sep * max(n - 1, 0)
    if isinstance(v, dict):
      chars += sum(key_len(k) + key_sep for k in v)
    lines = sum(lines for _, lines in kids)
    if unit is not None and n:
      chars += n * (1 + unit) + 1  # "\n" + indent before each item, "\n".
      lines += n + 1
    return chars, lines

  if children(value) is None:
    return leaf(value)[0]
  return _walk(value, leaf, children, combine, (4, 0), tick)[0]
