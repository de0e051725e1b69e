"""The types of an architecture spec: everything a checkpoint reader needs.

An :class:`ArchitectureSpec` declares, as plain frozen data, what the readers
of :mod:`penzai_lm.checkpoints` used to decide with ``architecture == ...``
branches: the Hugging Face class names and ``model_type`` values that select
the architecture, how its raw ``config.json`` is completed, which tensors its
``state_dict()`` holds, how a safetensors file's tensor names are cleaned up,
and how a llama.cpp GGUF file of it maps onto all that. The readers interpret
these fields; the built-in specs are declared in
:mod:`penzai_lm.checkpoints.specs`.

A few rules are shared by several architectures in different shapes (which
layers attend in a sliding window, the tensor layout); each shape is its own
small dataclass, and a spec field holds one of them.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, ClassVar, Mapping, Union

# A layout flag: a constant, or the name of the boolean config key that holds
# it (e.g. "attention_bias").
Flag = Union[bool, str]


def frozen_map(mapping: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
  """A read-only copy of ``mapping`` (for spec fields and derived tables)."""
  return types.MappingProxyType(dict(mapping or {}))


def _freeze_mappings(obj, *names: str) -> None:
  """Replaces the mapping fields ``names`` of a frozen dataclass by copies."""
  for name in names:
    object.__setattr__(obj, name, frozen_map(getattr(obj, name)))


# ---- Config rules ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RopeSpec:
  """Rotary position embeddings, as a config spells them.

  A spec with a RoPE is a Llama-style decoder config: ``num_key_value_heads``
  defaults to ``num_attention_heads``, ``head_dim`` to
  ``hidden_size // num_attention_heads``, and ``rope_parameters`` /
  ``rope_theta`` / ``rope_scaling`` are filled in both transformers spellings.

  Attributes:
    theta: The RoPE base when the config names none.
    local_theta: The base of a second RoPE for sliding-window layers
      (Gemma 3's ``rope_local_base_freq``; ``rope_parameters`` is then keyed
      by layer type), or None for one RoPE shared by every layer.
  """

  theta: float = 10000.0
  local_theta: float | None = None


@dataclasses.dataclass(frozen=True)
class SlidingFromLayer:
  """Qwen2-style windows: layers from ``first_layer_key`` on slide, if enabled.

  When the config's ``switch_key`` is false, ``sliding_window`` becomes None.
  ``layer_types`` is derived when absent.

  Attributes:
    switch_key: Boolean config key that enables sliding windows.
    first_layer_key: Config key of the first sliding layer's index.
  """

  switch_key: str = "use_sliding_window"
  first_layer_key: str = "max_window_layers"


@dataclasses.dataclass(frozen=True)
class SlidingPeriodic:
  """Gemma-style windows: every ``period``-th layer is global, others slide.

  The period is read from ``sliding_window_pattern`` (or
  ``_sliding_window_pattern``) and written back under both names;
  ``layer_types`` is derived when absent.

  Attributes:
    period: The period when the config names none.
  """

  period: int = 6


# ---- Tensor layouts -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecoderLayout:
  """Tensors of a Llama-style decoder.

  ``model.embed_tokens``, per layer ``self_attn.{q,k,v,o}_proj``,
  ``mlp.{gate,up,down}_proj``, ``input_layernorm`` and
  ``post_attention_layernorm`` (RMSNorms, no biases), then ``model.norm`` and
  ``lm_head`` (absent when embeddings are tied). Weights are ``nn.Linear``
  ``(out, in)``.

  Attributes:
    qkv_bias: Whether q/k/v projections have biases.
    output_bias: Whether ``o_proj`` has a bias.
    mlp_bias: Whether the three MLP projections have biases.
    qk_norm: Per-head ``self_attn.q_norm`` / ``k_norm`` weights.
    sandwich_norms: ``pre_feedforward_layernorm`` and
      ``post_feedforward_layernorm`` too (Gemma's norms around the MLP).
    fused_qkv: One ``self_attn.qkv_proj`` (queries, then keys, then values,
      stacked on the output axis) instead of ``{q,k,v}_proj`` (Phi-3); its
      bias, if any, follows ``qkv_bias``.
    fused_gate_up: One ``mlp.gate_up_proj`` (gate, then up, stacked on the
      output axis) instead of ``gate_proj`` and ``up_proj`` (Phi-3).
    layer_count_key: The config key of the layer count.
    layer_prefix: The prefix of per-layer tensor names (then the index).
  """

  # Class constants, not fields: the validators count the layers a checkpoint
  # has tensors for before trusting the config's layer count.
  layer_count_key: ClassVar[str] = "num_hidden_layers"
  layer_prefix: ClassVar[str] = "model.layers."

  qkv_bias: Flag = False
  output_bias: Flag = False
  mlp_bias: Flag = False
  qk_norm: bool = False
  sandwich_norms: bool = False
  fused_qkv: bool = False
  fused_gate_up: bool = False


@dataclasses.dataclass(frozen=True)
class Conv1DLayout:
  """Tensors of a GPT-2-style model.

  ``transformer.wte`` / ``wpe`` embeddings, per layer LayerNorms ``ln_1`` /
  ``ln_2`` with biases, fused q/k/v ``attn.c_attn`` and ``attn.c_proj``,
  ``mlp.c_fc`` / ``c_proj``, all with biases, then ``transformer.ln_f``.
  Conv1D weights are stored ``(in, out)``, the transpose of ``nn.Linear``.
  Sizes come from the GPT-2 config keys (``n_embd``, ``n_layer``,
  ``n_positions``, ``n_inner``).

  Attributes:
    mlp_ratio: MLP width per embedding width when ``n_inner`` is None.
    layer_count_key: The config key of the layer count.
    layer_prefix: The prefix of per-layer tensor names (then the index).
  """

  layer_count_key: ClassVar[str] = "n_layer"
  layer_prefix: ClassVar[str] = "transformer.h."

  mlp_ratio: int = 4


# ---- Hugging Face directories ---------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultimodalSpec:
  """A multimodal wrapper whose text model has the spec's architecture.

  Its ``text_config`` is read as the text model's config; its vision tensors
  are dropped (list them in :attr:`HFSpec.dropped_tensors`).

  Attributes:
    classes: The wrapper's HF class names.
    model_type: The wrapper's ``model_type`` (a config with this type and a
      ``text_config`` is a wrapper config).
    text_defaults: Defaults of ``text_config`` that differ from those of the
      text model's own config class.
  """

  classes: tuple[str, ...]
  model_type: str
  text_defaults: Mapping[str, Any] = dataclasses.field(
      default_factory=frozen_map
  )

  def __post_init__(self):
    _freeze_mappings(self, "text_defaults")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFSpec:
  """How a Hugging Face model directory of the architecture is recognized.

  Attributes:
    classes: Causal-LM class names (``config.json``'s ``architectures``);
      the first is the canonical one, written into normalized configs.
    model_types: ``model_type`` values, used when ``architectures`` is
      absent; the first is written into normalized configs.
    dropped_tensors: Regular expressions (``re.search``) of tensor names that
      are buffers or other models' parts, not the LM's parameters.
    tensor_renames: ``(pattern, replacement)`` pairs for ``re.sub``; the first
      pattern that matches a tensor name rewrites it to its ``state_dict()``
      name (e.g. from a base model or a multimodal wrapper).
    multimodal: A multimodal wrapper whose text model can be read, or None.
  """

  classes: tuple[str, ...]
  model_types: tuple[str, ...]
  dropped_tensors: tuple[str, ...] = ()
  tensor_renames: tuple[tuple[str, str], ...] = ()
  multimodal: MultimodalSpec | None = None

  @property
  def all_classes(self) -> tuple[str, ...]:
    """Every class name that selects the architecture, wrappers included."""
    return self.classes + (self.multimodal.classes if self.multimodal else ())

  @property
  def all_model_types(self) -> tuple[str, ...]:
    """Every ``model_type`` that selects the architecture."""
    extra = (self.multimodal.model_type,) if self.multimodal else ()
    return self.model_types + extra


# ---- GGUF files -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MetadataField:
  """An optional GGUF metadata key copied into the config.

  Attributes:
    key: The key after the ``<architecture>.`` prefix.
    config_key: The HF config key.
    convert: Applied to the value (``int``, ``float``).
  """

  key: str
  config_key: str
  convert: Callable[[Any], Any]


@dataclasses.dataclass(frozen=True)
class GGUFQueryScale:
  """llama.cpp's attention scale, stored as HF's ``query_pre_attn_scalar``.

  ``head_dim``, except for models with a layer count in
  ``hidden_per_head_layer_counts``, which use ``hidden_size // num_heads``.

  Attributes:
    hidden_per_head_layer_counts: Layer counts of the exceptions.
  """

  hidden_per_head_layer_counts: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class GGUFSpec:
  """How a llama.cpp GGUF file of the architecture maps onto the HF form.

  Sizes, context length, RMSNorm epsilon, RoPE base and scaling and special
  tokens are read the same way for every architecture; these fields hold the
  rest.

  Attributes:
    architecture: The file's ``general.architecture`` (also the prefix of its
      metadata keys).
    block_names: llama.cpp block tensor kind (``attn_q``) -> HF module path
      inside ``model.layers.{i}`` (``self_attn.q_proj``).
    unpermute_qk: llama.cpp permuted q/k rows for interleaved-pair RoPE; they
      are un-permuted to HF's rotate-half layout.
    norm_offset: Stored RMSNorm weights are the HF weights plus this (Gemma:
      1); it is subtracted.
    extra_tensors: Tensors that are not weights but are understood
      (``rope_freqs.weight``: Llama 3 RoPE scaling factors).
    bias_flags: Config key -> tensor whose presence sets that key true.
    head_dim_keys: Metadata keys (after the prefix) tried for ``head_dim``.
    default_head_dim: ``head_dim`` when no key has it; None means
      ``hidden_size // num_attention_heads``.
    fixed_config: Config values llama.cpp hard-codes for the architecture.
    optional_metadata: Further metadata copied when present.
    query_scale: How ``query_pre_attn_scalar`` is derived, or None.
    refused_tensors: Tensor name -> the feature it encodes, which the model
      does not implement; a file with such a tensor is refused with an error
      naming the feature (Phi-3's ``rope_factors_long.weight``: LongRoPE).
  """

  architecture: str
  block_names: Mapping[str, str]
  unpermute_qk: bool = False
  norm_offset: float = 0.0
  extra_tensors: tuple[str, ...] = ()
  bias_flags: Mapping[str, str] = dataclasses.field(default_factory=frozen_map)
  head_dim_keys: tuple[str, ...] = ("attention.key_length",)
  default_head_dim: int | None = None
  fixed_config: Mapping[str, Any] = dataclasses.field(
      default_factory=frozen_map
  )
  optional_metadata: tuple[MetadataField, ...] = ()
  query_scale: GGUFQueryScale | None = None
  refused_tensors: Mapping[str, str] = dataclasses.field(
      default_factory=frozen_map
  )

  def __post_init__(self):
    _freeze_mappings(
        self, "block_names", "bias_flags", "fixed_config", "refused_tensors"
    )


# ---- The spec -------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArchitectureSpec:
  """Everything the checkpoint readers know about one architecture.

  Attributes:
    name: The canonical architecture name (``Checkpoint.architecture``; the
      key of its loading adapter).
    hf: Hugging Face class names, ``model_type`` values and tensor names.
    config_defaults: Defaults of the transformers config class; None entries
      that depend on other fields are derived during normalization.
    config_aliases: Alias -> config key, copied after defaults are filled
      (HF's ``attribute_map``, e.g. GPT-2's ``hidden_size`` -> ``n_embd``).
    rope: The RoPE of a Llama-style decoder config, or None (learned
      positions, no grouped-query derivations).
    sliding_layers: Which layers attend in a sliding window, or None.
    layout: The ``state_dict()`` tensors and their shapes.
    gguf: How GGUF files map onto the HF form, or None if not supported.
  """

  name: str
  hf: HFSpec
  config_defaults: Mapping[str, Any]
  config_aliases: Mapping[str, str] = dataclasses.field(
      default_factory=frozen_map
  )
  rope: RopeSpec | None = None
  sliding_layers: SlidingFromLayer | SlidingPeriodic | None = None
  layout: DecoderLayout | Conv1DLayout = DecoderLayout()
  gguf: GGUFSpec | None = None

  def __post_init__(self):
    _freeze_mappings(self, "config_defaults", "config_aliases")

  @property
  def hf_class(self) -> str:
    """The canonical HF causal-LM class."""
    return self.hf.classes[0]

  @property
  def model_type(self) -> str:
    """The ``model_type`` HF writes into ``config.json``."""
    return self.hf.model_types[0]
