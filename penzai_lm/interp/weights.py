"""A model's weights by TransformerLens name.

``weights(model, "blocks.5.attn.W_O")`` returns block 5's output projection
as a named array, on either layout (a layer stack's block is sliced out)
and for quantized weights too (dequantized to float32). Names:

==========================  ==============================================
name                        weight (its named axes)
==========================  ==============================================
``embed.W_E``               token embeddings (``vocabulary``, ``embedding``)
``pos_embed.W_pos``         learned positions (``positions``, ``embedding``)
``unembed.W_U``             the unembedding (``embedding``, ``vocabulary``;
                            the embeddings when they are tied)
``ln_final.w`` / ``.b``     the final norm's scale / shift (``embedding``)
``blocks.{i}.attn.W_Q``     queries (``embedding``, query head axes,
                            ``projection``); ``W_K``, ``W_V`` with the
                            key/value head axes; ``b_Q`` ... if the model
                            has biases
``blocks.{i}.attn.W_O``     the output projection (query head axes,
                            ``projection``, ``embedding``); ``b_O``
``blocks.{i}.attn.q_norm.w``  Gemma 3's / Qwen3's query norm (``k_norm``)
``blocks.{i}.ln1.w`` / ``.b``  the pre-attention norm; ``ln2``: pre-MLP;
                            ``ln1_post`` / ``ln2_post``: Gemma's post norms
``blocks.{i}.mlp.W_in``     the MLP's up projection (``embedding``,
                            ``neurons``); ``W_gate`` (gated MLPs),
                            ``W_out`` (``neurons``, ``embedding``),
                            ``b_in`` / ``b_out``
==========================  ==============================================

Norm scales are the multipliers the model applies (Gemma's stored
``1 + w``, as loaded). `weight_names` lists what a model has.
"""

from __future__ import annotations

import dataclasses
import difflib
import re

from penzai import pz

from penzai_lm.quantization.layers import QuantizedLinear

# TransformerLens name -> (layer path inside a block, parameter suffix);
# "W_in" is the gated MLP's value projection or the plain MLP's input.
_BLOCK = {
    "attn.W_Q": ("attention/query", "weights"),
    "attn.b_Q": ("attention/query", "bias"),
    "attn.W_K": ("attention/key", "weights"),
    "attn.b_K": ("attention/key", "bias"),
    "attn.W_V": ("attention/value", "weights"),
    "attn.b_V": ("attention/value", "bias"),
    "attn.W_O": ("attention/output", "weights"),
    "attn.b_O": ("attention/output", "bias"),
    "attn.q_norm.w": ("attention/query_norm/scale", "weights"),
    "attn.k_norm.w": ("attention/key_norm/scale", "weights"),
    "ln1.w": ("pre_attention_norm/scale", "weights"),
    "ln1.b": ("pre_attention_norm/shift", "bias"),
    "ln1_post.w": ("post_attention_norm/scale", "weights"),
    "ln2.w": ("pre_ffw_norm/scale", "weights"),
    "ln2.b": ("pre_ffw_norm/shift", "bias"),
    "ln2_post.w": ("post_ffw_norm/scale", "weights"),
    "mlp.W_gate": ("mlp/gating_linear", "weights"),
    "mlp.W_out": ("mlp/out_linear", "weights"),
    "mlp.b_out": ("mlp/out_linear", "bias"),
    "mlp.b_in": ("mlp/in_linear", "bias"),
}
_W_IN = (("mlp/value_linear", "weights"), ("mlp/in_linear", "weights"))
_MODEL = {
    "embed.W_E": (("embedder", "embeddings"), ("embedder/decode", "weights")),
    "pos_embed.W_pos": (("position_embedder", "embeddings"),),
    "unembed.W_U": (("lm_head", "weights"), ("embedder/decode", "weights"),
                    ("embedder", "embeddings")),
    "ln_final.w": (("final_norm/scale", "weights"),),
    "ln_final.b": (("final_norm/shift", "bias"),),
}
_BLOCK_NAME = re.compile(r"^blocks\.(-?\d+)\.(.+)$")


def _table(model) -> dict[tuple[str, str], object]:
  """``{(path, suffix): ParameterValue or QuantizedLinear}``, paths without
  the model's own name (``transformer/``)."""
  out = {}
  for value in pz.select(model).at_instances_of(pz.ParameterValue
                                                ).get_sequence():
    path, _, suffix = value.label.rpartition(".")
    out[(path.partition("/")[2], suffix)] = value
  for layer in pz.select(model).at_instances_of(QuantizedLinear
                                                ).get_sequence():
    path = layer.qs.label.rpartition(".")[0]
    out[(path.partition("/")[2], "weights")] = layer
  return out


def _candidates(name: str) -> tuple[int | None, tuple[tuple[str, str], ...]]:
  """(block or None, the (path, suffix) keys that may hold ``name``)."""
  if name in _MODEL:
    return None, _MODEL[name]
  m = _BLOCK_NAME.match(name)
  if m is None or (m.group(2) not in _BLOCK and m.group(2) != "mlp.W_in"):
    raise KeyError(name)
  keys = _W_IN if m.group(2) == "mlp.W_in" else (_BLOCK[m.group(2)],)
  return int(m.group(1)), keys


def _resolve(table, block: int | None, key: tuple[str, str]):
  if block is None:
    return table.get(key), None
  path, suffix = key
  found = table.get((f"block_{block}/{path}", suffix))
  if found is not None:
    return found, None
  return table.get((f"blocks/{path}", suffix)), block  # A layer stack.


def _value(found, block: int | None) -> pz.nx.NamedArray:
  if isinstance(found, QuantizedLinear):
    if block is not None:
      take = lambda p: None if p is None else dataclasses.replace(  # pylint: disable=g-long-lambda
          p, value=p.value[{"blocks": block}])
      found = dataclasses.replace(found, qs=take(found.qs),
                                  scale=take(found.scale),
                                  mins=take(found.mins))
    return found.dequantized()
  value = found.value
  return value if block is None else value[{"blocks": block}]


def weights(model, name: str) -> pz.nx.NamedArray:
  """One weight of ``model`` by TransformerLens name (the module docstring
  lists them), e.g. ``weights(model, "blocks.5.attn.W_O")``.

  Returns:
    The weight as a named array (a layer stack's block sliced out;
    quantized weights dequantized to float32). It is the model's own array
    (no copy) for float weights.

  Raises:
    ValueError: for a name this model does not have (with the names it
      has), or a block outside the model.
  """
  return WeightTable(model)[name]


def weight_names(model) -> list[str]:
  """Every TransformerLens weight name ``model`` has, model-level names
  first, then block by block."""
  return WeightTable(model).names


class WeightTable:
  """A model's weights by TransformerLens name, from one walk over the
  model (for reading many: `weights` and `weight_names` make one each).

  Attributes:
    names: The names this model has (as `weight_names`).
  """

  def __init__(self, model):
    self._table = _table(model)
    self._num_layers = model.config.num_layers
    names = [n for n in _MODEL if any(
        _resolve(self._table, None, k)[0] is not None for k in _MODEL[n])]
    for i in range(self._num_layers):
      for short in (*_BLOCK, "mlp.W_in"):
        keys = _W_IN if short == "mlp.W_in" else (_BLOCK[short],)
        if any(_resolve(self._table, i, k)[0] is not None for k in keys):
          names.append(f"blocks.{i}.{short}")
    self.names = names

  def __contains__(self, name: str) -> bool:
    return name in self.names

  def __getitem__(self, name: str) -> pz.nx.NamedArray:
    """The weight ``name`` (as `weights`)."""
    if not isinstance(name, str):
      raise TypeError(f"a weight name must be a str, got {name!r}.")
    try:
      block, keys = _candidates(name)
    except KeyError:
      close = difflib.get_close_matches(name, self.names, 1)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
      raise ValueError(
          f"unknown weight {name!r}{hint}; weight_names(model) lists this"
          " model's, e.g. 'blocks.0.attn.W_O', 'unembed.W_U'.") from None
    if block is not None and not 0 <= block < self._num_layers:
      raise ValueError(
          f"{name!r} does not exist: the model has {self._num_layers} blocks"
          f" (blocks.0 to blocks.{self._num_layers - 1}).")
    for key in keys:
      found, stacked_block = _resolve(self._table, block, key)
      if found is not None:
        return _value(found, stacked_block)
    raise ValueError(
        f"this model has no {name!r} (its family has no such weight: e.g."
        " biases exist only in GPT-2 and Qwen2, post norms only in Gemma);"
        " weight_names(model) lists the ones it has.")
