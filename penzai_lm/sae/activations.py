"""Activations for training autoencoders: token windows in, shuffled batches
out.

* `token_windows` turns what the user gives into fixed-length windows of
  ids: a token stream (1-D: cut into windows, cycled with a new order each
  pass), windows (2-D: cycled likewise), or an iterable of 2-D batches
  (consumed once).
* `PointActivations` runs the model on ``rows`` windows at a time, in one
  compiled program (`run_with_cache`'s captures, called statelessly under
  ``jax.jit``, on per-block layers: XLA drops the blocks after the point
  and the unembedding, since only the point's value is returned), and
  gives the value flattened to
  ``[tokens, d_in]`` in the order of the point's axes, without each
  window's first ``skip_positions`` tokens (the first position carries the
  attention sink's huge activations, which no autoencoder should spend
  features on).
* `finite_chunks` refuses activations holding NaN or inf (counting the
  rows), before `NormFilter` would compare their norms.
* `NormFilter` drops activations far longer than the median (attention
  sinks besides position 0).
* `ShuffleBuffer` mixes activations across windows in bounded memory, as
  SAELens's mixing buffer: fill to capacity, shuffle, hand out half, refill.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.model import points as points_lib
from penzai_lm.model.captures import insert_captures
from penzai_lm.model.stateless import stateless_call
from penzai_lm.runtime.shared_traces import share_block_traces
from penzai_lm.runtime.unstack import unstack_layers


def token_windows(tokens, length: int, seed: int, *, cycle: bool = True,
                  vocab: int | None = None) -> Iterator[np.ndarray]:
  """Windows of ``length`` ids, one ``[length]`` array at a time.

  Args:
    tokens: A 1-D stream of ids (cut into windows, the tail dropped), a 2-D
      array of windows, or an iterable of 2-D batches of windows.
    length: Window length.
    seed: Orders the windows of an array source (a new order each pass).
    cycle: Pass over an array source again when it ends (iterables end).
    vocab: If given, every id must lie in ``[0, vocab)`` (`check_token_ids`;
      an array source is checked before the first window, each batch of an
      iterable before its windows).

  Raises:
    ValueError: for windows of another length, a stream shorter than one
      window, or an id outside the vocabulary.
  """
  array = _as_array(tokens, vocab)
  if array is None:
    for i, batch in enumerate(tokens):
      batch = np.asarray(batch)
      if batch.ndim != 2 or batch.shape[1] != length:
        raise ValueError(
            f"token batches must be [rows, {length}] (context_length), got"
            f" shape {batch.shape}.")
      check_token_ids(batch, vocab, f"token batch {i}")
      yield from batch.astype(np.int32)
    return
  if array.ndim == 1:
    count = array.shape[0] // length
    if not count:
      raise ValueError(f"the token stream has {array.shape[0]} ids, fewer"
                       f" than one window of context_length={length}.")
    array = array[:count * length].reshape(count, length)
  if array.ndim != 2 or array.shape[1] != length or not array.shape[0]:
    raise ValueError(f"token windows must be [rows, {length}]"
                     f" (context_length), got shape {array.shape}.")
  rng = np.random.default_rng(seed)
  while True:
    yield from array[rng.permutation(array.shape[0])]
    if not cycle:
      return


def check_token_ids(ids: np.ndarray, vocab: int | None, what: str) -> None:
  """Raises unless every id of ``ids`` lies in ``[0, vocab)`` (as
  `penzai_lm.generation.generate` checks prompts; None: no check).

  Raises:
    ValueError: naming ``what``, the first id outside and the range.
  """
  if vocab is None or not ids.size:
    return
  if not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{what} must hold integer token ids, got dtype"
                     f" {ids.dtype}.")
  low, high = int(ids.min()), int(ids.max())
  if low < 0 or high >= vocab:
    bad = low if low < 0 else high
    raise ValueError(f"{what} contains token id {bad}, outside the model's"
                     f" vocabulary [0, {vocab}).")


def _as_array(tokens, vocab: int | None = None) -> np.ndarray | None:
  """An int32 array from an array-like source (its ids checked against
  ``vocab`` before the cast), None for an iterable."""
  if isinstance(tokens, (np.ndarray, jax.Array)):
    array = np.asarray(tokens)
  elif isinstance(tokens, (list, tuple)) and (
      not tokens or isinstance(tokens[0], (int, np.integer, list, tuple,
                                           np.ndarray))):
    try:
      array = np.asarray(tokens)
    except ValueError as e:
      raise ValueError("token windows must all have the same length.") from e
  else:
    return None
  if not np.issubdtype(array.dtype, np.integer):
    raise ValueError(f"tokens must be integer ids, got dtype {array.dtype}.")
  check_token_ids(array, vocab, "tokens")
  return array.astype(np.int32)


def split_held_out(tokens, length: int, windows: int, *,
                   vocab: int | None = None):
  """``(training source, held-out [windows, length] array or None)``: the
  last windows of an array source, the first ones of an iterable (ids
  checked against ``vocab`` as in `token_windows`)."""
  if not windows:
    return tokens, None
  array = _as_array(tokens, vocab)
  if array is None:
    iterator = token_windows(tokens, length, 0, cycle=False, vocab=vocab)
    held = [w for _, w in zip(range(windows), iterator)]
    rest = (w[None] for w in iterator)  # Still an iterable of batches.
    return rest, np.stack(held) if held else None
  rows = array
  if array.ndim == 1:
    rows = array[:array.shape[0] // length * length].reshape(-1, length)
  if rows.shape[0] <= windows:
    raise ValueError(
        f"the tokens hold {rows.shape[0]} windows of {length}; holding out"
        f" eval_windows={windows} for evaluation leaves none to train on."
        " Pass more tokens, eval_windows=0, or eval_tokens=...")
  return rows[:-windows], rows[-windows:]


class PointActivations:
  """The value at a point, ``[tokens, d_in]``, for batches of windows.

  Attributes:
    point: The point, e.g. ``"blocks.15.resid_post"``.
    input_axes: Its value's axes besides ``batch`` and ``seq``, in the order
      they are flattened (``((name, size), ...)``).
  """

  def __init__(self, model, point: str, skip_positions: int = 0):
    parsed = points_lib.parse_point(model, point)
    if parsed.point == "attn.pattern":
      raise ValueError("attn.pattern grows with the tokens: train on a point"
                       " of fixed width (resid_post, mlp_out, attn.head_out,"
                       " mlp.neurons, ...).")
    if pz.select(model).at_instances_of(pz.nn.LayerStack).count():
      # Per-block layers, so that XLA can drop the blocks after the point
      # (a layer stack's scan runs them all): twice as fast mid-model. On
      # CPU the blocks alias the stacked weights.
      model = unstack_layers(model)
    self.model = model
    self.point = point
    self.skip_positions = skip_positions
    self._programs = {}
    self.input_axes = tuple(
        points_lib.point_value_axes(model.config, parsed.point, 0).items())

  @property
  def d_in(self) -> int:
    return math.prod(n for _, n in self.input_axes)

  def __call__(self, windows: np.ndarray) -> jax.Array:
    """Activations of ``[rows, length]`` windows as ``[rows * (length -
    skip_positions), d_in]`` float32 (a device array)."""
    windows = np.asarray(windows, np.int32)
    if windows.shape not in self._programs:
      # Capture buffers are allocated for one token shape; the block index
      # of a per-block point must be concrete, so captures are inserted
      # here, outside the compiled function.
      rows, length = windows.shape
      patched, captures = insert_captures(
          self.model, [self.point], {"batch": rows, "seq": length})
      stateless, variables = pz.unbind_state_vars(patched, freeze=True)
      self._programs[windows.shape] = (stateless, variables,
                                       captures[self.point][1])
    stateless, variables, spec = self._programs[windows.shape]
    ids = pz.nx.wrap(jnp.asarray(windows)).tag("batch", "seq")
    return _values_at(stateless, variables, ids, spec=spec,
                      axes=tuple(a for a, _ in self.input_axes),
                      skip=self.skip_positions)

  def stream(self, windows: Iterator[np.ndarray], rows: int
             ) -> Iterator[jax.Array]:
    """Activations of ``rows`` windows at a time (a last partial group is
    dropped: one shape, one compiled program)."""
    while True:
      group = [w for _, w in zip(range(rows), windows)]
      if len(group) < rows:
        return
      yield self(np.stack(group))


@functools.partial(jax.jit, static_argnames=("spec", "axes", "skip"))
def _values_at(stateless, variables, ids, *, spec, axes, skip):
  # Only the captured value is returned: XLA drops the unembedding (and,
  # on per-block layers, the blocks after the point). Blocks of one
  # structure share one trace.
  _, new = stateless_call(share_block_traces(stateless), variables, ids)
  (value,) = [spec.take(v.value) for v in new if v.label == spec.label]
  flat = value.unwrap("batch", "seq", *axes)[:, skip:]
  return flat.reshape(-1, math.prod(flat.shape[2:])).astype(jnp.float32)


def check_finite_rows(values: np.ndarray, what: str) -> None:
  """Raises if any row of ``values`` holds NaN or inf.

  Raises:
    ValueError: naming ``what``, how many rows are not finite (of how
      many) and the first one.
  """
  finite = np.isfinite(values)
  if finite.all():
    return
  rows = finite.reshape(values.shape[0], -1).all(1) if values.ndim else (
      finite.reshape(1))
  first = int(np.flatnonzero(~rows)[0])
  raise ValueError(
      f"{what}: {int((~rows).sum())} of {rows.size} rows hold NaN or inf"
      f" values (the first: row {first}); an autoencoder cannot train on"
      " them. Drop those rows (x[np.isfinite(x).all(axis=1)]) or fix"
      " their source.")


def finite_chunks(chunks: Iterable, what: str) -> Iterator[np.ndarray]:
  """``chunks`` as float32 arrays, each checked by `check_finite_rows`
  (named ``what``, chunk ``i``) before it is handed on."""
  for i, chunk in enumerate(chunks):
    chunk = np.asarray(chunk, np.float32)
    check_finite_rows(chunk, f"{what}, chunk {i}")
    yield chunk


class NormFilter:
  """Drops activations longer than ``ratio`` times the median norm of the
  first chunk it sees.

  Attributes:
    limit: The norm limit (None before the first chunk).
    dropped: Activations dropped so far.
  """

  def __init__(self, ratio: float | None):
    self.ratio = ratio
    self.limit: float | None = None
    self.dropped = 0

  def __call__(self, chunks: Iterable) -> Iterator[np.ndarray]:
    for chunk in chunks:
      chunk = np.asarray(chunk, np.float32)
      if self.ratio is None:
        yield chunk
        continue
      norms = np.linalg.norm(chunk, axis=-1)
      if self.limit is None:
        self.limit = self.ratio * float(np.median(norms))
      kept = norms <= self.limit
      self.dropped += int((~kept).sum())
      yield chunk if kept.all() else chunk[kept]


class ShuffleBuffer:
  """Batches of activations mixed across windows, in bounded memory.

  Holds up to ``capacity`` tokens; once full, shuffles them and hands out
  the first half in batches, keeping the rest to mix with the next chunks
  (SAELens's mixing buffer). When the source ends, what is left is shuffled
  and handed out in whole batches.
  """

  def __init__(self, capacity: int, batch: int, seed: int):
    self.capacity = max(capacity, 2 * batch)
    self.batch = batch
    self.rng = np.random.default_rng(seed)

  def batches(self, chunks: Iterable) -> Iterator[np.ndarray]:
    pending, size = [], 0
    for chunk in chunks:
      pending.append(np.asarray(chunk, np.float32))
      size += pending[-1].shape[0]
      if size < self.capacity:
        continue
      mixed = np.concatenate(pending)
      mixed = mixed[self.rng.permutation(size)]
      out = (size // 2) // self.batch * self.batch
      for start in range(0, out, self.batch):
        yield mixed[start:start + self.batch]
      pending, size = [mixed[out:]], size - out
    if size >= self.batch:
      rest = np.concatenate(pending)
      rest = rest[self.rng.permutation(size)]
      for start in range(0, size - self.batch + 1, self.batch):
        yield rest[start:start + self.batch]
