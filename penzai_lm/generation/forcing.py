"""Forced tokens and calculator tool use (as in nanochat's engine).

Forced tokens: every row has a queue of tokens that the compiled loop
consumes before sampling; a forced token is recorded like a sampled one
(its log-probability under the model is reported too) and marked in
``GenerationResult.forced``. Queues are filled from ``forced_tokens=`` at the
start of generation, by `GenerationStream.force` between streamed chunks, or
by a tool.

Tools: the engine knows tools only through two members::

    pause_token_id: int          # a row pauses right after sampling it
    respond(history) -> list[int] | None
        # history: the row's prompt + generated ids, ending with the pause
        # token; returns ids to force next (or None for nothing).

When a row samples ``pause_token_id`` the compiled loop exits (the other rows
lose nothing: they stop at the same step and resume in the next call), the
host calls ``respond`` and queues the reply, and the loop resumes. So tool
use costs one host round-trip per call, and only when a tool is given.

`CalculatorTool` is such a tool: when a row emits the call-end marker after a
call-start marker, the tokens between them are decoded, evaluated with the
safe `penzai_lm.tools.calculator.evaluate`, and
``<output_start>result<output_end>`` is forced. Refused expressions force
nothing (the model just continues), as in nanochat.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from penzai_lm.tools import calculator


class Tool(Protocol):
  """What the engine needs from a tool (see the module docstring)."""

  pause_token_id: int

  def respond(self, history: Sequence[int]) -> list[int] | None:
    ...


def _single_token(tokenizer, marker: str, what: str) -> int:
  token_id = tokenizer.token_to_id(marker)
  if token_id is None:
    ids = tokenizer.encode(marker, add_bos=False)
    if len(ids) == 1:
      token_id = ids[0]
  if token_id is None:
    raise ValueError(
        f"the {what} marker {marker!r} is not a single token of this"
        " tokenizer; tool use needs one token per marker. Pass a"
        " ToolCallParser whose markers are tokens of the vocabulary (e.g."
        " special tokens).")
  return int(token_id)


class CalculatorTool:
  """Calculator tool use: evaluates ``<call_start>expr<call_end>`` spans.

  Args:
    tokenizer: The model's `penzai_lm.tokenizer.Tokenizer`.
    parser: The four marker strings (`penzai_lm.tools.ToolCallParser`); each
      must be one token of the tokenizer. Defaults to nanochat's
      ``<|python_start|>`` ... ``<|output_end|>``.

  Attributes:
    pause_token_id: The call-end marker's id.
    call_start_id, call_end_id, output_start_id, output_end_id: Marker ids.
    calls: Every ``(expression, result or None)`` handled, in order.
  """

  def __init__(self, tokenizer, parser: calculator.ToolCallParser | None = None):
    self.tokenizer = tokenizer
    self.parser = parser or calculator.ToolCallParser()
    p = self.parser
    self.call_start_id = _single_token(tokenizer, p.call_start, "call start")
    self.call_end_id = _single_token(tokenizer, p.call_end, "call end")
    self.output_start_id = _single_token(
        tokenizer, p.output_start, "output start")
    self.output_end_id = _single_token(tokenizer, p.output_end, "output end")
    self.pause_token_id = self.call_end_id
    self.calls: list[tuple[str, str | None]] = []

  def respond(self, history: Sequence[int]) -> list[int] | None:
    """Forced reply for a row whose last token is the call-end marker."""
    history = [int(t) for t in history]
    if not history or history[-1] != self.call_end_id:
      return None
    try:
      start = len(history) - 2 - history[-2::-1].index(self.call_start_id)
    except ValueError:
      return None  # An end marker without a start: nothing to evaluate.
    body = history[start + 1:-1]
    if self.call_end_id in body:
      return None
    expression = self.tokenizer.decode(body).strip()
    try:
      result = calculator.evaluate(expression)
    except calculator.CalculatorError:
      self.calls.append((expression, None))
      return None
    self.calls.append((expression, result))
    return ([self.output_start_id]
            + self.tokenizer.encode(result, add_bos=False)
            + [self.output_end_id])
