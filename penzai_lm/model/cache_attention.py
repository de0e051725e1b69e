"""`InPlaceKVCachingAttention`: key/value caching that writes in place.

Penzai's `pz.nn.KVCachingAttention` writes new keys and values with
``nmap(dynamic_update_slice)``: the write is vmapped over every other named
axis, which JAX turns into a scatter. Inside a compiled decode loop XLA lowers
that scatter to a masked read-modify-write and copies the whole cache around
it, several times per layer and step, so decoding slows down as the cache
grows. This subclass computes exactly the same thing with one plain
``dynamic_update_slice`` on the cache's underlying array (the axes in the
cache's own order, the sequence index at the cache end: `write_at`), which
XLA performs in place. With one end per row (`CacheLayout.per_row_end`)
each row is written at its own end.
"""

from __future__ import annotations

from typing import Any

from penzai import pz

from penzai_lm.model.cache_layout import write_at

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
  def empty(cls, attention: pz.nn.Attention, kv_cache: pz.StateVariable
            ) -> InPlaceKVCachingAttention:
    """``attention``'s sublayers caching into ``kv_cache`` (its value the
    empty ``(keys, values)``), on the sequence axis ``seq`` with the end
    index side input ``cache_end_index``: `pz.nn.KVCachingAttention.
    from_uncached`'s layer, without its own (discarded) empty caches."""
    return cls(
        input_to_query=attention.input_to_query,
        input_to_key=attention.input_to_key,
        input_to_value=attention.input_to_value,
        query_key_to_attn=attention.query_key_to_attn,
        attn_value_to_output=attention.attn_value_to_output,
        sequence_axis="seq",
        kv_cache_end_index_key="cache_end_index",
        kv_cache=kv_cache,
    )
