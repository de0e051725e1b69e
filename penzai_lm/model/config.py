"""Configuration for the `TransformerLM` family.

One keyword-only dataclass describes every supported architecture. The
``family`` field picks the block structure (norm kind, MLP kind, positional
scheme); the remaining fields are the sizes and options that vary between
checkpoints of that family.

Families:

* ``"llama"``: Llama 2/3, SmolLM2, Mistral, Qwen2. RMSNorm, RoPE, SwiGLU MLP,
  grouped-query attention, optional q/k/v biases (Qwen2), optional sliding
  window (Mistral), tied or untied embeddings.
* ``"gemma3"``: Gemma 3 text models. GeGLU MLP (tanh GELU), RMSNorm on queries
  and keys per head, norms before and after both attention and MLP, embeddings
  scaled by sqrt(hidden), local sliding-window layers interleaved with global
  layers, each kind with its own RoPE base.
* ``"gpt2"``: GPT-2. LayerNorm with bias, learned absolute positions, GELU MLP,
  biases on every projection, tied embeddings.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

Family = Literal["llama", "gemma3", "gpt2"]
LayerType = Literal["global", "local"]

FAMILIES = ("llama", "gemma3", "gpt2")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


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

  Attributes:
    family: Block structure; one of ``FAMILIES``.
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
    norm_eps: Epsilon of every normalization layer.
    rope_base: RoPE base (theta) of global layers. Unused by GPT-2.
    local_rope_base: RoPE base of local (sliding-window) layers; defaults to
      ``rope_base``.
    rope_scaling: Optional Llama 3 style frequency scaling (global layers).
    sliding_window: Window size of local layers: a query at position p attends
      to keys at positions p - sliding_window + 1 .. p.
    layer_types: Per-layer attention kind, "global" or "local". ``None`` means
      every layer is global, or every layer is local if ``sliding_window`` is
      set (Mistral).
    qkv_bias: Whether the query/key/value projections have biases (Qwen2).
    tie_embeddings: Whether the output projection reuses the input embedding
      table.
    query_pre_attn_scalar: Queries are scaled by ``query_pre_attn_scalar **
      -0.5``; defaults to ``head_dim``.
    max_position_embeddings: Longest context the model supports (the size of
      GPT-2's learned position table).
    parameter_dtype: Dtype of the weights.
    activation_dtype: Dtype of activations and of key/value caches.
    use_layer_stack: Scan over the blocks with a layer stack (fast to compile)
      instead of listing them one by one (easiest to patch per layer).
    bos_token_id: Beginning-of-sequence token, if the checkpoint names one.
    eos_token_ids: Tokens that end generation, as the checkpoint records them.
    pad_token_id: Padding token, if the checkpoint names one.
  """

  family: Family
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_hidden_size: int
  activation: str = "silu"
  norm_eps: float = 1e-5
  rope_base: float = 10_000.0
  local_rope_base: float | None = None
  rope_scaling: RopeScaling | None = None
  sliding_window: int | None = None
  layer_types: tuple[LayerType, ...] | None = None
  qkv_bias: bool = False
  tie_embeddings: bool = False
  query_pre_attn_scalar: float | None = None
  max_position_embeddings: int = 8192
  parameter_dtype: jax.typing.DTypeLike = jnp.float32
  activation_dtype: jax.typing.DTypeLike = jnp.float32
  use_layer_stack: bool = True
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None

  def __post_init__(self):
    if self.family not in FAMILIES:
      raise ValueError(
          f"Unknown family {self.family!r}; expected one of {FAMILIES}."
      )
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
    if self.family != "gpt2" and self.head_dim % 2:
      raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}.")
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
    if self.family == "gpt2" and (self.sliding_window or self.layer_types):
      raise ValueError("GPT-2 models have no sliding-window layers.")

  @property
  def resolved_layer_types(self) -> tuple[LayerType, ...]:
    """The attention kind of every layer."""
    if self.layer_types is not None:
      return self.layer_types
    kind = "local" if self.sliding_window is not None else "global"
    return (kind,) * self.num_layers

  @property
  def query_scale(self) -> float:
    """Factor applied to queries before the query-key dot product."""
    scalar = self.query_pre_attn_scalar or self.head_dim
    return float(scalar) ** -0.5

  def replace(self, **changes) -> TransformerConfig:
    """Returns a copy with some fields changed."""
    return dataclasses.replace(self, **changes)
