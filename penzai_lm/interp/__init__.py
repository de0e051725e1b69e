"""Interpretability tools: named points, captures, lenses, steering vectors.

* Named points (`penzai_lm.model.hooks`): ``embed``,
  ``blocks.{i}.resid_pre`` ... ``blocks.{i}.resid_post``, ``final_norm``;
  `insert_at(model, name, layer)` patches a layer in at one or more points
  on either model layout, `point_names(model)` lists them.
* `run_with_cache(model, tokens, names=...)`: logits and activations of one
  forward pass (``return_loss=True``: and the next-token losses).
* `token_losses(model, prompts)`: each prompt's per-token next-token loss.
* Direct logit attribution: `decompose_resid` (the residual stream as the
  sum of the embeddings' and each block's or head's output), then
  `apply_final_norm` and `logit_attribution`; `weights(model, name)` reads
  a weight by TransformerLens name (``"blocks.5.attn.W_O"``),
  `weight_names` lists them (`WeightTable`: many reads, one walk).
* Intervention layers: `AddVector` (steering), `Ablate` / `ZeroHeads`
  (zero or mean ablation), `Clamp`, `PatchValue` (activation patching);
  their values may be per row, and a `TokenRule` (``where=``) says which
  tokens they change, correctly with a KV cache.
* `unembed` (logit lens), `embed` / `logits_from_embeddings` (gradients
  with respect to the input embeddings).
* Heads in Hugging Face order: `head_coordinates`, `heads_mask`.
* Control vectors in llama.cpp's GGUF format: `ControlVector`,
  `load_control_vector`, `save_control_vector`; `ControlVector.apply`
  steers a model with one.
* Activation patching sweeps: `patching_sweep` (every layer x position in
  one batched run) returning a `PatchingResult`; `LogitDiff` metric.
* Causal tracing: ``patching_sweep(..., corrupt=GaussianNoise(positions),
  window=10, metric=AnswerProb(answer))`` (noised embeddings, several
  samples at once, restoring windows of blocks).
* Attribution patching: `attribution_patching` (the gradient estimate of
  every cell of a sweep, per head and neuron too, in one compiled forward
  and backward pass) returning an `AttributionResult`.
"""

from penzai_lm.interp.activation_cache import ActivationCache
from penzai_lm.interp.activation_cache import run_with_cache
from penzai_lm.interp.attribution import attribution_patching
from penzai_lm.interp.attribution import AttributionResult
from penzai_lm.interp.control_vector_files import load_control_vector
from penzai_lm.interp.control_vector_files import save_control_vector
from penzai_lm.interp.control_vectors import ControlVector
from penzai_lm.interp.decompose import apply_final_norm
from penzai_lm.interp.decompose import decompose_resid
from penzai_lm.interp.decompose import logit_attribution
from penzai_lm.interp.decompose import ResidStack
from penzai_lm.interp.interventions import Ablate
from penzai_lm.interp.interventions import AddVector
from penzai_lm.interp.interventions import Clamp
from penzai_lm.interp.interventions import PatchValue
from penzai_lm.interp.interventions import ZeroHeads
from penzai_lm.interp.lens import embed
from penzai_lm.interp.lens import logits_from_embeddings
from penzai_lm.interp.lens import unembed
from penzai_lm.interp.metrics import AnswerProb
from penzai_lm.interp.metrics import LogitDiff
from penzai_lm.interp.losses import token_losses
from penzai_lm.interp.patching import patching_sweep
from penzai_lm.interp.patching import PatchingResult
from penzai_lm.interp.token_rules import TokenRule
from penzai_lm.interp.tracing import GaussianNoise
from penzai_lm.interp.weights import weight_names
from penzai_lm.interp.weights import WeightTable
from penzai_lm.interp.weights import weights
from penzai_lm.model.captures import Capture
from penzai_lm.model.hooks import head_coordinates
from penzai_lm.model.hooks import heads_mask
from penzai_lm.model.hooks import HookPoint
from penzai_lm.model.points import AtLayers
from penzai_lm.model.points import insert_at
from penzai_lm.model.points import Intervention
from penzai_lm.model.points import parse_point
from penzai_lm.model.points import Point
from penzai_lm.model.points import point_names

__all__ = [
    "Ablate",
    "ActivationCache",
    "AddVector",
    "AnswerProb",
    "AtLayers",
    "AttributionResult",
    "Capture",
    "Clamp",
    "GaussianNoise",
    "ControlVector",
    "HookPoint",
    "Intervention",
    "LogitDiff",
    "PatchValue",
    "PatchingResult",
    "Point",
    "ResidStack",
    "TokenRule",
    "WeightTable",
    "ZeroHeads",
    "apply_final_norm",
    "attribution_patching",
    "decompose_resid",
    "embed",
    "head_coordinates",
    "heads_mask",
    "insert_at",
    "load_control_vector",
    "logit_attribution",
    "logits_from_embeddings",
    "parse_point",
    "patching_sweep",
    "point_names",
    "run_with_cache",
    "save_control_vector",
    "token_losses",
    "unembed",
    "weight_names",
    "weights",
]
