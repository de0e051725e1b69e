"""Large random Hugging Face checkpoints, written fast, for memory tests.

`write_random_llama` writes a sharded safetensors ``LlamaForCausalLM``
directory of any size without holding it in memory: tensors are slices of
one random pool, each written straight to its shard (``safetensors``'
``save_file`` would need the whole state dict at once). The benchmark
``benchmarks/load_and_memory.py`` uses it too.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

# ~1.1B parameters (2.2 GB in bfloat16): the "1B" of the memory tests.
LLAMA_1B = dict(
    vocab_size=32000, hidden_size=2048, intermediate_size=8192,
    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
)
_DTYPES = {"BF16": ml_dtypes.bfloat16, "F32": np.float32}


def llama_shapes(c: dict) -> dict[str, tuple[int, ...]]:
  """HF tensor name -> shape of an untied ``LlamaForCausalLM``."""
  h, inter = c["hidden_size"], c["intermediate_size"]
  kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
  shapes = {"model.embed_tokens.weight": (c["vocab_size"], h)}
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    shapes.update({
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (h, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, h),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
    })
  shapes["model.norm.weight"] = (h,)
  shapes["lm_head.weight"] = (c["vocab_size"], h)
  return shapes


def _pool(size: int, kind: str, seed: int) -> np.ndarray:
  """Random finite values of magnitude < 2, as the on-disk dtype."""
  rng = np.random.default_rng(seed)
  if kind == "BF16":
    # Clearing bit 14 keeps the exponent below 2**1: finite, |x| < 2.
    bits = rng.integers(0, 2**16, size, dtype=np.uint16) & np.uint16(0xBFFF)
    return bits.view(ml_dtypes.bfloat16)
  return rng.uniform(-1, 1, size).astype(np.float32)


def _write_shard(file: Path, tensors: dict[str, np.ndarray]) -> None:
  header, offset = {}, 0
  for name, arr in tensors.items():
    kind = next(k for k, d in _DTYPES.items() if arr.dtype == d)
    header[name] = dict(dtype=kind, shape=list(arr.shape),
                        data_offsets=[offset, offset + arr.nbytes])
    offset += arr.nbytes
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)
  with open(file, "wb") as f:
    f.write(struct.pack("<Q", len(raw)) + raw)
    for arr in tensors.values():
      f.write(memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)))


def write_random_llama(
    path: str | os.PathLike, config: dict | None = None, *, kind: str = "BF16",
    shards: int = 2, seed: int = 0,
) -> Path:
  """Writes a random ``LlamaForCausalLM`` checkpoint into directory ``path``.

  Args:
    path: The directory (created).
    config: Sizes (default `LLAMA_1B`); any other config.json keys.
    kind: The safetensors dtype of every tensor, "BF16" or "F32".
    shards: Number of safetensors files (with an index when more than 1).
    seed: Seed of the values.

  Returns:
    The directory.
  """
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  c = {**LLAMA_1B, **(config or {})}
  shapes = llama_shapes(c)
  biggest = max(int(np.prod(s)) for s in shapes.values())
  pool = _pool(biggest + 4096, kind, seed)
  ones = np.ones(c["hidden_size"], pool.dtype)
  tensors = {}
  for i, (name, shape) in enumerate(shapes.items()):
    n = int(np.prod(shape))
    # Norm scales near 1, as in real models; matrices from the pool.
    data = ones[:n] if len(shape) == 1 else pool[(i * 977) % 4096:][:n]
    tensors[name] = data.reshape(shape)
  names = list(tensors)
  per = -(-len(names) // shards)
  weight_map = {}
  for s in range(shards):
    file = (f"model-{s + 1:05d}-of-{shards:05d}.safetensors" if shards > 1
            else "model.safetensors")
    part = names[s * per:(s + 1) * per]
    _write_shard(path / file, {n: tensors[n] for n in part})
    weight_map.update(dict.fromkeys(part, file))
  if shards > 1:
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
  (path / "config.json").write_text(json.dumps({
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
      "rope_theta": 10000.0, "tie_word_embeddings": False,
      "torch_dtype": "bfloat16" if kind == "BF16" else "float32",
      "bos_token_id": 1, "eos_token_id": 2, **c,
  }))
  return path


def checkpoint_bytes(path: str | os.PathLike) -> int:
  """Bytes of a directory's safetensors files."""
  return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
