"""Recognizing the attention chain that `build_transformer` makes.

The attention layers `build_transformer` makes compute, for queries over the
keys (or the key/value caches): scores (a `pz.nn.NamedEinsum` contracting
``projection``), Gemma 2's optional `SoftCap`, a causal or sliding-window
mask from the ``token_positions``/``kv_token_positions`` side inputs, a
softmax over ``kv_seq``, the ``attn.pattern`` `HookPoint`, and the weighted
sum of values (a second einsum) followed by the rest of
``attn_value_to_output`` (the ``attn.head_out`` hook point and the output
projection). `plain_chain` recognizes exactly that chain, so that a fused
implementation (the CPU decode kernel, `jax.nn.dot_product_attention` for
prompts on GPU) may replace it; a captured or patched ``attn.pattern``, a
different mask or any other edit leaves the chain unrecognized, and the
layer runs its own sublayers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.model.cache_attention import InPlaceKVCachingAttention
from penzai_lm.model.hooks import HookPoint
from penzai_lm.model.layers import SoftCap

_MASKS = (pz.nn.ApplyCausalAttentionMask,
          pz.nn.ApplyCausalSlidingWindowAttentionMask)
NO_WINDOW = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class PlainChain:
  """What a fused implementation needs from a plain attention chain.

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


def chain_window(layer: InPlaceKVCachingAttention, chain: PlainChain):
  """The sliding window of ``layer``'s mask as an int32 scalar (`NO_WINDOW`
  for a causal mask); None if it is not one value for every row."""
  mask = layer.query_key_to_attn.sublayers[chain.mask_index]
  if type(mask) is pz.nn.ApplyCausalAttentionMask:
    return jnp.asarray(NO_WINDOW, jnp.int32)
  window = mask.sliding_window_size
  if isinstance(window, pz.nx.NamedArrayBase):
    if window.named_shape or window.positional_shape:
      return None
    window = window.unwrap()
  window = jnp.asarray(window)
  if window.shape or not jnp.issubdtype(window.dtype, jnp.integer):
    return None
  return window.astype(jnp.int32)
