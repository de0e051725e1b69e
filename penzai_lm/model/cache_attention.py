"""`InPlaceKVCachingAttention`: key/value caching that writes in place.

Penzai's `pz.nn.KVCachingAttention` writes new keys and values with
``nmap(dynamic_update_slice)``: the write is vmapped over every other named
axis, which JAX turns into a scatter. Inside a compiled decode loop XLA lowers
that scatter to a masked read-modify-write and copies the whole cache around
it, several times per layer and step, so decoding slows down as the cache
grows. This subclass computes exactly the same thing with one plain
``dynamic_update_slice`` on the cache's underlying array (the axes in the
cache's own order, the sequence index at the cache end), which XLA performs
in place.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from penzai import pz

_AS_BITS = {jnp.dtype(jnp.bfloat16): jnp.uint16,
            jnp.dtype(jnp.float16): jnp.uint16}


def write_at(cache: pz.nx.NamedArray, new: pz.nx.NamedArray, axis: str,
             index) -> pz.nx.NamedArray:
  """``cache`` with ``new`` written at ``index`` along ``axis``.

  Args:
    cache: A NamedArray without positional axes.
    new: The values, with the axes of ``cache`` (any order, and any length
      along ``axis``).
    axis: The axis to write along.
    index: Scalar start index along ``axis``.
  """
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


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # pytype: disable=wrong-keyword-args
class InPlaceKVCachingAttention(pz.nn.KVCachingAttention):
  """A `pz.nn.KVCachingAttention` whose cache writes are in place."""

  def __call__(self, x: pz.nx.NamedArray, **side_inputs: Any):
    query = self.input_to_query(x, **side_inputs)
    key = self.input_to_key(x, **side_inputs)
    value = self.input_to_value(x, **side_inputs)
    return self.write_and_attend(query, key, value, side_inputs)

  def write_and_attend(self, query: pz.nx.NamedArray, key: pz.nx.NamedArray,
                       value: pz.nx.NamedArray, side_inputs: dict[str, Any]
                       ) -> pz.nx.NamedArray:
    """Writes the new keys and values at the cache end, then runs the
    scores, mask, softmax and value sum of the sublayers over the caches."""
    end = side_inputs[self.kv_cache_end_index_key]
    key_cache, value_cache = self.kv_cache.value
    key_cache = write_at(key_cache, key, self.sequence_axis, end)
    value_cache = write_at(value_cache, value, self.sequence_axis, end)
    self.kv_cache.value = (key_cache, value_cache)
    attn = self.query_key_to_attn((query, key_cache), **side_inputs)
    return self.attn_value_to_output((attn, value_cache), **side_inputs)

  @classmethod
  def from_penzai(cls, layer: pz.nn.KVCachingAttention
                  ) -> InPlaceKVCachingAttention:
    """The same layer (sublayers, cache variable) with in-place writes."""
    return cls(
        input_to_query=layer.input_to_query,
        input_to_key=layer.input_to_key,
        input_to_value=layer.input_to_value,
        query_key_to_attn=layer.query_key_to_attn,
        attn_value_to_output=layer.attn_value_to_output,
        sequence_axis=layer.sequence_axis,
        kv_cache_end_index_key=layer.kv_cache_end_index_key,
        kv_cache=layer.kv_cache,
    )
