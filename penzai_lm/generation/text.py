"""Text-level helpers: prompts as text, decoded output, stop strings.

* `generate_text(model, tokenizer, prompt_or_prompts, **settings)` returns a
  `GenerationResult` whose ``texts`` (and ``text`` for one row) hold the
  decoded output.
* `stream_text(model, tokenizer, prompt_or_prompts, **settings)` returns a
  `GenerationStream` with a `TextView`: its events carry text pieces made
  by `penzai_lm.tokenizer.IncrementalDetokenizer`; the pieces of a row
  concatenate exactly to its final ``texts[row]``.

Prompts: a string (encoded with the tokenizer's BOS rule), a chat
conversation (a list of ``{"role", "content"}`` dicts, rendered with the chat
template), a list of token ids, or a list of any of these (a batch).

Stop tokens default to the model's ``eos_token_ids`` plus the tokenizer's
``stop_ids`` (EOS, end-of-turn tokens). A stop token is kept in ``tokens`` but
its text is not part of ``texts``.

Padded vocabularies: a model may have more ids than its tokenizer (Qwen2.5,
Phi-3 round the embedding up); the extra ids have no text, so the text
functions (and `ChatSession`) never sample them: ids at and above
``tokenizer.vocab_size`` are banned in every row, as data (no new compile).
`generate` with token ids has no tokenizer and bans nothing; pass it
``tokenizer_vocab_size=tokenizer.vocab_size`` for the same ban.

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
from typing import Any

from penzai_lm.generation import engine as engine_lib
from penzai_lm.generation.forcing import CalculatorTool
from penzai_lm.generation.prompts import is_int
from penzai_lm.generation.results import GenerationResult
from penzai_lm.generation.run import check_run_controls
from penzai_lm.generation.stop_strings import stop_string_rows
from penzai_lm.generation.stop_strings import StopStringMatcher
from penzai_lm.generation.stream import GenerationStream
from penzai_lm.tokenizer import IncrementalDetokenizer
from penzai_lm.tools import ToolCallParser

DEFAULT_TEXT_CHUNK_SIZE = 8


def _is_conversation(value: Any) -> bool:
  return (isinstance(value, Sequence) and not isinstance(value, str)
          and len(value) > 0 and all(isinstance(m, Mapping) for m in value))


def _is_ids(value: Any) -> bool:
  return (isinstance(value, Sequence) and not isinstance(value, str)
          and len(value) > 0
          and all(is_int(i) for i in value))


def encode_prompts(tokenizer, prompt_or_prompts: Any) -> list[list[int]]:
  """Encodes the accepted prompt forms (see module docstring) to id lists."""

  def encode_one(i, prompt):
    _check_not_bytes(prompt, f"prompt {i}")
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
  _check_not_bytes(p, "the prompt")
  if isinstance(p, str) or _is_conversation(p) or _is_ids(p):
    return [encode_one(0, p)]
  if isinstance(p, Sequence) and not isinstance(p, (str, bytes)):
    if not p:
      raise ValueError("no prompts given: pass a string or a list of them.")
    return [encode_one(i, x) for i, x in enumerate(p)]
  raise TypeError(
      "prompt_or_prompts must be a string, a chat conversation, a list of"
      f" token ids or a list of these; got {type(p).__name__}.")


def _check_not_bytes(value: Any, what: str) -> None:
  """Bytes are a sequence of ints: without this, they would pass for ids."""
  if isinstance(value, (bytes, bytearray, memoryview)):
    raise TypeError(
        f"{what} is {type(value).__name__}, not text: decode it first (e.g."
        " data.decode('utf-8')), or pass token ids as a list of ints.")


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


@dataclasses.dataclass(frozen=True)
class TextUpdate:
  """What one row's new tokens add to its text.

  Attributes:
    text: Newly released text.
    kept_tokens: How many of the pushed tokens are kept (all, unless a stop
      string matched).
    keep: Tokens of the row kept in all (after a stop-string match).
    stop_string: The stop string that matched, if any.
  """

  text: str
  kept_tokens: int
  keep: int | None = None
  stop_string: str | None = None


class TextView:
  """Decodes the rows of a run as their tokens arrive, with stop strings.

  Attributes:
    tokenizer: The tokenizer.
  """

  def __init__(self, tokenizer, stop_strings: list[list[str]],
               stop_tokens: Sequence[Sequence[int]],
               skip_special_tokens: bool = False):
    """Creates a view.

    Args:
      tokenizer: The model's tokenizer.
      stop_strings: Per row, the stop strings (see `stop_string_rows`).
      stop_tokens: Per row, the stop ids (their text is not part of the
        output).
      skip_special_tokens: Drop special tokens from the text.
    """
    self.tokenizer = tokenizer
    self._rows = [_RowText(tokenizer, stops, ids, skip_special_tokens)
                  for stops, ids in zip(stop_strings, stop_tokens)]

  @classmethod
  def for_request(cls, tokenizer, request, stop_strings=None,
                  skip_special_tokens: bool = False) -> TextView:
    """A view of a `Request`'s rows; ``stop_strings`` as in `stream_text`."""
    stops = stop_string_rows(stop_strings, request.num_prompts,
                             request.num_samples)
    return cls(tokenizer, stops, request.stop_tokens, skip_special_tokens)

  @property
  def has_stop_strings(self) -> bool:
    return any(row.matcher.stop_strings for row in self._rows)

  def push(self, row: int, tokens: list[int],
           finish_reason: str | None) -> TextUpdate:
    """Adds a row's new tokens (and its finish reason, if it finished)."""
    text_row = self._rows[row]
    text, kept = text_row.push(tokens, finish_reason)
    return TextUpdate(text, len(kept), text_row.keep, text_row.matched)

  def fill(self, result: GenerationResult, finished: bool = True
           ) -> GenerationResult:
    """Sets ``result.texts`` and ``stop_strings_matched`` (flushing text
    held back for rows that finished, once the run has)."""
    for r, row in enumerate(self._rows):
      if finished and not row.closed and result.finish_reasons[r]:
        row.push([], result.finish_reasons[r])
    result.texts = [row.text for row in self._rows]
    result.stop_strings_matched = [row.matched for row in self._rows]
    return result


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


def _text_stream(model, tokenizer, prompt_or_prompts, stop_strings,
                 skip_special_tokens, calculator, tool, chunk_size, cancel,
                 engine, options) -> GenerationStream:
  check_run_controls(chunk_size, cancel)
  prompts = encode_prompts(tokenizer, prompt_or_prompts)
  check_vocabularies(model, tokenizer)
  options = text_options(model, tokenizer, options)
  run = engine_lib.resolve_engine(engine).start(
      model, prompts, tool=_tool(tokenizer, calculator, tool), **options)
  view = TextView.for_request(tokenizer, run.request, stop_strings,
                              skip_special_tokens)
  return GenerationStream(run, chunk_size=chunk_size, cancel=cancel,
                          text=view)


def text_options(model, tokenizer, options: dict[str, Any]
                 ) -> dict[str, Any]:
  """``options`` plus what the tokenizer implies: the default stop tokens,
  and the ban of the ids it has no text for (see the module docstring)."""
  options = dict(options)
  if options.get("stop_tokens") is None:
    options["default_stop_tokens"] = default_stop_tokens(model, tokenizer)
  if options.get("tokenizer_vocab_size") is None:  # Ids it cannot decode.
    options["tokenizer_vocab_size"] = tokenizer.vocab_size
  return options


def check_vocabularies(model, tokenizer) -> None:
  """The tokenizer's ids must all be ids of the model."""
  if tokenizer.vocab_size > model.config.vocab_size:
    raise ValueError(
        f"the tokenizer has {tokenizer.vocab_size} tokens but the model's"
        f" vocabulary has {model.config.vocab_size}; they do not belong"
        " together.")


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
    engine: engine_lib.Engine | None = None,
    **options,
) -> GenerationStream:
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
    engine: The `Engine` to run on (default: `default_engine()`).
    **options: Options of `generate` (max_new_tokens, temperature, ...).

  Returns:
    A `GenerationStream` whose events carry ``text``; ``.result`` has
    ``texts``.
  """
  return _text_stream(model, tokenizer, prompt_or_prompts, stop_strings,
                      skip_special_tokens, calculator, tool, chunk_size, cancel,
                      engine, options)


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
    engine: engine_lib.Engine | None = None,
    **options,
) -> GenerationResult:
  """Generates text; arguments as in `stream_text`.

  With stop strings, a tool or ``cancel``, generation runs in compiled
  chunks so the host can take part between them; otherwise it is one
  compiled loop, decoded once at the end.

  Returns:
    A `GenerationResult` with ``texts`` (``.text`` for a single row) and
    ``stop_strings_matched``.
  """
  stream = _text_stream(
      model, tokenizer, prompt_or_prompts, stop_strings, skip_special_tokens,
      calculator, tool, chunk_size, cancel, engine, options)
  if stream.text.has_stop_strings or cancel is not None or (
      stream.run.tool is not None):
    return stream.run_to_end()
  run = stream.run
  result = run.run_to_end()
  for r, tokens in enumerate(result.tokens):
    stream.text.push(r, tokens, result.finish_reasons[r])
  return stream.text.fill(result)
