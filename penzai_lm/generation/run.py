"""`Run`: one request in flight, its device state and host bookkeeping.

A run owns the decode loop's carry (on device between calls) and what the
host adds: forced-token queues, rows ended from the host (stop strings,
cancellation), tool replies, timings. `generate` drives it in one decode call
(or chunks when the host must take part); the streaming helpers drive it in
chunks of ``k`` steps.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from penzai_lm import sampling
from penzai_lm.generation import plan as plan_lib
from penzai_lm.generation import prepare
from penzai_lm.generation import programs
from penzai_lm.generation import requests as requests_lib
from penzai_lm.generation.program_cache import PROGRAMS
from penzai_lm.generation.programs import REASON_NAMES
from penzai_lm.generation.programs import RUNNING
from penzai_lm.generation.programs import STOP
from penzai_lm.generation.programs import CANCELLED
from penzai_lm.generation.results import GenerationResult
from penzai_lm.generation.results import Timings


def _grown_state(prepared, continuation) -> list:
  """A previous run's state leaves, grown to ``prepared``'s cache size.

  Grown slots take the fill of an empty cache (positions -1: unwritten).
  Growing is a copy outside the prefill program, so the prefill compiles
  once per cache size, not once per pair of sizes.
  """
  if continuation.state is None:  # An empty cache.
    args = iter(prepared.state_args)
    return [next(args) if s is None else jnp.full(shape, s[2], s[1])
            for shape, s in zip(prepared.state_shapes, prepared.state_spec)]
  _check_continuation(prepared, continuation)
  leaves = []
  for x, shape, s in zip(continuation.state, prepared.state_shapes,
                         prepared.state_spec):
    if tuple(x.shape) != shape:
      x = jnp.pad(x, [(0, n - o) for o, n in zip(x.shape, shape)],
                  constant_values=s[2])
    leaves.append(x)
  return leaves


def _check_continuation(prepared, continuation) -> None:
  """The previous state must fit this model's state, grown at most."""
  shapes, spec = prepared.state_shapes, prepared.state_spec
  ok = prepared.cache_labels is not None and len(continuation.state) == len(
      shapes)
  for x, shape, s in zip(continuation.state, shapes, spec) if ok else ():
    old = tuple(np.shape(x))
    if old != shape and (s is None or len(old) != len(shape) or any(
        o > n for o, n in zip(old, shape))):
      ok = False
  if not ok:
    raise ValueError(
        "the previous state does not belong to this model (different"
        " structure or shapes); start a new session for this model.")


def _row_lists(values, rows, fill):
  return list(values) + [fill] * (rows - len(values))


class Run:
  """One request in flight: owns the device state and the host bookkeeping.

  Used by `generate` (one decode call, or chunks when the host must take
  part) and by the streaming helpers (chunks of ``k`` steps). With a
  `plan.Continuation` the prompt is appended to a previous run's state
  (see `penzai_lm.generation.session`).
  """

  def __init__(self, model, request: requests_lib.GenerationRequest, *,
               use_cache: bool = True, tool=None,
               continuation: plan_lib.Continuation | None = None):
    self._start = time.perf_counter()
    self.request = request
    self.tool = tool
    plan = plan_lib.plan_request(model, request, use_cache, continuation)
    self.plan = plan
    rows, B = request.num_rows, plan.batch
    self.rows = rows
    prepared = prepare.prepare_model(model, plan_lib.model_kind(model), plan)
    self._model_leaves = prepared.model_leaves
    self._treedef = prepared.treedef
    self._state_static = prepared.state_static
    self._state_shapes = prepared.state_shapes
    self._state_args = prepared.state_args
    self.start_slot = 0
    if continuation is not None:
      self._state_args = _grown_state(prepared, continuation)
      self.start_slot = continuation.start_slot

    # Prompts, left-padded to the bucket.
    P = plan.prompt_len
    prefill_rows = plan.prefill_batch
    if plan.gather:
      prompts = request.prompts
      src = [request.prompt_of_row(r) for r in range(rows)]
    else:
      prompts = [request.prompts[request.prompt_of_row(r)] for r in range(rows)]
      src = list(range(rows))
    tokens = np.zeros((prefill_rows, P), np.int32)
    padding = np.ones((prefill_rows, P), bool)
    for i, prompt in enumerate(prompts):
      tokens[i, P - len(prompt):] = prompt
      padding[i, P - len(prompt):] = False
    self._prefill_inputs = (
        tokens, padding, np.asarray(_row_lists(src, B, 0), np.int32),
        np.asarray([r < rows for r in range(B)], bool))

    # Per-row settings, padded with neutral rows.
    values = {name: _row_lists(v, B, requests_lib.SAMPLING_DEFAULTS.get(
        name)) for name, v in request.sampling.items()}
    for name in ("logit_bias", "banned_tokens"):
      values[name] = _row_lists(request.sampling[name], B, None)
    if all(v is None for v in values["logit_bias"]):
      values["logit_bias"] = None
    else:
      values["logit_bias"] = [v or {} for v in values["logit_bias"]]
    if all(v is None for v in values["banned_tokens"]):
      values["banned_tokens"] = None
    else:
      values["banned_tokens"] = [list(v or ()) for v in values["banned_tokens"]]
    try:
      self.settings = sampling.SamplingSettings.make(
          B, plan.vocab, seed=_row_lists(request.seeds, B, 0),
          top_k_cap=request.top_k_cap, always_dense=True, **values)
    except ValueError as e:
      hint = ""
      if request.num_samples > 1:
        hint = (f" (rows are prompt-major: row r is sample r %"
                f" {request.num_samples} of prompt r // {request.num_samples})")
      raise ValueError(f"{e}{hint}") from None
    self._max_new = np.asarray(
        _row_lists(request.max_new_tokens.tolist(), B, 1), np.int32)
    stop_ids = np.full((B, plan.stop_width), -1, np.int32)
    for r, ids in enumerate(request.stop_tokens):
      stop_ids[r, :len(ids)] = ids
    self._stop_ids = stop_ids
    pause = -1 if tool is None else int(tool.pause_token_id)
    self._pause_id = np.asarray(pause, np.int32)

    # Host bookkeeping.
    self.queues: list[list[int]] = [list(f) for f in request.forced_tokens]
    self._end_rows = np.zeros((B,), bool)
    self._end_reason = np.zeros((B,), np.int32)
    self._resume = np.zeros((B,), bool)
    self.host_reason: list[str | None] = [None] * rows
    self.keep: list[int | None] = [None] * rows  # Truncation (stop strings).
    self.emitted = [0] * rows
    self.carry = None
    self.view: dict[str, np.ndarray] | None = None
    self.timings = Timings(batch_rows=B)
    self.timings.prompt_tokens = int(sum(len(p) for p in request.prompts))
    self._first_token_done = False
    self.finished = False

  # Device calls.

  def prefill(self) -> None:
    args = (self._model_leaves, self._state_args, *self._prefill_inputs,
            np.asarray(self.start_slot, np.int32))
    program, compile_s = PROGRAMS.get(
        "prefill", programs.prefill_program,
        (self.plan, self._treedef, self._state_static), args)
    self.timings.compile_s += compile_s
    start = time.perf_counter()
    self.carry = program(*args)
    jax.block_until_ready(self.carry)
    self.timings.prefill_s = time.perf_counter() - start
    self._fetch()

  def decode(self, steps: int | None = None) -> None:
    """Runs the loop for at most ``steps`` iterations (None: to the end)."""
    if self.finished:
      return
    B, Q = self.plan.batch, self.plan.queue_len
    q_tokens = np.zeros((B, Q), np.int32)
    q_len = np.zeros((B,), np.int32)
    q_more = np.zeros((B,), bool)
    for r, queue in enumerate(self.queues):
      n = min(len(queue), Q)
      q_tokens[r, :n] = queue[:n]
      q_len[r] = n
      q_more[r] = len(queue) > Q
    t = int(self.view["t"])
    stop_at = np.asarray(
        np.iinfo(np.int32).max if steps is None else t + steps, np.int32)
    args = (self._model_leaves, self.carry, self.settings, self._max_new,
            self._stop_ids, self._pause_id, stop_at, self._end_rows,
            self._end_reason, self._resume, q_tokens, q_len, q_more)
    # The decode program does not depend on how the prefill was batched.
    plan = dataclasses.replace(
        self.plan, prefill_batch=0, gather=False, prompt_len=0,
        continued=False)
    program, compile_s = PROGRAMS.get(
        "decode", programs.decode_program,
        (plan, self._treedef, self._state_static), args, donate=(1,))
    self.timings.compile_s += compile_s
    start = time.perf_counter()
    self.carry = program(*args)
    self._fetch()
    elapsed = time.perf_counter() - start
    steps_run = int(self.view["t"]) - t
    if not self._first_token_done and steps_run:
      # The first iteration produces every row's first token.
      self._first_token_done = True
      self.timings.time_to_first_token_s = self.timings.prefill_s + (
          elapsed / steps_run if steps_run > 1 else elapsed)
      if steps_run > 1:
        self.timings.decode_s += elapsed * (steps_run - 1) / steps_run
        self.timings.decode_steps += steps_run - 1
    else:
      self.timings.decode_s += elapsed
      self.timings.decode_steps += steps_run
    self._end_rows[:] = False
    self._resume[:] = False
    consumed = self.view["q_pos"]
    for r in range(self.rows):
      if consumed[r]:
        del self.queues[r][:int(consumed[r])]
    self._handle_waiting()
    self.finished = self._all_done()

  def _fetch(self) -> None:
    keys = ["t", "step", "reason", "waiting", "feed", "q_pos", "out_tokens",
            "out_logprobs", "out_forced"]
    if self.plan.top_n:
      keys += ["out_top_logprobs", "out_top_ids"]
    self.view = jax.device_get({k: self.carry[k] for k in keys})

  def _handle_waiting(self) -> None:
    waiting = self.view["waiting"]
    for r in range(self.rows):
      if not waiting[r]:
        continue
      if self.tool is not None and not self.queues[r]:
        prompt = self.request.prompts[self.request.prompt_of_row(r)]
        reply = self.tool.respond(prompt.tolist() + self.tokens_of(r))
        if reply:
          self.queues[r].extend(int(t) for t in reply)
      self._resume[r] = True

  def _all_done(self) -> bool:
    reason = self.view["reason"]
    return all(self.host_reason[r] is not None or reason[r] != RUNNING
               for r in range(self.rows))

  # Host control.

  def end_row(self, row: int, reason: str, keep: int | None = None) -> None:
    """Ends a row from the host (stop string, cancellation)."""
    if self.host_reason[row] is not None:
      return
    if self.view is None:
      raise RuntimeError("end_row() needs a started run.")
    if self.view["reason"][row] != RUNNING and keep is None:
      return
    self.host_reason[row] = reason
    if keep is not None:
      self.keep[row] = keep
    self._end_rows[row] = True
    self._end_reason[row] = STOP if reason == "stop" else CANCELLED
    self.finished = self._all_done()

  def force(self, row: int, tokens) -> None:
    """Queues forced tokens for a row (consumed before sampling)."""
    if not 0 <= row < self.rows:
      raise IndexError(f"row {row} is outside [0, {self.rows}).")
    ids = requests_lib.token_list("forced tokens", tokens, self.plan.vocab)
    self.queues[row].extend(ids)

  def cancel(self) -> None:
    """Ends every running row with "cancelled" (nothing more runs)."""
    for r in range(self.rows):
      if self.finish_reason(r) is None:
        self.host_reason[r] = "cancelled"
    self.finished = True

  def next_continuation(self, previous: plan_lib.Continuation | None):
    """Where a one-row run leaves the conversation, for its next turn.

    Args:
      previous: The continuation this run started from (None if fresh).

    Returns:
      ``(continuation, pending)``: the state to continue from and the
      tokens that are part of the conversation but not in the cache yet
      (fed first next turn): the last kept token, or the whole prompt if
      nothing ran.

    Raises:
      RuntimeError: if the device state is gone (a decode call was
        interrupted after taking it over).
    """
    if self.rows != 1 or not self.plan.use_cache:
      raise ValueError("only a one-row cached run can be continued.")
    prompt = self.request.prompts[0].tolist()
    if self.carry is None:  # Cancelled before the prefill: nothing changed.
      return previous, prompt
    kept = self.tokens_of(0)
    pending = kept[-1:] or prompt[-1:]
    in_cache = len(prompt) + len(kept) - 1  # Real tokens this run added.
    end = self.start_slot + self.plan.prompt_len - 1 + len(kept)
    positions = (previous.positions if previous else 0) + in_cache
    packed = self.carry["mstate"]
    if any(x.is_deleted() for x in packed if hasattr(x, "is_deleted")):
      raise RuntimeError("the run's device state was released.")
    state = [x.reshape(shape) for x, shape in zip(packed, self._state_shapes)]
    return plan_lib.Continuation(
        state=state, start_slot=end, positions=positions,
        cache_len=self.plan.cache_len), pending

  # Reading.

  def row_length(self, row: int) -> int:
    if self.view is None:
      return 0
    n = int(self.view["step"][row])
    return n if self.keep[row] is None else min(n, self.keep[row])

  def tokens_of(self, row: int, start: int = 0) -> list[int]:
    return self.view["out_tokens"][row, start:self.row_length(row)].tolist()

  def finish_reason(self, row: int) -> str | None:
    if self.host_reason[row] is not None:
      return self.host_reason[row]
    if self.view is None:
      return None
    return REASON_NAMES.get(int(self.view["reason"][row]))

  def new_tokens(self, row: int) -> tuple[list[int], list[float], list[bool]]:
    """Tokens of a row not yet taken with this method."""
    start, end = self.emitted[row], self.row_length(row)
    self.emitted[row] = max(start, end)
    v = self.view
    return (v["out_tokens"][row, start:end].tolist(),
            v["out_logprobs"][row, start:end].tolist(),
            v["out_forced"][row, start:end].tolist())

  def result(self) -> GenerationResult:
    v = self.view
    if v is None:  # Nothing ran (e.g. cancelled before the prefill).
      B, T, n = self.plan.batch, self.plan.out_len, max(1, self.plan.top_n)
      v = dict(
          step=np.zeros((B,), np.int32), out_tokens=np.zeros((B, T), np.int32),
          out_logprobs=np.zeros((B, T), np.float32),
          out_forced=np.zeros((B, T), bool),
          out_top_ids=np.zeros((B, T, n), np.int32),
          out_top_logprobs=np.zeros((B, T, n), np.float32))
    n = self.request.num_samples
    tokens, logprobs, forced, reasons = [], [], [], []
    top = [] if self.plan.top_n else None
    for r in range(self.rows):
      end = self.row_length(r)
      tokens.append(v["out_tokens"][r, :end].tolist())
      logprobs.append(v["out_logprobs"][r, :end].tolist())
      forced.append(v["out_forced"][r, :end].tolist())
      reasons.append(self.finish_reason(r))  # None: still running.
      if top is not None:
        ids = v["out_top_ids"][r, :end].tolist()
        lps = v["out_top_logprobs"][r, :end].tolist()
        top.append([list(zip(i, l)) for i, l in zip(ids, lps)])
    t = self.timings
    t.total_s = time.perf_counter() - self._start
    t.generated_tokens = sum(len(x) for x in tokens)
    if t.time_to_first_token_s:
      t.prefill_tokens_per_s = t.prompt_tokens / t.time_to_first_token_s
    if t.decode_s and t.decode_steps:
      t.decode_tokens_per_s = t.decode_steps / t.decode_s
    return GenerationResult(
        tokens=tokens,
        finish_reasons=reasons,
        logprobs=logprobs,
        forced=forced,
        prompt_indices=[r // n for r in range(self.rows)],
        sample_indices=[r % n for r in range(self.rows)],
        seeds=list(self.request.seeds),
        prompt_lengths=self.request.row_prompt_lengths,
        timings=t,
        top_logprobs=top,
    )
