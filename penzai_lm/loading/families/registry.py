"""The family adapters, by checkpoint architecture.

`ADAPTERS` maps each canonical architecture name (`Checkpoint.architecture`)
to the `FamilyAdapter` that turns such a checkpoint into a `TransformerLM`:
its config into `TransformerConfig` fields (family name and explicit feature
fields), its tensors into parameters. Nothing else in `penzai_lm.loading` or
`penzai_lm.model` knows about families.

How to add a family (as Qwen3, a Qwen2 with per-head q/k norms, was added):

1. Declare its `ArchitectureSpec` in ``penzai_lm/checkpoints/specs.py``
   (HF classes, ``model_type``, config defaults, tensor layout, GGUF names):
   that is all the checkpoint readers need.
2. Write its adapter (``penzai_lm/loading/families/qwen3.py``): a
   `FamilyAdapter` whose ``config_fields`` returns the family name, every
   feature field (e.g. the Llama features with ``qk_norm=True``) and its
   options, raising `common.unsupported` for options the model lacks; and whose
   ``global_tensors`` / ``layer_tensors`` map the HF tensor names to parameter
   labels (reuse `common.llama_like_layer` / `common.llama_like_globals` when
   the layout is Llama-like: they follow the feature fields).
3. Register it in `ADAPTERS` below, under the spec's name.
4. Test it: a tiny random HF model whose logits must match transformers'
   (see ``tests/loading/test_hf_parity.py``).

A block structure that no feature field describes (a new norm placement, a
new MLP kind) is a model change instead: add the feature to
`penzai_lm.model.config.TransformerConfig` and `penzai_lm.model.build`.

An architecture can also be loaded without editing the package: pass its spec
and adapter to `penzai_lm.loading.load` (``specs=SPECS + (spec,)``,
``adapters={**ADAPTERS, spec.name: adapter}``). A test keeps `ADAPTERS` and
`penzai_lm.checkpoints.SPECS` in step.
"""

from __future__ import annotations

from typing import Mapping

from penzai_lm.checkpoints import specs
from penzai_lm.checkpoints.spec_types import frozen_map
from penzai_lm.loading.families.common import FamilyAdapter
from penzai_lm.loading.families.gemma2 import GEMMA2
from penzai_lm.loading.families.gemma3 import GEMMA3
from penzai_lm.loading.families.gpt2 import GPT2
from penzai_lm.loading.families.llama import LLAMA
from penzai_lm.loading.families.llama import MISTRAL
from penzai_lm.loading.families.llama import QWEN2
from penzai_lm.loading.families.phi3 import PHI3
from penzai_lm.loading.families.qwen3 import QWEN3

# Architecture name (`ArchitectureSpec.name`) -> adapter; read-only.
ADAPTERS: Mapping[str, FamilyAdapter] = frozen_map({
    specs.LLAMA.name: LLAMA,
    specs.MISTRAL.name: MISTRAL,
    specs.QWEN2.name: QWEN2,
    specs.QWEN3.name: QWEN3,
    specs.PHI3.name: PHI3,
    specs.GEMMA2.name: GEMMA2,
    specs.GEMMA3.name: GEMMA3,
    specs.GPT2.name: GPT2,
})


def adapter_for(
    architecture: str, adapters: Mapping[str, FamilyAdapter] = ADAPTERS
) -> FamilyAdapter:
  """The adapter of ``architecture``.

  Args:
    architecture: The checkpoint's architecture name.
    adapters: Architecture name -> adapter (default: the built-in ones).

  Raises:
    ValueError: if no adapter is registered for it.
  """
  if architecture not in adapters:
    raise ValueError(
        f"Unsupported architecture {architecture!r}; supported:"
        f" {sorted(adapters)}."
    )
  return adapters[architecture]
