"""Tiny random Hugging Face models saved for loading tests, and logits."""

import jax
import numpy as np
import torch


def save_perturbed(cls, config, path):
  """Builds ``cls(config)``, perturbs every tensor (random init leaves norms
  at their identity values) and saves it as safetensors in ``path``."""
  torch.manual_seed(0)
  model = cls(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  model.save_pretrained(path, safe_serialization=True)
  return model


def hf_logits(model, ids) -> np.ndarray:
  """(seq, vocab) float32 logits of a transformers model for one row."""
  with torch.no_grad():
    return model(torch.tensor([ids])).logits[0].float().numpy()


@jax.jit
def logits(model, tokens):
  """A frozen penzai_lm model's logits, compiled."""
  return model(tokens)
