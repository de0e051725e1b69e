"""`FusedPromptAttention`: cached attention whose prompts run as one fused
attention call (`jax.nn.dot_product_attention`; cuDNN flash attention on
NVIDIA GPUs).

penzai's chain of layers (`penzai_lm.model.attention_chain`) materializes
the scores of every query against every cache slot, in float32 after the
softmax: per layer, a tensor quadratic in the prompt's length, written
and read several times. A flash attention keeps the scores in on-chip
memory. The engine swaps layers whose chain
`plain_chain` recognizes for this subclass on a GPU
(`with_fused_prompt_attention`); calls with one token per row (decode
steps) and anything the fused call does not compute exactly (Gemma 2's
soft-capped scores, a captured or patched ``attn.pattern``, other masks)
run the layer's own sublayers.

The mask is penzai's, built from the ``token_positions`` and
``kv_token_positions`` side inputs: a query sees the cache slots whose
position is valid (``>= 0``), not after its own, and within the sliding
window. It is passed as a boolean ``[batch, 1, seq, kv_seq]`` array, so left
padding, unwritten slots and a cache that already holds earlier turns mean
the same as in the chain. A causal layer's first prompt without padding
(every row's slot j holds position j: the 8k-token TTFT case) takes a
second branch, chosen at run time, with the causal flag instead of a mask
array. Outputs at padding queries (position -1, where the chain averages
over nothing meaningful) are zero.

Axis conventions (`penzai_lm.model.transformer`): queries have the batch
axes, ``seq``, the key/value head axes (``heads`` or ``head_groups``), the
query-only head axes (``query_heads``) and ``projection``; query head
``(g, q)`` reads key/value head ``g``, which is how
`jax.nn.dot_product_attention` groups query heads (``n // per_group``) once
they are flattened with the key/value head axes first.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp
from penzai import pz

from penzai_lm.model.attention_chain import chain_window
from penzai_lm.model.attention_chain import plain_chain
from penzai_lm.model.attention_chain import PlainChain
from penzai_lm.model.cache_attention import InPlaceKVCachingAttention
from penzai_lm.model.cache_layout import write_at
from penzai_lm.model.devices import devices_of

Implementation = Literal["xla", "cudnn"]

# Dtypes cuDNN's flash attention takes (query, keys and values alike).
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # pytype: disable=wrong-keyword-args
class FusedPromptAttention(InPlaceKVCachingAttention):
  """An `InPlaceKVCachingAttention` whose prompts (several tokens per row)
  run as one `jax.nn.dot_product_attention` call over the caches.

  Attributes:
    chain: What `plain_chain` found in the sublayers.
    implementation: `jax.nn.dot_product_attention`'s implementation:
      "cudnn" (flash attention, GPU only, bfloat16/float16) or "xla".
  """

  chain: PlainChain = dataclasses.field(
      default=None, metadata={"pytree_node": False})
  implementation: Implementation = dataclasses.field(
      default="xla", metadata={"pytree_node": False})

  @classmethod
  def swap(cls, layer: InPlaceKVCachingAttention,
           implementation: Implementation = "xla"):
    """``layer`` as a `FusedPromptAttention`, or unchanged if its chain is
    not plain or has soft-capped scores (which the fused call lacks)."""
    if implementation not in ("xla", "cudnn"):
      raise ValueError(f"Unknown attention implementation {implementation!r};"
                       " expected 'xla' or 'cudnn'.")
    chain = plain_chain(layer)
    if chain is None or chain.softcap is not None:
      return layer
    fields = {f.name: getattr(layer, f.name)
              for f in dataclasses.fields(layer)}
    return cls(**fields, chain=chain, implementation=implementation)

  def write_and_attend(self, query, key, value,
                       side_inputs: dict[str, Any]):
    if not self._applies(query, side_inputs):
      return super().write_and_attend(query, key, value, side_inputs)
    end = side_inputs[self.kv_cache_end_index_key]
    key_cache, value_cache = self.kv_cache.value
    key_cache = write_at(key_cache, key, "seq", end)
    value_cache = write_at(value_cache, value, "seq", end)
    self.kv_cache.value = (key_cache, value_cache)
    heads = self._attend(query, key_cache, value_cache, side_inputs)
    for layer in self.attn_value_to_output.sublayers[1:]:
      heads = layer(heads, **side_inputs)
    return heads

  def _applies(self, query, side_inputs) -> bool:
    """Whether this call is a prompt the fused attention computes exactly."""
    if self.chain is None or self.sequence_axis != "seq":
      return False
    key_cache, value_cache = self.kv_cache.value
    q_pos = side_inputs.get("token_positions")
    kv_pos = side_inputs.get("kv_token_positions")
    end = side_inputs.get(self.kv_cache_end_index_key)
    arrays = (query, key_cache, value_cache, q_pos, kv_pos)
    if not all(isinstance(a, pz.nx.NamedArray) and not a.positional_shape
               for a in arrays) or jnp.shape(end) != ():
      return False
    kv, qh = self.chain.kv_head_axes, self.chain.query_head_axes
    batch = _batch_axes(query, kv, qh)
    cache_axes = {*batch, *kv, "seq", "projection"}
    if (query.named_shape.get("seq", 1) < 2
        or set(key_cache.named_shape) != cache_axes
        or set(value_cache.named_shape) != cache_axes
        or set(q_pos.named_shape) != {*batch, "seq"}
        or set(kv_pos.named_shape) != {*batch, "seq"}
        or kv_pos.named_shape["seq"] != key_cache.named_shape["seq"]
        or chain_window(self, self.chain) is None):
      return False
    if self.implementation == "cudnn":
      # cuDNN's flash attention: one 16-bit float dtype, head sizes that
      # are multiples of 8 up to 256.
      dtypes = {jnp.dtype(a.dtype) for a in (query, key_cache, value_cache)}
      dim = query.named_shape["projection"]
      return (len(dtypes) == 1 and dtypes <= set(CUDNN_DTYPES)
              and dim % 8 == 0 and dim <= 256)
    return True

  def _attend(self, query, key_cache, value_cache, side_inputs):
    """The value sum (``attn.head_out``'s input) of every query."""
    kv, qh = self.chain.kv_head_axes, self.chain.query_head_axes
    batch = _batch_axes(query, kv, qh)
    sizes = query.named_shape
    rows = math.prod(sizes[a] for a in batch)
    groups = math.prod(sizes[a] for a in kv)
    n_query = groups * math.prod(sizes[a] for a in qh)
    dim, tokens = sizes["projection"], sizes["seq"]
    slots = key_cache.named_shape["seq"]
    q = query.order_as(*batch, "seq", *kv, *qh, "projection").data_array
    k, v = (c.order_as(*batch, "seq", *kv, "projection").data_array
            for c in (key_cache, value_cache))
    dtype = q.dtype if self.implementation == "cudnn" else jnp.result_type(
        q.dtype, k.dtype)
    q = q.reshape(rows, tokens, n_query, dim).astype(dtype)
    k, v = (a.reshape(rows, slots, groups, dim).astype(dtype) for a in (k, v))
    q_pos = side_inputs["token_positions"].order_as(
        *batch, "seq").data_array.reshape(rows, tokens, 1)
    kv_pos = side_inputs["kv_token_positions"].order_as(
        *batch, "seq").data_array.reshape(rows, 1, slots)
    window = chain_window(self, self.chain)
    attend = functools.partial(jax.nn.dot_product_attention, q, k, v,
                               scale=1.0, implementation=self.implementation)

    def masked():
      mask = (q_pos >= kv_pos) & (kv_pos >= 0) & (q_pos - kv_pos < window)
      return attend(mask=mask[:, None])

    mask_layer = self.query_key_to_attn.sublayers[self.chain.mask_index]
    if type(mask_layer) is pz.nn.ApplyCausalAttentionMask:
      # A first prompt without padding (slot j holds position j) needs no
      # mask array: the causal mask alone, which cuDNN computes without
      # reading a [seq, kv_seq] bias per head and skips the blocks above
      # the diagonal of (and the unwritten slots past the prompt).
      end = side_inputs[self.kv_cache_end_index_key]
      fresh = (end == 0) & jnp.all(
          kv_pos[:, 0, :tokens] == jnp.arange(tokens, dtype=kv_pos.dtype))
      out = jax.lax.cond(fresh, lambda: attend(is_causal=True), masked)
    else:
      out = masked()
    out = jnp.where((q_pos >= 0)[..., None], out, 0)
    axes = [*batch, "seq", *kv, *qh, "projection"]
    shape = [sizes[a] for a in axes]
    out_dtype = jnp.result_type(query.dtype, value_cache.dtype)
    return pz.nx.NamedArray(
        named_axes=collections.OrderedDict(zip(axes, shape)),
        data_array=out.astype(out_dtype).reshape(shape))


def _batch_axes(query, kv, qh) -> list[str]:
  return [a for a in query.named_axes
          if a not in ("seq", "projection", *kv, *qh)]


def on_gpus(model) -> bool:
  """Whether ``model`` has arrays, all of them on GPUs."""
  devices = devices_of(model)
  return bool(devices) and all(d.platform == "gpu" for d in devices)


def on_one_gpu(model) -> bool:
  """Whether every array of ``model`` is on one and the same GPU."""
  return on_gpus(model) and len(devices_of(model)) == 1


def with_fused_prompt_attention(model,
                                implementation: Implementation = "cudnn"):
  """``model`` with its plain cached attention layers (see `plain_chain`)
  swapped for `FusedPromptAttention`; other layers are kept."""
  return (pz.select(model).at_instances_of(InPlaceKVCachingAttention)
          .where(lambda layer: type(layer) is InPlaceKVCachingAttention)
          .apply(lambda layer: FusedPromptAttention.swap(layer,
                                                         implementation)))
