"""What a `Run` reads back: tokens, finish reasons, captures, state.

`RunReading` holds the reading half of `Run` (`run.py`, the driver of the
programs). It reads the attributes a run keeps (``carry``, ``view``,
``request``, ``rows``, ``host_reason``, ``keep``, ``emitted``,
``captured``, ``finished``, ``timings``, ``_history``, ``_start`` and the
prepared decode model, ``_prepared``) and writes only its own counters
(``emitted``, ``captured``: what `new_tokens` and `new_captures` handed
out already). Host-side rows are ``[0, rows)``; the loop state carries the
batch bucket's padding rows beyond them.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from penzai import pz

from penzai_lm.generation.captures import CaptureBuffers
from penzai_lm.generation.results import GenerationResult
from penzai_lm.generation.state import Outputs
from penzai_lm.generation.state import REASON_NAMES


class RunReading:
  """The reading methods of `Run` (see the module docstring)."""

  def model_state(self) -> list:
    """The model's state leaves after this run (device arrays).

    Raises:
      RuntimeError: if nothing ran, or the state was handed to a decode
        call that did not return (interrupted).
    """
    if self.carry is None:
      raise RuntimeError("the run has no state (it never started).")
    packed = self.carry.model_state
    if any(x.is_deleted() for x in packed if hasattr(x, "is_deleted")):
      raise RuntimeError("the run's device state was released.")
    return [x.reshape(s.shape)
            for x, s in zip(packed, self._prepared.layout.leaves)]

  def patch_state(self) -> dict[str, object]:
    """Final values of the user's model state (patches' state variables),
    by label, batch axis cut to the request's rows; {} if nothing ran."""
    if self.carry is None or not self._prepared.layout.user_labels:
      return {}
    carry = self.carry.model_state
    if self.request.decode.use_cache:
      state = self._prepared.layout.unflatten(self.model_state())
    else:
      state = carry.state
    axis = self.request.decode.batch_axis
    out = {}
    for v in state:
      if v.label in self._prepared.layout.user_labels:
        out[v.label] = jax.tree_util.tree_map(
            lambda x: x[{axis: slice(0, self.rows)}] if isinstance(
                x, pz.nx.NamedArrayBase) and axis in x.named_shape else x,
            v.value, is_leaf=pz.nx.is_namedarray)
    return out

  def capture_buffers(self) -> CaptureBuffers | None:
    """The capture buffers on the host (None without captures or before
    the prefill)."""
    prepared = self._prepared
    if not prepared.captures or self.carry is None:
      return None
    axis = self.request.decode.batch_axis
    if self.request.decode.use_cache:
      state = prepared.layout.unflatten(self.model_state())
      values = {v.label: v.value for v in state}
      positions = values[prepared.layout.labels.positions]
    else:
      carry = self.carry.model_state
      values = {v.label: v.value for v in carry.state}
      positions = pz.nx.wrap(carry.positions).tag(axis, "seq")
    return CaptureBuffers.read(prepared.captures, values, positions, axis)

  def tail_pending(self, row: int) -> bool:
    """Whether a finished row's last token is still to be fed (captures)."""
    return (self.view is not None and self.host_reason[row] is None
            and bool(self.view.tail[row]))

  def _capture_end(self, row: int) -> int:
    """End of a row's kept tokens among its real slots."""
    return (self._history + len(self.request.prompt_of_row(row))
            + self.row_length(row))

  def new_captures(self, buffers: CaptureBuffers, row: int
                   ) -> dict[str, pz.nx.NamedArray]:
    """Captured values of the row's tokens not yet taken with this method
    (prompt tokens first; each token's once it has been fed)."""
    start = self._history + self.captured[row]
    stop = min(buffers.count(row), self._capture_end(row))
    self.captured[row] = max(self.captured[row], stop - self._history)
    return buffers.row(row, start, max(start, stop))

  def row_length(self, row: int) -> int:
    if self.view is None:
      return 0
    n = int(self.view.step[row])
    return n if self.keep[row] is None else min(n, self.keep[row])

  def tokens_of(self, row: int, start: int = 0) -> list[int]:
    if self.view is None:
      return []
    return self.view.out.tokens[row, start:self.row_length(row)].tolist()

  def finish_reason(self, row: int) -> str | None:
    if self.host_reason[row] is not None:
      return self.host_reason[row]
    if self.view is None:
      return None
    return REASON_NAMES[int(self.view.reason[row])]

  def new_tokens(self, row: int) -> tuple[list[int], list[float], list[bool]]:
    """Tokens of a row not yet taken with this method."""
    start, end = self.emitted[row], self.row_length(row)
    self.emitted[row] = max(start, end)
    out = self.view.out
    return (out.tokens[row, start:end].tolist(),
            out.logprobs[row, start:end].tolist(),
            out.forced[row, start:end].tolist())

  def result(self) -> GenerationResult:
    """The result so far (rows still running have finish reason None)."""
    out = self.view.out if self.view is not None else Outputs.empty(
        self.rows, 0, self.request.logprobs_top_n, xp=np)
    lengths = [self.row_length(r) for r in range(self.rows)]
    self.timings.total_s = time.perf_counter() - self._start
    result = GenerationResult.from_outputs(
        out, lengths, [self.finish_reason(r) for r in range(self.rows)],
        self.request, self.timings)
    if self.finished:
      result.state = self.patch_state()
    buffers = self.capture_buffers()
    if buffers is not None:
      rows = [buffers.row(r, self._history, self._capture_end(r))
              for r in range(self.rows)]
      result.captures = {name: [row[name] for row in rows]
                         for name in (p.name for p in self.request.capture)}
    return result
