"""Streaming: the compiled loop in chunks of k steps, with an optional text
view.

`stream` returns a `GenerationStream`, an iterator of `StreamEvent`s. The
first chunk is a single step (the first token of every row arrives as soon
as possible), later chunks run ``chunk_size`` steps of the same compiled
decode loop that `generate` uses; the model state stays on device between
chunks, and only the small output buffers come back to the host. Rows of a
batch are streamed together: each chunk yields one event per row that
produced tokens (or finished).

With a `penzai_lm.generation.text.TextView` (as `stream_text` and
`ChatSession` attach), events also carry decoded text, and a stop string
ends its row with the tokens of the text kept.

Stopping early: ``stream.close()`` (or leaving a ``with`` block, or the
garbage collector closing it), ``stream.cancel()`` or setting the
``threading.Event`` passed as ``cancel=`` ends generation at the next chunk
boundary: the running rows finish with ``"cancelled"``, nothing keeps
running (every chunk is waited for before it is yielded) and
``stream.result`` holds what was generated.

Threads: one thread at a time iterates a stream; ``close()`` from another
thread waits for the chunk in flight (at most ``chunk_size`` steps), then
stops it.

Example::

    with stream(model, prompt, max_new_tokens=64) as s:
      for event in s:
        print(event.row, event.tokens)
    print(s.result.finish_reasons)
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Iterator

from penzai_lm.generation.results import GenerationResult
from penzai_lm.generation.run import Run

DEFAULT_CHUNK_SIZE = 8


@dataclasses.dataclass(frozen=True)
class StreamEvent:
  """New output of one row.

  Attributes:
    row: The row (prompt-major: sample ``row % num_samples`` of prompt
      ``row // num_samples``).
    tokens: Ids generated since the row's previous event (with a text view:
      those that are kept, i.e. not past a stop string).
    logprobs: Their log-probabilities (raw distribution).
    forced: Whether each was forced.
    finish_reason: None while the row runs; on the row's last event, why it
      finished.
    text: With a text view, the new text (may be empty while a piece is held
      back because it could start a stop string); else None.
    stop_string: The stop string that ended the row, if any.
    captures: With ``capture=[names]``, the values recorded for the row
      since its previous event, per point name, along ``seq``: the prompt's
      tokens in the first event, then each token once it has been fed (a
      token's values arrive one step after the token); else None.
  """

  row: int
  tokens: list[int]
  logprobs: list[float]
  forced: list[bool]
  finish_reason: str | None = None
  text: str | None = None
  stop_string: str | None = None
  captures: dict[str, Any] | None = None


class GenerationStream:
  """Iterator of `StreamEvent` objects; see the module docstring.

  Attributes:
    run: The underlying `Run` (host bookkeeping, device state).
    chunk_size: Decode steps per compiled call after the first.
    text: The `TextView` decoding the rows, or None.
  """

  def __init__(self, run: Run, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
               cancel: threading.Event | None = None, text=None):
    self.run = run
    self.chunk_size = chunk_size
    self.text = text
    self._cancel_event = cancel
    self._cancel_requested = False
    self._reported = [False] * run.rows
    self._done = False
    # Held while a chunk runs, so close() from another thread waits for it
    # (closing a generator that is executing raises).
    self._step = threading.RLock()
    self._on_done: list[Callable[[], None]] = []
    self._events = self._generate()

  # Iteration.

  def __iter__(self) -> Iterator[StreamEvent]:
    return self

  def __next__(self) -> StreamEvent:
    with self._step:
      return next(self._events)

  def __enter__(self) -> GenerationStream:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    # A stream dropped unfinished releases what it holds (a session's turn).
    try:
      self._events.close()
      self._finish()
    except Exception:  # pylint: disable=broad-except
      pass

  @property
  def done(self) -> bool:
    """Whether iteration is over (or the stream was closed)."""
    return self._done

  @property
  def idle(self) -> bool:
    """Whether no chunk is running now (nothing changes the run until the
    next ``next()``)."""
    if not self._step.acquire(blocking=False):
      return False
    self._step.release()
    return True

  def add_done_callback(self, fn: Callable[[], None]) -> None:
    """Calls ``fn()`` once the stream is done (iteration over, closed or
    garbage-collected); at once if it already is."""
    if self._done:
      fn()
    else:
      self._on_done.append(fn)

  def _finish(self) -> None:
    """Marks the stream done (ending a running run) and runs the done
    callbacks, once."""
    self._done = True
    if not self.run.finished:
      self.run.cancel()
    callbacks, self._on_done = self._on_done, []
    for fn in callbacks:
      fn()

  def _cancelled(self) -> bool:
    return self._cancel_requested or (
        self._cancel_event is not None and self._cancel_event.is_set())

  def _generate(self) -> Iterator[StreamEvent]:
    run = self.run
    try:
      if self._cancelled():
        run.cancel()
        return
      run.prefill(streamed=True)
      first = not run.view.t  # Else the prefill picked the first tokens.
      if not first:
        yield from self._drain()
      while not run.finished:
        if self._cancelled():
          run.cancel()
          break
        run.decode(1 if first else self.chunk_size)
        first = False
        yield from self._drain()
      yield from self._drain()
    finally:
      self._finish()

  def _drain(self) -> Iterator[StreamEvent]:
    run = self.run
    buffers = run.capture_buffers()
    for row in range(run.rows):
      if self._reported[row]:
        continue
      tokens, logprobs, forced = run.new_tokens(row)
      # A row whose last token is still to be fed (captures) reports its
      # end with those values, in a later chunk.
      reason = None if run.tail_pending(row) else run.finish_reason(row)
      text = stop = None
      if self.text is not None:
        update = self.text.push(row, tokens, reason)
        text, stop = update.text, update.stop_string
        if stop is not None:
          run.end_row(row, "stop", keep=update.keep)
          reason = "stop"
        n = update.kept_tokens
        tokens, logprobs, forced = tokens[:n], logprobs[:n], forced[:n]
      captures = None
      if buffers is not None:
        captures = run.new_captures(buffers, row)
      if reason is not None:
        self._reported[row] = True
      if tokens or text or reason is not None or (
          captures and next(iter(captures.values())).named_shape["seq"]):
        yield StreamEvent(row, tokens, logprobs, forced, reason, text, stop,
                          captures)

  # Control.

  def close(self) -> None:
    """Stops generation (running rows: ``"cancelled"``)."""
    self._cancel_requested = True
    with self._step:
      self._events.close()
      self._finish()

  def cancel(self) -> None:
    """Asks generation to stop at the next chunk boundary."""
    self._cancel_requested = True

  def force(self, row: int, tokens: Any) -> None:
    """Forces tokens into a row; the loop consumes them before sampling."""
    self.run.force(row, tokens)

  def end_row(self, row: int, reason: str = "stop",
              keep: int | None = None) -> None:
    """Ends one row from the host, keeping its first ``keep`` tokens."""
    self.run.end_row(row, reason, keep)

  @property
  def result(self) -> GenerationResult:
    """The result so far: final once iteration is over or the stream is
    closed; before that, rows still running have finish reason None. With a
    text view it has ``texts`` and ``stop_strings_matched``."""
    return result_with_text(self.run, self.text)

  def run_to_end(self) -> GenerationResult:
    """Consumes the remaining events and returns the result."""
    for _ in self:
      pass
    return self.result


def result_with_text(run: Run, text=None,
                     finished: bool | None = None) -> GenerationResult:
  """``run.result()`` with the texts of a `TextView` filled in (text held
  back is flushed once ``finished``, default ``run.finished``)."""
  result = run.result()
  if text is not None:
    text.fill(result, finished=run.finished if finished is None
              else finished)
  return result
