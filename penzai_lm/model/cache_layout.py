"""`CacheLayout`: the one owner of the KV cache's layout.

A cached model (`penzai_lm.model.KVCachingTransformerLM`) keeps, per batch
row, ``cache_len`` slots along ``seq`` (``kv_seq`` inside attention). Its
state variables, under a label prefix (default ``"sampler"``):

* ``{prefix}/cache_end_index``: the next slot to write. A scalar shared by
  the rows, or, with ``per_row_end``, one index per row (an int32 array over
  the batch axes): rows then sit at different slots, and a row can be reset
  and refilled while the others go on.
* ``{prefix}/kv_positions``: the position of the token in each slot, over
  ``(batch axes, seq)``; -1 for padding and for slots not written, which no
  token attends to.
* ``{prefix}/previous_tokens``: the token in each slot (the pad id where
  none is).
* ``{prefix}/cache_{i}``: attention layer ``i``'s ``(keys, values)``, keys
  ordered ``(stack axes, batch axes, head axes, seq, projection)`` and values
  ``(..., projection, seq)``: each attention product contracts the minor
  axis, so XLA reads the caches as they are, never transposed.

A call of ``n`` tokens writes them at each row's end (`write_at`, in place);
the end then moves by `consumed`: ``n`` for a shared end, and per row up to
its last real token with ``per_row_end`` (padding after it is written but
overwritten by the next call). Everything else that reads or changes a
cache goes through here: the generation engine's history of tokens for the
penalties (`history`), a session's cut of the slots a turn discarded
(`cut`) and its growth to a larger cache (`grow`), and `reset_rows`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.model.tracing import full

_AS_BITS = {jnp.dtype(jnp.bfloat16): jnp.uint16,
            jnp.dtype(jnp.float16): jnp.uint16}


@dataclasses.dataclass(frozen=True)
class CacheLabels:
  """Labels of a cached model's bookkeeping state variables."""

  end: str
  positions: str
  tokens: str


@dataclasses.dataclass(frozen=True)
class CacheLayout:
  """How a cached model's KV cache is laid out (static).

  Attributes:
    batch_axes: Names and sizes of the batch axes, in order.
    cache_len: Slots per row.
    per_row_end: One end index per row instead of one shared by the batch.
    prefix: Prefix of the state variables' labels.
  """

  batch_axes: tuple[tuple[str, int], ...]
  cache_len: int
  per_row_end: bool = False
  prefix: str = "sampler"

  @classmethod
  def of(cls, batch_axes: Mapping[str, int], cache_len: int, *,
         per_row_end: bool = False, prefix: str = "sampler") -> CacheLayout:
    return cls(tuple(batch_axes.items()), int(cache_len), bool(per_row_end),
               prefix)

  @property
  def batch(self) -> dict[str, int]:
    return dict(self.batch_axes)

  @property
  def labels(self) -> CacheLabels:
    return CacheLabels(end=f"{self.prefix}/cache_end_index",
                       positions=f"{self.prefix}/kv_positions",
                       tokens=f"{self.prefix}/previous_tokens")

  def cache_label(self, index: int) -> str:
    """The label of attention layer ``index``'s cache variable."""
    return f"{self.prefix}/cache_{index}"

  # Empty state.

  def empty_end(self):
    """The end index of an empty cache: 0, per row with ``per_row_end``."""
    if self.per_row_end:
      return filled(self.batch, 0, jnp.int32)
    return full((), 0, jnp.int32)

  def empty_positions(self) -> pz.nx.NamedArray:
    return filled({**self.batch, "seq": self.cache_len}, -1, jnp.int32)

  def empty_tokens(self, pad_id: int) -> pz.nx.NamedArray:
    return filled({**self.batch, "seq": self.cache_len}, pad_id, jnp.int32)

  @staticmethod
  def key_order(lead) -> tuple[str, ...]:
    """The axis order of a key cache whose other axes are ``lead`` (stack,
    batch and head axes): ``seq`` then ``projection``, the axis the scores
    contract, last."""
    return (*lead, "seq", "projection")

  @staticmethod
  def value_order(lead) -> tuple[str, ...]:
    """The axis order of a value cache: ``projection`` then ``seq``, the
    axis the value sum contracts, last."""
    return (*lead, "projection", "seq")

  def empty_kv(self, lead: Mapping[str, int], heads: Mapping[str, int],
               projection: int, dtype):
    """Empty ``(keys, values)`` in the layout's axis order: ``lead`` (stack
    axes), the batch axes, ``heads``, then ``seq``/``projection``."""
    sizes = {**lead, **self.batch, **heads, "seq": self.cache_len,
             "projection": projection}
    leading = [*lead, *self.batch, *heads]
    return tuple(filled({a: sizes[a] for a in order(leading)}, 0, dtype)
                 for order in (self.key_order, self.value_order))

  # A call.

  def consumed(self, is_padding: pz.nx.NamedArray, end):
    """The end after a call whose tokens have this padding mask: ``end +
    n`` for a shared end; per row, ``end`` plus the tokens up to the row's
    last real one (a row of padding only stays where it is)."""
    n = is_padding.named_shape["seq"]
    if not self.per_row_end:
      return end + n
    real = (~is_padding).untag("seq")
    upto = pz.nx.nmap(lambda r: jnp.max(
        jnp.where(r, jnp.arange(1, n + 1, dtype=jnp.int32), 0)))(real)
    return end + upto

  def reset_rows(self, end, positions, tokens, rows, pad_id: int):
    """``(end, positions, tokens)`` with the rows where ``rows`` (bool over
    the batch axes) is True emptied: end 0, every slot unwritten. Only with
    ``per_row_end`` (a shared end cannot restart one row)."""
    if not self.per_row_end:
      raise ValueError(
          "reset_rows needs a cache with one end per row: build it with"
          " KVCachingTransformerLM.from_uncached(..., per_row_end=True).")
    where = pz.nx.nmap(jnp.where)
    return (pz.nx.order_like(where(rows, 0, end), end),
            pz.nx.order_like(where(rows, -1, positions), positions),
            pz.nx.order_like(where(rows, pad_id, tokens), tokens))

  # What the generation engine and sessions do to a cache.

  @staticmethod
  def history(tokens: pz.nx.NamedArray, positions: pz.nx.NamedArray,
              batch_axis: str) -> tuple[jax.Array, jax.Array]:
    """``(tokens, written)`` of every slot, ``(B, C)`` arrays (the
    sampler's penalties count what is in the cache)."""
    return (tokens.unwrap(batch_axis, "seq"),
            positions.unwrap(batch_axis, "seq") >= 0)

  @staticmethod
  def cut(end, positions: pz.nx.NamedArray, start):
    """``(end, positions)`` with slots from ``start`` on discarded: the end
    goes back to ``start`` and their positions to -1, so no token attends
    to them and the next tokens overwrite them."""
    slots = pz.nx.arange("seq", positions.named_shape["seq"])
    cut = pz.nx.nmap(jnp.where)(slots >= start, -1, positions)
    if isinstance(end, pz.nx.NamedArrayBase):
      new_end = pz.nx.nmap(jnp.minimum)(end, start).astype(end.dtype)
    else:
      new_end = jnp.asarray(start, jnp.asarray(end).dtype)
    return new_end, pz.nx.order_like(cut, positions)

  @staticmethod
  def grow(leaf: jax.Array, shape: tuple[int, ...], fill) -> jax.Array:
    """A state leaf grown to ``shape`` (more slots), new slots ``fill`` (an
    empty cache's: positions -1, unwritten)."""
    if tuple(leaf.shape) == tuple(shape):
      return leaf
    return jnp.pad(leaf, [(0, n - o) for o, n in zip(leaf.shape, shape)],
                   constant_values=fill)


def filled(named_shape: Mapping[str, int], fill, dtype) -> pz.nx.NamedArray:
  """`full` over named axes (``named_shape``, in its order)."""
  return pz.nx.wrap(full(tuple(named_shape.values()), fill, dtype),
                    *named_shape)


def write_at(cache: pz.nx.NamedArray, new: pz.nx.NamedArray, axis: str,
             index) -> pz.nx.NamedArray:
  """``cache`` with ``new`` written at ``index`` along ``axis``, in place.

  Args:
    cache: A NamedArray without positional axes.
    new: The values, with the axes of ``cache`` (any order, and any length
      along ``axis``).
    axis: The axis to write along.
    index: The start index along ``axis``: a scalar shared by every row, or
      a NamedArray over some of ``cache``'s other axes (one start per row;
      each row must have room for all of ``new``).
  """
  if isinstance(index, pz.nx.NamedArrayBase) and index.named_shape:
    return _write_rows(cache, new, axis, index)
  if isinstance(index, pz.nx.NamedArrayBase):
    index = index.unwrap()
  names = list(cache.named_shape)
  data = cache.unwrap(*names)
  update = new.unwrap(*names).astype(data.dtype)
  # Size-1 dimensions are dropped for the write: XLA drops them anyway where
  # the cache is read, and a write whose result is then reshaped is not done
  # in place (the cache is copied first).
  keep = [i for i, n in enumerate(data.shape) if n != 1 or names[i] == axis]
  start = [index if names[i] == axis else 0 for i in keep]
  base = data.reshape([data.shape[i] for i in keep])
  update = update.reshape([update.shape[i] for i in keep])
  if data.dtype in _AS_BITS:
    # XLA:CPU writes into a 16-bit float array by converting all of it to
    # float32 and back (two whole-cache conversions per layer and step);
    # the same bits written as integers need no conversion.
    bits = _AS_BITS[data.dtype]
    written = jax.lax.bitcast_convert_type(jax.lax.dynamic_update_slice(
        jax.lax.bitcast_convert_type(base, bits),
        jax.lax.bitcast_convert_type(update, bits), start), data.dtype)
  else:
    written = jax.lax.dynamic_update_slice(base, update, start)
  return pz.nx.wrap(written.reshape(data.shape)).tag(*names)


def _write_rows(cache, new, axis: str, index) -> pz.nx.NamedArray:
  """`write_at` with one start per row: one in-place write per row."""
  names = list(cache.named_shape)
  rows = list(index.named_shape)
  if axis in rows or not set(rows) <= set(names):
    raise ValueError(
        f"the write index has axes {rows}; expected some of the cache's"
        f" other axes {[n for n in names if n != axis]}.")
  data = cache.unwrap(*names)
  update = new.unwrap(*names).astype(data.dtype)
  starts = index.unwrap(*rows).astype(jnp.int32)
  for coords in itertools.product(*(range(n) for n in starts.shape)):
    at = dict(zip(rows, coords))
    piece = update[tuple(slice(at[n], at[n] + 1) if n in at else slice(None)
                         for n in names)]
    start = [at[n] if n in at else starts[coords] if n == axis else 0
             for n in names]
    data = jax.lax.dynamic_update_slice(data, piece, start)
  return pz.nx.wrap(data).tag(*names)

