"""Text-level helpers: prompts as text, decoded output, stop strings.

* `generate_text(model, tokenizer, prompt_or_prompts, **settings)` returns a
  `GenerationResult` whose ``texts`` (and ``text`` for one row) hold the
  decoded output.
* `stream_text(model, tokenizer, prompt_or_prompts, **settings)` returns a
  `TextStream` yielding `TextEvent`s with text pieces made by
  `penzai_lm.tokenizer.IncrementalDetokenizer`; the pieces of a row
  concatenate exactly to its final ``texts[row]``.

Prompts: a string (encoded with the tokenizer's BOS rule), a chat
conversation (a list of ``{"role", "content"}`` dicts, rendered with the chat
template), a list of token ids, or a list of any of these (a batch).

Stop tokens default to the model's ``eos_token_ids`` plus the tokenizer's
``stop_ids`` (EOS, end-of-turn tokens). A stop token is kept in ``tokens`` but
its text is not part of ``texts``.

Stop strings (``stop_strings=["\\n\\n", ...]``, or one list per prompt/row)
are matched on the decoded text as it is produced: the earliest match ends
the row with ``"stop"``, the match and everything after it are removed from
the text, and ``tokens`` keeps only the tokens needed to produce the text up
to the end of the match. Streamed text holds back a piece while it could be
the start of a stop string, so nothing that is later removed is ever
yielded. With stop strings (or a tool, or ``cancel``) generation runs in
compiled chunks so the host can check the text between chunks; otherwise
`generate_text` is a single compiled loop plus one decode.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Iterator

from penzai_lm.generation import engine
from penzai_lm.generation import requests as requests_lib
from penzai_lm.generation import streaming
from penzai_lm.generation.forcing import CalculatorTool
from penzai_lm.generation.results import GenerationResult
from penzai_lm.tokenizer import IncrementalDetokenizer
from penzai_lm.tools import ToolCallParser

DEFAULT_TEXT_CHUNK_SIZE = 8


def _is_conversation(value: Any) -> bool:
  return (isinstance(value, Sequence) and not isinstance(value, str)
          and len(value) > 0 and all(isinstance(m, Mapping) for m in value))


def _is_ids(value: Any) -> bool:
  return (isinstance(value, Sequence) and not isinstance(value, str)
          and len(value) > 0
          and all(requests_lib._is_int(i) for i in value))  # pylint: disable=protected-access


def encode_prompts(tokenizer, prompt_or_prompts: Any) -> list[list[int]]:
  """Encodes the accepted prompt forms (see module docstring) to id lists."""

  def encode_one(i, prompt):
    if isinstance(prompt, str):
      ids = tokenizer.encode(prompt)
      if not ids:
        raise ValueError(
            f"prompt {i} encodes to no tokens (an empty string with no BOS);"
            " give the model at least one token.")
      return ids
    if _is_conversation(prompt):
      return tokenizer.encode_chat(prompt)
    if _is_ids(prompt):
      return [int(t) for t in prompt]
    raise TypeError(
        f"prompt {i} must be a string, a chat conversation (list of role /"
        f" content dicts) or a list of token ids, got {prompt!r:.80}.")

  p = prompt_or_prompts
  if isinstance(p, str) or _is_conversation(p) or _is_ids(p):
    return [encode_one(0, p)]
  if isinstance(p, Sequence) and not isinstance(p, (str, bytes)):
    if not p:
      raise ValueError("no prompts given: pass a string or a list of them.")
    return [encode_one(i, x) for i, x in enumerate(p)]
  raise TypeError(
      "prompt_or_prompts must be a string, a chat conversation, a list of"
      f" token ids or a list of these; got {type(p).__name__}.")


class StopStringMatcher:
  """Finds the earliest stop string in text arriving piece by piece.

  ``push(piece)`` returns ``(safe_text, match)``: text that can be released
  (it cannot be part of a stop string any more) and the matched stop string
  or None. After a match, ``match_end`` is the end of the match in the whole
  text (counted from the start of the stream).
  """

  def __init__(self, stop_strings: Sequence[str]):
    self.stop_strings = [s for s in stop_strings if s]
    self._held = ""
    self._released = 0  # Characters released so far.
    self.match_end: int | None = None

  def push(self, piece: str) -> tuple[str, str | None]:
    text = self._held + piece
    if not self.stop_strings:
      self._released += len(text)
      self._held = ""
      return text, None
    best = None
    for s in self.stop_strings:
      i = text.find(s)
      if i >= 0 and (best is None or i < best[0]
                     or (i == best[0] and len(s) > len(best[1]))):
        best = (i, s)
    if best is not None:
      i, s = best
      self.match_end = self._released + i + len(s)
      self._released += i
      self._held = ""
      return text[:i], s
    hold = 0
    for s in self.stop_strings:
      for k in range(min(len(s) - 1, len(text)), 0, -1):
        if text.endswith(s[:k]):
          hold = max(hold, k)
          break
    safe = text[:len(text) - hold]
    self._held = text[len(text) - hold:]
    self._released += len(safe)
    return safe, None

  def flush(self) -> str:
    """Releases the held text (the stream ended without a match)."""
    text, self._held = self._held, ""
    self._released += len(text)
    return text


@dataclasses.dataclass(frozen=True)
class TextEvent:
  """New text of one row.

  Attributes:
    row: The row (prompt-major).
    text: New text since the row's previous event (may be empty when only
      tokens or the finish reason are new).
    tokens: The row's new token ids.
    finish_reason: None while running, else the reason on the last event.
    stop_string: The stop string that ended the row, if any.
  """

  row: int
  text: str
  tokens: list[int]
  finish_reason: str | None = None
  stop_string: str | None = None


class _RowText:
  """Per-row detokenizer, stop-string matcher and token/char bookkeeping."""

  def __init__(self, tokenizer, stop_strings, stop_ids, skip_special_tokens):
    self.detok = IncrementalDetokenizer(
        tokenizer, skip_special_tokens=skip_special_tokens)
    self.matcher = StopStringMatcher(stop_strings)
    self.stop_ids = set(stop_ids)
    self.text = ""  # Released text.
    self.chars = 0  # Characters decoded (released or held).
    self.token_ends: list[int] = []  # Decoded characters after each token.
    self.matched: str | None = None
    self.keep: int | None = None  # Tokens kept after a stop-string match.
    self.closed = False

  def push(self, tokens: list[int],
           finish_reason: str | None) -> tuple[str, list[int]]:
    """Adds tokens; returns (newly released text, tokens that are kept)."""
    if self.closed:
      return "", []
    start = len(self.token_ends)
    out = []
    for k, token in enumerate(tokens):
      is_stop_token = (finish_reason == "stop" and k == len(tokens) - 1
                       and token in self.stop_ids)
      piece = "" if is_stop_token else self.detok.push(token)
      self.chars += len(piece)
      self.token_ends.append(self.chars)
      safe, match = self.matcher.push(piece)
      out.append(safe)
      if match is not None:
        self._matched(match)
        break
    if finish_reason is not None and not self.closed:
      piece = self.detok.flush()
      self.chars += len(piece)
      if self.token_ends:
        self.token_ends[-1] = self.chars
      safe, match = self.matcher.push(piece)
      out.append(safe)
      if match is not None:
        self._matched(match)
      else:
        out.append(self.matcher.flush())
      self.closed = True
    released = "".join(out)
    self.text += released
    kept = tokens if self.keep is None else tokens[:max(0, self.keep - start)]
    return released, list(kept)

  def _matched(self, match: str) -> None:
    self.matched = match
    end = self.matcher.match_end
    # Keep tokens up to the one whose text completes the match.
    keep = len(self.token_ends)
    for i, chars in enumerate(self.token_ends):
      if chars >= end:
        keep = i + 1
        break
    self.keep = keep
    self.closed = True


class TextStream:
  """Iterator of `TextEvent`s over a `GenerationStream`.

  Attributes:
    tokens: The underlying token-level `GenerationStream`.
  """

  def __init__(self, token_stream: streaming.GenerationStream, tokenizer,
               stop_strings: list[list[str]], skip_special_tokens: bool):
    self.tokens = token_stream
    self.tokenizer = tokenizer
    run = token_stream.run
    self._rows = [
        _RowText(tokenizer, stop_strings[r], run.request.stop_tokens[r],
                 skip_special_tokens)
        for r in range(run.rows)
    ]
    self.done = False  # Iteration is over (or the stream was closed).
    self._events = self._generate()

  def __iter__(self) -> Iterator[TextEvent]:
    return self

  def __next__(self) -> TextEvent:
    return next(self._events)

  def __enter__(self) -> TextStream:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def close(self) -> None:
    """Stops generation; running rows finish with ``"cancelled"``."""
    self._events.close()
    self.tokens.close()
    self.done = True

  def cancel(self) -> None:
    """Asks generation to stop at the next chunk boundary."""
    self.tokens.cancel()

  def force(self, row: int, tokens: Any) -> None:
    """Forces token ids into a row (see `GenerationStream.force`)."""
    self.tokens.force(row, tokens)

  def _generate(self) -> Iterator[TextEvent]:
    try:
      for event in self.tokens:
        row = self._rows[event.row]
        if row.closed:
          continue
        text, kept = row.push(event.tokens, event.finish_reason)
        if row.matched is not None:
          self.tokens.end_row(event.row, "stop", keep=row.keep)
          yield TextEvent(event.row, text, kept, "stop", row.matched)
        else:
          yield TextEvent(event.row, text, kept, event.finish_reason)
    finally:
      self.done = True
      self.tokens.close()

  def run_to_end(self) -> GenerationResult:
    """Consumes the remaining events and returns the result."""
    for _ in self:
      pass
    return self.result

  @property
  def result(self) -> GenerationResult:
    """The result so far, with ``texts`` (final once iteration is over)."""
    result = self.tokens.result
    for r, row in enumerate(self._rows):
      if not row.closed and result.finish_reasons[r] is not None and (
          self.tokens.run.finished):
        row.push([], result.finish_reasons[r])  # Flush held text.
    result.texts = [row.text for row in self._rows]
    result.stop_strings_matched = [row.matched for row in self._rows]
    return result


def stop_string_rows(stop_strings, num_prompts: int,
                     num_samples: int) -> list[list[str]]:
  """Validates ``stop_strings`` and expands it to one list per row."""

  def is_scalar(v):
    return v is None or isinstance(v, str) or (
        isinstance(v, Sequence) and all(isinstance(x, str) for x in v))

  if stop_strings is None:
    return [[] for _ in range(num_prompts * num_samples)]
  if not isinstance(stop_strings, (str, Sequence)):
    raise ValueError(
        "stop_strings must be a string, a list of strings, or one such list"
        f" per prompt/row; got {stop_strings!r}.")
  rows = requests_lib.expand_rows(
      "stop_strings", stop_strings, num_prompts, num_samples, is_scalar)
  out = []
  for r, value in enumerate(rows):
    value = [] if value is None else [value] if isinstance(value, str) else (
        list(value))
    for s in value:
      if not isinstance(s, str) or not s:
        raise ValueError(
            f"stop_strings[{r}] contains {s!r}; stop strings must be"
            " non-empty strings.")
    out.append(value)
  return out


def _tool(tokenizer, calculator, tool):
  if calculator and tool is not None:
    raise ValueError("pass either calculator= or tool=, not both.")
  if calculator:
    parser = calculator if isinstance(calculator, ToolCallParser) else None
    return CalculatorTool(tokenizer, parser)
  return tool


def default_stop_tokens(model, tokenizer) -> list[int]:
  """The model's EOS ids plus the tokenizer's stop ids (end of turn, ...)."""
  ids = dict.fromkeys([*model.config.eos_token_ids, *tokenizer.stop_ids])
  return [t for t in ids if t < model.config.vocab_size]


def _text_run(model, tokenizer, prompt_or_prompts, settings, calculator, tool):
  prompts = encode_prompts(tokenizer, prompt_or_prompts)
  if settings.get("stop_tokens") is None:
    settings = dict(settings,
                    default_stop_tokens=default_stop_tokens(model, tokenizer))
  if tokenizer.vocab_size > model.config.vocab_size:
    raise ValueError(
        f"the tokenizer has {tokenizer.vocab_size} tokens but the model's"
        f" vocabulary has {model.config.vocab_size}; they do not belong"
        " together.")
  return engine.start_run(
      model, prompts, tool=_tool(tokenizer, calculator, tool), **settings)


def _text_stream(model, tokenizer, prompt_or_prompts, stop_strings,
                 skip_special_tokens, calculator, tool, chunk_size, cancel,
                 settings) -> TextStream:
  run = _text_run(model, tokenizer, prompt_or_prompts, settings, calculator,
                  tool)
  stops = stop_string_rows(stop_strings, run.request.num_prompts,
                           run.request.num_samples)
  token_stream = streaming.GenerationStream(
      run, chunk_size=chunk_size, cancel=cancel)
  return TextStream(token_stream, tokenizer, stops, skip_special_tokens)


def stream_text(
    model,
    tokenizer,
    prompt_or_prompts: Any,
    *,
    stop_strings: str | list[str] | list[list[str]] | None = None,
    skip_special_tokens: bool = False,
    calculator: bool | ToolCallParser = False,
    tool: Any = None,
    chunk_size: int = DEFAULT_TEXT_CHUNK_SIZE,
    cancel: threading.Event | None = None,
    **settings,
) -> TextStream:
  """Streams decoded text; see the module docstring.

  Args:
    model: As in `generate`.
    tokenizer: The model's `penzai_lm.tokenizer.Tokenizer`.
    prompt_or_prompts: A string, chat conversation, id list, or a list of
      these.
    stop_strings: Text that ends a row (removed with what follows).
    skip_special_tokens: Drop special tokens from the text.
    calculator: True (nanochat's markers) or a `ToolCallParser` with marker
      tokens of this tokenizer: enables calculator tool use.
    tool: Another tool (see `penzai_lm.generation.forcing`).
    chunk_size: Decode steps per compiled call.
    cancel: ``threading.Event`` that stops generation when set.
    **settings: Keywords of `generate` (max_new_tokens, temperature, ...).

  Returns:
    A `TextStream` of `TextEvent`s; ``.result`` has ``texts``.
  """
  return _text_stream(model, tokenizer, prompt_or_prompts, stop_strings,
                      skip_special_tokens, calculator, tool, chunk_size, cancel,
                      settings)


def generate_text(
    model,
    tokenizer,
    prompt_or_prompts: Any,
    *,
    stop_strings: str | list[str] | list[list[str]] | None = None,
    skip_special_tokens: bool = False,
    calculator: bool | ToolCallParser = False,
    tool: Any = None,
    chunk_size: int = DEFAULT_TEXT_CHUNK_SIZE,
    cancel: threading.Event | None = None,
    **settings,
) -> GenerationResult:
  """Generates text; arguments as in `stream_text`.

  Returns:
    A `GenerationResult` with ``texts`` (``.text`` for a single row) and
    ``stop_strings_matched``.
  """
  text_stream = _text_stream(
      model, tokenizer, prompt_or_prompts, stop_strings, skip_special_tokens,
      calculator, tool, chunk_size, cancel, settings)
  if (any(row.matcher.stop_strings for row in text_stream._rows)  # pylint: disable=protected-access
      or cancel is not None):
    return text_stream.run_to_end()
  # Nothing to check on the host between steps: one compiled loop.
  run = text_stream.tokens.run
  result = engine.run_to_end(run)
  texts = []
  for r, tokens in enumerate(result.tokens):
    if (result.finish_reasons[r] == "stop" and tokens
        and tokens[-1] in run.request.stop_tokens[r]):
      tokens = tokens[:-1]
    texts.append(tokenizer.decode(
        tokens, skip_special_tokens=skip_special_tokens))
  result.texts = texts
  result.stop_strings_matched = [None] * len(texts)
  return result
