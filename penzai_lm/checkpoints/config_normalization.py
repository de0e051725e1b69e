"""Completes raw Hugging Face config dicts into the canonical form.

:func:`normalize_config` accepts transformers 4.x and 5.x spellings of a
config and returns every field of the transformers config class, defaults
filled in, plus derived fields. :data:`GUARANTEED_CONFIG_KEYS` lists the keys
every normalized config of an architecture has.

What to fill in and derive is read from the architecture's spec
(:class:`~penzai_lm.checkpoints.spec_types.ArchitectureSpec`): its defaults
and aliases, its RoPE (:class:`~penzai_lm.checkpoints.spec_types.RopeSpec`)
and its sliding-window rule.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Sequence

from penzai_lm.checkpoints.architectures import spec_for
from penzai_lm.checkpoints.spec_types import ArchitectureSpec
from penzai_lm.checkpoints.spec_types import RopeSpec
from penzai_lm.checkpoints.spec_types import SlidingFromLayer
from penzai_lm.checkpoints.spec_types import SlidingPeriodic
from penzai_lm.checkpoints.spec_types import frozen_map
from penzai_lm.checkpoints.specs import SPECS
from penzai_lm.checkpoints.validation import check_config_values

# Keys of a raw config that are bookkeeping, not architecture; dropped.
_DROP_KEYS = (
    "transformers_version",
    "_name_or_path",
    "_commit_hash",
    "_attn_implementation_autoset",
)


def _std_rope(params: Mapping[str, Any] | None) -> dict[str, Any]:
  """Copies a rope dict, turning the legacy ``type`` key into ``rope_type``."""
  out = dict(params or {})
  if "type" in out:
    legacy = out.pop("type")
    out.setdefault("rope_type", legacy)
  out.setdefault("rope_type", "default")
  if "rope_theta" in out:
    out["rope_theta"] = float(out["rope_theta"])
  return out


def _scaling_of(params: Mapping[str, Any]) -> dict[str, Any] | None:
  """Legacy ``rope_scaling`` view of a ``rope_parameters`` dict."""
  if params.get("rope_type", "default") == "default":
    return None
  return {k: v for k, v in params.items() if k != "rope_theta"}


def normalize_config(
    architecture: str | ArchitectureSpec,
    raw: Mapping[str, Any],
    specs: Sequence[ArchitectureSpec] = SPECS,
    *,
    source: str | None = None,
) -> dict[str, Any]:
  """Completes a raw HF-style config dict for ``architecture``.

  Accepts both transformers 4.x (``rope_theta`` / ``rope_scaling`` /
  ``rope_local_base_freq`` / ``sliding_window_pattern``) and 5.x
  (``rope_parameters``) spellings and returns a dict that has both, plus every
  field of the transformers config class with its default filled in, plus
  derived fields (``head_dim``, ``num_key_value_heads``, ``layer_types``).

  Args:
    architecture: One of :data:`SUPPORTED_ARCHITECTURES`, or a spec.
    raw: The raw config (e.g. parsed ``config.json``). Not modified.
    specs: The specs to look ``architecture`` up in.
    source: Where the config comes from (a file), for error messages.

  Guaranteed keys of the built-in specs (:data:`GUARANTEED_CONFIG_KEYS`):

  * every architecture: ``model_type`` (HF's: "llama", "mistral", "qwen2",
    "qwen3", "phi3", "gemma2", "gemma3_text", "gpt2"), ``architectures``
    (``[HF class name]``),
    ``vocab_size``, ``tie_word_embeddings``, ``bos_token_id``,
    ``eos_token_id``, ``pad_token_id``, ``initializer_range``, ``use_cache``;
  * specs with a RoPE (all but gpt2): ``hidden_size``,
    ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``,
    ``head_dim`` (derived as hidden/heads when absent, also for qwen2),
    ``max_position_embeddings``, ``rms_norm_eps``, ``attention_dropout``,
    ``rope_parameters`` (transformers 5.x form), ``rope_theta`` and
    ``rope_scaling`` (4.x form; None when rope_type is "default");
  * llama: ``hidden_act``, ``attention_bias``, ``mlp_bias``,
    ``pretraining_tp``;
  * mistral: ``hidden_act``, ``sliding_window`` (None = full attention);
  * qwen2: ``hidden_act``, ``use_sliding_window``, ``sliding_window`` (None
    unless use_sliding_window), ``max_window_layers``, ``layer_types``;
  * qwen3: as qwen2, plus ``attention_bias`` (``sliding_window`` defaults
    to None);
  * phi3: ``hidden_act``, ``sliding_window`` (None = full attention),
    ``original_max_position_embeddings``;
  * gemma2: ``hidden_activation``, ``attention_bias``,
    ``query_pre_attn_scalar``, ``sliding_window``, ``layer_types`` (even
    layers slide), ``final_logit_softcapping``, ``attn_logit_softcapping``
    (default 30 and 50), ``use_bidirectional_attention``;
  * gemma3: ``hidden_activation``, ``attention_bias``,
    ``query_pre_attn_scalar``, ``sliding_window``, ``layer_types``
    ("sliding_attention" / "full_attention"), ``sliding_window_pattern`` and
    ``_sliding_window_pattern``, ``rope_local_base_freq`` (RoPE base of
    sliding layers; ``rope_theta`` is the full-attention layers' base),
    ``final_logit_softcapping``, ``attn_logit_softcapping``,
    ``use_bidirectional_attention``;
  * gpt2: every GPT2Config field (``n_embd``, ``n_layer``, ``n_head``,
    ``n_positions``, ``n_inner`` (None = 4 * n_embd), ``activation_function``,
    ``layer_norm_epsilon``, ``scale_attn_weights``,
    ``scale_attn_by_inverse_layer_idx``, ``reorder_and_upcast_attn``, ...)
    plus HF's aliases ``hidden_size``, ``num_attention_heads``,
    ``num_hidden_layers``, ``max_position_embeddings``.

  Other keys of the raw config are kept as they are.

  Returns:
    A new dict.

  Raises:
    CheckpointError (a ValueError): a value no model can have (see
      :func:`~penzai_lm.checkpoints.validation.check_config_values`).
  """
  spec = spec_for(architecture, specs)
  if not isinstance(raw, Mapping):
    raise TypeError(
        f"the config{f' of {source}' if source else ''} must be a dict (a"
        f" parsed config.json), got {type(raw).__name__}")
  raw = copy.deepcopy(dict(raw))
  for k in _DROP_KEYS:
    raw.pop(k, None)
  # torch_dtype (4.x) / dtype (5.x) describe storage, not architecture: keep
  # whatever was there under "dtype" for information only.
  if "torch_dtype" in raw:
    raw.setdefault("dtype", raw.pop("torch_dtype"))

  cfg: dict[str, Any] = dict(spec.config_defaults)
  cfg.update({k: v for k, v in raw.items()})
  # Before any derivation: head_dim divides by the head count, layer_types
  # has one entry per claimed layer.
  check_config_values(spec, cfg, where=source or "config")
  cfg["model_type"] = spec.model_type
  cfg["architectures"] = [spec.hf_class]
  for alias, key in spec.config_aliases.items():
    cfg[alias] = cfg[key]
  if spec.rope is None:
    return cfg

  # ---- decoder-only RoPE families ----
  if cfg.get("num_key_value_heads") is None:
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
  if cfg.get("head_dim") is None:
    cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
  cfg["rms_norm_eps"] = float(cfg["rms_norm_eps"])

  rule = spec.sliding_layers
  if isinstance(rule, SlidingPeriodic):
    _periodic_layer_types(cfg, raw, rule)
  if spec.rope.local_theta is not None:
    _normalize_local_global_rope(cfg, raw, spec.rope)
  else:
    _normalize_single_rope(cfg, raw, spec.rope)
  if isinstance(rule, SlidingFromLayer):
    _layer_types_from_layer(cfg, rule)
  return cfg


def _normalize_single_rope(
    cfg: dict[str, Any], raw: Mapping[str, Any], rope: RopeSpec
) -> None:
  """Fills a RoPE shared by every layer, in both spellings."""
  rp = raw.get("rope_parameters")
  if rp:
    params = _std_rope(rp)
    params.setdefault("rope_theta", float(raw.get("rope_theta", rope.theta)))
  else:
    params = _std_rope(raw.get("rope_scaling"))
    params["rope_theta"] = float(raw.get("rope_theta", rope.theta))
  _default_original_context(params, cfg)
  cfg["rope_parameters"] = params
  cfg["rope_theta"] = params["rope_theta"]
  cfg["rope_scaling"] = _scaling_of(params)


def _default_original_context(
    params: dict[str, Any], cfg: Mapping[str, Any]
) -> None:
  """The pre-training context length of the scaled RoPEs that need it, as
  transformers fills it in: the config's top-level value (Phi-3 has one),
  else the RoPE dict's own, else ``max_position_embeddings``."""
  if params["rope_type"] not in ("llama3", "yarn", "longrope"):
    return
  key = "original_max_position_embeddings"
  if cfg.get(key) is not None:
    params[key] = cfg[key]
  elif params.get(key) is None:
    params[key] = cfg["max_position_embeddings"]


def _layer_types_from_layer(
    cfg: dict[str, Any], rule: SlidingFromLayer
) -> None:
  """Derives ``sliding_window`` and ``layer_types`` (Qwen2-style)."""
  if not cfg[rule.switch_key]:
    cfg["sliding_window"] = None
  if cfg.get("layer_types") is None:
    cfg["layer_types"] = [
        "sliding_attention"
        if cfg["sliding_window"] is not None and i >= cfg[rule.first_layer_key]
        else "full_attention"
        for i in range(cfg["num_hidden_layers"])
    ]


def _periodic_layer_types(
    cfg: dict[str, Any], raw: Mapping[str, Any], rule: SlidingPeriodic
) -> None:
  """Derives the window pattern and ``layer_types`` (Gemma-style)."""
  # Null counts as absent (the pattern is only needed to derive layer_types).
  pattern = raw.get("sliding_window_pattern")
  if pattern is None:
    pattern = raw.get("_sliding_window_pattern")
  if pattern is None:
    pattern = rule.period
  cfg["sliding_window_pattern"] = pattern
  cfg["_sliding_window_pattern"] = pattern
  if cfg.get("layer_types") is None:
    cfg["layer_types"] = [
        "sliding_attention" if bool((i + 1) % pattern) else "full_attention"
        for i in range(cfg["num_hidden_layers"])
    ]


def _normalize_local_global_rope(
    cfg: dict[str, Any], raw: Mapping[str, Any], rope: RopeSpec
) -> None:
  """Fills two RoPEs, of full-attention and of sliding layers (Gemma-style)."""
  rp = raw.get("rope_parameters")
  if rp and ("full_attention" in rp or "sliding_attention" in rp):
    full = _std_rope(rp.get("full_attention"))
    sliding = _std_rope(rp.get("sliding_attention"))
  else:
    full = _std_rope(rp if rp else raw.get("rope_scaling"))
    sliding = _std_rope(None)
  full.setdefault("rope_theta", float(raw.get("rope_theta", rope.theta)))
  sliding.setdefault(
      "rope_theta", float(raw.get("rope_local_base_freq", rope.local_theta))
  )
  _default_original_context(full, cfg)
  cfg["rope_parameters"] = {"sliding_attention": sliding, "full_attention": full}
  cfg["rope_theta"] = full["rope_theta"]
  cfg["rope_local_base_freq"] = sliding["rope_theta"]
  cfg["rope_scaling"] = _scaling_of(full)


# Keys every normalized config of each architecture has (values may be None,
# e.g. rope_scaling, pad_token_id, sliding_window, n_inner).
GUARANTEED_CONFIG_KEYS: Mapping[str, frozenset[str]] = frozen_map(
    {spec.name: frozenset(normalize_config(spec, {})) for spec in SPECS}
)
