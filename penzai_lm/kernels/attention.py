"""`KernelCachedAttention`: cached attention whose decode steps run on the
CPU decode-attention kernel (`attention.cc`).

The attention layers `build_transformer` makes compute, for a query over the
key/value caches: scores (a `pz.nn.NamedEinsum` contracting
``projection``), Gemma 2's optional `SoftCap`, a causal or sliding-window
mask from the ``token_positions``/``kv_token_positions`` side inputs, a
softmax over ``kv_seq``, the ``attn.pattern`` `HookPoint`, and the weighted
sum of values (a second einsum) followed by the rest of
``attn_value_to_output`` (the ``attn.head_out`` hook point and the output
projection). `plain_chain` recognizes exactly that chain; the engine swaps
such layers for this subclass (`penzai_lm.kernels.with_cpu_kernels`), which
runs the cache write and the chain up to the value sum as one kernel call
when one token per row is decoded. Anything else runs the layer's own sublayers: a prompt (several
tokens), a captured or patched ``attn.pattern`` (the chain no longer
matches), other masks, a cache that keeps a layer stack's axis.

Axis conventions (`penzai_lm.model.transformer`): queries have the batch
axes, ``seq``, the key/value head axes (``heads`` or ``head_groups``), the
query-only head axes (``query_heads``) and ``projection``; the caches lie as
`KVCachingTransformerLM.from_uncached` makes them, keys
``{batch..., kv heads..., seq, projection}`` and values
``{batch..., kv heads..., projection, seq}``, so the kernel reads them as
they are.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.kernels import ops
from penzai_lm.model.cache_attention import InPlaceKVCachingAttention
from penzai_lm.model.hooks import HookPoint
from penzai_lm.model.layers import SoftCap

_MASKS = (pz.nn.ApplyCausalAttentionMask,
          pz.nn.ApplyCausalSlidingWindowAttentionMask)
_NO_WINDOW = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class PlainChain:
  """What the kernel needs from a plain attention chain.

  Attributes:
    kv_head_axes: Head axes shared by queries and keys (``heads`` or
      ``head_groups``; empty for one key/value head).
    query_head_axes: Head axes of the queries only (``query_heads``).
    softcap: Gemma 2's attention logit cap, or None.
    mask_index: Position of the mask in ``query_key_to_attn``.
  """

  kv_head_axes: tuple[str, ...]
  query_head_axes: tuple[str, ...]
  softcap: float | None
  mask_index: int


def _spec(spec) -> dict[str, str]:
  return dict(spec) if isinstance(spec, dict) else {a: a for a in spec}


def _einsum_heads(einsum) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
  """The (kv, query-only) head axes of the score einsum, if it is the one
  `build_attention` makes."""
  if type(einsum) is not pz.nn.NamedEinsum or len(einsum.input_axes) != 2:
    return None
  q, k = map(_spec, einsum.input_axes)
  q_heads = [a for a in q if a not in ("seq", "projection")]
  kv_heads = [a for a in k if a not in ("seq", "projection")]
  expected = (
      {"seq": "tq", **{a: a for a in q_heads}, "projection": "p"},
      {"seq": "tkv", **{a: a for a in kv_heads}, "projection": "p"},
      {"seq": "tq", **{a: a for a in q_heads}, "kv_seq": "tkv"},
  )
  if (q, k, _spec(einsum.output_axes)) != expected or not set(
      kv_heads) <= set(q_heads):
    return None
  return tuple(kv_heads), tuple(a for a in q_heads if a not in kv_heads)


def _value_einsum_matches(einsum, kv_heads, q_heads) -> bool:
  if type(einsum) is not pz.nn.NamedEinsum or len(einsum.input_axes) != 2:
    return False
  heads = {a: a for a in (*kv_heads, *q_heads)}
  expected = (
      {"seq": "tq", **heads, "kv_seq": "tkv"},
      {"seq": "tkv", **{a: a for a in kv_heads}, "projection": "p"},
      {"seq": "tq", **heads, "projection": "p"},
  )
  return (*map(_spec, einsum.input_axes), _spec(einsum.output_axes)
          ) == expected


def _plain_mask(mask) -> bool:
  if type(mask) not in _MASKS:
    return False
  try:
    masked = float(np.asarray(mask.masked_out_value))
  except (TypeError, jax.errors.ConcretizationTypeError,
          jax.errors.TracerArrayConversionError):
    return False  # traced: not known to mask out
  return (mask.query_positions_input_name == "token_positions"
          and mask.kv_positions_input_name == "kv_token_positions"
          and mask.seq_axis == "seq" and mask.kv_seq_axis == "kv_seq"
          and masked <= -1e30)


def plain_chain(layer: InPlaceKVCachingAttention) -> PlainChain | None:
  """The chain of ``layer`` if the kernel computes it exactly, else None."""
  qk, av = layer.query_key_to_attn, layer.attn_value_to_output
  if (layer.sequence_axis != "seq" or type(qk) is not pz.nn.Sequential
      or type(av) is not pz.nn.Sequential or not av.sublayers):
    return None
  subs = list(qk.sublayers)
  if len(subs) not in (4, 5):
    return None
  heads = _einsum_heads(subs[0])
  softmax, pattern = subs[-2], subs[-1]
  if (heads is None or type(softmax) is not pz.nn.Softmax
      or softmax.axes not in ("kv_seq", ("kv_seq",))
      or type(pattern) is not HookPoint or pattern.point != "attn.pattern"
      or not _plain_mask(subs[-3])
      or not _value_einsum_matches(av.sublayers[0], *heads)):
    return None
  softcap = None
  if len(subs) == 5:
    if type(subs[1]) is not SoftCap:
      return None
    softcap = float(subs[1].cap)
  return PlainChain(kv_head_axes=heads[0], query_head_axes=heads[1],
                    softcap=softcap, mask_index=len(subs) - 3)


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # pytype: disable=wrong-keyword-args
class KernelCachedAttention(InPlaceKVCachingAttention):
  """An `InPlaceKVCachingAttention` whose one-token steps run on the CPU
  decode-attention kernel.

  Attributes:
    chain: What `plain_chain` found in the sublayers.
  """

  chain: PlainChain = dataclasses.field(
      default=None, metadata={"pytree_node": False})

  @classmethod
  def swap(cls, layer: InPlaceKVCachingAttention):
    """``layer`` as a `KernelCachedAttention`, or unchanged if its chain is
    not plain."""
    chain = plain_chain(layer)
    if chain is None:
      return layer
    fields = {f.name: getattr(layer, f.name)
              for f in dataclasses.fields(layer)}
    return cls(**fields, chain=chain)

  def write_and_attend(self, query, key, value,
                       side_inputs: dict[str, Any]):
    result = self._kernel(query, key, value, side_inputs)
    if result is None:
      return super().write_and_attend(query, key, value, side_inputs)
    heads, key_cache, value_cache = result
    self.kv_cache.value = (key_cache, value_cache)
    for layer in self.attn_value_to_output.sublayers[1:]:
      heads = layer(heads, **side_inputs)
    return heads

  def _kernel(self, query, key, value, side_inputs):
    """``(value sum, key cache, value cache)`` from the kernel, the value
    sum being ``attn.head_out``'s input; None where it does not apply."""
    if self.chain is None:  # built directly rather than by `swap`
      return None
    kv, qh = self.chain.kv_head_axes, self.chain.query_head_axes
    key_cache, value_cache = self.kv_cache.value
    q_pos = side_inputs.get("token_positions")
    kv_pos = side_inputs.get("kv_token_positions")
    end = side_inputs.get(self.kv_cache_end_index_key)
    arrays = (query, key, value, key_cache, value_cache, q_pos, kv_pos)
    if not all(isinstance(a, pz.nx.NamedArrayBase) and not a.positional_shape
               for a in arrays) or jnp.shape(end) != () or not all(
                   isinstance(c, pz.nx.NamedArray)
                   for c in (key_cache, value_cache)):
      return None
    batch = [a for a in query.named_axes
             if a not in ("seq", "projection", *kv, *qh)]
    cache_axes = {*batch, *kv, "seq", "projection"}
    if (query.named_shape.get("seq") != 1
        or dict(key.named_shape) != dict(value.named_shape)
        or set(key.named_shape) != cache_axes
        or set(key_cache.named_shape) != cache_axes
        or set(value_cache.named_shape) != cache_axes
        or key_cache.dtype != value_cache.dtype
        or not ops.dense_dtype_supported(key_cache.dtype)
        or set(q_pos.named_shape) != {*batch, "seq"}
        or set(kv_pos.named_shape) != {*batch, "seq"}):
      return None
    window = self._window()
    if window is None:
      return None
    sizes = query.named_shape
    r = math.prod(sizes[a] for a in batch)
    g = math.prod(sizes[a] for a in kv)
    per_group = math.prod(sizes[a] for a in qh)
    d = sizes["projection"]
    slots = key_cache.named_shape["seq"]
    if per_group > 32 or kv_pos.named_shape["seq"] != slots:
      return None
    k_order = (*batch, *kv, "seq", "projection")
    v_order = (*batch, *kv, "projection", "seq")
    # The caches in their own axis order (no transpose; the kernel reads
    # them in k_order / v_order).
    if (tuple(key_cache.named_axes) != k_order
        or tuple(value_cache.named_axes) != v_order):
      return None
    heads, k_data, v_data = ops.decode_attention(
        query.order_as(*batch, "seq", *kv, *qh, "projection")
        .data_array.reshape(r, g, per_group, d),
        key_cache.data_array, value_cache.data_array,
        key.order_as(*k_order).data_array,
        value.order_as(*v_order).data_array,
        end,
        q_pos.order_as(*batch, "seq").data_array.reshape(r),
        kv_pos.order_as(*batch, "seq").data_array.reshape(r, slots),
        window, self.chain.softcap)
    axes = [*batch, "seq", *kv, *qh, "projection"]
    shape = [sizes[a] for a in axes]
    dtype = jnp.result_type(query.dtype, value_cache.dtype)
    heads = pz.nx.NamedArray(
        named_axes=collections.OrderedDict(zip(axes, shape)),
        data_array=heads.astype(dtype).reshape(shape))
    return (heads, pz.nx.wrap(k_data).tag(*k_order),
            pz.nx.wrap(v_data).tag(*v_order))

  def _window(self):
    """The sliding window as an int32 scalar (int32 max for a causal
    mask); None if it is not one value for every row."""
    mask = self.query_key_to_attn.sublayers[self.chain.mask_index]
    if type(mask) is pz.nn.ApplyCausalAttentionMask:
      return jnp.asarray(_NO_WINDOW, jnp.int32)
    window = mask.sliding_window_size
    if isinstance(window, pz.nx.NamedArrayBase):
      if window.named_shape or window.positional_shape:
        return None
      window = window.unwrap()
    window = jnp.asarray(window)
    if window.shape or not jnp.issubdtype(window.dtype, jnp.integer):
      return None
    return window.astype(jnp.int32)
