"""The safe calculator and the tool-call parser."""

import time

import pytest

from penzai_lm.tools import CalculatorError
from penzai_lm.tools import ToolCallParser
from penzai_lm.tools import evaluate
from penzai_lm.tools import calculator


@pytest.mark.parametrize("expression,result", [
    ("1+2", "3"), ("2*3+4", "10"), ("2+3*4", "14"), ("(2+3)*4", "20"),
    ("2**3**2", "512"),  # Right-associative.
    ("-2**2", "-4"),  # Unary minus binds looser than **.
    ("(-2)**2", "4"), ("2**-2", "0.25"), ("-+-3", "3"),
    ("7/2", "3.5"), ("4/2", "2"), ("7//2", "3"), ("-7//2", "-4"),
    ("-7%3", "2"), ("7.5%2", "1.5"), ("10-4-3", "3"), ("100/10/5", "2"),
    ("0.1+0.2", "0.3"), ("1/3", "0.333333333333"), ("2.50*2", "5"),
    ("1e20*3", "3e+20"), ("1.5e-3*2", "0.003"), ("-0.0", "0"),
    ("1,234 * 2", "2468"), ("1,234,567-1", "1234566"), (" ( 1 + 1 ) ", "2"),
    ("2**100", str(2**100)), ("10**99", "1" + "0" * 99),
    ("12345678901234567890*98765432109876543210",
     str(12345678901234567890 * 98765432109876543210)),
    ("2**0.5", "1.41421356237"), ("9**0.5", "3"),
])
def test_valid_arithmetic(expression, result):
  assert evaluate(expression) == result


@pytest.mark.parametrize("expression,message", [
    ("x + 1", "not allowed: the name 'x'"),
    ("__import__('os')", "not allowed: function calls"),
    ("abs(-1)", "not allowed: function calls"),
    ("(1).real", "not allowed: attribute access"),
    ("'a' * 3", "not allowed: strings"),
    ("b'a'", "not allowed: bytes"),
    ("True + 1", "not allowed: booleans"),
    ("1j * 2", "not allowed: complex numbers"),
    ("lambda: 1", "not allowed: lambda"),
    ("[x for x in (1, 2)]", "not allowed: comprehensions"),
    ("{x for x in (1, 2)}", "not allowed: comprehensions"),
    ("sum(x for x in (1, 2))", "not allowed: function calls"),
    ("(1, 2)", "not allowed: tuples"), ("[1]", "not allowed: lists"),
    ("{1: 2}", "not allowed: dicts"), ("{1}", "not allowed: sets"),
    ("(1)[0]", "not allowed: indexing"),
    ("1 < 2", "not allowed: comparisons"),
    ("1 and 2", "not allowed: 'and'/'or'"),
    ("1 if 2 else 3", "not allowed: conditional expressions"),
    ("f'{1}'", "not allowed: f-strings"),
    ("(y := 2)", r"not allowed: assignment \(:=\)"),
    ("2 ^ 3", "not allowed: the operator '\\^'"),
    ("2 << 3", "not allowed: the operator '<<'"),
    ("2 & 3", "not allowed: the operator '&'"),
    ("~2", "not allowed: the operator '~'"),
    ("not 2", "not allowed: the operator 'not'"),
    ("2 (3)", "not allowed: function calls"),
    ("1 +", "could not parse"), ("import os", "could not parse"),
    ("1; 2", "could not parse"), ("", "expression is empty"),
    ("   ", "expression is empty"),
])
def test_rejected_constructs(expression, message):
  with pytest.raises(CalculatorError, match=message):
    evaluate(expression)


@pytest.mark.parametrize("expression", ["1/0", "1//0", "5%0", "1.0/0.0",
                                        "0**-1", "2/(1-1)"])
def test_division_by_zero(expression):
  with pytest.raises(CalculatorError, match="division by zero"):
    evaluate(expression)


@pytest.mark.parametrize("expression,message", [
    ("2**101", r"exponent 101 is too large; \|exponent\| must be <= 100"),
    ("2**-1000", "exponent -1000 is too large"),
    ("9**9**9", "exponent 387420489 is too large"),
    ("10**10**10", "is too large"),
    ("99**100", "would have more than 100 digits"),
    ("(10**60)*(10**60)", "integer value has more than 100 digits"),
    ("9" * 101, "integer value has more than 100 digits"),
    ("1e308*10", "too large for a float"), ("1e999", "too large for a float"),
    ("10.0**100*1e300", "too large for a float"),
    ("1e300**2", "too large for a float"),
    ("(-8)**(1/3)", "complex number"),
])
def test_huge_results_are_refused_up_front(expression, message):
  start = time.perf_counter()
  with pytest.raises(CalculatorError, match=message):
    evaluate(expression)
  assert time.perf_counter() - start < 0.1


def test_length_limit():
  ok = "+".join(["1"] * 100)  # 199 characters.
  assert evaluate(ok) == "100"
  with pytest.raises(CalculatorError, match="201 characters long; the limit "
                     "is 200"):
    evaluate("1" + "+1" * 100)
  with pytest.raises(CalculatorError, match="expected a string"):
    evaluate(12)


def test_worst_case_within_limits_is_fast():
  # ~60 multiplications of near-limit integers, each checked as it goes.
  expression = "*".join(["(10**33)"] * 3) + "+" + "+".join(
      ["3**60%7"] * 20)
  assert len(expression) <= calculator.MAX_EXPRESSION_CHARS
  start = time.perf_counter()
  evaluate(expression)
  assert time.perf_counter() - start < 0.05


def test_nesting_is_bounded():
  deep = "(" * 99 + "1" + ")" * 99
  assert evaluate(deep) == "1"
  assert evaluate("-" * 199 + "1") == "-1"


# --- ToolCallParser -------------------------------------------------------------

def test_extract_expression_with_and_without_markers():
  parser = ToolCallParser()
  assert parser.extract_expression(
      "<|python_start|> 12*(3+4) <|python_end|>") == "12*(3+4)"
  assert parser.extract_expression("12*(3+4)<|python_end|>") == "12*(3+4)"
  assert parser.extract_expression(" 2+2 ") == "2+2"
  with pytest.raises(ValueError, match="not finished"):
    parser.extract_expression("<|python_start|>2+2")
  with pytest.raises(ValueError, match="more than one call"):
    parser.extract_expression(
        "<|python_start|>1<|python_end|><|python_start|>2<|python_end|>")


def test_respond_formats_forced_output():
  parser = ToolCallParser()
  assert parser.respond("<|python_start|>6*7<|python_end|>") == (
      "<|output_start|>42<|output_end|>")
  assert parser.respond("<|python_start|>open('x')<|python_end|>") is None
  assert parser.respond("<|python_start|>1/0<|python_end|>") is None


def test_custom_markers_and_find_expressions():
  parser = ToolCallParser(call_start="<calc>", call_end="</calc>",
                          output_start="[", output_end="]")
  text = "a <calc>1+1</calc> b <calc> 2*3 </calc> c <calc>4"
  assert parser.find_expressions(text) == ["1+1", "2*3"]
  assert parser.respond("<calc>2**10</calc>") == "[1024]"
  assert ToolCallParser().find_expressions("no calls here") == []
  with pytest.raises(ValueError, match="call_end must be a non-empty"):
    ToolCallParser(call_end="")
