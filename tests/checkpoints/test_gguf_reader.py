"""read_gguf on small GGUF files written here (llama.cpp conventions)."""

from __future__ import annotations

import math

import gguf
from gguf import GGMLQuantizationType as Q
import ml_dtypes
import numpy as np
import pytest

from tests.checkpoints.checkpoint_test_utils import quant_roundtrip
from tests.checkpoints.checkpoint_test_utils import write_gguf
from penzai_lm.checkpoints import CheckpointError
from penzai_lm.checkpoints import GUARANTEED_CONFIG_KEYS
from penzai_lm.checkpoints import read_checkpoint
from penzai_lm.checkpoints import read_gguf
from penzai_lm.checkpoints import gguf_file
from penzai_lm.checkpoints import gguf_reader as gguf_reader_lib
from penzai_lm.checkpoints import gguf_tensors

LLAMA_CFG = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)

GEMMA3_CFG = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=7,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    max_position_embeddings=512,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    bos_token_id=2,
    eos_token_id=1,
    sliding_window=16,
)

MIXED_TYPES = {
    "q_proj": Q.Q8_0,
    "k_proj": Q.Q4_0,
    "v_proj": Q.F16,
    "o_proj": Q.Q4_1,
    "gate_proj": Q.Q5_0,
    "up_proj": Q.F32,
    "down_proj": Q.Q8_0,
    "embed_tokens": Q.Q8_0,
    "lm_head": Q.F16,
}


def mixed_qtype(name, arr):
  if arr.ndim == 1:
    return Q.F32  # norms and biases stay F32, as llama.cpp writes them
  for key, qt in MIXED_TYPES.items():
    if key in name:
      return qt
  raise AssertionError(name)


def _random_state_dict(shapes, seed=0):
  rng = np.random.default_rng(seed)
  return {
      n: rng.standard_normal(s).astype(np.float32) * (0.5 if len(s) > 1 else 1.0)
      for n, s in shapes.items()
  }


def llama_shapes(cfg, tied):
  h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
  nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
  out = {"model.embed_tokens.weight": (v, h)}
  for l in range(cfg["num_hidden_layers"]):
    b = f"model.layers.{l}."
    out.update({
        b + "self_attn.q_proj.weight": (nh * hd, h),
        b + "self_attn.k_proj.weight": (nkv * hd, h),
        b + "self_attn.v_proj.weight": (nkv * hd, h),
        b + "self_attn.o_proj.weight": (h, nh * hd),
        b + "mlp.gate_proj.weight": (i, h),
        b + "mlp.up_proj.weight": (i, h),
        b + "mlp.down_proj.weight": (h, i),
        b + "input_layernorm.weight": (h,),
        b + "post_attention_layernorm.weight": (h,),
    })
  out["model.norm.weight"] = (h,)
  if not tied:
    out["lm_head.weight"] = (v, h)
  return out


def gemma3_shapes(cfg):
  out = llama_shapes(cfg, tied=True)
  hd = cfg["head_dim"]
  for l in range(cfg["num_hidden_layers"]):
    b = f"model.layers.{l}."
    out[b + "self_attn.q_norm.weight"] = (hd,)
    out[b + "self_attn.k_norm.weight"] = (hd,)
    out[b + "pre_feedforward_layernorm.weight"] = (cfg["hidden_size"],)
    out[b + "post_feedforward_layernorm.weight"] = (cfg["hidden_size"],)
  return out


@pytest.fixture(scope="module")
def llama_mixed(tmp_path_factory):
  sd = _random_state_dict(llama_shapes(LLAMA_CFG, tied=False))
  path = write_gguf(
      tmp_path_factory.mktemp("gguf") / "llama-mixed.gguf",
      "llama",
      sd,
      LLAMA_CFG,
      mixed_qtype,
  )
  return path, sd


@pytest.fixture(scope="module")
def llama_f32_tied(tmp_path_factory):
  sd = _random_state_dict(llama_shapes(LLAMA_CFG, tied=True), seed=1)
  path = write_gguf(
      tmp_path_factory.mktemp("gguf") / "llama-f32.gguf", "llama", sd, LLAMA_CFG
  )
  return path, sd


@pytest.fixture(scope="module")
def gemma3_file(tmp_path_factory):
  sd = _random_state_dict(gemma3_shapes(GEMMA3_CFG), seed=2)
  path = write_gguf(
      tmp_path_factory.mktemp("gguf") / "gemma3.gguf",
      "gemma3",
      sd,
      GEMMA3_CFG,
      lambda n, a: Q.F32 if a.ndim == 1 or "k_proj" in n else Q.Q8_0,
  )
  return path, sd


def test_llama_mixed_quant_types_recover_hf_layout(llama_mixed):
  path, sd = llama_mixed
  ckpt = read_gguf(path)
  assert ckpt.architecture == "llama"
  assert set(ckpt.tensors) == set(sd)
  for name, w in sd.items():
    got = ckpt.tensors[name]
    assert got.dtype == np.float32
    qt = mixed_qtype(name, w)
    # Quantization is row-wise, so it commutes with llama.cpp's row
    # permutation: un-permuting must give exactly the quantized HF tensor.
    np.testing.assert_array_equal(got, quant_roundtrip(w, qt), err_msg=name)
    if qt == Q.F32:
      np.testing.assert_array_equal(got, w, err_msg=name)
    else:
      tol = {Q.F16: 2e-3, Q.Q8_0: 0.03, Q.Q5_0: 0.15, Q.Q4_0: 0.3, Q.Q4_1: 0.3}
      assert np.abs(got - w).max() < tol[qt], name


def test_llama_config(llama_mixed):
  ckpt = read_gguf(llama_mixed[0])
  c = ckpt.config
  for k, v in LLAMA_CFG.items():
    assert c[k] == pytest.approx(v), k
  assert c["tie_word_embeddings"] is False
  assert c["rope_scaling"] is None
  assert c["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
  assert c["hidden_act"] == "silu"
  assert c["attention_bias"] is False
  assert c["model_type"] == "llama"
  assert c["architectures"] == ["LlamaForCausalLM"]
  assert GUARANTEED_CONFIG_KEYS["llama"] <= set(c)


def test_llama_f32_tied_exact(llama_f32_tied):
  path, sd = llama_f32_tied
  ckpt = read_checkpoint(path)
  assert "lm_head.weight" not in ckpt.tensors
  assert ckpt.config["tie_word_embeddings"] is True
  assert set(ckpt.tensors) == set(sd)
  for name, w in sd.items():
    np.testing.assert_array_equal(ckpt.tensors[name], w, err_msg=name)
    assert ckpt.tensors[name].flags.writeable  # not a view of the mmap


def test_bfloat16(llama_f32_tied, gemma3_file):
  for path, sd in (llama_f32_tied, gemma3_file):
    f32 = read_gguf(path)
    bf = read_gguf(path, dtype=ml_dtypes.bfloat16)
    assert set(bf.tensors) == set(f32.tensors)
    for name, t in f32.tensors.items():
      assert bf.tensors[name].dtype == ml_dtypes.bfloat16
      np.testing.assert_array_equal(
          bf.tensors[name].view(np.uint16),
          t.astype(ml_dtypes.bfloat16).view(np.uint16),
      )


def test_reader_kept_for_tokenizer(llama_f32_tied):
  ckpt = read_gguf(llama_f32_tied[0])
  assert isinstance(ckpt.gguf_reader, gguf.GGUFReader)
  assert "general.architecture" in ckpt.gguf_reader.fields


def test_dequantizes_each_tensor_once(llama_mixed, monkeypatch):
  calls = []
  real = gguf_tensors._dequantize_data

  def counting(data, qtype, name, path):
    calls.append(name)
    return real(data, qtype, name, path)

  monkeypatch.setattr(gguf_tensors, "_dequantize_data", counting)
  ckpt = read_gguf(llama_mixed[0])
  # The test tensors are smaller than a chunk: one call each.
  assert sorted(calls) == sorted(set(calls))
  assert len(calls) == len(ckpt.tensors)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.F16])
def test_chunked_dequantization_is_gguf_py_bit_for_bit(qtype, tmp_path):
  # Rows split across chunks, through the block class's dequantize_rows:
  # the same bits as one gguf.quants.dequantize call on the whole tensor.
  rng = np.random.default_rng(3)
  w = rng.normal(size=(3 * 1000 + 7, 64)).astype(np.float32)
  path = tmp_path / "one.gguf"
  writer = gguf.GGUFWriter(path, "llama")
  writer.add_tensor("t", gguf.quants.quantize(w, qtype), raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  t = gguf.GGUFReader(path).tensors[0]
  want = gguf.quants.dequantize(t.data, qtype).reshape(w.shape)
  got = gguf_tensors.read_gguf_tensor(path, t, np.float32)
  assert got.shape == w.shape
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_gemma3_norms_and_defaults(gemma3_file):
  path, sd = gemma3_file
  ckpt = read_gguf(path)
  assert ckpt.architecture == "gemma3"
  assert set(ckpt.tensors) == set(sd)
  for name, w in sd.items():
    got = ckpt.tensors[name]
    if name.endswith("norm.weight"):
      # Stored as 1 + w; HF keeps w.
      np.testing.assert_array_equal(got, (w + np.float32(1)) - np.float32(1))
      np.testing.assert_allclose(got, w, atol=1e-6)
    elif "k_proj" in name:  # F32 and not permuted
      np.testing.assert_array_equal(got, w, err_msg=name)
    else:
      np.testing.assert_array_equal(got, quant_roundtrip(w, Q.Q8_0), err_msg=name)
  c = ckpt.config
  assert c["model_type"] == "gemma3_text"
  assert c["architectures"] == ["Gemma3ForCausalLM"]
  assert c["rope_theta"] == 1e6
  assert c["rope_local_base_freq"] == 10000.0
  assert c["rope_parameters"] == {
      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
      "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
  }
  assert c["sliding_window"] == 16
  assert c["sliding_window_pattern"] == 6
  assert c["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] + [
      "sliding_attention"
  ]
  assert c["query_pre_attn_scalar"] == 32  # head_dim, as llama.cpp uses
  assert c["hidden_activation"] == "gelu_pytorch_tanh"
  assert c["tie_word_embeddings"] is True
  assert c["head_dim"] == 32
  assert c["num_key_value_heads"] == 1
  assert (c["bos_token_id"], c["eos_token_id"]) == (2, 1)
  assert GUARANTEED_CONFIG_KEYS["gemma3"] <= set(c)


def test_rope_scaling_metadata(tmp_path):
  sd = _random_state_dict(llama_shapes(LLAMA_CFG, tied=True))

  def linear(w):
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(4.0)

  ckpt = read_gguf(write_gguf(tmp_path / "lin.gguf", "llama", sd, LLAMA_CFG,
                              extra_kv=linear))
  assert ckpt.config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
  assert ckpt.config["rope_parameters"] == {
      "rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0}

  def yarn(w):
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    w.add_rope_scaling_orig_ctx_len(64)

  ckpt = read_gguf(write_gguf(tmp_path / "yarn.gguf", "llama", sd, LLAMA_CFG,
                              extra_kv=yarn))
  assert ckpt.config["rope_scaling"] == {
      "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def _llama_cpp_rope_factors(theta, dim, factor, low, high, old):
  """llama.cpp convert_hf_to_gguf LlamaModel.generate_extra_tensors."""
  freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
  low_wl, high_wl = old / low, old / high
  out = []
  for freq in freqs:
    wl = 2 * math.pi / freq
    if wl < high_wl:
      out.append(1)
    elif wl > low_wl:
      out.append(factor)
    else:
      smooth = (old / wl - low) / (high - low)
      out.append(1 / ((1 - smooth) / factor + smooth))
  return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs(tmp_path):
  cfg = dict(LLAMA_CFG, rope_theta=500000.0, head_dim=64, num_attention_heads=1,
             num_key_value_heads=1)
  sd = _random_state_dict(llama_shapes(cfg, tied=True))
  factors = _llama_cpp_rope_factors(500000.0, 64, 32.0, 1.0, 4.0, 8192)
  assert len(set(factors.tolist())) > 2  # all three regimes present
  path = write_gguf(tmp_path / "l3.gguf", "llama", sd, cfg,
                    extra_tensors={"rope_freqs.weight": factors})
  ckpt = read_gguf(path)
  assert ckpt.config["rope_scaling"] == {
      "rope_type": "llama3",
      "factor": 32.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192,
  }
  assert ckpt.config["rope_parameters"]["rope_theta"] == 500000.0
  assert "rope_freqs.weight" not in ckpt.tensors


def test_matches_transformers_gguf_loader(llama_mixed, gemma3_file):
  """transformers' own GGUF loader reads the same tensors from our test files."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # pylint: disable=g-import-not-at-top

  for path, _ in (llama_mixed, gemma3_file):
    ckpt = read_gguf(path)
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)
    cfg_dict = dict(parsed["config"])
    hf_config = transformers.AutoConfig.for_model(cfg_dict.pop("model_type"),
                                                  **cfg_dict)
    with torch.device("meta"):
      model = transformers.AutoModelForCausalLM.from_config(hf_config)
    hf = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    hf_tensors = {k: v.numpy() for k, v in hf["tensors"].items()}
    assert set(hf_tensors) == set(ckpt.tensors)
    for name, t in ckpt.tensors.items():
      np.testing.assert_array_equal(t, hf_tensors[name], err_msg=name)
    hc = hf_config.to_dict()
    for key in ("vocab_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "max_position_embeddings", "rms_norm_eps",
                "tie_word_embeddings", "rope_parameters", "bos_token_id",
                "eos_token_id", "layer_types", "sliding_window"):
      if key in hc:
        assert ckpt.config[key] == hc[key], (path.name, key)


# ---------------------------------------------------------------------------
# Errors


def test_missing_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.gguf"):
    read_gguf(tmp_path / "nope.gguf")


def test_directory(tmp_path):
  with pytest.raises(ValueError, match="is a directory"):
    read_gguf(tmp_path)


def test_not_gguf(tmp_path):
  p = tmp_path / "model.gguf"
  p.write_bytes(b"PK\x03\x04" + b"\0" * 100)
  with pytest.raises(CheckpointError, match="not a GGUF file"):
    read_gguf(p)
  p.write_bytes(b"GG")
  with pytest.raises(CheckpointError, match="not a GGUF file.*truncated or corrupt"):
    read_gguf(p)


def test_truncated(llama_mixed, tmp_path):
  src = llama_mixed[0].read_bytes()
  reader = gguf.GGUFReader(llama_mixed[0])
  data_start = min(t.data_offset for t in reader.tensors)
  cuts = [6, 30, 200, data_start // 2, data_start - 1, data_start + 10,
          len(src) - 1]
  for n in cuts:
    p = tmp_path / f"cut{n}.gguf"
    p.write_bytes(src[:n])
    with pytest.raises(CheckpointError,
                       match="truncated or corrupt; re-download it") as e:
      read_gguf(p)
    assert str(p) in str(e.value)


def test_corrupt_header(llama_mixed, tmp_path):
  src = bytearray(llama_mixed[0].read_bytes())
  src[8:16] = (2**40).to_bytes(8, "little")  # absurd tensor count
  p = tmp_path / "corrupt.gguf"
  p.write_bytes(bytes(src))
  with pytest.raises(CheckpointError, match="truncated or corrupt"):
    read_gguf(p)


def test_unsupported_architecture(tmp_path):
  w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
  w.add_block_count(1)
  w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(
      ValueError, match="'phi2'.*llama, qwen2, qwen3, phi3, gemma2, gemma3"
  ):
    read_gguf(tmp_path / "phi.gguf")


def test_missing_metadata(tmp_path):
  sd = _random_state_dict(llama_shapes(LLAMA_CFG, tied=True))
  p = write_gguf(tmp_path / "m.gguf", "llama", sd, LLAMA_CFG,
                 skip_kv=("block_count",))
  with pytest.raises(CheckpointError, match="llama.block_count"):
    read_gguf(p)


def test_missing_extra_and_misshapen_tensors(tmp_path):
  shapes = llama_shapes(LLAMA_CFG, tied=True)
  sd = _random_state_dict(shapes)

  missing = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
  p = write_gguf(tmp_path / "missing.gguf", "llama", missing, LLAMA_CFG)
  with pytest.raises(ValueError, match="missing 1 tensor.*layers.1.mlp.up_proj"):
    read_gguf(p)

  p = write_gguf(tmp_path / "extra.gguf", "llama", sd, LLAMA_CFG,
                 extra_tensors={"blk.0.mystery.weight": np.zeros(4)})
  with pytest.raises(ValueError, match="no Hugging Face counterpart: blk.0.mystery"):
    read_gguf(p)

  # A layer beyond block_count maps to an HF name the config does not expect.
  extra_layer = dict(sd)
  extra_layer["model.layers.2.input_layernorm.weight"] = np.ones(64, np.float32)
  p = write_gguf(tmp_path / "extra2.gguf", "llama", extra_layer, LLAMA_CFG)
  with pytest.raises(ValueError, match="unexpected extra 1 tensor.*layers.2.input"):
    read_gguf(p)

  bad = dict(sd)
  bad["model.layers.0.mlp.down_proj.weight"] = np.zeros((64, 64), np.float32)
  p = write_gguf(tmp_path / "shape.gguf", "llama", bad, LLAMA_CFG)
  with pytest.raises(
      ValueError,
      match=r"layers.0.mlp.down_proj.weight: expected \(64, 96\), got \(64, 64\)",
  ):
    read_gguf(p)


def test_unpermute_inverts_permute():
  rng = np.random.default_rng(0)
  for rows, heads in ((64, 4), (32, 2), (576, 9), (192, 3)):
    w = rng.standard_normal((rows, 8)).astype(np.float32)
    p = gguf_reader_lib.permute_rows(w, heads)
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(gguf_reader_lib.unpermute_rows(p, heads), w)
    b = rng.standard_normal(rows).astype(np.float32)
    np.testing.assert_array_equal(
        gguf_reader_lib.unpermute_rows(gguf_reader_lib.permute_rows(b, heads), heads), b)


def test_fast_reader_matches_gguf_reader(tmp_path):
  sd = _random_state_dict(llama_shapes(LLAMA_CFG, tied=True))

  def tokenizer_kv(w):
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(LLAMA_CFG["vocab_size"])])
    w.add_token_types([1] * LLAMA_CFG["vocab_size"])
    w.add_token_merges(["t o", "to k", "", "é ü"])
    w.add_chat_template("{{ messages }}")
    # Every array kind the reader splits in one pass, and those it leaves
    # to gguf-py (empty, nested).
    w.add_array("test.floats", [1.5, -2.25, 3.0])
    w.add_array("test.bools", [True, False])
    w.add_array("test.empty", [])
    w.add_array("test.nested", [[1, 2], [3]])

  path = write_gguf(tmp_path / "tok.gguf", "llama", sd, LLAMA_CFG,
                    mixed_qtype, extra_kv=tokenizer_kv)
  ours = read_gguf(path).gguf_reader
  ref = gguf.GGUFReader(path)
  assert isinstance(ours, gguf.GGUFReader)
  assert list(ours.fields) == list(ref.fields)
  for key, field in ref.fields.items():
    mine = ours.fields[key]
    assert mine.offset == field.offset
    assert mine.types == field.types and mine.data == field.data
    assert len(mine.parts) == len(field.parts), key
    for p, q in zip(mine.parts, field.parts):
      assert p.dtype == q.dtype, key
      np.testing.assert_array_equal(p, q, err_msg=key)
    a, b = mine.contents(), field.contents()
    if isinstance(a, np.ndarray):
      np.testing.assert_array_equal(a, b)
    else:
      assert a == b, key
  assert ours.fields["tokenizer.ggml.tokens"].contents()[5] == "tok5"
  # Array parts are made when read; negative indices and slices as a list's.
  for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
    mine, theirs = ours.fields[key].parts, ref.fields[key].parts
    assert isinstance(mine, gguf_file.ArrayParts), key
    for index in (-1, -2, len(theirs) - 1, -len(theirs)):
      np.testing.assert_array_equal(mine[index], theirs[index])
    for got, want in zip(mine[1:9:3], theirs[1:9:3]):
      np.testing.assert_array_equal(got, want)
    with pytest.raises(IndexError):
      mine[len(theirs)]
  for t_ours, t_ref in zip(ours.tensors, ref.tensors):
    assert t_ours.name == t_ref.name
    np.testing.assert_array_equal(t_ours.data, t_ref.data)


def test_checkpoint_repr_is_short(llama_f32_tied):
  r = repr(read_gguf(llama_f32_tied[0]))
  assert r.startswith("Checkpoint(architecture='llama'")
  assert len(r) < 300
