"""GGUF files of qwen2, qwen3, gemma2 and phi3 against two other readers.

Each tiny random transformers model is written as a GGUF file the way
llama.cpp's converter writes it (tensor names from gguf-py's own
``TensorNameMap``, not from our specs; the metadata keys its
``convert_hf_to_gguf.py`` writes; Gemma norms stored as ``1 + w``; q/k rows
not permuted, as for every architecture but llama), then loaded by
penzai_lm and by transformers' independent GGUF reader
(``from_pretrained(..., gguf_file=...)``); the logits of both, and of the
original model, agree.

transformers' GGUF reader does not read every key llama.cpp writes for these
architectures (qwen3's ``attention.key_length`` and q/k/v biases, gemma2's
soft-caps and attention scale, phi3's ``attention.sliding_window``); those
config values, listed in
``_TRANSFORMERS_UNREAD``, are copied into its config from the original model;
everything else (sizes, RoPE base, epsilon, tensor names and values) it reads
from the file. Mistral is here too: llama.cpp writes ``MistralForCausalLM`` as
``llama`` (q/k rows permuted; no sliding window in that format), which
penzai_lm reads as a Llama.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from penzai import pz  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

from penzai_lm.checkpoints import CheckpointError  # pylint: disable=g-import-not-at-top
from penzai_lm.checkpoints import open_gguf  # pylint: disable=g-import-not-at-top
from penzai_lm.loading import load_model  # pylint: disable=g-import-not-at-top
from tests.checkpoints.checkpoint_test_utils import llama_cpp_permute  # pylint: disable=g-import-not-at-top
from tests.loading.hf_models import hf_logits  # pylint: disable=g-import-not-at-top
from tests.loading.hf_models import logits  # pylint: disable=g-import-not-at-top
from tests.loading.hf_models import save_perturbed  # pylint: disable=g-import-not-at-top
from tests.loading.test_hf_parity import _CLASSES  # pylint: disable=g-import-not-at-top
from tests.loading.test_hf_parity import _configs  # pylint: disable=g-import-not-at-top

# Family -> the architecture llama.cpp's converter writes it as.
_ARCH = {
    "mistral": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3, "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "phi3": gguf.MODEL_ARCH.PHI3,
}
_CASES = (
    "mistral_nowindow_headdim", "qwen2_bias", "qwen2_5", "qwen3",
    "qwen3_tied_bias", "phi3", "gemma2",
)
_TRANSFORMERS_UNREAD = {
    "qwen3": ("head_dim", "attention_bias"),
    # transformers keeps Gemma2Config's query_pre_attn_scalar (256); llama.cpp
    # scales by head_dim (the same for Gemma 2 2B and 9B).
    "gemma2": (
        "attn_logit_softcapping", "final_logit_softcapping",
        "query_pre_attn_scalar",
    ),
    "phi3": ("sliding_window",),
}


def _config(case):
  config = _configs()[case]
  if case == "gemma2":
    # A GGUF file has no query_pre_attn_scalar: llama.cpp scales by head_dim.
    config.query_pre_attn_scalar = config.head_dim
  return config


def _metadata(w, family, c, rope_factors):
  """The metadata llama.cpp's convert_hf_to_gguf.py writes for ``family``."""
  w.add_block_count(c.num_hidden_layers)
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  w.add_vocab_size(c.vocab_size)
  theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta")
  if family != "gemma2":  # Gemma2Model writes no RoPE base (10000)
    w.add_rope_freq_base(float(theta))
  if family == "mistral":  # LlamaModel
    w.add_rope_dimension_count(c.head_dim)
  if family in ("qwen3", "gemma2"):
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
  if family == "gemma2":
    w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_sliding_window(c.sliding_window)
  if family == "phi3":
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
    w.add_sliding_window(c.sliding_window or 0)
    if rope_factors:
      w.add_rope_scaling_attn_factors(1.19)
  for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
    if getattr(c, key, None) is not None:
      getattr(w, f"add_{key}")(getattr(c, key))


def write_llama_cpp_gguf(path, family, model, *, rope_factors=False):
  """``model``'s weights as llama.cpp's converter writes them (f32)."""
  c = model.config
  names = gguf.get_tensor_name_map(_ARCH[family], c.num_hidden_layers)
  w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[_ARCH[family]])
  _metadata(w, family, c, rope_factors)
  for name, t in model.state_dict().items():
    if name == "lm_head.weight" and c.tie_word_embeddings:
      continue
    base, suffix = name.rsplit(".", 1)
    arr = t.detach().float().numpy()
    if family == "gemma2" and name.endswith("norm.weight"):
      arr = arr + np.float32(1.0)  # Gemma2Model.modify_tensors
    if family == "mistral" and base.endswith(("q_proj", "k_proj")):
      heads = c.num_attention_heads  # LlamaModel.modify_tensors
      kv = heads if base.endswith("q_proj") else c.num_key_value_heads
      arr = llama_cpp_permute(arr, heads, kv)
    w.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(arr))
  if rope_factors:
    half = c.hidden_size // c.num_attention_heads // 2
    for kind in ("long", "short"):
      w.add_tensor(f"rope_factors_{kind}.weight", np.ones(half, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def _transformers_gguf(directory, file_name, family, original_config):
  config = transformers.AutoConfig.from_pretrained(
      directory, gguf_file=file_name
  )
  for key in _TRANSFORMERS_UNREAD.get(family, ()):
    setattr(config, key, getattr(original_config, key))
  return transformers.AutoModelForCausalLM.from_pretrained(
      directory, gguf_file=file_name, config=config, dtype=torch.float32
  ).eval()


@pytest.mark.parametrize("case", _CASES)
def test_gguf_logits_match_transformers(case, tmp_path):
  family = case.split("_")[0]
  cls = getattr(transformers, _CLASSES[family])
  original = save_perturbed(cls, _config(case), tmp_path / "hf")
  path = write_llama_cpp_gguf(tmp_path / "model.gguf", family, original)

  ids = list(np.random.RandomState(1).randint(0, 101, size=12))
  model = load_model(path)
  ours = np.asarray(
      logits(pz.freeze_params(model), pz.nx.wrap(jnp.array(ids)).tag("seq"))
      .unwrap("seq", "vocabulary")
  )
  theirs = hf_logits(
      _transformers_gguf(tmp_path, path.name, family, original.config), ids
  )
  reference = hf_logits(original, ids)
  print(
      f"{case}: max |ours - transformers GGUF| ="
      f" {np.abs(ours - theirs).max():.2e}, max |ours - original| ="
      f" {np.abs(ours - reference).max():.2e}"
  )
  np.testing.assert_allclose(ours, theirs, atol=1e-4, err_msg=case)
  np.testing.assert_allclose(ours, reference, atol=1e-4, err_msg=case)


def test_phi3_longrope_gguf_is_refused(tmp_path):
  original = save_perturbed(
      transformers.Phi3ForCausalLM, _config("phi3"), tmp_path / "hf"
  )
  path = write_llama_cpp_gguf(
      tmp_path / "long.gguf", "phi3", original, rope_factors=True
  )
  with pytest.raises(CheckpointError, match="LongRoPE"):
    load_model(path)


def test_phi3_gguf_without_window_and_gemma2_metadata(tmp_path):
  """phi3's window 0 means none; gemma2's soft-caps and window are read."""
  config = _config("phi3")
  config.sliding_window = None
  phi3 = save_perturbed(transformers.Phi3ForCausalLM, config, tmp_path / "p")
  ckpt = open_gguf(write_llama_cpp_gguf(tmp_path / "p.gguf", "phi3", phi3))
  assert ckpt.config["sliding_window"] is None
  gemma2 = save_perturbed(
      transformers.Gemma2ForCausalLM, _config("gemma2"), tmp_path / "g"
  )
  ckpt = open_gguf(write_llama_cpp_gguf(tmp_path / "g.gguf", "gemma2", gemma2))
  c = ckpt.config
  assert (c["attn_logit_softcapping"], c["final_logit_softcapping"]) == (
      0.5, 3.0
  )
  assert c["sliding_window"] == 5 and c["query_pre_attn_scalar"] == 16
  assert c["layer_types"] == [
      "sliding_attention", "full_attention", "sliding_attention"
  ]
