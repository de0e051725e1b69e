"""read_hf_dir against tiny random transformers models saved to disk."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top

from penzai_lm.checkpoints import CheckpointError
from penzai_lm.checkpoints import GUARANTEED_CONFIG_KEYS
from penzai_lm.checkpoints import expected_tensor_shapes
from penzai_lm.checkpoints import normalize_config
from penzai_lm.checkpoints import read_checkpoint
from penzai_lm.checkpoints import read_hf_dir

# Config keys that describe storage or bookkeeping, not the architecture.
_IGNORED_KEYS = {"dtype", "transformers_version", "architectures", "_name_or_path"}

_SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2)

CASES = {
    # GQA (4 heads / 2 kv heads), head_dim != hidden/heads, untied, biases,
    # llama3 RoPE scaling.
    "llama_gqa_bias_untied": (
        "llama",
        lambda: transformers.LlamaConfig(
            **_SMALL,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "llama_tied": (
        "llama",
        lambda: transformers.LlamaConfig(
            **_SMALL,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        ),
    ),
    "mistral_sliding": (
        "mistral",
        lambda: transformers.MistralConfig(
            **_SMALL,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=16,
        ),
    ),
    "qwen2_biases_tied": (
        "qwen2",
        lambda: transformers.Qwen2Config(
            **_SMALL,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
        ),
    ),
    "gemma3_layer_types": (
        "gemma3",
        lambda: transformers.Gemma3TextConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=80,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=8,
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
            ],
            query_pre_attn_scalar=32,
            rope_parameters={
                "full_attention": {
                    "rope_type": "linear",
                    "factor": 8.0,
                    "rope_theta": 1e6,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
    "gemma3_untied": (
        "gemma3",
        lambda: transformers.Gemma3TextConfig(
            vocab_size=96,
            hidden_size=64,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            tie_word_embeddings=False,
        ),
    ),
    "gpt2_tied": (
        "gpt2",
        lambda: transformers.GPT2Config(
            vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=40
        ),
    ),
    "gpt2_untied_inner": (
        "gpt2",
        lambda: transformers.GPT2Config(
            vocab_size=96,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=40,
            n_inner=100,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
}


def _random_model(config):
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config)
  model.eval()
  with torch.no_grad():
    for p in model.parameters():  # norms init to 0/1: make everything random
      p.normal_()
  return model


def _canonical_state_dict(model, arch):
  """model.state_dict() minus the tied lm_head and non-persistent buffers."""
  sd = model.state_dict()
  if model.config.tie_word_embeddings:
    sd.pop("lm_head.weight", None)
  return sd


@pytest.fixture(scope="module", params=sorted(CASES))
def saved_model(request, tmp_path_factory):
  arch, make_config = CASES[request.param]
  model = _random_model(make_config())
  d = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(d, safe_serialization=True)
  return arch, model, d


def _assert_config_matches(ckpt, model):
  hf = model.config.to_dict()
  ours = ckpt.config
  compared = 0
  for key, value in hf.items():
    if key in _IGNORED_KEYS or key not in ours:
      continue
    compared += 1
    if key == "rope_parameters":
      value = json.loads(json.dumps(value))
    assert ours[key] == value, key
  assert compared >= 15
  assert ours["architectures"] == [type(model).__name__]


def test_read_matches_state_dict_exactly(saved_model):
  arch, model, d = saved_model
  ckpt = read_hf_dir(d)
  assert ckpt.architecture == arch
  assert ckpt.source == str(d)
  assert ckpt.gguf_reader is None
  sd = _canonical_state_dict(model, arch)
  assert set(ckpt.tensors) == set(sd)
  for name, t in sd.items():
    got = ckpt.tensors[name]
    assert got.dtype == np.float32, name
    np.testing.assert_array_equal(got, t.numpy(), err_msg=name)
  _assert_config_matches(ckpt, model)
  assert GUARANTEED_CONFIG_KEYS[arch] <= set(ckpt.config)
  # The layout module predicts exactly the state dict.
  assert expected_tensor_shapes(arch, ckpt.config) == {
      n: tuple(t.shape) for n, t in sd.items()
  }


def test_config_reproduces_transformers_model(saved_model):
  """Our normalized config, fed back to transformers, builds the same model."""
  arch, model, d = saved_model
  ckpt = read_hf_dir(d)
  cfg_cls = type(model.config)
  cfg = dict(ckpt.config)
  rebuilt = cfg_cls(**{k: v for k, v in cfg.items() if k != "model_type"})
  with torch.device("meta"):
    m2 = transformers.AutoModelForCausalLM.from_config(rebuilt)
  sd2 = _canonical_state_dict(m2, arch)
  assert {n: tuple(t.shape) for n, t in sd2.items()} == {
      n: tuple(t.shape) for n, t in ckpt.tensors.items()
  }


def test_read_checkpoint_dispatches_to_hf(saved_model):
  _, _, d = saved_model
  assert read_checkpoint(d).architecture == saved_model[0]


def test_sharded_save(tmp_path):
  _, make_config = CASES["llama_gqa_bias_untied"]
  model = _random_model(make_config())
  model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
  assert (tmp_path / "model.safetensors.index.json").is_file()
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
  ckpt = read_hf_dir(tmp_path)
  sd = _canonical_state_dict(model, "llama")
  assert set(ckpt.tensors) == set(sd)
  for name, t in sd.items():
    np.testing.assert_array_equal(ckpt.tensors[name], t.numpy(), err_msg=name)


@pytest.mark.parametrize("case", ["qwen2_biases_tied", "gemma3_layer_types"])
def test_bf16_save(tmp_path, case):
  _, make_config = CASES[case]
  model = _random_model(make_config()).to(torch.bfloat16)
  model.save_pretrained(tmp_path, safe_serialization=True)
  sd = _canonical_state_dict(model, None)
  bf = read_hf_dir(tmp_path, dtype=ml_dtypes.bfloat16)
  f32 = read_hf_dir(tmp_path, dtype=np.float32)
  also_bf = read_hf_dir(tmp_path, dtype="bfloat16")
  for name, t in sd.items():
    want_bits = t.view(torch.int16).numpy()
    assert bf.tensors[name].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(
        bf.tensors[name].view(np.int16), want_bits, err_msg=name
    )
    np.testing.assert_array_equal(also_bf.tensors[name].view(np.int16), want_bits)
    assert f32.tensors[name].dtype == np.float32
    np.testing.assert_array_equal(
        f32.tensors[name], t.float().numpy(), err_msg=name
    )


def test_fp32_save_read_as_bf16_rounds_like_torch(tmp_path):
  _, make_config = CASES["mistral_sliding"]
  model = _random_model(make_config())
  model.save_pretrained(tmp_path, safe_serialization=True)
  ckpt = read_hf_dir(tmp_path, dtype=ml_dtypes.bfloat16)
  for name, t in model.state_dict().items():
    np.testing.assert_array_equal(
        ckpt.tensors[name].view(np.int16),
        t.to(torch.bfloat16).view(torch.int16).numpy(),
        err_msg=name,
    )


def test_gpt2_original_names_and_buffers(tmp_path):
  """GPT-2 files from the original release lack 'transformer.' and keep buffers."""
  _, make_config = CASES["gpt2_tied"]
  model = _random_model(make_config())
  model.save_pretrained(tmp_path, safe_serialization=True)
  sd = _canonical_state_dict(model, "gpt2")
  raw = {n[len("transformer.") :]: t.numpy() for n, t in sd.items()}
  n_pos = model.config.n_positions
  for i in range(model.config.n_layer):
    raw[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, n_pos, n_pos), np.float32))
    raw[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
  (tmp_path / "model.safetensors").unlink()
  save_file(raw, str(tmp_path / "model.safetensors"))
  ckpt = read_hf_dir(tmp_path)
  assert set(ckpt.tensors) == set(sd)
  for name, t in sd.items():
    np.testing.assert_array_equal(ckpt.tensors[name], t.numpy(), err_msg=name)


def test_gemma3_multimodal_prefixes(tmp_path):
  """Gemma3ForConditionalGeneration files: text weights under a prefix."""
  _, make_config = CASES["gemma3_layer_types"]
  model = _random_model(make_config())
  sd = _canonical_state_dict(model, "gemma3")
  text_cfg = model.config.to_dict()
  for prefix, d in (("model.language_model.", "v5"), ("language_model.model.", "v4")):
    out = tmp_path / d
    out.mkdir()
    tensors = {prefix + n[len("model.") :]: t.numpy() for n, t in sd.items()}
    tensors["model.vision_tower.x.weight" if d == "v5" else "vision_tower.x.weight"] = (
        np.zeros((2, 2), np.float32)
    )
    tensors["multi_modal_projector.y.weight"] = np.zeros((2,), np.float32)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(
        json.dumps({
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": text_cfg,
            "vision_config": {"model_type": "siglip_vision_model"},
        })
    )
    ckpt = read_hf_dir(out)
    assert ckpt.architecture == "gemma3"
    assert ckpt.config["layer_types"] == text_cfg["layer_types"]
    assert set(ckpt.tensors) == set(sd)
    for name, t in sd.items():
      np.testing.assert_array_equal(ckpt.tensors[name], t.numpy(), err_msg=name)


LEGACY_CONFIGS = {
    # transformers 4.x spellings: rope_theta / rope_scaling / torch_dtype ...
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 80,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "torch_dtype": "bfloat16",
        "vocab_size": 96,
    },
    "mistral": {
        "model_type": "mistral",
        "hidden_size": 64,
        "intermediate_size": 80,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "rope_theta": 1e6,
        "sliding_window": None,
        "vocab_size": 96,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 80,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "rope_theta": 1e6,
        "rope_scaling": {"type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 32768},
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": 2,
        "vocab_size": 96,
        "tie_word_embeddings": True,
    },
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 80,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "num_hidden_layers": 7,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "rope_theta": 1000000.0,
        "sliding_window": 16,
        "sliding_window_pattern": 3,
        "vocab_size": 96,
    },
    "gpt2": {
        "model_type": "gpt2",
        "n_embd": 64,
        "n_head": 4,
        "n_layer": 2,
        "n_ctx": 40,
        "n_positions": 40,
        "vocab_size": 96,
    },
}


def _strip_legacy_type(d):
  if isinstance(d, dict):
    return {k: _strip_legacy_type(v) for k, v in d.items() if k != "type"}
  return d


@pytest.mark.parametrize("arch", sorted(LEGACY_CONFIGS))
def test_legacy_config_normalized_like_transformers(arch):
  raw = LEGACY_CONFIGS[arch]
  ours = normalize_config(arch, raw)
  model_type = {"gemma3": "gemma3_text"}.get(arch, arch)
  hf_cfg = transformers.AutoConfig.for_model(
      model_type, **{k: v for k, v in raw.items() if k != "model_type"}
  )
  hf = hf_cfg.to_dict()
  for key, value in hf.items():
    if key in _IGNORED_KEYS or key not in ours:
      continue
    assert _strip_legacy_type(ours[key]) == _strip_legacy_type(value), key
  if arch != "gpt2":
    assert ours["num_key_value_heads"] == hf_cfg.num_key_value_heads
    assert ours["head_dim"] == getattr(
        hf_cfg, "head_dim", hf_cfg.hidden_size // hf_cfg.num_attention_heads
    )
  with torch.device("meta"):
    m = transformers.AutoModelForCausalLM.from_config(hf_cfg)
  assert expected_tensor_shapes(arch, ours) == {
      n: tuple(t.shape) for n, t in _canonical_state_dict(m, arch).items()
  }


def test_legacy_config_aliases():
  g = normalize_config("gemma3", LEGACY_CONFIGS["gemma3"])
  assert g["rope_theta"] == 1e6
  assert g["rope_local_base_freq"] == 1e4
  assert g["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
  assert g["sliding_window_pattern"] == 3
  assert g["layer_types"][2] == "full_attention"
  assert g["layer_types"][5] == "full_attention"
  l = normalize_config("llama", LEGACY_CONFIGS["llama"])
  assert l["rope_scaling"]["rope_type"] == "llama3"
  assert l["rope_parameters"]["rope_theta"] == 500000.0
  assert "torch_dtype" not in l and l["dtype"] == "bfloat16"
  q = normalize_config("qwen2", LEGACY_CONFIGS["qwen2"])
  assert q["sliding_window"] is None
  assert q["rope_scaling"] == {
      "rope_type": "yarn",
      "factor": 4.0,
      "original_max_position_embeddings": 32768,
  }
  gp = normalize_config("gpt2", LEGACY_CONFIGS["gpt2"])
  assert gp["hidden_size"] == 64 and gp["num_hidden_layers"] == 2


def test_hf_errors(tmp_path):
  _, make_config = CASES["gpt2_tied"]
  model = _random_model(make_config())
  good = tmp_path / "good"
  model.save_pretrained(good, safe_serialization=True)
  cfg_text = (good / "config.json").read_text()
  weights = (good / "model.safetensors").read_bytes()

  # Missing directory.
  with pytest.raises(FileNotFoundError, match="not found"):
    read_hf_dir(tmp_path / "nope")

  # Missing config.json.
  d = tmp_path / "no_config"
  d.mkdir()
  (d / "model.safetensors").write_bytes(weights)
  with pytest.raises(FileNotFoundError, match="config.json"):
    read_hf_dir(d)

  # Missing weights (and a hint about other formats).
  d = tmp_path / "no_weights"
  d.mkdir()
  (d / "config.json").write_text(cfg_text)
  (d / "pytorch_model.bin").write_bytes(b"x")
  with pytest.raises(FileNotFoundError, match="pytorch_model.bin.*only safetensors"):
    read_hf_dir(d)

  # Unknown architecture.
  d = tmp_path / "bert"
  d.mkdir()
  (d / "config.json").write_text(
      json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"})
  )
  (d / "model.safetensors").write_bytes(weights)
  with pytest.raises(ValueError, match="BertForMaskedLM") as e:
    read_hf_dir(d)
  for cls in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
              "Gemma3ForCausalLM", "GPT2LMHeadModel"):
    assert cls in str(e.value)

  # Truncated safetensors.
  d = tmp_path / "truncated"
  d.mkdir()
  (d / "config.json").write_text(cfg_text)
  (d / "model.safetensors").write_bytes(weights[: len(weights) // 2])
  with pytest.raises(CheckpointError, match="truncated or corrupt; re-download"):
    read_hf_dir(d)

  # Garbage safetensors.
  (d / "model.safetensors").write_bytes(b"\xff" * 100)
  with pytest.raises(CheckpointError, match="truncated or corrupt"):
    read_hf_dir(d)

  # Sharded index naming a missing shard.
  d = tmp_path / "shards"
  d.mkdir()
  (d / "config.json").write_text(cfg_text)
  (d / "model.safetensors.index.json").write_text(
      json.dumps({"weight_map": {"transformer.wte.weight": "model-00001.safetensors"}})
  )
  with pytest.raises(FileNotFoundError, match="model-00001.safetensors"):
    read_hf_dir(d)

  # A file instead of a directory.
  with pytest.raises(ValueError, match="not a directory"):
    read_hf_dir(good / "config.json")


def _rewrite(d, edit):
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top

  tensors = load_file(str(d / "model.safetensors"))
  edit(tensors)
  save_file(tensors, str(d / "model.safetensors"))


def test_hf_layout_errors(tmp_path):
  _, make_config = CASES["llama_tied"]
  model = _random_model(make_config())

  def fresh(name):
    d = tmp_path / name
    model.save_pretrained(d, safe_serialization=True)
    return d

  d = fresh("missing")
  _rewrite(d, lambda t: (t.pop("model.layers.1.mlp.up_proj.weight"),
                         t.pop("model.norm.weight")))
  with pytest.raises(ValueError, match="missing 2 tensor") as e:
    read_hf_dir(d)
  assert "model.layers.1.mlp.up_proj.weight" in str(e.value)
  assert "model.norm.weight" in str(e.value)

  d = fresh("extra")
  _rewrite(d, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias":
                                  np.zeros(64, np.float32)}))
  with pytest.raises(ValueError, match="unexpected extra 1 tensor.*q_proj.bias"):
    read_hf_dir(d)

  d = fresh("shape")
  _rewrite(d, lambda t: t.update({"model.layers.0.mlp.down_proj.weight":
                                  np.zeros((64, 81), np.float32)}))
  with pytest.raises(
      ValueError,
      match=r"model.layers.0.mlp.down_proj.weight: expected \(64, 80\), got \(64, 81\)",
  ):
    read_hf_dir(d)

  d = fresh("untied_missing_head")
  cfg = json.loads((d / "config.json").read_text())
  cfg["tie_word_embeddings"] = False
  (d / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match="missing 1 tensor.*lm_head.weight"):
    read_hf_dir(d)


def test_fp16_save(tmp_path):
  _, make_config = CASES["llama_tied"]
  model = _random_model(make_config()).to(torch.float16)
  model.save_pretrained(tmp_path, safe_serialization=True)
  f32 = read_hf_dir(tmp_path)
  bf = read_hf_dir(tmp_path, dtype=ml_dtypes.bfloat16)
  for name, t in _canonical_state_dict(model, "llama").items():
    np.testing.assert_array_equal(f32.tensors[name], t.float().numpy())
    np.testing.assert_array_equal(
        bf.tensors[name].view(np.int16),
        t.float().to(torch.bfloat16).view(torch.int16).numpy(),
    )


def test_unsupported_dtype_argument(saved_model):
  with pytest.raises(ValueError, match="float32 or bfloat16"):
    read_hf_dir(saved_model[2], dtype=np.float16)
