"""Tiny valid checkpoints, and functions that write corrupted copies of them.

Each ``gguf_*`` / ``hf_*`` builder takes a ``tmp_path`` and returns a GGUF
file or Hugging Face directory with exactly one thing broken; the table in
``test_corrupt_files.py`` says which error each must raise.
"""

from __future__ import annotations

import json
import math
import struct

import gguf
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from penzai_lm.checkpoints import expected_tensor_shapes
from tests.checkpoints.checkpoint_test_utils import write_gguf

CFG = dict(
    vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-5,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
)


def state_dict(seed=0, **poison):
  """Random weights in HF layout; ``poison`` sets one value of a tensor."""
  rng = np.random.default_rng(seed)
  sd = {
      n: rng.standard_normal(s).astype(np.float32)
      for n, s in expected_tensor_shapes("llama", CFG).items()
  }
  for name, value in poison.items():
    sd[name.replace("__", ".")].reshape(-1)[3] = value
  return sd


# ---- GGUF corruptions ------------------------------------------------------


def valid_gguf(tmp_path, cfg=CFG, **poison):
  """A tiny llama GGUF (F32) of ``cfg``, with ``poison``ed weights if any."""
  return write_gguf(tmp_path / "m.gguf", "llama", state_dict(**poison), cfg)


def _patch_gguf(tmp_path, edit):
  """A valid file, edited in place through a writable gguf-py reader."""
  path = valid_gguf(tmp_path)
  reader = gguf.GGUFReader(path, "r+")
  edit(reader, {t.name: t for t in reader.tensors})
  reader.data.flush()
  del reader
  return path


def _set_offset(t, value):
  t.field.parts[-1][0] = value


def _set_field(reader, key, value):
  f = reader.fields[key]
  f.parts[f.data[0]][0] = value


def gguf_truncated(tmp_path):
  path = valid_gguf(tmp_path)
  path.write_bytes(path.read_bytes()[:-100])
  return path


def gguf_misaligned(tmp_path):
  return _patch_gguf(
      tmp_path,
      lambda r, t: _set_offset(t["output_norm.weight"],
                               t["output_norm.weight"].field.parts[-1][0] + 4),
  )


def gguf_offset_past_eof(tmp_path):
  return _patch_gguf(
      tmp_path, lambda r, t: _set_offset(t["blk.1.ffn_down.weight"], 2**30)
  )


def gguf_overlap(tmp_path):
  def edit(r, t):
    # Two same-sized norms: the second now reads the first one's bytes.
    _set_offset(t["blk.1.attn_norm.weight"],
                t["blk.0.attn_norm.weight"].field.parts[-1][0])
  return _patch_gguf(tmp_path, edit)


def gguf_huge_shape(tmp_path):
  def edit(r, t):
    t["blk.0.ffn_up.weight"].field.parts[3][:] = 2**20  # 4 TiB of float32
  return _patch_gguf(tmp_path, edit)


def gguf_unknown_type(tmp_path):
  def edit(r, t):
    t["blk.0.attn_v.weight"].field.parts[4][0] = 999
  return _patch_gguf(tmp_path, edit)


def gguf_block_count(tmp_path):
  return _patch_gguf(
      tmp_path, lambda r, t: _set_field(r, "llama.block_count", 10**9)
  )


def gguf_heads_not_dividing(tmp_path):
  return _patch_gguf(
      tmp_path, lambda r, t: _set_field(r, "llama.attention.head_count_kv", 3)
  )


def gguf_zero_heads(tmp_path):
  return _patch_gguf(
      tmp_path, lambda r, t: _set_field(r, "llama.attention.head_count", 0)
  )


def gguf_nan_weight(tmp_path):
  return valid_gguf(tmp_path, model__layers__1__mlp__up_proj__weight=np.nan)


def gguf_inf_weight(tmp_path):
  return valid_gguf(tmp_path, model__embed_tokens__weight=-np.inf)


def gguf_nan_rope_base(tmp_path):
  return valid_gguf(tmp_path, {**CFG, "rope_theta": math.nan})


def gguf_negative_eps(tmp_path):
  return valid_gguf(tmp_path, {**CFG, "rms_norm_eps": -1e-5})


# ---- Hugging Face corruptions ----------------------------------------------


def valid_hf(tmp_path, config=None, tensors=None):
  """A tiny llama HF directory; ``config`` overrides config.json keys."""
  d = tmp_path / "hf"
  d.mkdir()
  cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **CFG}
  cfg.update(config or {})
  (d / "config.json").write_text(json.dumps(cfg))  # NaN is written as NaN
  save_file(tensors or state_dict(), str(d / "model.safetensors"))
  return d


def _edit_header(d, edit):
  """Rewrites model.safetensors' JSON header (data bytes unchanged)."""
  f = d / "model.safetensors"
  raw = f.read_bytes()
  (n,) = struct.unpack("<Q", raw[:8])
  header = json.loads(raw[8 : 8 + n])
  edit(header)
  new = json.dumps(header).encode()
  new += b" " * (-len(new) % 8)
  f.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])
  return d


def hf_truncated(tmp_path):
  d = valid_hf(tmp_path)
  f = d / "model.safetensors"
  f.write_bytes(f.read_bytes()[:-64])
  return d


def hf_header_length_past_eof(tmp_path):
  d = valid_hf(tmp_path)
  f = d / "model.safetensors"
  f.write_bytes(struct.pack("<Q", 10**12) + f.read_bytes()[8:])
  return d


def hf_offsets_past_eof(tmp_path):
  def edit(h):
    h["model.norm.weight"]["data_offsets"][1] += 10**6
  return _edit_header(valid_hf(tmp_path), edit)


def hf_wrong_dtype(tmp_path):
  return _edit_header(
      valid_hf(tmp_path), lambda h: h["model.norm.weight"].update(dtype="F16")
  )


def hf_unknown_dtype(tmp_path):
  return _edit_header(
      valid_hf(tmp_path), lambda h: h["model.norm.weight"].update(dtype="F33")
  )


def hf_huge_shape(tmp_path):
  return _edit_header(
      valid_hf(tmp_path),
      lambda h: h["model.norm.weight"].update(shape=[2**20, 2**20]),
  )


def hf_overlap(tmp_path):
  def edit(h):
    a, b = "model.layers.0.input_layernorm.weight", "model.norm.weight"
    h[b]["data_offsets"] = list(h[a]["data_offsets"])
  return _edit_header(valid_hf(tmp_path), edit)


def hf_missing_shard(tmp_path):
  d = valid_hf(tmp_path)
  names = list(state_dict())
  (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
  (d / "model.safetensors.index.json").write_text(json.dumps({
      "weight_map": {
          n: f"model-0000{1 + (n == names[-1])}-of-00002.safetensors"
          for n in names
      }
  }))
  return d


def hf_index_names_absent_tensor(tmp_path):
  d = valid_hf(tmp_path)
  (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
  weight_map = {n: "model-00001-of-00001.safetensors" for n in state_dict()}
  weight_map["model.layers.7.mlp.up_proj.weight"] = (
      "model-00001-of-00001.safetensors"
  )
  (d / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": weight_map})
  )
  return d


def hf_many_layers(tmp_path):
  return valid_hf(tmp_path, {"num_hidden_layers": 100_000})


def hf_absurd_layers(tmp_path):
  return valid_hf(tmp_path, {"num_hidden_layers": 10**12})


def hf_config_disagrees_with_shapes(tmp_path):
  return valid_hf(tmp_path, {"intermediate_size": 25})


def hf_heads_not_dividing(tmp_path):
  return valid_hf(tmp_path, {"num_key_value_heads": 3})


def hf_hidden_not_dividing(tmp_path):
  return valid_hf(tmp_path, {"num_attention_heads": 3, "head_dim": None})


def hf_vocab_zero(tmp_path):
  return valid_hf(tmp_path, {"vocab_size": 0})


def hf_nan_rope_theta(tmp_path):
  return valid_hf(tmp_path, {"rope_theta": math.nan})


def hf_inf_rope_factor(tmp_path):
  return valid_hf(tmp_path, {"rope_scaling": {"rope_type": "linear",
                                         "factor": math.inf}})


def hf_negative_eps(tmp_path):
  return valid_hf(tmp_path, {"rms_norm_eps": -1e-6})


def hf_nan_weight(tmp_path):
  return valid_hf(tmp_path, tensors=state_dict(model__norm__weight=np.nan))


def hf_bf16_inf_weight(tmp_path):
  sd = state_dict()
  name = "model.layers.0.self_attn.v_proj.weight"
  sd[name] = sd[name].astype(ml_dtypes.bfloat16)
  sd[name][0, 0] = np.inf
  sd = {n: t.astype(ml_dtypes.bfloat16) for n, t in sd.items()}
  return valid_hf(tmp_path, tensors=sd)
