"""Completes raw Hugging Face config dicts into the canonical form.

:func:`normalize_config` accepts transformers 4.x and 5.x spellings of a
config and returns every field of the transformers config class, defaults
filled in, plus derived fields. :data:`GUARANTEED_CONFIG_KEYS` lists the keys
every normalized config of an architecture has.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from penzai_lm.checkpoints.architectures import ARCHITECTURE_CLASSES
from penzai_lm.checkpoints.architectures import CONFIG_DEFAULTS
from penzai_lm.checkpoints.architectures import MODEL_TYPES
from penzai_lm.checkpoints.architectures import check_architecture

_GEMMA3_DEFAULT_THETA = {"global": 1_000_000.0, "local": 10_000.0}
_GEMMA3_DEFAULT_SLIDING_WINDOW_PATTERN = 6

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


def normalize_config(architecture: str, raw: Mapping[str, Any]) -> dict[str, Any]:
  """Completes a raw HF-style config dict for ``architecture``.

  Accepts both transformers 4.x (``rope_theta`` / ``rope_scaling`` /
  ``rope_local_base_freq`` / ``sliding_window_pattern``) and 5.x
  (``rope_parameters``) spellings and returns a dict that has both, plus every
  field of the transformers config class with its default filled in, plus
  derived fields (``head_dim``, ``num_key_value_heads``, ``layer_types``).

  Args:
    architecture: One of :data:`SUPPORTED_ARCHITECTURES`.
    raw: The raw config (e.g. parsed ``config.json``). Not modified.

  Guaranteed keys (:data:`GUARANTEED_CONFIG_KEYS`):

  * every architecture: ``model_type`` (HF's: "llama", "mistral", "qwen2",
    "gemma3_text", "gpt2"), ``architectures`` (``[HF class name]``),
    ``vocab_size``, ``tie_word_embeddings``, ``bos_token_id``,
    ``eos_token_id``, ``pad_token_id``, ``initializer_range``, ``use_cache``;
  * llama / mistral / qwen2 / gemma3: ``hidden_size``, ``intermediate_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
    ``head_dim`` (derived as hidden/heads when absent, also for qwen2),
    ``max_position_embeddings``, ``rms_norm_eps``, ``attention_dropout``,
    ``rope_parameters`` (transformers 5.x form), ``rope_theta`` and
    ``rope_scaling`` (4.x form; None when rope_type is "default");
  * llama: ``hidden_act``, ``attention_bias``, ``mlp_bias``,
    ``pretraining_tp``;
  * mistral: ``hidden_act``, ``sliding_window`` (None = full attention);
  * qwen2: ``hidden_act``, ``use_sliding_window``, ``sliding_window`` (None
    unless use_sliding_window), ``max_window_layers``, ``layer_types``;
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
  """
  check_architecture(architecture)
  raw = copy.deepcopy(dict(raw))
  for k in _DROP_KEYS:
    raw.pop(k, None)
  # torch_dtype (4.x) / dtype (5.x) describe storage, not architecture: keep
  # whatever was there under "dtype" for information only.
  if "torch_dtype" in raw:
    raw.setdefault("dtype", raw.pop("torch_dtype"))

  cfg: dict[str, Any] = dict(CONFIG_DEFAULTS[architecture])
  cfg.update({k: v for k, v in raw.items()})
  cfg["model_type"] = MODEL_TYPES[architecture]
  cfg["architectures"] = [ARCHITECTURE_CLASSES[architecture]]

  if architecture == "gpt2":
    # HF's attribute_map aliases, handy for generic code.
    cfg["hidden_size"] = cfg["n_embd"]
    cfg["num_attention_heads"] = cfg["n_head"]
    cfg["num_hidden_layers"] = cfg["n_layer"]
    cfg["max_position_embeddings"] = cfg["n_positions"]
    return cfg

  # ---- decoder-only RoPE families ----
  if cfg.get("num_key_value_heads") is None:
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
  if cfg.get("head_dim") is None:
    cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
  cfg["rms_norm_eps"] = float(cfg["rms_norm_eps"])

  if architecture == "gemma3":
    _normalize_gemma3(cfg, raw)
    return cfg

  _normalize_single_rope(cfg, raw)
  if architecture == "qwen2":
    _normalize_qwen2(cfg)
  return cfg


def _normalize_single_rope(cfg: dict[str, Any], raw: Mapping[str, Any]) -> None:
  """Fills the single RoPE of llama / mistral / qwen2 in both spellings."""
  rp = raw.get("rope_parameters")
  if rp:
    params = _std_rope(rp)
    params.setdefault("rope_theta", float(raw.get("rope_theta", 10000.0)))
  else:
    params = _std_rope(raw.get("rope_scaling"))
    params["rope_theta"] = float(raw.get("rope_theta", 10000.0))
  cfg["rope_parameters"] = params
  cfg["rope_theta"] = params["rope_theta"]
  cfg["rope_scaling"] = _scaling_of(params)


def _normalize_qwen2(cfg: dict[str, Any]) -> None:
  """Derives qwen2's ``sliding_window`` and ``layer_types``."""
  if not cfg["use_sliding_window"]:
    cfg["sliding_window"] = None
  if cfg.get("layer_types") is None:
    cfg["layer_types"] = [
        "sliding_attention"
        if cfg["sliding_window"] is not None and i >= cfg["max_window_layers"]
        else "full_attention"
        for i in range(cfg["num_hidden_layers"])
    ]


def _normalize_gemma3(cfg: dict[str, Any], raw: Mapping[str, Any]) -> None:
  """Derives gemma3's layer types and its two RoPEs (full and sliding)."""
  pattern = raw.get(
      "sliding_window_pattern",
      raw.get("_sliding_window_pattern", _GEMMA3_DEFAULT_SLIDING_WINDOW_PATTERN),
  )
  cfg["sliding_window_pattern"] = pattern
  cfg["_sliding_window_pattern"] = pattern
  if cfg.get("layer_types") is None:
    cfg["layer_types"] = [
        "sliding_attention" if bool((i + 1) % pattern) else "full_attention"
        for i in range(cfg["num_hidden_layers"])
    ]

  rp = raw.get("rope_parameters")
  if rp and ("full_attention" in rp or "sliding_attention" in rp):
    full = _std_rope(rp.get("full_attention"))
    sliding = _std_rope(rp.get("sliding_attention"))
  else:
    full = _std_rope(rp if rp else raw.get("rope_scaling"))
    sliding = _std_rope(None)
  full.setdefault(
      "rope_theta", float(raw.get("rope_theta", _GEMMA3_DEFAULT_THETA["global"]))
  )
  sliding.setdefault(
      "rope_theta",
      float(raw.get("rope_local_base_freq", _GEMMA3_DEFAULT_THETA["local"])),
  )
  cfg["rope_parameters"] = {"sliding_attention": sliding, "full_attention": full}
  cfg["rope_theta"] = full["rope_theta"]
  cfg["rope_local_base_freq"] = sliding["rope_theta"]
  cfg["rope_scaling"] = _scaling_of(full)


# Keys every normalized config of each architecture has (values may be None,
# e.g. rope_scaling, pad_token_id, sliding_window, n_inner).
GUARANTEED_CONFIG_KEYS: dict[str, frozenset[str]] = {
    arch: frozenset(normalize_config(arch, {})) for arch in ARCHITECTURE_CLASSES
}
