"""A corpus of corrupted checkpoint files, each failing with a clear error.

Every case starts from a tiny valid GGUF file or Hugging Face directory
(written by ``corrupt_file_builders``) and breaks one thing: bytes
(truncation, offsets, shapes, dtypes), metadata/config values, or weights.
Each must raise its error class (all ValueErrors) with a message naming what
is wrong and where, quickly and without allocating anything sized by the
broken claim.
"""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

from penzai_lm.checkpoints import CheckpointError
from penzai_lm.checkpoints import expected_tensor_shapes
from penzai_lm.checkpoints import gguf_reader
from penzai_lm.checkpoints import hf_reader
from penzai_lm.checkpoints import normalize_config
from penzai_lm.checkpoints import open_checkpoint
from penzai_lm.checkpoints import read_checkpoint
from penzai_lm.checkpoints.checkpoint import CheckpointFileNotFoundError
from tests.checkpoints import corrupt_file_builders as b
from tests.checkpoints.corrupt_file_builders import state_dict
from tests.checkpoints.corrupt_file_builders import valid_gguf
from tests.checkpoints.corrupt_file_builders import valid_hf

HINT = "the file is truncated or corrupt; re-download it"

CASES = [
    # (builder, error class, message regex)
    (b.gguf_truncated, CheckpointError, f"past the end of the file.*{HINT}"),
    (b.gguf_misaligned, CheckpointError,
     r"'output_norm.weight' starts at data offset \d+, which is not a"
     r" multiple of general.alignment=32"),
    (b.gguf_offset_past_eof, CheckpointError,
     r"'blk.1.ffn_down.weight' \(type F32, shape \[24, 16\]\) needs 1,536"
     r" bytes at file offset [\d,]+, past the end of the file"),
    (b.gguf_overlap, CheckpointError,
     r"tensors 'blk.0.attn_norm.weight' \(bytes \d+..\d+\) and"
     r" 'blk.1.attn_norm.weight' \(bytes \d+..\d+\) overlap"),
    (b.gguf_huge_shape, CheckpointError,
     r"'blk.0.ffn_up.weight' \(type F32, shape \[1048576, 1048576\]\) needs"
     r" 4,398,046,511,104 bytes.*past the end"),
    (b.gguf_unknown_type, CheckpointError,
     rf"tensor 'blk.0.attn_v.weight' has unknown tensor type 999; {HINT}"),
    (b.gguf_block_count, CheckpointError,
     r"says llama.block_count=1000000000 but the checkpoint has tensors for"
     r" 2 layers \(blk.0 .. blk.1\); the file's metadata is corrupt"),
    (b.gguf_heads_not_dividing, CheckpointError,
     r"metadata key 'llama.attention.head_count' = 2 is not a multiple of"
     r" metadata key 'llama.attention.head_count_kv' = 3"),
    (b.gguf_zero_heads, CheckpointError,
     r"metadata key 'llama.attention.head_count' = 0 must be a positive"
     r" integer"),
    (b.gguf_nan_weight, CheckpointError,
     r"tensor 'blk.1.ffn_up.weight' holds 1 NaN and 0 infinite value\(s\)"
     r" \(first at flat index 3\); the weights are corrupt"),
    (b.gguf_inf_weight, CheckpointError,
     r"tensor 'token_embd.weight' holds 0 NaN and 1 infinite"),
    (b.gguf_nan_rope_base, CheckpointError,
     r"metadata key 'llama.rope.freq_base' = nan must be a finite positive"
     r" number; the file's metadata is corrupt"),
    (b.gguf_negative_eps, CheckpointError,
     r"metadata key 'llama.attention.layer_norm_rms_epsilon' = -[\d.e-]+ must"
     r" be a finite non-negative number"),
    (b.hf_truncated, CheckpointError,
     rf"tensor '[\w.]+': the header places its data at bytes \d+..\d+ of the"
     rf" data section, but the file holds only \d+ bytes of data; {HINT}"),
    (b.hf_header_length_past_eof, CheckpointError,
     rf"header length 1000000000000 exceeds the file \(\d+ bytes\); {HINT}"),
    (b.hf_offsets_past_eof, CheckpointError,
     r"tensor 'model.norm.weight': the header places its data at bytes"
     r" \d+..\d+ of the data section, but the file holds only"),
    (b.hf_wrong_dtype, CheckpointError,
     r"tensor 'model.norm.weight': dtype F16 x shape \[16\] is 32 bytes, but"
     r" its data_offsets span 64 bytes"),
    (b.hf_unknown_dtype, CheckpointError,
     r"tensor 'model.norm.weight' has unknown dtype 'F33'"),
    (b.hf_huge_shape, CheckpointError,
     r"tensor 'model.norm.weight': dtype F32 x shape \[1048576, 1048576\] is"
     r" 4398046511104 bytes, but its data_offsets span 64 bytes"),
    (b.hf_overlap, CheckpointError,
     r"tensors 'model.layers.0.input_layernorm.weight' \(bytes \d+..\d+\) and"
     r" 'model.norm.weight' \(bytes \d+..\d+\) overlap"),
    (b.hf_missing_shard, CheckpointFileNotFoundError,
     r"lists shard\(s\) missing from .*: model-00002-of-00002.safetensors;"
     r" download"),
    (b.hf_index_names_absent_tensor, CheckpointError,
     r"places tensor 'model.layers.7.mlp.up_proj.weight' in"
     r" model-00001-of-00001.safetensors, but .* has no such tensor"),
    (b.hf_many_layers, CheckpointError,
     r"config.json says num_hidden_layers=100000 but the checkpoint has"
     r" tensors for 2 layers \(model.layers.0 .. model.layers.1\); fix the"
     r" value"),
    (b.hf_absurd_layers, CheckpointError,
     r"says num_hidden_layers=1000000000000 but the checkpoint has tensors"
     r" for 2 layers"),
    (b.hf_config_disagrees_with_shapes, CheckpointError,
     r"model.layers.0.mlp.up_proj.weight: expected \(25, 16\), got"
     r" \(24, 16\).*the config and the tensors disagree"),
    (b.hf_heads_not_dividing, CheckpointError,
     r"config.json: key 'num_attention_heads' = 2 is not a multiple of key"
     r" 'num_key_value_heads' = 3"),
    (b.hf_hidden_not_dividing, CheckpointError,
     r"key 'hidden_size' = 16 is not a multiple of key 'num_attention_heads'"
     r" = 3 \(and no head_dim is given\)"),
    (b.hf_vocab_zero, CheckpointError,
     r"config.json: key 'vocab_size' = 0 must be a positive integer"),
    (b.hf_nan_rope_theta, CheckpointError,
     r"config.json: key 'rope_theta' = nan must be a finite positive number;"
     r" fix the value"),
    (b.hf_inf_rope_factor, CheckpointError,
     r"key 'rope_scaling.factor' = inf must be a finite positive number"),
    (b.hf_negative_eps, CheckpointError,
     r"key 'rms_norm_eps' = -1e-06 must be a finite non-negative number"),
    (b.hf_nan_weight, CheckpointError,
     r"model.safetensors: tensor 'model.norm.weight' holds 1 NaN and 0"
     r" infinite value\(s\) \(first at flat index 3\)"),
    (b.hf_bf16_inf_weight, CheckpointError,
     r"tensor 'model.layers.0.self_attn.v_proj.weight' holds 0 NaN and 1"
     r" infinite value\(s\) \(first at flat index 0\)"),
]


@pytest.mark.parametrize(
    "build,error,message", CASES, ids=[c[0].__name__ for c in CASES]
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_corrupt_file_fails_clearly_and_fast(
    tmp_path, build, error, message, dtype
):
  path = build(tmp_path)
  start = time.perf_counter()
  with pytest.raises(error, match=message) as e:
    read_checkpoint(path, dtype=dtype)
  elapsed = time.perf_counter() - start
  assert isinstance(e.value, ValueError)
  assert str(path) in str(e.value)  # says where
  # Nothing sized by the broken claim is built (a billion layers, 4 TiB).
  assert elapsed < 5, f"{build.__name__} took {elapsed:.1f} s"


@pytest.mark.parametrize("build", [valid_gguf, valid_hf], ids=["gguf", "hf"])
def test_valid_tiny_files_still_load(tmp_path, build):
  ckpt = read_checkpoint(build(tmp_path))
  assert ckpt.architecture == "llama"
  assert ckpt.config["num_hidden_layers"] == 2
  sd = state_dict()
  assert set(ckpt.tensors) == set(sd)
  np.testing.assert_array_equal(
      ckpt.tensors["model.norm.weight"], sd["model.norm.weight"]
  )


def test_sharded_valid_directory_still_loads(tmp_path):
  d = valid_hf(tmp_path)
  sd = state_dict()
  (d / "model.safetensors").unlink()
  names = sorted(sd)
  half = {n: f"model-0000{1 + (i % 2)}-of-00002.safetensors"
          for i, n in enumerate(names)}
  for shard in set(half.values()):
    save_file({n: sd[n] for n in names if half[n] == shard}, str(d / shard))
  (d / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": half})
  )
  assert set(read_checkpoint(d).tensors) == set(sd)


def test_direct_calls_reject_absurd_layer_counts_fast():
  start = time.perf_counter()
  for call in (normalize_config, expected_tensor_shapes):
    with pytest.raises(CheckpointError,
                       match=r"num_hidden_layers' = 1000000000 is more layers"):
      call("llama", {"num_hidden_layers": 10**9})
  assert time.perf_counter() - start < 1


def test_missing_files_are_value_and_file_not_found_errors(tmp_path):
  with pytest.raises(CheckpointFileNotFoundError) as e:
    read_checkpoint(tmp_path / "nope.gguf")
  assert isinstance(e.value, ValueError)
  assert isinstance(e.value, FileNotFoundError)
  d = tmp_path / "empty"
  d.mkdir()
  shutil.copy(valid_hf(tmp_path) / "config.json", d / "config.json")
  with pytest.raises(CheckpointFileNotFoundError, match="no model.safetensors"):
    read_checkpoint(d)


@pytest.mark.parametrize(
    "build",
    [b.gguf_block_count, b.gguf_nan_rope_base, b.gguf_heads_not_dividing,
     b.hf_many_layers, b.hf_config_disagrees_with_shapes, b.hf_nan_rope_theta],
    ids=lambda f: f.__name__,
)
def test_config_errors_come_before_reading_tensor_data(
    tmp_path, monkeypatch, build
):
  def no_data(*args, **kwargs):
    raise AssertionError("tensor data read before the config was checked")

  monkeypatch.setattr(gguf_reader, "dequantize", no_data)
  monkeypatch.setattr(gguf_reader, "read_gguf_tensor", no_data)
  monkeypatch.setattr(hf_reader, "read_tensor", no_data)
  path = build(tmp_path)
  with pytest.raises(CheckpointError):
    read_checkpoint(path)
  with pytest.raises(CheckpointError):  # the streaming loader's entry point
    open_checkpoint(path)
