"""A safe arithmetic calculator tool and a parser for its call markers.

Conventions: expressions and results are plain ``str``; the generation engine
decodes the tokens between the call markers to text, calls
:meth:`ToolCallParser.respond`, and tokenizes the returned text (output
markers included) into forced tokens, as nanochat's engine does.

Safety: the expression is parsed with ``ast.parse(..., mode="eval")`` and the
tree is walked by a small interpreter that knows only int/float literals,
unary ``+``/``-``, binary ``+ - * / // % **`` and parentheses; anything else
raises :class:`CalculatorError` naming what is not allowed. User text is
never passed to ``eval``, ``exec`` or ``compile``.

Why no wall-time guard is needed: all sizes are bounded before any work is
done. The expression has at most ``MAX_EXPRESSION_CHARS`` characters, so at
most ~100 operations; every integer (literal or intermediate) is checked to
have at most ``MAX_INT_DIGITS`` digits, and a power is refused *before* it is
computed when ``|exponent| > MAX_EXPONENT`` or when its integer result would
exceed ``MAX_INT_DIGITS`` digits (estimated as ``exponent * log10|base|``).
Floats are fixed-size and overflow is reported, not computed. So the worst
case is ~100 operations on numbers of a few hundred bits: microseconds. (A
signal-based timeout would also not work outside the main thread.)
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
import re
import warnings

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
MAX_INT_DIGITS = 100

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_ALLOWED = ("only numbers, + - * / // % **, unary + and -, and parentheses "
            "are allowed")


class CalculatorError(ValueError):
  """The expression is not allowed, malformed, or its result is too large."""


def evaluate(expression: str) -> str:
  """Evaluates an arithmetic expression and formats the result.

  Thousands separators are removed first (``"1,000 * 3"`` is ``3000``; a
  comma is dropped when it sits between a digit and exactly three digits), as
  nanochat does with all commas.
  Python semantics apply: ``/`` is true division, ``//`` and ``%`` floor.

  Args:
    expression: e.g. ``"(2 + 3) * 4 ** 2 / 7"``.

  Returns:
    The result as text: integers in full (``"12"``), floats with up to 12
    significant digits and no trailing zeros (``0.1 + 0.2`` -> ``"0.3"``,
    ``4 / 2`` -> ``"2"``, ``1e20 * 3`` -> ``"3e+20"``).

  Raises:
    CalculatorError: On disallowed syntax, division by zero, or results
      outside the limits; the message says what is wrong.
  """
  if not isinstance(expression, str):
    raise CalculatorError(f"expected a string expression, got "
                          f"{type(expression).__name__}.")
  if len(expression) > MAX_EXPRESSION_CHARS:
    raise CalculatorError(f"expression is {len(expression)} characters long; "
                          f"the limit is {MAX_EXPRESSION_CHARS}.")
  text = _THOUSANDS.sub("", expression).strip()
  if not text:
    raise CalculatorError("expression is empty.")
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", SyntaxWarning)  # e.g. "2 (3)".
      tree = ast.parse(text, mode="eval")
  except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
    raise CalculatorError(f"could not parse {text!r} as arithmetic: "
                          f"{getattr(e, 'msg', e)}.") from None
  return format_number(_eval(tree.body))


def format_number(value: int | float) -> str:
  """Formats a result: ints in full, floats to 12 significant digits."""
  if isinstance(value, int):
    return str(value)
  text = format(value, ".12g")
  return "0" if text == "-0" else text


def _check(value: int | float) -> int | float:
  if isinstance(value, complex):
    raise CalculatorError("the result is a complex number (e.g. a fractional "
                          "power of a negative number); it is not supported.")
  if isinstance(value, int) and abs(value) >= 10**MAX_INT_DIGITS:
    raise CalculatorError(f"integer value has more than {MAX_INT_DIGITS} "
                          "digits.")
  if isinstance(value, float) and not math.isfinite(value):
    raise CalculatorError("result is too large for a float (overflow).")
  return value


def _check_power(base: int | float, exponent: int | float) -> None:
  if abs(exponent) > MAX_EXPONENT:
    raise CalculatorError(f"exponent {exponent} is too large; |exponent| must "
                          f"be <= {MAX_EXPONENT}.")
  if (isinstance(base, int) and isinstance(exponent, int) and exponent > 0
      and abs(base) > 1
      and exponent * math.log10(abs(base)) > MAX_INT_DIGITS):
    raise CalculatorError(f"{base} ** {exponent} would have more than "
                          f"{MAX_INT_DIGITS} digits.")


def _eval(node: ast.AST) -> int | float:
  """Interprets the allowed subset of Python expression nodes."""
  if isinstance(node, ast.Constant):
    if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
      raise CalculatorError(f"not allowed: {_describe(node)}; {_ALLOWED}.")
    return _check(node.value)
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _check(_UNARY[type(node.op)](_eval(node.operand)))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _eval(node.left), _eval(node.right)
    if isinstance(node.op, ast.Pow):
      _check_power(left, right)
    try:
      return _check(_BINARY[type(node.op)](left, right))
    except ZeroDivisionError:
      raise CalculatorError("division by zero.") from None
    except OverflowError:
      raise CalculatorError(
          "result is too large for a float (overflow).") from None
  raise CalculatorError(f"not allowed: {_describe(node)}; {_ALLOWED}.")


_NAMES = {
    ast.Call: "function calls", ast.Attribute: "attribute access",
    ast.Subscript: "indexing", ast.Lambda: "lambda", ast.Compare: "comparisons",
    ast.BoolOp: "'and'/'or'", ast.IfExp: "conditional expressions",
    ast.ListComp: "comprehensions", ast.SetComp: "comprehensions",
    ast.DictComp: "comprehensions", ast.GeneratorExp: "comprehensions",
    ast.List: "lists", ast.Tuple: "tuples", ast.Dict: "dicts", ast.Set: "sets",
    ast.JoinedStr: "f-strings", ast.NamedExpr: "assignment (:=)",
    ast.Starred: "starred expressions", ast.Await: "await",
}


_SYMBOLS = {
    ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.LShift: "<<",
    ast.RShift: ">>", ast.MatMult: "@", ast.Invert: "~", ast.Not: "not",
}


def _describe(node: ast.AST) -> str:
  """A short human name for a disallowed node."""
  if isinstance(node, ast.Name):
    return f"the name {node.id!r}"
  if isinstance(node, ast.Constant):
    kind = {str: "strings", bytes: "bytes", bool: "booleans",
            complex: "complex numbers"}.get(type(node.value))
    return kind or f"the constant {node.value!r}"
  if isinstance(node, (ast.BinOp, ast.UnaryOp)):
    symbol = _SYMBOLS.get(type(node.op), type(node.op).__name__)
    return f"the operator {symbol!r}"
  return _NAMES.get(type(node), type(node).__name__)


@dataclasses.dataclass(frozen=True)
class ToolCallParser:
  """Finds calculator calls in generated text and builds the forced reply.

  Attributes:
    call_start: Marker opening a call (e.g. a special token's text).
    call_end: Marker closing a call.
    output_start: Marker opening the tool's answer.
    output_end: Marker closing the tool's answer.
  """

  call_start: str = "<|python_start|>"
  call_end: str = "<|python_end|>"
  output_start: str = "<|output_start|>"
  output_end: str = "<|output_end|>"

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if not getattr(self, field.name):
        raise ValueError(f"{field.name} must be a non-empty marker string.")

  def extract_expression(self, span: str) -> str:
    """The expression text of one finished call span.

    Args:
      span: The decoded call, with or without its markers, e.g.
        ``"<|python_start|>2+2<|python_end|>"`` or ``"2+2"``.

    Returns:
      The stripped text between the markers.

    Raises:
      ValueError: If the span has a start marker but no end marker (the call
        is not finished) or contains a second call.
    """
    text = span
    if text.startswith(self.call_start):
      text = text[len(self.call_start):]
      if not text.endswith(self.call_end):
        raise ValueError(f"the call is not finished: {self.call_end!r} is "
                         "missing at the end of the span.")
    if text.endswith(self.call_end):
      text = text[:-len(self.call_end)]
    if self.call_start in text or self.call_end in text:
      raise ValueError("the span contains more than one call; pass one "
                       f"{self.call_start}...{self.call_end} span at a time.")
    return text.strip()

  def find_expressions(self, text: str) -> list[str]:
    """Expressions of every finished call in ``text``, in order."""
    found, pos = [], 0
    while (start := text.find(self.call_start, pos)) >= 0:
      end = text.find(self.call_end, start + len(self.call_start))
      if end < 0:
        break
      found.append(text[start + len(self.call_start):end].strip())
      pos = end + len(self.call_end)
    return found

  def format_output(self, result: str) -> str:
    """The text to force after a call: output_start + result + output_end."""
    return f"{self.output_start}{result}{self.output_end}"

  def respond(self, span: str) -> str | None:
    """Evaluates a finished call; the forced output text, or None.

    As in nanochat, a call the calculator refuses gets no forced output (the
    model simply continues), so this returns None instead of raising.
    """
    try:
      return self.format_output(evaluate(self.extract_expression(span)))
    except (CalculatorError, ValueError):
      return None
