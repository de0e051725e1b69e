"""TransformerLens 3.9 models of penzai_lm's cached GGUF files, offline.

transformers dequantizes the GGUF file (as the parity tests do) into a
float32 model; TransformerLens converts that model's weights with its own
converters and its default processing (``fold_ln``, centred writing
weights and unembedding, folded value biases, as ``from_pretrained``
does). Nothing is fetched:

* SmolLM2 is not in TransformerLens's list of official names, so its
  config is read from a local directory holding only ``config.json``
  (TransformerLens treats a path containing "llama" as a hub name: the
  directory's name avoids it).
* Gemma 3 270M is an official name whose config TransformerLens spells out
  itself, so ``from_pretrained(name, hf_model=..., tokenizer=...)`` needs
  no download.

Used by ``benchmarks/interp_vs_transformerlens.py``.
"""

from __future__ import annotations

import tempfile

import torch
import transformers
from transformer_lens import HookedTransformer
from transformer_lens.loading_from_pretrained import get_pretrained_model_config
from transformer_lens.pretrained.weight_conversions.llama import (
    convert_llama_weights)

from penzai_lm.fetch import resolve_model_path

GEMMA3_NAME = "google/gemma-3-270m-it"


def hf_model(name: str):
  """``(model, tokenizer)`` of transformers, float32, from penzai_lm's GGUF
  file ``name`` (e.g. ``"smollm2-135m-instruct"``)."""
  path = resolve_model_path(name)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      path.parent, gguf_file=path.name, dtype=torch.float32).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(
      path.parent, gguf_file=path.name)
  # The tensors are dequantized float32; the config still says "gguf",
  # which TransformerLens refuses to convert.
  if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
  return model, tokenizer


def smollm2(hf, tokenizer) -> HookedTransformer:
  """A HookedTransformer of the transformers Llama ``hf``, processed as
  ``from_pretrained`` does by default."""
  config_dir = tempfile.mkdtemp(prefix="smollm2-config-")
  # A config read from a GGUF file names no architecture.
  hf.config.architectures = ["LlamaForCausalLM"]
  hf.config.save_pretrained(config_dir)
  cfg = get_pretrained_model_config(config_dir, device="cpu",
                                    dtype=torch.float32)
  tl = HookedTransformer(cfg, tokenizer=tokenizer)
  tl.load_and_process_state_dict(convert_llama_weights(hf, cfg))
  return tl.eval()


def gemma3(hf, tokenizer) -> HookedTransformer:
  """A HookedTransformer of the transformers Gemma 3 270M ``hf``, by
  ``from_pretrained`` with its defaults."""
  return HookedTransformer.from_pretrained(
      GEMMA3_NAME, hf_model=hf, tokenizer=tokenizer, device="cpu").eval()
