"""`Run`: one request in flight -- a thin driver of the two programs.

A run holds the decode loop's `LoopState` (on device between calls), a host
copy of its small part (`LoopState.host_view`) and what the host adds:
forced-token queues, rows ended from the host (stop strings, cancellation),
tool replies and timings. `Engine.generate` drives it in one decode call (or
chunks when the host must take part), `GenerationStream` in chunks of ``k``
steps, and `Session` reads the state it leaves for the next turn. What a
run hands back (tokens, captures, the final state) is `run_reading.py`.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from penzai_lm.generation import prefill as prefill_lib
from penzai_lm.generation import programs
from penzai_lm.generation import stacked_prefill
from penzai_lm.generation.prepare import PreparedModel
from penzai_lm.generation.prompts import token_list
from penzai_lm.generation.request import Request
from penzai_lm.generation.run_reading import RunReading
from penzai_lm.generation.results import GenerationResult
from penzai_lm.generation.results import Timings
from penzai_lm.generation.state import CANCELLED
from penzai_lm.generation.state import Continuation
from penzai_lm.generation.state import DecodeInputs
from penzai_lm.generation.state import LoopState
from penzai_lm.generation.state import RUNNING
from penzai_lm.generation.state import STOP
from penzai_lm.runtime.program_cache import Pending


def _padded(values, rows: int, fill, dtype) -> np.ndarray:
  return np.asarray(list(values) + [fill] * (rows - len(values)), dtype)


def _prompt_batch(request: Request):
  """(tokens, padding, src, real): prompts left-padded to the bucket."""
  shape = request.prefill
  B, P, rows = shape.decode.batch, shape.prompt_len, request.num_rows
  if shape.gather:
    prompts, src = request.prompts, [r // request.num_samples
                                     for r in range(rows)]
  else:
    prompts, src = [request.prompt_of_row(r) for r in range(rows)], range(rows)
  tokens = np.zeros((shape.batch, P), np.int32)
  padding = np.ones((shape.batch, P), bool)
  for i, prompt in enumerate(prompts):
    tokens[i, P - len(prompt):] = prompt
    padding[i, P - len(prompt):] = False
  return (tokens, padding, _padded(src, B, 0, np.int32),
          np.arange(B) < rows)


MAX_CHUNK_SIZE = 1 << 30  # Loop steps are int32 on device.


def check_run_controls(chunk_size, cancel) -> None:
  """Checks `generate`'s and `stream`'s ``chunk_size`` and ``cancel``; the
  public functions call it before anything is prepared.

  Raises:
    ValueError / TypeError: naming the argument.
  """
  check_chunk_size(chunk_size)
  check_cancel(cancel)


def check_chunk_size(chunk_size) -> None:
  if (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
      or not 1 <= chunk_size <= MAX_CHUNK_SIZE):
    raise ValueError(
        f"chunk_size must be a positive integer (at most 2**30), got"
        f" {chunk_size!r}.")


def check_cancel(cancel) -> None:
  if cancel is not None and not callable(getattr(cancel, "is_set", None)):
    raise TypeError(
        f"cancel must be a threading.Event (or have is_set()), got"
        f" {type(cancel).__name__}.")


class Run(RunReading):
  """One request in flight; see the module docstring.

  Attributes:
    request: The validated `Request`.
    rows: Rows of the request (the loop runs ``request.decode.batch``).
    start_slot: First cache slot of this run's prompt (a session's turn
      appends after the previous one).
    view: Host copy of the loop state's small part (None before the
      prefill).
    finished: Whether every row has finished.
    timings: `Timings` so far.
  """

  def __init__(self, engine, prepared, request: Request, *,
               tool=None, continuation: Continuation | None = None,
               prefill_first: PreparedModel | None = None,
               started: float | None = None):
    # ``prepared``: the decode model's `PreparedModel`, or with
    # ``prefill_first`` (the model a fresh prompt is prefilled on, with its
    # layer stacks: `Engine`) a function that prepares it, called once the
    # prefill is compiling. ``started``: when the engine began the request
    # (its host preparation counts in ``total_s``).
    self._start = time.perf_counter() if started is None else started
    self._engine = engine
    self._prefill_first = prefill_first
    self._prepare_later = prepared if prefill_first is not None else None
    self._prepared_model = None if prefill_first is not None else prepared
    self.request = request
    self.tool = tool
    self.rows = request.num_rows
    self.start_slot = 0
    self._history = 0  # Real tokens of a session's earlier turns.
    self._state_args = None if prefill_first is not None else (
        prepared.state_args)
    if continuation is not None:
      self._state_args = continuation.state_args(prepared.layout,
                                                 prepared.state_args)
      self.start_slot = continuation.start_slot
      self._history = continuation.positions
    shape = request.decode
    B = shape.batch
    stop_ids = np.full((B, shape.stop_width), -1, np.int32)
    for r, ids in enumerate(request.stop_tokens):
      stop_ids[r, :len(ids)] = ids
    self._settings = request.sampling.pad_rows(B)
    self._max_new = _padded(request.max_new_tokens, B, 1, np.int32)
    self._min_new = _padded(request.min_new_tokens, B, 0, np.int32)
    self._stop_ids = stop_ids
    self._pause_id = np.asarray(
        -1 if tool is None else int(tool.pause_token_id), np.int32)
    self.queues: list[list[int]] = [list(f) for f in request.forced_tokens]
    self._end_rows = np.zeros((B,), bool)
    self._end_reason = np.zeros((B,), np.int32)
    self._resume = np.zeros((B,), bool)
    self.host_reason: list[str | None] = [None] * self.rows
    self.keep: list[int | None] = [None] * self.rows  # Cut by the host.
    self.emitted = [0] * self.rows
    self.captured = [0] * self.rows  # Tokens whose captures were taken.
    self.carry: LoopState | None = None
    self.view: LoopState | None = None
    self.timings = Timings(batch_rows=B, prompt_tokens=int(
        sum(len(p) for p in request.prompts)))
    self.finished = False

  # Device calls.

  def run_to_end(self, *, cancel=None, chunk_size: int = 8
                 ) -> GenerationResult:
    """Prefills and decodes until every row has finished.

    Where the prefill did not pick the first tokens, the first decode call
    runs one step (so the time to first token is measured). Then one call
    runs to the end, or chunks of ``chunk_size`` steps between which
    ``cancel`` (a ``threading.Event``) is checked. Both were checked by the
    caller (`check_run_controls`).
    """
    if cancel is not None and cancel.is_set():
      self.cancel()
      return self.result()
    self.prefill()
    if not self.view.t:
      self.decode(1)
    while not self.finished:
      if cancel is None:
        self.decode(None)
      elif cancel.is_set():
        self.cancel()
      else:
        self.decode(chunk_size)
    return self.result()

  @property
  def _prepared(self) -> PreparedModel:
    """The decode model, prepared now if the run began with only its
    prefill's model (while the prefill compiles: it counts in
    ``timings.compile_s``)."""
    if self._prepared_model is None:
      self._prepared_model = self._prepare_later()
      self._prepare_later = None
      self._state_args = self._prepared_model.state_args
    return self._prepared_model

  def prefill(self, *, streamed: bool = False) -> None:
    """Runs the prefill program; with ``emits_first`` every row has its
    first token afterwards (``view.t`` is 1).

    On a first request XLA compiles the decode program on another thread:
    beside the prefill's compile, or, for a ``streamed`` run whose prefill
    emits the first tokens, after it, so that those come sooner (a new
    SmolLM2 process: first streamed token 5.44 -> 4.39 s). There the
    prefill compiles on another thread while this one traces the decode
    program, which then waits for neither (4.33 -> 4.13 s). Unstreamed, a
    whole first request ends sooner beside it (SmolLM2's first `generate`
    took 5.9 s the other way, against 5.2; docs/cpu-speed.md).

    A run that began with only the prefill's model (``prefill_first``, a
    model not prepared before) has XLA compile the prefill on another
    thread before this one prepares the decode model; where the decode
    model's state is not what that prefill hands over
    (`stacked_prefill.fits`), the prompt is prefilled per layer instead."""
    first = None if self.request.prefill.continued else self._prefill_first
    pending, args = self._lower_prefill(first)
    if first is not None:
      pending.start_compile()
      if not stacked_prefill.fits(self._prepared, first):
        self._prefill_first = None
        pending, args = self._lower_prefill(None)
    prepared = self._prepared
    first_request = (pending.out_info is not None
                     and prepared.layout.placement is None)
    if first is not None and streamed and self.request.prefill.emits_first:
      # The prefill has compiled by now, beside the decode model's
      # preparation: its first tokens come before the decode program is
      # traced (by the next `decode`).
      first_request = False
    decode = self._decode_beside(pending, streamed) if first_request else None
    try:
      program, seconds = pending.compile()
      self.timings.compile_s += seconds
      start = time.perf_counter()
      self.carry = jax.block_until_ready(program(*args))
    except BaseException:
      if decode is not None:
        decode.abandon()
      raise
    if decode is not None:
      # After the prefill's compile and run rather than beside them
      # (docs/cpu-speed.md); the first tokens are out now.
      decode.start_compile()
    self.view = self.carry.host_view()
    self.timings.prefill_s = time.perf_counter() - start
    if self.view.t:
      self.timings.time_to_first_token_s = self.timings.prefill_s
      self._after_call()

  def _lower_prefill(self, first: PreparedModel | None
                     ) -> tuple[Pending, tuple]:
    """The prefill program traced, and its arguments: over ``first`` (a
    model with layer stacks), else, for a fresh prompt, over the decode
    model's prefill model if it has one (`stacked_prefill.py`), else over
    the decode model itself."""
    over = first
    if over is None and not self.request.prefill.continued:
      over = self._prepared.prefill
    stacked = stacked_prefill.program_static(over)
    if stacked is None:
      runs_on = self._prepared
      state_args, static = self._state_args, (runs_on.treedef, runs_on.layout)
    else:
      # The decode model's structure and layout play no part (the carry's
      # layout is ``stacked.carried``): one program for the first request
      # and the next.
      runs_on, state_args, static = over, over.state_args, (None, None)
    args = (runs_on.model_leaves, state_args, *_prompt_batch(self.request),
            np.asarray(self.start_slot, np.int32), self._decode_inputs(1))
    # Its first token is picked as the decode program picks (the same
    # sampler: ``cpu_sampler`` of the prepared model).
    shape = dataclasses.replace(self.request.prefill, decode=dataclasses.replace(
        self.request.decode, cpu_sampler=runs_on.cpu_sampler))
    pending = self._engine.lower(
        "prefill", prefill_lib.prefill_program, (shape, *static, stacked),
        args, shape=shape, blocks=runs_on.blocks,  # Over a stack: one.
        parameters=runs_on.parameters)
    return pending, args

  def _decode_beside(self, prefill: Pending, streamed: bool
                     ) -> Pending | None:
    """Traces the decode program of a first request beside the prefill's
    compile. Its XLA compile starts now, or, for a ``streamed`` run whose
    prefill emits the first tokens, is returned for the caller to start
    after the prefill has run (the prefill then compiles on another thread
    from now on, while this one traces). Its tracing counts in the
    prefill's compile seconds, which run from the start of the prefill's
    lowering."""
    later = streamed and self.request.prefill.emits_first
    if later:
      prefill.start_compile()
    decode = self._lower_decode(prefill.out_info)
    if not later and decode is not None:
      # XLA builds the decode program (its carry is the prefill's output)
      # on another core while the prefill compiles and runs (SmolLM2 fp32:
      # first generate 4.1 -> 2.7 s of compile+trace).
      decode.start_compile()
      return None
    return decode

  def _lower_decode(self, carry_info) -> Pending | None:
    """The decode program for a carry like ``carry_info``, traced for a
    compile on another thread (None: cached or being made)."""
    prepared = self._prepared
    return self._engine.lower_ahead(
        "decode", programs.decode_program, self._decode_static(),
        (prepared.model_leaves, carry_info, self._decode_inputs(0)),
        shape=self.request.decode, donate=(1,), blocks=prepared.blocks,
        parameters=prepared.parameters)

  def decode(self, steps: int | None = None) -> None:
    """Runs the loop for at most ``steps`` iterations (None: to the end)."""
    if self.finished:
      return
    t = int(self.view.t)
    inputs = self._decode_inputs(
        np.iinfo(np.int32).max if steps is None else t + steps)
    args = (self._prepared.model_leaves, self.carry, inputs)
    program, seconds = self._engine.program(
        "decode", programs.decode_program, self._decode_static(), args,
        shape=self.request.decode, donate=(1,), blocks=self._prepared.blocks,
        parameters=self._prepared.parameters)
    self.timings.compile_s += seconds
    start = time.perf_counter()
    self.carry = program(*args)
    self.view = self.carry.host_view()
    self.timings.add_decode_call(time.perf_counter() - start,
                                 int(self.view.t) - t)
    self._after_call()

  def _after_call(self) -> None:
    """The host's part after a call that ran loop steps: consumed forced
    tokens, rows waiting for the host, whether every row has finished."""
    self._end_rows[:] = False
    self._resume[:] = False
    for r in range(self.rows):
      del self.queues[r][:int(self.view.q_pos[r])]
    self._handle_waiting()
    self.finished = self._all_done()

  def _decode_static(self):
    shape = dataclasses.replace(self.request.decode,
                                cpu_sampler=self._prepared.cpu_sampler)
    return (shape, self._prepared.treedef,
            self._prepared.layout)

  def _decode_inputs(self, stop_at: int) -> DecodeInputs:
    B, Q = self.request.decode.batch, self.request.decode.queue_len
    q_tokens = np.zeros((B, Q), np.int32)
    q_len = np.zeros((B,), np.int32)
    q_more = np.zeros((B,), bool)
    for r, queue in enumerate(self.queues):
      n = min(len(queue), Q)
      q_tokens[r, :n] = queue[:n]
      q_len[r] = n
      q_more[r] = len(queue) > Q
    return DecodeInputs(
        settings=self._settings, max_new=self._max_new, min_new=self._min_new,
        stop_ids=self._stop_ids, pause_id=self._pause_id,
        stop_at=np.asarray(stop_at, np.int32), end_rows=self._end_rows.copy(),
        end_reason=self._end_reason.copy(), resume=self._resume.copy(),
        q_tokens=q_tokens, q_len=q_len, q_more=q_more)

  def _handle_waiting(self) -> None:
    for r in np.flatnonzero(self.view.waiting[:self.rows]):
      if self.tool is not None and not self.queues[r]:
        prompt = self.request.prompt_of_row(r)
        reply = self.tool.respond(prompt.tolist() + self.tokens_of(r))
        if reply:
          self.queues[r].extend(int(t) for t in reply)
      self._resume[r] = True

  def _all_done(self) -> bool:
    if any(self.tail_pending(r) for r in range(self.rows)):
      return False  # Last tokens to feed for the captures.
    return all(self.finish_reason(r) is not None for r in range(self.rows))

  # Host control.

  def end_row(self, row: int, reason: str, keep: int | None = None) -> None:
    """Ends a row from the host (stop string, cancellation), keeping its
    first ``keep`` tokens (all if None)."""
    if self.host_reason[row] is not None:
      return
    if self.view is None:
      raise RuntimeError("end_row() needs a started run.")
    if self.view.reason[row] != RUNNING and keep is None:
      return
    self.host_reason[row] = reason
    self.keep[row] = keep
    self._end_rows[row] = True
    self._end_reason[row] = STOP if reason == "stop" else CANCELLED
    self.finished = self._all_done()

  def force(self, row: int, tokens) -> None:
    """Queues forced tokens for a row (consumed before sampling)."""
    if not 0 <= row < self.rows:
      raise IndexError(f"row {row} is outside [0, {self.rows}).")
    self.queues[row].extend(
        token_list("forced tokens", tokens, self.request.decode.vocab))

  def cancel(self) -> None:
    """Ends every running row with "cancelled" (nothing more runs)."""
    for r in range(self.rows):
      if self.finish_reason(r) is None:
        self.host_reason[r] = "cancelled"
    self.finished = True
