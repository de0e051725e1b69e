"""Configuration of a `TransformerLM`: sizes plus architecture features.

One keyword-only dataclass describes every supported architecture. The block
structure is spelled out as independent feature fields, which the builder
(`penzai_lm.model.build`) reads one by one; nothing in the model branches on
the family name. The features:

* ``norm_kind``: "rms" (RMSNorm, a scale) or "layer" (LayerNorm, a scale and a
  bias), for the pre-attention, pre-MLP, post (see ``post_norms``) and final
  norms.
* ``position_embedding``: "rope" (rotary embedding of queries and keys in every
  layer; any context length) or "learned" (a table of absolute positions added
  to the token embeddings; at most ``max_position_embeddings`` tokens).
* ``mlp_kind``: "gated" (GLU: ``act(x W_gate) * (x W_value)``, then ``W_out``)
  or "plain" (``act(x W_in) W_out``).
* ``qkv_bias`` / ``attention_output_bias`` / ``mlp_bias``: biases on the
  query/key/value projections, on the attention output projection, and on
  every MLP projection.
* ``qk_norm``: a per-head RMSNorm on queries and keys before RoPE.
* ``post_norms``: a norm after attention and after the MLP, inside their
  residual branches, besides the usual pre-norms.
* ``embedding_scale``: a constant factor on the token embeddings.
* ``attn_logit_softcap`` / ``final_logit_softcap``: ``cap * tanh(x / cap)``
  on attention logits (before masking) and on the output logits.

``family`` is a descriptive name: which kind of checkpoint the config came
from. It also selects a preset of feature defaults (`FAMILY_PRESETS`) for
callers that give only a family and sizes: a feature field left at ``None``
takes the preset's value when the config is made. The presets:

* ``"llama"``: Llama 2/3, SmolLM2, Mistral, Qwen2. RMSNorm, RoPE, SwiGLU
  (gated) MLP, no biases (Qwen2 turns ``qkv_bias`` on).
* ``"gemma3"``: Gemma 3. RMSNorm, RoPE, gated MLP, ``qk_norm``,
  ``post_norms``, embeddings scaled by sqrt(hidden_size).
* ``"gpt2"``: GPT-2. LayerNorm, learned positions, plain MLP, biases on every
  projection.

Any other family name is allowed if every preset feature is given explicitly.
Loaded checkpoints get explicit features from their family adapter
(`penzai_lm.loading.families`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import jax
import jax.numpy as jnp

LayerType = Literal["global", "local"]
NormKind = Literal["rms", "layer"]
PositionEmbedding = Literal["rope", "learned"]
MlpKind = Literal["gated", "plain"]

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
NORM_KINDS = ("rms", "layer")
POSITION_EMBEDDINGS = ("rope", "learned")
MLP_KINDS = ("gated", "plain")

# Feature fields that a family preset fills when they are left at None.
_CHOICE_FEATURES = {
    "norm_kind": NORM_KINDS,
    "position_embedding": POSITION_EMBEDDINGS,
    "mlp_kind": MLP_KINDS,
}
_BOOL_FEATURES = (
    "qkv_bias", "attention_output_bias", "mlp_bias", "qk_norm", "post_norms",
)
PRESET_FEATURES = (*_CHOICE_FEATURES, *_BOOL_FEATURES, "embedding_scale")

_LLAMA_PRESET: dict[str, Any] = dict(
    norm_kind="rms", position_embedding="rope", mlp_kind="gated",
    qkv_bias=False, attention_output_bias=False, mlp_bias=False,
    qk_norm=False, post_norms=False, embedding_scale=None,
)

# Feature defaults per family. "sqrt_hidden" stands for sqrt(hidden_size).
FAMILY_PRESETS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA_PRESET,
    "gemma3": {
        **_LLAMA_PRESET, "qk_norm": True, "post_norms": True,
        "embedding_scale": "sqrt_hidden",
    },
    "gpt2": dict(
        norm_kind="layer", position_embedding="learned", mlp_kind="plain",
        qkv_bias=True, attention_output_bias=True, mlp_bias=True,
        qk_norm=False, post_norms=False, embedding_scale=None,
    ),
}
# The families with a preset (kept for backward compatibility).
FAMILIES = tuple(FAMILY_PRESETS)


# Hugging Face config.json names of fields `TransformerConfig` names
# otherwise: a config built with one of them gets an error naming ours.
HF_FIELD_NAMES = {
    "rms_norm_eps": "norm_eps", "layer_norm_eps": "norm_eps",
    "layer_norm_epsilon": "norm_eps", "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads",
    "intermediate_size": "mlp_hidden_size", "rope_theta": "rope_base",
    "tie_word_embeddings": "tie_embeddings", "hidden_act": "activation",
}

# Names `jax.default_matmul_precision` takes, most precise first.
MATMUL_PRECISIONS = ("float32", "tensorfloat32", "bfloat16")

@dataclasses.dataclass(kw_only=True, frozen=True)
class RopeScaling:
  """Llama 3 style RoPE frequency scaling ("rope_type": "llama3").

  Attributes:
    factor: Overall scaling factor for low frequencies.
    low_freq_factor: Wavelengths above ``original_max_position_embeddings /
      low_freq_factor`` are scaled by ``factor``.
    high_freq_factor: Wavelengths below ``original_max_position_embeddings /
      high_freq_factor`` are kept; in between, the two are interpolated.
    original_max_position_embeddings: Context length of the original model.
  """

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(kw_only=True, frozen=True)
class TransformerConfig:
  """Architecture of a `TransformerLM`.

  Feature fields marked "preset" may be left at ``None`` for a family in
  `FAMILY_PRESETS`; they hold the resolved value once the config is made.

  Attributes:
    family: Descriptive name of the architecture family (e.g. "llama",
      "qwen2"); selects the preset of feature defaults, if there is one.
    vocab_size: Number of tokens in the vocabulary.
    hidden_size: Width of the residual stream (the "embedding" axis).
    num_layers: Number of transformer blocks.
    num_heads: Number of query heads.
    num_kv_heads: Number of key/value heads; must divide ``num_heads``.
    head_dim: Width of each head (the "projection" axis). Independent of
      ``hidden_size // num_heads``.
    mlp_hidden_size: Width of the MLP hidden layer (the "neurons" axis).
    activation: MLP activation: "silu" (SwiGLU), "gelu_tanh" (GeGLU / GPT-2's
      gelu_new) or "gelu" (exact erf GELU).
    norm_kind: (preset) "rms" for RMSNorm (scale only) or "layer" for
      LayerNorm (scale and bias). Query/key norms are always RMSNorm.
    position_embedding: (preset) "rope" for rotary embeddings of queries and
      keys, or "learned" for a learned absolute position table of
      ``max_position_embeddings`` entries added to the token embeddings.
    mlp_kind: (preset) "gated" for a GLU MLP (gating, value and output
      projections) or "plain" for a two-layer MLP (input and output).
    qkv_bias: (preset) Whether the query/key/value projections have biases
      (Qwen2, GPT-2).
    attention_output_bias: (preset) Whether the attention output projection
      has a bias (GPT-2).
    mlp_bias: (preset) Whether every MLP projection has a bias (GPT-2).
    qk_norm: (preset) Whether queries and keys get a per-head RMSNorm (over
      ``projection``) before RoPE (Gemma 3).
    post_norms: (preset) Whether the attention and MLP outputs are normalized
      before they join the residual stream (Gemma 3).
    embedding_scale: (preset) Factor applied to the token embeddings (Gemma:
      sqrt(hidden_size)); ``None`` after resolution means no scaling.
    attn_logit_softcap: If set, attention logits ``x`` (after query scaling,
      before masking) become ``cap * tanh(x / cap)``; ``None`` is off.
    final_logit_softcap: If set, the output logits are soft-capped the same
      way; ``None`` is off.
    norm_eps: Epsilon of every normalization layer.
    rope_base: RoPE base (theta) of global layers. Unused with learned
      positions.
    local_rope_base: RoPE base of local (sliding-window) layers; defaults to
      ``rope_base``.
    rope_scaling: Optional Llama 3 style frequency scaling (global layers).
    sliding_window: Window size of local layers: a query at position p attends
      to keys at positions p - sliding_window + 1 .. p.
    layer_types: Per-layer attention kind, "global" or "local". ``None`` means
      every layer is global, or every layer is local if ``sliding_window`` is
      set (Mistral).
    tie_embeddings: Whether the output projection reuses the input embedding
      table.
    query_pre_attn_scalar: Queries are scaled by ``query_pre_attn_scalar **
      -0.5``; defaults to ``head_dim``.
    max_position_embeddings: Longest context the model supports (the size of
      the learned position table, with learned positions).
    parameter_dtype: Dtype of the weights.
    activation_dtype: Dtype of activations and of key/value caches.
    matmul_precision: Precision of float32 matrix products, as
      ``jax.default_matmul_precision`` names it. "float32" (the default)
      means float32 on every backend; JAX's own default computes float32
      matmuls in TF32 on recent NVIDIA GPUs (our Gemma 3 test against a
      float64 reference: 4.6e-3 off on an H100, 1e-5 on CPU).
      "tensorfloat32" opts into TF32 for speed, "bfloat16" into one bf16
      pass. No effect on bfloat16 models or on CPU.
    use_layer_stack: Scan over the blocks with a layer stack (fast to compile)
      instead of listing them one by one (easiest to patch per layer).
    bos_token_id: Beginning-of-sequence token, if the checkpoint names one.
    eos_token_ids: Tokens that end generation, as the checkpoint records them.
    pad_token_id: Padding token, if the checkpoint names one.
  """

  family: str = "custom"
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_hidden_size: int
  activation: str = "silu"
  norm_kind: NormKind | None = None
  position_embedding: PositionEmbedding | None = None
  mlp_kind: MlpKind | None = None
  qkv_bias: bool | None = None
  attention_output_bias: bool | None = None
  mlp_bias: bool | None = None
  qk_norm: bool | None = None
  post_norms: bool | None = None
  embedding_scale: float | None = None
  attn_logit_softcap: float | None = None
  final_logit_softcap: float | None = None
  norm_eps: float = 1e-5
  rope_base: float = 10_000.0
  local_rope_base: float | None = None
  rope_scaling: RopeScaling | None = None
  sliding_window: int | None = None
  layer_types: tuple[LayerType, ...] | None = None
  tie_embeddings: bool = False
  query_pre_attn_scalar: float | None = None
  max_position_embeddings: int = 8192
  parameter_dtype: jax.typing.DTypeLike = jnp.float32
  activation_dtype: jax.typing.DTypeLike = jnp.float32
  matmul_precision: str = "float32"
  use_layer_stack: bool = True
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None

  def __new__(cls, *args, **fields):
    del args  # The generated __init__ refuses positional arguments.
    hf_names = sorted(set(fields) & set(HF_FIELD_NAMES))
    if hf_names:
      raise TypeError(
          f"TransformerConfig has no field {hf_names[0]!r} (Hugging Face's"
          f" name); it is called {HF_FIELD_NAMES[hf_names[0]]!r} here. To"
          " build a config from a Hugging Face config.json, load the"
          " checkpoint with penzai_lm.load / penzai_lm.loading.load_model.")
    return super().__new__(cls)

  def __post_init__(self):
    self._resolve_features()
    self._check_sizes()
    self._check_features()
    self._check_layers()

  def _resolve_features(self) -> None:
    """Fills feature fields left at None from the family's preset."""
    if not isinstance(self.family, str) or not self.family:
      raise ValueError(
          f"family must be a non-empty string, got {self.family!r}."
      )
    preset = FAMILY_PRESETS.get(self.family)
    if preset is None:
      missing = [
          name for name in PRESET_FEATURES
          if name != "embedding_scale" and getattr(self, name) is None
      ]
      if missing:
        raise ValueError(
            f"Unknown family {self.family!r}: it has no preset of feature"
            f" defaults (presets exist for {FAMILIES}), so set these feature"
            f" fields explicitly: {', '.join(missing)}."
        )
      return
    for name in PRESET_FEATURES:
      if getattr(self, name) is None:
        value = preset[name]
        if value == "sqrt_hidden":
          value = float(self.hidden_size) ** 0.5
        object.__setattr__(self, name, value)

  def _check_sizes(self) -> None:
    if self.matmul_precision not in MATMUL_PRECISIONS:
      raise ValueError(
          f"Unknown matmul_precision {self.matmul_precision!r}; expected one"
          f" of {MATMUL_PRECISIONS}.")
    if self.activation not in ACTIVATIONS:
      raise ValueError(
          f"Unknown activation {self.activation!r}; expected one of"
          f" {ACTIVATIONS}."
      )
    for name in (
        "vocab_size", "hidden_size", "num_layers", "num_heads",
        "num_kv_heads", "head_dim", "mlp_hidden_size",
        "max_position_embeddings",
    ):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_kv_heads ({self.num_kv_heads}) must divide num_heads"
          f" ({self.num_heads})."
      )
    if self.rope_base <= 0:
      raise ValueError(f"rope_base must be positive, got {self.rope_base}.")

  def _check_features(self) -> None:
    for name, allowed in _CHOICE_FEATURES.items():
      if getattr(self, name) not in allowed:
        raise ValueError(
            f"Unknown {name} {getattr(self, name)!r}; expected one of"
            f" {allowed}."
        )
    for name in _BOOL_FEATURES:
      if not isinstance(getattr(self, name), bool):
        raise ValueError(
            f"{name} must be True or False, got {getattr(self, name)!r}."
        )
    for name in ("embedding_scale", "attn_logit_softcap", "final_logit_softcap"):
      value = getattr(self, name)
      if value is not None and (
          isinstance(value, bool)
          or not isinstance(value, (int, float))
          or not math.isfinite(value)
          or value <= 0
      ):
        raise ValueError(
            f"{name} must be a positive number or None, got {value!r}."
        )
    if self.position_embedding == "rope" and self.head_dim % 2:
      raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}.")

  def _check_layers(self) -> None:
    if self.layer_types is not None:
      if len(self.layer_types) != self.num_layers:
        raise ValueError(
            f"layer_types has {len(self.layer_types)} entries but the model"
            f" has {self.num_layers} layers."
        )
      bad = set(self.layer_types) - {"global", "local"}
      if bad:
        raise ValueError(
            f"layer_types entries must be 'global' or 'local', got {bad}."
        )
      if "local" in self.layer_types and self.sliding_window is None:
        raise ValueError("layer_types has local layers but no sliding_window.")
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(
          f"sliding_window must be a positive integer, got"
          f" {self.sliding_window}."
      )

  @property
  def max_cache_len(self) -> int | None:
    """The longest KV cache (and sequence) the model can hold.

    ``max_position_embeddings`` with learned positions, whose table ends
    there; ``None`` (unbounded) with RoPE.
    """
    if self.position_embedding == "learned":
      return self.max_position_embeddings
    return None

  @property
  def resolved_layer_types(self) -> tuple[LayerType, ...]:
    """The attention kind of every layer."""
    if self.layer_types is not None:
      return self.layer_types
    kind = "local" if self.sliding_window is not None else "global"
    return (kind,) * self.num_layers

  @property
  def head_axes(self) -> tuple[dict[str, int], dict[str, int]]:
    """``(axes shared by queries, keys and values, axes of queries only)``:
    ``heads`` (multi-head), ``query_heads`` (multi-query), or
    ``head_groups`` + ``query_heads`` (grouped-query), with their sizes."""
    groups = self.num_kv_heads
    per_group = self.num_heads // self.num_kv_heads
    if per_group == 1:
      return {"heads": groups}, {}
    if groups == 1:
      return {}, {"query_heads": per_group}
    return {"head_groups": groups}, {"query_heads": per_group}

  @property
  def query_scale(self) -> float:
    """Factor applied to queries before the query-key dot product."""
    scalar = self.query_pre_attn_scalar or self.head_dim
    return float(scalar) ** -0.5

  def replace(self, **changes) -> TransformerConfig:
    """Returns a copy with some fields changed.

    Feature fields keep their resolved values unless changed: replacing
    ``family`` alone does not apply the new family's preset.
    """
    return dataclasses.replace(self, **changes)
