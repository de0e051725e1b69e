"""``load(..., quantize="keep")``: each projection in its GGUF file's blocks.

A GGUF file stores each weight in a llama.cpp type. "keep" reads every
quantized projection's raw blocks from the file (its rows moved into the
model's order, as the float loader moves them) and repacks them into the
smallest layout that holds them exactly (`gguf_blocks`): a kept weight
dequantizes to the float weight loaded from the same file, bit for bit.
Float weights (F32, F16, BF16) stay float. The layers of a layer stack share
one layout, so a file that mixes types across layers (Q4_K_M gives some
layers' ``ffn_down`` Q6_K, the others Q4_K) keeps that stack in the layout
that holds all of them; ``use_layer_stack=False`` keeps each layer in its
own.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from penzai_lm.checkpoints.architectures import spec_for
from penzai_lm.checkpoints.gguf_tensors import hf_conventions
from penzai_lm.checkpoints.gguf_tensors import hf_tensor_name
from penzai_lm.checkpoints.gguf_tensors import read_gguf_blocks
from penzai_lm.quantization import gguf_blocks
from penzai_lm.quantization.formats import QuantizedWeight

# Our layer (label without block prefix) -> llama.cpp tensor kind.
_KINDS = {
    "attention/query": "attn_q", "attention/key": "attn_k",
    "attention/value": "attn_v", "attention/output": "attn_output",
    "mlp/gating_linear": "ffn_gate", "mlp/value_linear": "ffn_up",
    "mlp/out_linear": "ffn_down", "lm_head": "output",
    "embedder": "token_embd",
}
_FLOAT = {"F32", "F16", "BF16"}
_LABEL = re.compile(r"^[^/]+/(?:(blocks)/|block_(\d+)/)?(.+?)(?:\.weights|"
                    r"\.embeddings)$")

# label -> the weight of each stacked layer (None: leave the layer float).
KeptWeights = Callable[[str], list[QuantizedWeight] | None]


def _tensor_names(label: str, num_layers: int) -> list[str]:
  """The GGUF tensors a parameter label was loaded from, one per layer."""
  m = _LABEL.match(label)
  kind = _KINDS.get(m.group(3)) if m else None
  if kind is None:
    raise ValueError(
        f"quantize='keep' cannot tell which GGUF tensor {label!r} came"
        " from; use quantize='int8' or 'q8_0' to quantize every"
        " projection, or quantize=None.")
  if m.group(1):
    return [f"blk.{i}.{kind}.weight" for i in range(num_layers)]
  if m.group(2) is not None:
    return [f"blk.{m.group(2)}.{kind}.weight"]
  return [f"{kind}.weight"]


def _gguf_tensors(checkpoint) -> dict:
  """GGUF name -> tensor of a GGUF checkpoint; a clear error otherwise."""
  reader = getattr(checkpoint, "gguf_reader", None)
  if reader is None:
    raise ValueError(
        f"quantize='keep' keeps a GGUF file's blocks, and"
        f" {getattr(checkpoint, 'source', checkpoint)!r} is not an opened"
        " GGUF checkpoint (penzai_lm.checkpoints.open_checkpoint of a .gguf"
        " file); use quantize='int8'.")
  return {t.name: t for t in reader.tensors}


def kept_tensor_names(checkpoint) -> frozenset[str]:
  """HF names of the tensors `kept_weights` replaces: the quantized
  projections, and a quantized tied token table (its lookup then reads the
  kept rows too). The float loader need not read them."""
  names = _gguf_tensors(checkpoint)
  spec = spec_for(checkpoint.architecture)
  kinds = set(_KINDS.values())
  if "output.weight" in names:  # Untied: the token table is only looked up.
    kinds.discard("token_embd")
  out = set()
  for gname, t in names.items():
    parts = gname.split(".")
    kind = parts[2] if parts[0] == "blk" and len(parts) > 2 else parts[0]
    if (kind in kinds and parts[-1] == "weight" and len(t.shape) == 2
        and t.tensor_type.name not in _FLOAT):
      hf = hf_tensor_name(spec, gname)
      if hf is not None:
        out.add(hf)
  return frozenset(out)


def kept_weights(checkpoint, num_layers: int) -> KeptWeights:
  """The file's own blocks of each projection of a GGUF checkpoint.

  Args:
    checkpoint: A GGUF `penzai_lm.checkpoints.LazyCheckpoint` or
      ``Checkpoint`` (``gguf_reader`` set).
    num_layers: The model's blocks.

  Returns:
    label -> the kept weight of each layer, for `quantize`. It raises
    ValueError for a projection it cannot keep exactly: a type with no
    layout here (``KEPT_TYPES``), or float and quantized layers in one
    stack.
  """
  tensors = _gguf_tensors(checkpoint)
  path = Path(checkpoint.source)
  spec = spec_for(checkpoint.architecture)
  heads = (checkpoint.config["num_attention_heads"],
           checkpoint.config["num_key_value_heads"])

  def kept(label: str) -> list[QuantizedWeight] | None:
    names = _tensor_names(label, num_layers)
    missing = [n for n in names if n not in tensors]
    if missing:
      raise ValueError(f"quantize='keep': {label!r} comes from no tensor of"
                       f" {path} (looked for {missing[0]}).")
    types = {tensors[n].tensor_type.name for n in names}
    if types <= _FLOAT:
      return None
    unknown = types - set(gguf_blocks.KEPT_TYPES)
    if unknown:
      raise ValueError(
          f"quantize='keep' keeps {', '.join(gguf_blocks.KEPT_TYPES)}"
          f" blocks, and {names[0]} is {sorted(types)}; use"
          " quantize='int8' or 'q8_0' (requantized from the dequantized"
          " weights), or quantize=None (float).")
    layout = gguf_blocks.common_layout(types)
    weights = []
    for name in names:
      t = tensors[name]
      unpermute, _ = hf_conventions(spec, name, hf_tensor_name(spec, name),
                                    *heads)
      raw = read_gguf_blocks(path, t, unpermute_heads=unpermute)
      groups = gguf_blocks.decode(raw, t.tensor_type.name, int(t.shape[0]))
      del raw
      weights.append(gguf_blocks.to_layout(groups, layout))
      del groups
    return weights

  return kept
