"""`Session`: a one-row conversation whose KV cache is kept between calls.

Each call appends its tokens to everything the session already holds (the
earlier prompts and generated tokens) and generates; only the new tokens are
prefilled, the rest is read from the cache::

    session = Session(model)
    first = session.generate(prompt_ids, max_new_tokens=64)
    second = session.generate(more_ids, max_new_tokens=64)  # no re-reading
    session.tokens  # the whole conversation: prompts and generated tokens

The cache lives on device between calls, sized in powers of two (at least
``min_cache_len``) and grown (copied into a larger buffer) when a turn needs
more room, up to the model's context. Every call, the first included, runs
the same continuation prefill, so turns in the same buckets never compile. What the model sees is exactly ``session.tokens``: a row ended by a
stop string keeps only the tokens of its kept text, and a cancelled reply
keeps what was generated. Generated tokens past the kept ones are dropped
from the cache (their slots are reused), and the last kept token is fed at
the start of the next call (``pending``), so the model state always matches
the conversation.

Sampling settings are per call, as in `penzai_lm.generation.generate`;
repetition and presence penalties see the whole conversation. Prompt-bucket
padding takes cache slots (never positions): a turn of ``n`` tokens uses at
most ``max(8, 2n)`` slots.

Threads: a session runs one turn at a time (`penzai_lm.generation.turns`):
``generate`` and ``reset`` from several threads are serialised (each waits
for the turn before it, a streamed one included, until that stream is done
or closed); ``stream`` waits for another thread's ``generate`` but is
refused with `SessionBusyError` while another thread's stream is open.
Reading ``tokens`` and the other properties never waits for a turn.
"""

from __future__ import annotations

import threading
from typing import Any

from penzai import pz

from penzai_lm.generation import engine as engine_lib
from penzai_lm.generation.prompts import token_list
from penzai_lm.generation.results import GenerationResult
from penzai_lm.generation.run import check_run_controls
from penzai_lm.generation.run import Run
from penzai_lm.generation.shapes import next_power_of_two
from penzai_lm.generation.state import Continuation
from penzai_lm.generation.stream import GenerationStream
from penzai_lm.generation.turns import SessionBusyError
from penzai_lm.generation.turns import Turn
from penzai_lm.generation.turns import TurnGate
from penzai_lm.model import memory
from penzai_lm.model import TransformerLM

__all__ = ["Session", "SessionBusyError"]


class Session:
  """A conversation with one model and a KV cache kept between calls.

  Thread-safe: one turn at a time. ``generate`` and ``reset`` wait for the
  running turn (another thread's ``generate``, or its stream until that is
  done or closed), so N threads calling ``generate`` give N complete turns
  in some order. ``stream`` waits for another thread's ``generate`` but
  raises `SessionBusyError` while another thread's stream is open (it
  would wait as long as that stream's reader takes). A call from the
  thread that opened the open stream ends it first (``"cancelled"``).

  Attributes:
    model: The uncached `TransformerLM` (the session converts it).
    tokens: The conversation so far: every prompt and generated token, in
      order. All but ``pending`` are in the cache.
    pending: Tokens of the conversation not yet in the cache (fed first by
      the next call: the last generated token, or more after a call that
      was cancelled before it started).
  """

  def __init__(self, model: TransformerLM, *, min_cache_len: int = 0,
               engine: engine_lib.Engine | None = None):
    """Starts an empty session.

    Args:
      model: The uncached `TransformerLM`.
      min_cache_len: Cache slots to allocate at least (rounded up to a power
        of two). The cache grows when a call needs more, and each new size
        compiles new programs; a conversation that stays inside this size
        compiles once per prompt bucket. Attention reads every slot, so a
        larger cache decodes a little slower.
      engine: The `Engine` to run on (default: `default_engine()`).

    Raises:
      ValueError: for a bad ``min_cache_len``, or one whose cache cannot
        fit in the available memory (`memory.InsufficientMemoryError`).
    """
    if not isinstance(model, TransformerLM):
      raise TypeError(
          "Session needs the uncached TransformerLM (it manages its own"
          f" cache), got {type(model).__name__}.")
    if (not isinstance(min_cache_len, int) or isinstance(min_cache_len, bool)
        or min_cache_len < 0):
      raise ValueError(
          f"min_cache_len must be a non-negative integer, got"
          f" {min_cache_len!r}.")
    self.model = model
    self.min_cache_len = min_cache_len
    self.engine = engine_lib.resolve_engine(engine)
    self._gate = TurnGate("this Session")
    self._tokens: list[int] = []
    self._pending: list[int] = []
    self._continuation = self._empty()
    if self._continuation.cache_len:
      # Checked now: the first turn would allocate it.
      size = self._continuation.cache_len
      memory.check_fits(
          f"Session(min_cache_len={memory.format_count(min_cache_len)}): "
          + memory.describe_cache(model.config, 1, size)
          + ", with its output and sampling buffers,",
          memory.request_bytes(model.config, 1, size),
          "Lower min_cache_len.")
    self._run = None  # The latest run, until its state is taken over.
    self._run_turn: Turn | None = None  # The turn it runs in.
    self._new: list[int] = []  # Its new (non-pending) prompt tokens.

  # Calls.

  def stream(self, tokens: Any = (), *, chunk_size: int = 8,
             cancel: threading.Event | None = None, text=None,
             **settings) -> GenerationStream:
    """Appends ``tokens`` and streams the reply (`GenerationStream`).

    The turn lasts until the stream is done (iterated to the end, closed
    or garbage-collected). Starting another call in the same thread ends a
    reply that is still streaming (its finish reason becomes
    ``"cancelled"``, its tokens so far are kept).

    Args:
      tokens: New token ids (may be empty to continue the last reply).
      chunk_size: Decode steps per compiled call.
      cancel: ``threading.Event`` that stops generation when set.
      text: Optional `TextView` factory ``fn(request) -> TextView`` (used
        by `ChatSession`) to stream text.
      **settings: Keywords of `penzai_lm.generation.generate` except
        ``num_samples``, ``use_cache`` and ``prompts``.

    Raises:
      SessionBusyError: if another thread's stream is open.
    """
    check_run_controls(chunk_size, cancel)
    turn = self._gate.begin("stream")
    run = None
    try:
      with self._gate.lock:
        run = self._start(tokens, settings, turn)
      out = GenerationStream(
          run, chunk_size=chunk_size, cancel=cancel,
          text=None if text is None else text(run.request))
    except BaseException:
      with self._gate.lock:
        if run is not None and self._run is run:  # It never started.
          self._run = self._run_turn = None
      self._gate.end(turn)
      raise
    self._gate.attach(turn, out)
    return out

  def generate(self, tokens: Any = (), *, chunk_size: int = 8,
               cancel: threading.Event | None = None,
               **settings) -> GenerationResult:
    """Appends ``tokens`` and generates a reply; see `stream`.

    Waits for a turn running in another thread (see the class docstring).
    """
    check_run_controls(chunk_size, cancel)
    turn = self._gate.begin("call")
    try:
      with self._gate.lock:
        run = self._start(tokens, settings, turn)
      return run.run_to_end(cancel=cancel, chunk_size=chunk_size)
    finally:
      self._gate.end(turn)

  def reset(self) -> None:
    """Forgets the conversation (the next call starts an empty cache).

    Waits for a turn running in another thread, like `generate`.
    """
    turn = self._gate.begin("call")
    try:
      with self._gate.lock:
        self._finish_run()
        self._tokens, self._pending = [], []
        self._continuation = self._empty()
    finally:
      self._gate.end(turn)

  # State.

  @property
  def tokens(self) -> list[int]:
    """The conversation so far (a copy; a reply joins once finished)."""
    with self._gate.lock:
      self._settle()
      return list(self._tokens)

  @property
  def pending(self) -> list[int]:
    """Conversation tokens not in the cache yet (a copy)."""
    with self._gate.lock:
      self._settle()
      return list(self._pending)

  @property
  def cached_tokens(self) -> int:
    """Tokens of the conversation held in the cache."""
    with self._gate.lock:
      self._settle()
      return len(self._tokens) - len(self._pending)

  @property
  def cache_len(self) -> int:
    """Slots of the cache (0 before the first call)."""
    with self._gate.lock:
      self._settle()
      c = self._continuation
      return 0 if c is None or c.state is None else c.cache_len

  @property
  def slots_used(self) -> int:
    """Cache slots in use (tokens plus prompt-bucket padding)."""
    with self._gate.lock:
      self._settle()
      return self._continuation.start_slot if self._continuation else 0

  # Internals.

  def _empty(self) -> Continuation:
    size = 0
    if self.min_cache_len:
      size = next_power_of_two(self.min_cache_len)
      limit = self.model.config.max_cache_len
      if limit is not None:
        size = min(size, limit)
    return Continuation(state=None, start_slot=0, positions=0, cache_len=size)

  def _start(self, tokens, settings, turn: Turn) -> Run:
    """Starts a run in ``turn`` (the caller holds the turn and the lock)."""
    for key in ("num_samples", "use_cache", "prompts"):
      if key in settings:
        raise ValueError(
            f"Session calls do not take {key}=: a session is one cached row.")
    ids = list(token_list("tokens", _flat(tokens),
                          self.model.config.vocab_size))
    self._finish_run()
    prompt = self._pending + ids
    if not prompt:
      raise ValueError(
          "the session is empty: give at least one token to start it.")
    run = self.engine.start(self.model, [prompt],
                            continuation=self._continuation, **settings)
    self._run, self._new, self._run_turn = run, ids, turn
    return run

  def _settle(self) -> None:
    """Takes over the latest run's state once nothing can change it: its
    turn is over, or it has finished and no chunk of its stream is running
    (a chunk may still cut its tokens at a stop string). Holds the lock."""
    run = self._run
    if run is None:
      return
    if self._gate.active(self._run_turn):
      stream = self._run_turn.open_stream()
      if not run.finished or (stream is not None and not stream.idle):
        return
    self._finish_run()

  def _finish_run(self) -> None:
    """Takes over the latest run's state, ending it if still running.

    Holds the lock, and the turn unless the run is settled (`_settle`).
    """
    run = self._run
    if run is None:
      return
    self._run = self._run_turn = None
    if not run.finished:
      run.cancel()
    kept = run.tokens_of(0)
    self._tokens = self._tokens + self._new + kept
    if run.carry is None:  # Cancelled before the prefill: nothing changed.
      self._pending = self._pending + self._new
      return
    try:
      state = run.model_state()
    except RuntimeError:
      # The device state is gone (e.g. interrupted while its buffers were
      # handed to a program): re-read the whole conversation next time.
      self._continuation, self._pending = self._empty(), list(self._tokens)
      return
    # The loop samples the last kept token and stops: it is not in the cache
    # yet, so it is fed first next turn (or, if nothing was generated, the
    # prompt's last token, which the prefill leaves for the loop).
    prompt = run.request.prompts[0].tolist()
    self._pending = kept[-1:] or prompt[-1:]
    prompt_len = run.request.prefill.prompt_len
    self._continuation = Continuation(
        state=tuple(state),
        start_slot=run.start_slot + prompt_len - 1 + len(kept),
        positions=self._continuation.positions + len(prompt) + len(kept) - 1,
        cache_len=run.request.decode.cache_len)


def _flat(tokens: Any) -> list:
  if isinstance(tokens, pz.nx.NamedArrayBase):
    rows = {a: n for a, n in tokens.named_shape.items() if a != "seq"}
    if ("seq" not in tokens.named_shape or tokens.positional_shape
        or any(n != 1 for n in rows.values())):
      raise ValueError(
          "a Session holds one row: a named array of tokens needs a 'seq'"
          f" axis and no other axis longer than 1, got"
          f" {dict(tokens.named_shape)}.")
    tokens = tokens.unwrap(*rows, "seq").reshape(-1)
  if hasattr(tokens, "tolist"):
    tokens = tokens.tolist()
  if isinstance(tokens, (str, bytes, dict, set, frozenset)) or not hasattr(
      tokens, "__iter__"):
    raise TypeError(
        f"tokens must be a list of token ids, got {type(tokens).__name__}.")
  tokens = list(tokens)
  if any(isinstance(t, (list, tuple)) for t in tokens):
    raise ValueError("a Session holds one row: pass one flat list of ids.")
  return tokens
