"""``load(..., quantize="keep")``: each projection in its GGUF file's format.

A GGUF file stores each weight in a llama.cpp type. Q8_0, Q4_0 and Q4_1
weights are loaded (dequantized) and quantized again to the same format;
that gives back the file's integers and float16 scales exactly (the
quantizers are ggml's reference ones, and a dequantized block's extremes
map to the extreme codes), so "keep" is a faithful repacking of the blocks
into the layout the kernels read. Float weights (F32, F16, BF16) stay float.
"""

from __future__ import annotations

import collections
import re
from typing import Callable

# Our layer (label without block prefix) -> llama.cpp tensor kind.
_KINDS = {
    "attention/query": "attn_q", "attention/key": "attn_k",
    "attention/value": "attn_v", "attention/output": "attn_output",
    "mlp/gating_linear": "ffn_gate", "mlp/value_linear": "ffn_up",
    "mlp/out_linear": "ffn_down", "lm_head": "output",
    "embedder": "token_embd",
}
_KEPT = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
_FLOAT = {"F32", "F16", "BF16"}
_LABEL = re.compile(r"^[^/]+/(?:blocks/|block_\d+/)?(.+?)(?:\.weights|"
                    r"\.embeddings)$")


def _file_types(reader) -> dict[str, set[str]]:
  """llama.cpp tensor kind -> the types of its 2-D tensors in the file."""
  types = collections.defaultdict(set)
  for tensor in reader.tensors:
    parts = tensor.name.split(".")
    if parts[-1] != "weight" or len(tensor.shape) != 2:
      continue
    kind = parts[2] if parts[0] == "blk" else parts[0]
    types[kind].add(tensor.tensor_type.name)
  return types


def formats_from_gguf(reader) -> Callable[[str], str | None]:
  """label -> format of a model loaded from the GGUF file ``reader`` reads.

  Raises (from the returned function):
    ValueError: for a projection whose GGUF type cannot be kept (a K-quant
      such as Q4_K or Q6_K, or types that differ from layer to layer).
  """
  types = _file_types(reader)

  def choose(label: str) -> str | None:
    m = _LABEL.match(label)
    kind = _KINDS.get(m.group(1)) if m else None
    if kind is None or kind not in types:
      raise ValueError(
          f"quantize='keep' cannot tell which GGUF tensor {label!r} came"
          " from; use quantize='int8' or 'q8_0' to quantize every"
          " projection, or quantize=None.")
    found = types[kind]
    if found <= _FLOAT:
      return None
    if len(found) == 1 and next(iter(found)) in _KEPT:
      return _KEPT[next(iter(found))]
    raise ValueError(
        f"quantize='keep' keeps {sorted(_KEPT)} blocks, and this file's"
        f" {kind} weights are {sorted(found)}; use quantize='int8' or"
        " 'q8_0' (requantized from the dequantized weights), or"
        " quantize=None (float).")

  return choose
