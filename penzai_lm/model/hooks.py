"""Named hook points: identity layers that mark where activations live.

Every model built by `build_transformer` carries `HookPoint` layers at the
places TransformerLens names, so captures and interventions have stable
addresses on both layouts (a layer stack or per-layer blocks):

=====================  ====================================================
point                  value (axes besides the batch axes and ``seq``)
=====================  ====================================================
``embed``              the residual stream entering block 0 (token
                       embeddings, scaled, plus learned positions):
                       ``embedding``
``blocks.{i}.resid_pre``   the residual stream entering block i
``blocks.{i}.attn.pattern``  attention weights after the softmax: query head
                       axes and ``kv_seq`` (keys)
``blocks.{i}.attn.head_out``  each head's output before the output
                       projection: query head axes and ``projection``
``blocks.{i}.attn_out``    the attention branch's output (after Gemma's post
                       norm), added to the residual stream
``blocks.{i}.resid_mid``   the residual stream between attention and MLP
``blocks.{i}.mlp_in``      the MLP's input: the residual stream after the
                       pre-MLP norm, its weights applied (circuit-tracer's
                       ``mlp.hook_in``, where transcoders read; files
                       reading ``ln2.hook_normalized``, before the weights,
                       are folded at load)
``blocks.{i}.mlp.neurons``  the MLP's hidden activations (after the gate):
                       ``neurons``
``blocks.{i}.mlp_out``     the MLP branch's output (after Gemma's post norm)
``blocks.{i}.resid_post``  the residual stream leaving block i
``final_norm``         the residual stream after the final norm
=====================  ====================================================

Query head axes are ``heads`` (multi-head), ``query_heads`` (one key/value
head) or ``head_groups`` x ``query_heads`` (grouped-query); head ``h`` in
Hugging Face order is group ``h // per_group``, query head ``h % per_group``
(`head_coordinates`).

A hook point knows its block through ``layer``, an integer named array: a
scalar in per-layer blocks, one value per block along ``blocks`` in a layer
stack (the stack's scan hands each block its own).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.model.config import TransformerConfig

BLOCK_POINTS = ("resid_pre", "attn.pattern", "attn.head_out", "attn_out",
                "resid_mid", "mlp_in", "mlp.neurons", "mlp_out", "resid_post")
MODEL_POINTS = ("embed", "final_norm")


@pz.pytree_dataclass
class HookPoint(pz.nn.Layer):
  """An identity layer marking a named point (see the module docstring).

  Attributes:
    point: The point's name without the block, e.g. ``"resid_post"``.
    layer: The block index (int32 named array; None outside blocks).
  """

  point: str = dataclasses.field(metadata={"pytree_node": False})
  layer: pz.nx.NamedArray | None = None

  def __call__(self, x, /, **_side_inputs):
    return x

  def treescope_color(self):
    return "oklch(0.9 0.05 250 / 1.0)"


def hook(point: str, layer: int | None = None) -> HookPoint:
  """A `HookPoint` for ``point`` in block ``layer`` (None: outside
  blocks)."""
  index = None if layer is None else pz.nx.wrap(
      jax.device_put(np.int32(layer)))
  return HookPoint(point=point, layer=index)


def head_coordinates(config: TransformerConfig, head: int) -> dict[str, int]:
  """The named-axis coordinates of query head ``head`` (Hugging Face order).

  Raises:
    ValueError: if ``head`` is not in ``[0, config.num_heads)``.
  """
  if not isinstance(head, int) or isinstance(head, bool) or not (
      0 <= head < config.num_heads):
    raise ValueError(
        f"head {head!r} does not exist: the model has {config.num_heads}"
        f" query heads (0-{config.num_heads - 1}).")
  groups = config.num_kv_heads
  per_group = config.num_heads // groups
  if per_group == 1:
    return {"heads": head}
  if groups == 1:
    return {"query_heads": head}
  return {"head_groups": head // per_group, "query_heads": head % per_group}


def heads_mask(config: TransformerConfig, heads) -> pz.nx.NamedArray:
  """Boolean named array over the query head axes, True at ``heads`` (a list
  of head indices in Hugging Face order)."""
  groups = config.num_kv_heads
  per_group = config.num_heads // groups
  flat = jnp.zeros((config.num_heads,), bool)
  for h in heads:
    head_coordinates(config, h)  # Validates.
    flat = flat.at[h].set(True)
  if per_group == 1:
    return pz.nx.wrap(flat).tag("heads")
  if groups == 1:
    return pz.nx.wrap(flat).tag("query_heads")
  return pz.nx.wrap(flat.reshape(groups, per_group)).tag(
      "head_groups", "query_heads")
