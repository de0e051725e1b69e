"""The two real GGUF models, checked against transformers' GGUF loader."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.checkpoints.checkpoint_test_utils import real_model_path
from penzai_lm.checkpoints import expected_tensor_shapes
from penzai_lm.checkpoints import read_gguf

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Config keys whose values transformers' GGUF loader and ours must agree on.
COMMON_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "attention_bias",
)
EXTRA_KEYS = {
    "llama": ("hidden_act", "mlp_bias", "pretraining_tp"),
    "gemma3": (
        "hidden_activation",
        "layer_types",
        "sliding_window",
        "query_pre_attn_scalar",
        "final_logit_softcapping",
        "attn_logit_softcapping",
        "use_bidirectional_attention",
    ),
}


def _load_both(name):
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # pylint: disable=g-import-not-at-top

  path = real_model_path(name)
  t0 = time.perf_counter()
  ckpt = read_gguf(path)
  seconds = time.perf_counter() - t0
  # transformers, with the model skeleton built from transformers' own config
  # class fed our config (only the tensor names matter for the mapping).
  cfg = {k: v for k, v in ckpt.config.items() if k != "model_type"}
  hf_cls = transformers.CONFIG_MAPPING[ckpt.config["model_type"]]
  with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(hf_cls(**cfg))
  # Hand transformers the reader we already opened: opening parses the whole
  # token table (seconds); its own metadata and tensor processing is unchanged.
  import gguf  # pylint: disable=g-import-not-at-top

  real_reader = gguf.GGUFReader
  gguf.GGUFReader = lambda p, *a, **k: ckpt.gguf_reader
  try:
    parsed = load_gguf_checkpoint(
        str(path), return_tensors=True, model_to_load=model
    )
  finally:
    gguf.GGUFReader = real_reader
  hf_cfg_dict = dict(parsed["config"])
  hf_config = transformers.AutoConfig.for_model(
      hf_cfg_dict.pop("model_type"), **hf_cfg_dict
  )
  hf_tensors = {k: v.numpy() for k, v in parsed["tensors"].items()}
  return ckpt, seconds, hf_config, hf_tensors


@pytest.fixture(scope="module")
def smollm2():
  return _load_both("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def gemma3():
  return _load_both("gemma3-270m")


def _check(loaded, arch, capsys):
  ckpt, seconds, hf_config, hf_tensors = loaded
  with capsys.disabled():
    print(f"\n  read_gguf({ckpt.source}): {seconds:.1f} s")
  assert ckpt.architecture == arch
  # transformers keeps a tied lm_head; the canonical form drops it.
  assert hf_config.tie_word_embeddings
  hf_tensors = dict(hf_tensors)
  hf_tensors.pop("lm_head.weight", None)
  assert set(ckpt.tensors) == set(hf_tensors)
  worst = 0.0
  for name, t in ckpt.tensors.items():
    ref = hf_tensors[name]
    assert t.shape == ref.shape, name
    assert t.dtype == np.float32
    worst = max(worst, float(np.abs(t - ref).max()))
  assert worst == 0.0
  hc = hf_config.to_dict()
  for key in COMMON_KEYS + EXTRA_KEYS[arch]:
    assert ckpt.config[key] == hc[key], key
  assert expected_tensor_shapes(arch, ckpt.config) == {
      n: t.shape for n, t in ckpt.tensors.items()
  }


def test_smollm2_matches_transformers(smollm2, capsys):
  _check(smollm2, "llama", capsys)
  c = smollm2[0].config
  assert (c["num_hidden_layers"], c["hidden_size"], c["head_dim"]) == (30, 576, 64)
  assert (c["num_attention_heads"], c["num_key_value_heads"]) == (9, 3)
  assert c["rope_theta"] == 100000.0 and c["rope_scaling"] is None
  assert c["max_position_embeddings"] == 8192
  assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)


def test_gemma3_matches_transformers(gemma3, capsys):
  _check(gemma3, "gemma3", capsys)
  c = gemma3[0].config
  assert c["rope_theta"] == 1e6
  assert c["rope_local_base_freq"] == 10000.0
  assert c["sliding_window"] == 512
  assert c["sliding_window_pattern"] == 6
  full = [i for i, t in enumerate(c["layer_types"]) if t == "full_attention"]
  assert full == [5, 11, 17]
  assert c["query_pre_attn_scalar"] == 256 == c["head_dim"]
  assert c["hidden_activation"] == "gelu_pytorch_tanh"
  assert c["model_type"] == "gemma3_text"
  # The norm convention: HF stores w where the file stores 1 + w.
  reader = gemma3[0].gguf_reader
  stored = {t.name: np.asarray(t.data) for t in reader.tensors}
  np.testing.assert_array_equal(
      gemma3[0].tensors["model.layers.0.self_attn.q_norm.weight"],
      stored["blk.0.attn_q_norm.weight"] - np.float32(1),
  )


def test_gguf_reader_is_reusable(smollm2):
  reader = smollm2[0].gguf_reader
  tokens = reader.fields["tokenizer.ggml.tokens"]
  assert len(tokens.data) == smollm2[0].config["vocab_size"]
