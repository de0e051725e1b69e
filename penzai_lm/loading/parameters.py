"""Turns canonical (Hugging Face) tensors into the model's parameters.

The family adapter (`penzai_lm.loading.families`) maps tensor names and
layouts to parameter labels; this module casts them, and stacks the blocks'
tensors along ``blocks`` when the model uses a layer stack.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
from penzai import pz

from penzai_lm.checkpoints import Checkpoint
from penzai_lm.loading.families import ADAPTERS
from penzai_lm.loading.families import FamilyAdapter
from penzai_lm.loading.families import adapter_for
from penzai_lm.model import TransformerConfig


def parameters_from_checkpoint(
    checkpoint: Checkpoint,
    config: TransformerConfig,
    name: str = "transformer",
    *,
    adapters: Mapping[str, FamilyAdapter] = ADAPTERS,
) -> list[pz.Parameter]:
  """Parameters for a model built by ``build_transformer(config)``.

  Args:
    checkpoint: The checkpoint, in canonical (Hugging Face) form.
    config: The configuration derived from it.
    name: The model's parameter label prefix.
    adapters: Architecture name -> family adapter (default: the built-in
      ones).

  Returns:
    Parameters to bind with ``pz.bind_variables``.
  """
  adapter = adapter_for(checkpoint.architecture, adapters)
  t = checkpoint.tensors
  dtype = np.dtype(config.parameter_dtype)
  layers = [adapter.layer_tensors(config, t, i) for i in range(config.num_layers)]

  def make(label, data, axes):
    data = np.ascontiguousarray(np.asarray(data).astype(dtype))
    return pz.Parameter(value=pz.nx.wrap(data).tag(*axes), label=f"{name}/{label}")

  params = [make(k, *v) for k, v in adapter.global_tensors(config, t).items()]
  if config.use_layer_stack:
    for key, (_, axes) in layers[0].items():
      stacked = np.stack([layer[key][0] for layer in layers])
      params.append(make(f"blocks/{key}", stacked, ("blocks", *axes)))
  else:
    for i, layer in enumerate(layers):
      params.extend(make(f"block_{i}/{k}", *v) for k, v in layer.items())
  return params
