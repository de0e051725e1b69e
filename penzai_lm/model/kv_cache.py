"""`KVCachingTransformerLM`: the cached sampling mode of a `TransformerLM`.

Axis conventions follow `penzai_lm.model.transformer`. The caches hold one
slot per token written so far, along ``seq`` (renamed ``kv_seq`` inside
attention). Each row of the batch tracks its own token positions, so a batch
of left-padded prompts gives every row the logits it gets alone.

Padding is known from the tokens given as prompt: only the run of ``pad_id``
tokens at the very start of a row is padding (or an explicit ``is_padding``
mask). A later token equal to ``pad_id`` is a real token.

The state (the end index, the positions and tokens of the slots, one
key/value cache per attention layer) is laid out by a `CacheLayout`
(`penzai_lm.model.cache_layout`), which says what each variable holds. With
``per_row_end=True`` each row has its own end index: rows of one batch may
sit at different slots, a call's tokens may be padded at the end (a row
moves on only by its real tokens), and `KVCachingTransformerLM.reset_rows`
empties some rows while the others keep their caches.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from penzai import pz

from penzai_lm.model import memory
from penzai_lm.model.cache_attention import InPlaceKVCachingAttention
from penzai_lm.model.cache_layout import CacheLayout
from penzai_lm.model.cache_layout import write_at
from penzai_lm.model.config import TransformerConfig
from penzai_lm.model.transformer import check_tokens
from penzai_lm.model.transformer import leading_padding
from penzai_lm.model.transformer import TransformerLM

RESERVED_AXES = (
    "seq", "kv_seq", "embedding", "heads", "head_groups", "query_heads",
    "projection", "neurons", "vocabulary", "blocks", "positions",
)


class CacheOverflowError(ValueError):
  """Raised when tokens would be written past the end of the KV cache."""


def _overflow_message(end, new, cache_len) -> str:
  return (
      f"Cannot write {new} tokens at cache slot {end}: the KV cache holds"
      f" {cache_len} tokens. Build the cached model with a larger cache_len"
      " (KVCachingTransformerLM.from_uncached(model, cache_len=...))."
  )


def _raise_overflow(end, new, cache_len):
  raise CacheOverflowError(_overflow_message(int(end), new, cache_len))


@pz.pytree_dataclass
class KVCachingTransformerLM(pz.nn.Layer):
  """A `TransformerLM` in stateful, key/value-cached sampling mode.

  Build it with `from_uncached`. Each call appends tokens to the caches and
  returns their logits. For functional use, split the state out with
  ``pz.unbind_state_vars`` and call ``stateless_call``.

  Attributes:
    body: The uncached model's body with every attention layer swapped for a
      caching one; patches made to the uncached model are kept.
    cache_end_index: The next cache slot to write: a scalar, or one per row
      (an int32 array over the batch axes) with ``per_row_end``.
    previous_tokens: Tokens written so far (``pad_id`` where unwritten).
    kv_positions: Position of the token in each cache slot; -1 for padding.
    config: The architecture.
    cache_len: Number of slots in each cache.
    batch_axes: Names and sizes of the batch axes.
    pad_id: Token id that marks left padding in prompts.
    runtime_overflow_check: Under jit, check for cache overflow at run time
      with a host callback. Programs with callbacks cannot be stored in JAX's
      persistent compilation cache, so a driver that never overflows by
      construction (the generation engine) turns this off.
    per_row_end: One end index per row (see the module docstring).
  """

  body: pz.nn.Layer
  cache_end_index: pz.StateVariable[Any]
  previous_tokens: pz.StateVariable[pz.nx.NamedArray]
  kv_positions: pz.StateVariable[pz.nx.NamedArray]
  config: TransformerConfig = dataclasses.field(metadata={"pytree_node": False})
  cache_len: int = dataclasses.field(metadata={"pytree_node": False})
  batch_axes: dict[str, int] = dataclasses.field(metadata={"pytree_node": False})
  pad_id: int = dataclasses.field(metadata={"pytree_node": False})
  runtime_overflow_check: bool = dataclasses.field(
      default=True, metadata={"pytree_node": False}
  )
  per_row_end: bool = dataclasses.field(
      default=False, metadata={"pytree_node": False}
  )

  @property
  def layout(self) -> CacheLayout:
    """The `CacheLayout` of this model's caches."""
    prefix = self.cache_end_index.label.rpartition("/")[0]
    return CacheLayout.of(self.batch_axes, self.cache_len,
                          per_row_end=self.per_row_end, prefix=prefix)

  def __call__(
      self,
      tokens: pz.nx.NamedArray,
      *,
      is_padding: pz.nx.NamedArray | None = None,
      **side_inputs,
  ) -> pz.nx.NamedArray:
    """Appends tokens to the caches and returns their logits.

    Args:
      tokens: Integer named array with the batch axes and ``seq``.
      is_padding: Optional boolean array like ``tokens`` marking padding
        explicitly. By default, the leading run of ``pad_id`` in a row that
        has no real token yet is padding.
      **side_inputs: Extra side inputs forwarded to the body (for patches).

    Returns:
      Logits with the axes of ``tokens`` plus ``vocabulary``. Logits at
      padding positions are meaningless. The end index moves by the call's
      tokens (`CacheLayout.consumed`: per row, up to its last real token,
      with ``per_row_end``).

    Raises:
      CacheOverflowError: if the tokens do not fit in the remaining cache
        (at trace time when the cache index is known, else at run time).
    """
    check_tokens(tokens, self.config.vocab_size)
    expected = {**self.batch_axes, "seq": tokens.named_shape["seq"]}
    if dict(tokens.named_shape) != expected:
      raise ValueError(
          f"tokens have axes {dict(tokens.named_shape)}, but this cached model"
          f" was built for batch axes {self.batch_axes}: expected {expected}."
      )
    new = tokens.named_shape["seq"]
    end = self.cache_end_index.value
    self._check_room(end, new)

    slots = self.kv_positions.value
    next_position = pz.nx.nmap(jnp.max)(slots.untag("seq")) + 1
    if is_padding is None:
      is_padding = leading_padding(tokens, self.pad_id) & (next_position == 0)
    else:
      _check_padding_mask(is_padding, tokens)
    real = ~is_padding
    count = pz.nx.nmap(jnp.cumsum)(real.untag("seq"), dtype=jnp.int32).tag("seq")
    positions = pz.nx.nmap(jnp.where)(real, next_position + count - 1, -1)

    def write(buffer, update):
      return write_at(buffer, update, "seq", end)  # At each row's end.

    kv_positions = write(slots, positions.astype(jnp.int32))
    with jax.default_matmul_precision(self.config.matmul_precision):
      logits = self.body(
          tokens,
          token_positions=positions,
          kv_token_positions=kv_positions,
          cache_end_index=end,
          **side_inputs,
      )
    self.kv_positions.value = kv_positions
    self.previous_tokens.value = write(
        self.previous_tokens.value, tokens.astype(jnp.int32)
    )
    self.cache_end_index.value = self.layout.consumed(is_padding, end)
    return logits

  def reset_rows(self, rows) -> None:
    """Empties the rows where ``rows`` is True (their end goes back to 0
    and every slot is unwritten); the other rows keep their caches. The
    next call then starts those rows' sequences anew, e.g. with a new
    prompt while the other rows feed their next token (padded at the end).

    Args:
      rows: Booleans, one per row: a list or array over the flattened batch
        axes, or a NamedArray over the batch axes.

    Raises:
      ValueError: without ``per_row_end``, or for a mask of another shape.
    """
    if not isinstance(rows, pz.nx.NamedArrayBase):
      array = jnp.asarray(rows)
      size = math.prod(self.batch_axes.values())
      if array.dtype != jnp.bool_ or array.shape != (size,):
        raise ValueError(
            f"rows must be {size} booleans (one per row of batch axes"
            f" {self.batch_axes}), got {rows!r:.200}.")
      rows = pz.nx.wrap(array.reshape(tuple(self.batch_axes.values()))).tag(
          *self.batch_axes)
    elif dict(rows.named_shape) != self.batch_axes or rows.dtype != jnp.bool_:
      raise ValueError(
          f"rows must be a boolean NamedArray over the batch axes"
          f" {self.batch_axes}, got {rows!r:.200}.")
    (self.cache_end_index.value, self.kv_positions.value,
     self.previous_tokens.value) = self.layout.reset_rows(
         self.cache_end_index.value, self.kv_positions.value,
         self.previous_tokens.value, rows, self.pad_id)

  def _check_room(self, end, new: int) -> None:
    if isinstance(end, pz.nx.NamedArrayBase):
      end = jnp.max(end.data_array)  # The row with the least room.
    if isinstance(end, jax.core.Tracer):
      if not self.runtime_overflow_check:
        return
      jax.lax.cond(
          end + new > self.cache_len,
          lambda: jax.debug.callback(
              _raise_overflow, end, new, self.cache_len
          ),
          lambda: None,
      )
    elif int(end) + new > self.cache_len:
      raise CacheOverflowError(_overflow_message(int(end), new, self.cache_len))

  @classmethod
  def from_uncached(
      cls,
      uncached: TransformerLM,
      cache_len: int,
      batch_axes: dict[str, int],
      pad_id: int | None = None,
      variable_name_prefix: str = "sampler",
      per_row_end: bool = False,
  ) -> KVCachingTransformerLM:
    """Converts a `TransformerLM` to cached sampling mode.

    Every `pz.nn.Attention` is swapped for a `pz.nn.KVCachingAttention` (an
    `InPlaceKVCachingAttention`, which writes its cache in place) whose mask
    reads cache positions; everything else, including patches and their
    state variables, is kept as is.

    Args:
      uncached: The model.
      cache_len: Number of tokens each cache holds (prompt plus generated);
        at most ``config.max_cache_len`` when that is set.
      batch_axes: Names and sizes of the batch axes, e.g. ``{"batch": 4}``.
      pad_id: Token id of left padding; defaults to the model's pad token (or
        0 if it has none).
      variable_name_prefix: Prefix of the state variable labels.
      per_row_end: One end index per row (see the module docstring).

    Returns:
      The cached model, with empty caches.

    Raises:
      ValueError: for invalid arguments; `memory.InsufficientMemoryError`
        (a ``ValueError``) if the caches cannot fit in the memory available
        (checked before anything is allocated).
    """
    if not isinstance(uncached, TransformerLM):
      raise ValueError(
          f"from_uncached expects a TransformerLM, got {type(uncached).__name__}."
      )
    config = uncached.config
    if not isinstance(cache_len, int) or cache_len < 1:
      raise ValueError(f"cache_len must be a positive integer, got {cache_len!r}.")
    if config.max_cache_len is not None and cache_len > config.max_cache_len:
      raise ValueError(
          f"cache_len {cache_len} exceeds this model's"
          f" {config.max_cache_len} learned positions (config.max_cache_len)."
      )
    _check_batch_axes(batch_axes)
    # Refused before anything is allocated: a cache that cannot fit would
    # otherwise end in XLA's RESOURCE_EXHAUSTED or the kernel's OOM killer.
    rows = math.prod(batch_axes.values())
    memory.check_fits(
        f"KVCachingTransformerLM.from_uncached(cache_len="
        f"{memory.format_count(cache_len)},"
        f" batch_axes={batch_axes}): "
        + memory.describe_cache(config, rows, cache_len),
        memory.kv_cache_bytes(config, rows, cache_len)
        + rows * cache_len * 8,  # Cached tokens and their positions.
        "Lower cache_len or the batch.")
    if pad_id is None:
      pad_id = 0 if config.pad_token_id is None else config.pad_token_id
    if not 0 <= pad_id < config.vocab_size:
      raise ValueError(
          f"pad_id {pad_id} is outside the vocabulary [0, {config.vocab_size})."
      )

    if not isinstance(per_row_end, bool):
      raise ValueError(f"per_row_end must be True or False, got {per_row_end!r}.")
    layout = CacheLayout.of(batch_axes, cache_len, per_row_end=per_row_end,
                            prefix=variable_name_prefix)
    common_head_axes, _ = config.head_axes
    selection = pz.select(uncached.body).at_instances_of(pz.nn.Attention)
    cached = {}
    for index, (keypath, attention) in enumerate(
        selection.selected_by_path.items()
    ):
      attention = (
          pz.select(attention)
          .at_instances_of(
              pz.nn.ApplyCausalAttentionMask
              | pz.nn.ApplyCausalSlidingWindowAttentionMask
          )
          .apply(_read_cache_positions)
      )
      stack_axes = pz.nn.layerstack_axes_from_keypath(keypath)
      cached[keypath] = InPlaceKVCachingAttention.empty(
          attention, pz.StateVariable(
              # A layer stack returns per-layer state with the stack axes
              # first; start in that layout so the state's pytree never
              # changes between calls.
              value=layout.empty_kv(stack_axes, common_head_axes,
                                    config.head_dim, config.activation_dtype),
              label=layout.cache_label(index),
              metadata=_stack_metadata(stack_axes)))
    labels = layout.labels
    return cls(
        body=selection.set_by_path(cached),
        cache_end_index=pz.StateVariable(
            value=layout.empty_end(), label=labels.end),
        previous_tokens=pz.StateVariable(
            value=layout.empty_tokens(pad_id), label=labels.tokens),
        kv_positions=pz.StateVariable(
            value=layout.empty_positions(), label=labels.positions),
        config=config,
        cache_len=cache_len,
        batch_axes=dict(batch_axes),
        pad_id=pad_id,
        per_row_end=per_row_end,
    )


def _stack_metadata(stack_axes) -> dict:
  """A cache variable's metadata: per layer along ``stack_axes`` (as
  `pz.nn.KVCachingAttention.from_uncached` marks it)."""
  if not stack_axes:
    return {}
  return {"layerstack_axes": {
      axis: pz.nn.LayerStackVarBehavior.PER_LAYER for axis in stack_axes}}


def _check_padding_mask(is_padding, tokens) -> None:
  if (
      not isinstance(is_padding, pz.nx.NamedArrayBase)
      or dict(is_padding.named_shape) != dict(tokens.named_shape)
      or is_padding.positional_shape
      or is_padding.dtype != jnp.bool_
  ):
    raise ValueError(
        "is_padding must be a boolean NamedArray with the axes of tokens"
        f" {dict(tokens.named_shape)}; got {is_padding!r:.200}."
    )


def _check_batch_axes(batch_axes) -> None:
  if not isinstance(batch_axes, dict):
    raise ValueError(
        f"batch_axes must be a dict of axis name to size, e.g. {{'batch': 4}};"
        f" got {batch_axes!r}."
    )
  for name, size in batch_axes.items():
    if name in RESERVED_AXES:
      raise ValueError(
          f"Batch axis name {name!r} is used by the model; choose another"
          " (e.g. 'batch')."
      )
    if not isinstance(size, int) or size < 1:
      raise ValueError(
          f"Batch axis {name!r} must have a positive integer size, got {size!r}."
      )


def _read_cache_positions(mask):
  if mask.kv_positions_input_name != "token_positions":
    raise ValueError(
        "Cannot convert an attention mask that reads key positions from"
        f" {mask.kv_positions_input_name!r}; expected 'token_positions'."
    )
  return dataclasses.replace(mask, kv_positions_input_name="kv_token_positions")
