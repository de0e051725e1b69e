"""The device state of a generation run, as typed pytrees.

* `StateLayout`: how a prepared model's state (caches, positions, patch
  state) is laid out. Static: it is part of every program's cache key.
  Constant leaves (empty caches, positions -1) are described by shape and
  fill and created inside the programs, so nothing cache-sized is kept on the
  host or transferred.
* `LoopState`: the decode loop's carry (model state, per-row progress, the
  sampler's statistics and the output buffers), a registered pytree
  dataclass that stays on device between calls.
* `DecodeInputs`: what the host passes to each decode call (sampling
  settings, limits, forced-token queues, rows ended or resumed by the host).
* `Continuation`: the state a `Session`'s next turn starts from.

Array conventions: ``B`` decode rows, ``T`` output slots per row (the cache
length), ``Q`` forced tokens per row and call; per-row arrays are ``(B,)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm import sampling
from penzai_lm.model.cache_layout import CacheLabels
from penzai_lm.model.cache_layout import CacheLayout

# Row status codes on device.
(RUNNING, STOP, LENGTH, CACHE_FULL, CANCELLED, PADDING_ROW,
 NON_FINITE) = range(7)
# The finish reason of each status code (None: not finished).
REASON_NAMES = (None, "stop", "length", "cache_full", "cancelled", None,
                "non_finite")


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """One leaf of a model's state.

  Attributes:
    shape: Its shape (with size-1 dimensions; see `StateLayout.pack`).
    dtype: Its dtype.
    fill: The value of every element of a constant leaf (built inside the
      programs), or None for a leaf passed in as an argument.
  """

  shape: tuple[int, ...]
  dtype: np.dtype
  fill: Any = None


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """The layout of a prepared model's state (static in the programs).

  Attributes:
    treedef: Structure of the state (a list of ``pz.StateVariableValue``).
    leaves: One `LeafSpec` per leaf.
    labels: The cache bookkeeping labels, or None without a KV cache.
    user_labels: Labels of the state variables of the user's model (patch
      state), as opposed to the caches the engine adds.
    placement: Where the state lives on a sharded model's mesh
      (`penzai_lm.runtime.placement.Placement`); None on one device.
  """

  treedef: Any
  leaves: tuple[LeafSpec, ...]
  labels: CacheLabels | None = None
  user_labels: frozenset[str] = frozenset()
  placement: Any = None

  def initial(self, args) -> list:
    """The state from its non-constant leaves ``args`` (inside a program)."""
    args = iter(args)
    leaves = [next(args) if s.fill is None else jnp.full(s.shape, s.fill,
                                                          s.dtype)
              for s in self.leaves]
    return jax.tree_util.tree_unflatten(self.treedef, leaves)

  def unflatten(self, leaves) -> list:
    return jax.tree_util.tree_unflatten(self.treedef, list(leaves))

  def conform(self, state) -> list:
    """``state`` in this layout: each variable's arrays with their axes in
    the layout's order, and a variable whose values have other axes or
    sizes replaced by zeros of the layout's.

    A patch's state may take its shape from the call that sets it (penzai's
    ``SaveIntermediate`` holds the last value it saw: the prompt in the
    prefill, one token per decode step). The loop carries what a decode
    step leaves; the prefill's value of another shape is dropped (the first
    decode step sets it).

    ``state`` is a list of what the layout's treedef lists: variables
    (``pz.StateVariableValue``) or their values.
    """
    zeros = self.unflatten(jnp.zeros(s.shape, s.dtype) for s in self.leaves)
    return [pz.nx.order_like(v, ref) if _same_axes(v, ref)
            else ref for v, ref in zip(state, zeros)]

  def pack(self, state) -> list:
    """The state's arrays without their size-1 dimensions (the loop carry).

    With a batch of one row, every cache has a size-1 dimension. XLA drops it
    (a bitcast) where attention reads the cache, and then fuses the in-place
    cache write once per differently shaped user, copying the whole cache
    for each (at a 2048-slot cache that made SmolLM2's decode 2x slower).
    Carrying the arrays already squeezed gives every user the same shape.
    """
    return [x.reshape([d for d in x.shape if d != 1])
            for x in jax.tree_util.tree_leaves(state)]

  def unpack(self, packed) -> list:
    """Inverse of `pack`."""
    return self.unflatten(
        x.reshape(s.shape) for x, s in zip(packed, self.leaves))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Outputs:
  """Per-row output buffers, ``(B, T)`` (top-n: ``(B, T, n)`` or None)."""

  tokens: jax.Array
  logprobs: jax.Array
  forced: jax.Array
  top_logprobs: jax.Array | None = None
  top_ids: jax.Array | None = None

  @classmethod
  def empty(cls, rows: int, slots: int, top_n: int, xp=jnp) -> Outputs:
    top = (rows, slots, top_n)
    return cls(
        tokens=xp.zeros((rows, slots), np.int32),
        logprobs=xp.zeros((rows, slots), np.float32),
        forced=xp.zeros((rows, slots), bool),
        top_logprobs=xp.zeros(top, np.float32) if top_n else None,
        top_ids=xp.zeros(top, np.int32) if top_n else None)

  def write(self, index, token, logprob, forced, top=None) -> Outputs:
    """Writes one token per row at column ``index`` (``T``: dropped)."""
    rows = jnp.arange(self.tokens.shape[0])
    put = lambda buf, value: buf.at[rows, index].set(value, mode="drop")  # noqa: E731
    return Outputs(
        tokens=put(self.tokens, token),
        logprobs=put(self.logprobs, logprob),
        forced=put(self.forced, forced),
        top_logprobs=None if top is None else put(self.top_logprobs, top[0]),
        top_ids=None if top is None else put(self.top_ids, top[1]))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RecomputeState:
  """Model state of the ``use_cache=False`` reference loop: the whole
  sequence so far, recomputed every step."""

  tokens: jax.Array  # (B, C) ids written so far.
  positions: jax.Array  # (B, C) position of every slot, -1 = none.
  state: Any  # The uncached model's own state (patches).


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
  """The decode loop's carry.

  Attributes:
    model_state: The model's packed state (`StateLayout.pack`), or a
      `RecomputeState` without a KV cache.
    slots: Cache slots written (scalar, shared by all rows).
    next_token: Each row's pending token (fed next).
    feed: Rows that feed a token next iteration.
    step: Tokens each row has generated.
    reason: Row status (`RUNNING`, `STOP`, ...).
    waiting: Rows paused for the host (tool call, forced queue refill).
    q_pos: Forced tokens each row consumed in this call.
    t: Loop iterations so far.
    gen_start: Each row's first generated position (the model's
      ``generation_start`` side input).
    tail: Finished rows whose last token is still to be fed (captures).
    sampler: Token statistics for the penalties.
    out: The output buffers.
  """

  model_state: Any
  slots: jax.Array
  next_token: jax.Array
  feed: jax.Array
  step: jax.Array
  reason: jax.Array
  waiting: jax.Array
  q_pos: jax.Array
  t: jax.Array
  gen_start: jax.Array
  tail: jax.Array
  sampler: sampling.SamplerState | None
  out: Outputs

  def host_view(self) -> LoopState:
    """Everything but the model state and sampler statistics, on the host
    (numpy); the small part of the carry the host reads after each call."""
    return jax.device_get(
        dataclasses.replace(self, model_state=None, sampler=None))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeInputs:
  """What the host passes to one decode call.

  Attributes:
    settings: Sampling settings, one row per decode row.
    max_new: (B,) tokens each row may generate.
    min_new: (B,) tokens each row generates before its stop ids may be
      sampled.
    stop_ids: (B, S) stop ids per row, -1 padded.
    pause_id: Token after which a row waits for the host (a tool), or -1.
    stop_at: Run until ``t`` reaches this (chunked streaming).
    end_rows: (B,) rows the host ends now (stop strings, cancellation)...
    end_reason: (B,) ...with this status.
    resume: (B,) paused rows to resume.
    q_tokens: (B, Q) forced tokens queued for this call.
    q_len: (B,) queued tokens per row.
    q_more: (B,) whether the host holds more forced tokens for the row.
  """

  settings: sampling.SamplingSettings
  max_new: jax.Array
  min_new: jax.Array
  stop_ids: jax.Array
  pause_id: jax.Array
  stop_at: jax.Array
  end_rows: jax.Array
  end_reason: jax.Array
  resume: jax.Array
  q_tokens: jax.Array
  q_len: jax.Array
  q_more: jax.Array


@dataclasses.dataclass(frozen=True)
class Continuation:
  """The state a run continues from (a `Session`'s previous turn).

  Attributes:
    state: Leaves of the cached model's state after the previous turn, on
      device; None for an empty cache of ``cache_len`` slots (0: sized by
      the first turn).
    start_slot: Cache slot where the new tokens go. Slots from here on are
      discarded (tokens the previous turn generated past what it kept).
    positions: Real tokens already in the cache (the next token position).
    cache_len: Cache slots of ``state``; the next turn may grow the cache.
  """

  state: tuple | None
  start_slot: int
  positions: int
  cache_len: int

  def state_args(self, layout: StateLayout, empty_args) -> list:
    """All state leaves for a model of ``layout`` (whose non-constant empty
    leaves are ``empty_args``), grown from ``state``.

    Grown slots take the fill of an empty cache (positions -1: unwritten).
    Growing is a copy outside the prefill program, so the prefill compiles
    once per cache size, not once per pair of sizes.

    Raises:
      ValueError: if ``state`` does not belong to a model of this layout.
    """
    if self.state is None:
      args = iter(empty_args)
      leaves = [next(args) if s.fill is None else jnp.full(s.shape, s.fill,
                                                            s.dtype)
                for s in layout.leaves]
    elif layout.labels is None or len(self.state) != len(layout.leaves) or any(
        not _fits(np.shape(x), s) for x, s in zip(self.state, layout.leaves)):
      raise ValueError(
          "the previous state does not belong to this model (different"
          " structure or shapes); start a new session for this model.")
    else:
      leaves = [CacheLayout.grow(x, s.shape, s.fill)
                for x, s in zip(self.state, layout.leaves)]
    # On a mesh, every turn passes the state in the same shardings (those
    # the prefill was compiled for).
    return leaves if layout.placement is None else layout.placement.put(
        leaves)


def _axes(value) -> list:
  """Per leaf (named arrays whole): named sizes (any order), shape, dtype."""
  return [(dict(x.named_shape), x.positional_shape, x.dtype)
          if isinstance(x, pz.nx.NamedArrayBase) else (np.shape(x), x.dtype)
          for x in jax.tree_util.tree_leaves(value,
                                             is_leaf=pz.nx.is_namedarray)]


def _same_axes(value, ref) -> bool:
  return _axes(value) == _axes(ref)


def _fits(old: tuple, spec: LeafSpec) -> bool:
  """Whether a leaf of shape ``old`` grows into ``spec`` (equal, or a
  constant-filled leaf at most as large on every axis)."""
  if tuple(old) == spec.shape:
    return True
  return (spec.fill is not None and len(old) == len(spec.shape)
          and all(o <= n for o, n in zip(old, spec.shape)))
