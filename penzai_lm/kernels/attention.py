"""`KernelCachedAttention`: cached attention whose decode steps and prompts
run on the CPU attention kernels (`attention.cc`, `prompt_attention.cc`).

The engine swaps attention layers whose chain `plain_chain` recognizes
(`penzai_lm.model.attention_chain`) for this subclass
(`penzai_lm.kernels.with_cpu_kernels`), which runs the chain up to the
value sum as one kernel call: with one token per row (a decode step) the
decode kernel, which also writes the token's key and value into the
caches; with several (a prompt) the prompt's keys and values are written
as the chain writes them and the prompt kernel attends every token.
Anything else runs the layer's own sublayers: a captured or patched
``attn.pattern`` (the chain no longer matches), other masks, a cache that
keeps a layer stack's axis.

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

import jax.numpy as jnp
from penzai import pz

from penzai_lm.kernels import ops
from penzai_lm.model.attention_chain import PlainChain
from penzai_lm.model.attention_chain import chain_window
from penzai_lm.model.attention_chain import plain_chain
from penzai_lm.model.cache_attention import InPlaceKVCachingAttention
from penzai_lm.model.cache_layout import CacheLayout
from penzai_lm.model.cache_layout import write_at


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # pytype: disable=wrong-keyword-args
class KernelCachedAttention(InPlaceKVCachingAttention):
  """An `InPlaceKVCachingAttention` whose one-token steps and prompts run on
  the CPU attention kernels.

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
    tokens = query.named_shape.get("seq")
    if (tokens is None
        or dict(key.named_shape) != dict(value.named_shape)
        or set(key.named_shape) != cache_axes
        or set(key_cache.named_shape) != cache_axes
        or set(value_cache.named_shape) != cache_axes
        or key_cache.dtype != value_cache.dtype
        or not ops.dense_dtype_supported(key_cache.dtype)
        or set(q_pos.named_shape) != {*batch, "seq"}
        or set(kv_pos.named_shape) != {*batch, "seq"}):
      return None
    window = chain_window(self, self.chain)
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
    k_order = CacheLayout.key_order((*batch, *kv))
    v_order = CacheLayout.value_order((*batch, *kv))
    # The caches in their own axis order (no transpose; the kernel reads
    # them in k_order / v_order).
    if (tuple(key_cache.named_axes) != k_order
        or tuple(value_cache.named_axes) != v_order):
      return None
    q = query.order_as(*batch, "seq", *kv, *qh, "projection").data_array
    positions = q_pos.order_as(*batch, "seq").data_array
    slot_positions = kv_pos.order_as(*batch, "seq").data_array.reshape(
        r, slots)
    if tokens == 1:
      heads, k_data, v_data = ops.decode_attention(
          q.reshape(r, g, per_group, d),
          key_cache.data_array, value_cache.data_array,
          key.order_as(*k_order).data_array,
          value.order_as(*v_order).data_array,
          end, positions.reshape(r), slot_positions,
          window, self.chain.softcap)
    else:
      k_data = write_at(key_cache, key, "seq", end).order_as(
          *k_order).data_array
      v_data = write_at(value_cache, value, "seq", end).order_as(
          *v_order).data_array
      heads = ops.prompt_attention(
          q.reshape(r, tokens, g, per_group, d), k_data, v_data,
          positions.reshape(r, tokens), slot_positions, window,
          self.chain.softcap)
    axes = [*batch, "seq", *kv, *qh, "projection"]
    shape = [sizes[a] for a in axes]
    dtype = jnp.result_type(query.dtype, value_cache.dtype)
    heads = pz.nx.NamedArray(
        named_axes=collections.OrderedDict(zip(axes, shape)),
        data_array=heads.astype(dtype).reshape(shape))
    return (heads, pz.nx.wrap(k_data).tag(*k_order),
            pz.nx.wrap(v_data).tag(*v_order))
