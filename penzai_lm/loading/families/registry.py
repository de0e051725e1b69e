"""The family adapters, by checkpoint architecture.

`ADAPTERS` maps each canonical architecture name (`Checkpoint.architecture`)
to the `FamilyAdapter` that turns such a checkpoint into a `TransformerLM`:
its config into `TransformerConfig` fields (family name and explicit feature
fields), its tensors into parameters. Nothing else in `penzai_lm.loading` or
`penzai_lm.model` knows about families.

How to add a family (say Qwen3, a Llama with per-head q/k norms):

1. Write its adapter, ``penzai_lm/loading/families/qwen3.py``: a
   `FamilyAdapter` whose ``config_fields`` returns the family name, every
   feature field (e.g. the Llama features with ``qk_norm=True``) and its
   options, raising `common.unsupported` for options the model lacks; and whose
   ``global_tensors`` / ``layer_tensors`` map the HF tensor names to parameter
   labels (reuse `common.llama_like_layer` / `common.llama_like_globals` when
   the layout is Llama-like: they follow the feature fields).
2. Register it in `ADAPTERS` below.
3. Test it: a tiny random HF model whose logits must match transformers'
   (see ``tests/loading/test_hf_parity.py``).

A block structure that no feature field describes (a new norm placement, a
new MLP kind) is a model change instead: add the feature to
`penzai_lm.model.config.TransformerConfig` and `penzai_lm.model.build`.

The checkpoint readers keep their own per-architecture tables (HF class,
``model_type``, config defaults and tensor shapes, in
``penzai_lm/checkpoints/architectures.py`` and ``layout.py``); a new
architecture must be known there as well, and a test keeps `ADAPTERS` and
`penzai_lm.checkpoints.SUPPORTED_ARCHITECTURES` in step.
"""

from __future__ import annotations

from penzai_lm.loading.families.common import FamilyAdapter
from penzai_lm.loading.families.gemma3 import GEMMA3
from penzai_lm.loading.families.gpt2 import GPT2
from penzai_lm.loading.families.llama import LLAMA
from penzai_lm.loading.families.llama import MISTRAL
from penzai_lm.loading.families.llama import QWEN2

ADAPTERS: dict[str, FamilyAdapter] = {
    "llama": LLAMA,
    "mistral": MISTRAL,
    "qwen2": QWEN2,
    "gemma3": GEMMA3,
    "gpt2": GPT2,
}


def adapter_for(architecture: str) -> FamilyAdapter:
  """The adapter of ``architecture``.

  Raises:
    ValueError: if no adapter is registered for it.
  """
  if architecture not in ADAPTERS:
    raise ValueError(
        f"Unsupported architecture {architecture!r}; supported:"
        f" {sorted(ADAPTERS)}."
    )
  return ADAPTERS[architecture]
