"""The canonical (Hugging Face) checkpoint layout: configs and tensor shapes.

Every reader in this package produces tensors named and shaped exactly like the
``state_dict()`` of the corresponding ``transformers`` causal-LM class, and a
config dict with the keys of that class's ``config.json`` (defaults filled in
the way transformers 5.x fills them). This module knows, for each supported
architecture:

* how to complete a raw config dict (:func:`normalize_config`);
* which tensors the architecture needs and their shapes
  (:func:`expected_tensor_shapes`);
* how to check a checkpoint against that (:func:`validate`).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import numpy as np

# Canonical architecture name (HF ``model_type`` family) -> HF causal-LM class.
ARCHITECTURE_CLASSES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURE_CLASSES)

# The ``model_type`` HF writes into config.json for each architecture.
MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "gemma3": "gemma3_text",
    "gpt2": "gpt2",
}

# Defaults of the transformers 5.x config classes (LlamaConfig, MistralConfig,
# Qwen2Config, Gemma3TextConfig, GPT2Config). ``None`` entries that depend on
# other fields are derived in :func:`normalize_config`.
_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        hidden_act="silu",
        max_position_embeddings=2048,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
        pretraining_tp=1,
        tie_word_embeddings=False,
        attention_bias=False,
        attention_dropout=0.0,
        mlp_bias=False,
        head_dim=None,
    ),
    "mistral": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=None,
        hidden_act="silu",
        max_position_embeddings=4096 * 32,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        sliding_window=4096,
        attention_dropout=0.0,
    ),
    "qwen2": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        hidden_act="silu",
        max_position_embeddings=32768,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=4096,
        max_window_layers=28,
        layer_types=None,
        attention_dropout=0.0,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    ),
    "gemma3": dict(
        vocab_size=262_208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=131_072,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        use_cache=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=True,
        attention_bias=False,
        attention_dropout=0.0,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        layer_types=None,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        use_bidirectional_attention=False,
    ),
    "gpt2": dict(
        vocab_size=50257,
        n_positions=1024,
        n_embd=768,
        n_layer=12,
        n_head=12,
        n_inner=None,
        activation_function="gelu_new",
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        layer_norm_epsilon=1e-5,
        initializer_range=0.02,
        summary_type="cls_index",
        summary_use_proj=True,
        summary_activation=None,
        summary_proj_to_labels=True,
        summary_first_dropout=0.1,
        scale_attn_weights=True,
        use_cache=True,
        bos_token_id=50256,
        eos_token_id=50256,
        pad_token_id=None,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        add_cross_attention=False,
        tie_word_embeddings=True,
    ),
}

_GEMMA3_DEFAULT_THETA = {"global": 1_000_000.0, "local": 10_000.0}
_GEMMA3_DEFAULT_SLIDING_WINDOW_PATTERN = 6

# Keys of a raw config that are bookkeeping, not architecture; dropped.
_DROP_KEYS = (
    "transformers_version",
    "_name_or_path",
    "_commit_hash",
    "_attn_implementation_autoset",
)


def unsupported_architecture_message(what: str, supported: str) -> str:
  return f"Unsupported architecture {what}. Supported: {supported}."


def _check_architecture(architecture: str) -> None:
  if architecture not in ARCHITECTURE_CLASSES:
    raise ValueError(
        unsupported_architecture_message(
            repr(architecture), ", ".join(SUPPORTED_ARCHITECTURES)
        )
    )


def _as_float(x):
  return None if x is None else float(x)


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
  _check_architecture(architecture)
  raw = copy.deepcopy(dict(raw))
  for k in _DROP_KEYS:
    raw.pop(k, None)
  # torch_dtype (4.x) / dtype (5.x) describe storage, not architecture: keep
  # whatever was there under "dtype" for information only.
  if "torch_dtype" in raw:
    raw.setdefault("dtype", raw.pop("torch_dtype"))

  cfg: dict[str, Any] = dict(_CONFIG_DEFAULTS[architecture])
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

  # Single RoPE for llama / mistral / qwen2.
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

  if architecture == "qwen2":
    if not cfg["use_sliding_window"]:
      cfg["sliding_window"] = None
    if cfg.get("layer_types") is None:
      cfg["layer_types"] = [
          "sliding_attention"
          if cfg["sliding_window"] is not None and i >= cfg["max_window_layers"]
          else "full_attention"
          for i in range(cfg["num_hidden_layers"])
      ]
  return cfg


def _normalize_gemma3(cfg: dict[str, Any], raw: Mapping[str, Any]) -> None:
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


def expected_tensor_shapes(
    architecture: str, config: Mapping[str, Any]
) -> dict[str, tuple[int, ...]]:
  """The complete set of HF ``state_dict`` tensors for ``architecture``.

  Tied embeddings (``tie_word_embeddings``) mean no ``lm_head.weight``.

  Args:
    architecture: One of :data:`SUPPORTED_ARCHITECTURES`.
    config: A config dict (raw or normalized; it is normalized here).

  Returns:
    Mapping from tensor name to shape, in a stable order.
  """
  _check_architecture(architecture)
  c = normalize_config(architecture, config)
  out: dict[str, tuple[int, ...]] = {}

  if architecture == "gpt2":
    e, v, p = c["n_embd"], c["vocab_size"], c["n_positions"]
    inner = c["n_inner"] if c["n_inner"] is not None else 4 * e
    out["transformer.wte.weight"] = (v, e)
    out["transformer.wpe.weight"] = (p, e)
    for i in range(c["n_layer"]):
      b = f"transformer.h.{i}."
      out[b + "ln_1.weight"] = (e,)
      out[b + "ln_1.bias"] = (e,)
      # GPT-2 uses Conv1D: weights are stored (in_features, out_features).
      out[b + "attn.c_attn.weight"] = (e, 3 * e)
      out[b + "attn.c_attn.bias"] = (3 * e,)
      out[b + "attn.c_proj.weight"] = (e, e)
      out[b + "attn.c_proj.bias"] = (e,)
      out[b + "ln_2.weight"] = (e,)
      out[b + "ln_2.bias"] = (e,)
      out[b + "mlp.c_fc.weight"] = (e, inner)
      out[b + "mlp.c_fc.bias"] = (inner,)
      out[b + "mlp.c_proj.weight"] = (inner, e)
      out[b + "mlp.c_proj.bias"] = (e,)
    out["transformer.ln_f.weight"] = (e,)
    out["transformer.ln_f.bias"] = (e,)
    if not c["tie_word_embeddings"]:
      out["lm_head.weight"] = (v, e)
    return out

  h, v = c["hidden_size"], c["vocab_size"]
  inter = c["intermediate_size"]
  nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
  if architecture == "qwen2":
    qkv_bias, o_bias, mlp_bias = True, False, False
  elif architecture == "mistral":
    qkv_bias = o_bias = mlp_bias = False
  elif architecture == "llama":
    qkv_bias = o_bias = bool(c["attention_bias"])
    mlp_bias = bool(c["mlp_bias"])
  else:  # gemma3
    qkv_bias = o_bias = bool(c["attention_bias"])
    mlp_bias = False

  out["model.embed_tokens.weight"] = (v, h)
  for i in range(c["num_hidden_layers"]):
    b = f"model.layers.{i}."
    a = b + "self_attn."
    out[a + "q_proj.weight"] = (nh * hd, h)
    if qkv_bias:
      out[a + "q_proj.bias"] = (nh * hd,)
    out[a + "k_proj.weight"] = (nkv * hd, h)
    if qkv_bias:
      out[a + "k_proj.bias"] = (nkv * hd,)
    out[a + "v_proj.weight"] = (nkv * hd, h)
    if qkv_bias:
      out[a + "v_proj.bias"] = (nkv * hd,)
    out[a + "o_proj.weight"] = (h, nh * hd)
    if o_bias:
      out[a + "o_proj.bias"] = (h,)
    if architecture == "gemma3":
      out[a + "q_norm.weight"] = (hd,)
      out[a + "k_norm.weight"] = (hd,)
    m = b + "mlp."
    out[m + "gate_proj.weight"] = (inter, h)
    if mlp_bias:
      out[m + "gate_proj.bias"] = (inter,)
    out[m + "up_proj.weight"] = (inter, h)
    if mlp_bias:
      out[m + "up_proj.bias"] = (inter,)
    out[m + "down_proj.weight"] = (h, inter)
    if mlp_bias:
      out[m + "down_proj.bias"] = (h,)
    out[b + "input_layernorm.weight"] = (h,)
    out[b + "post_attention_layernorm.weight"] = (h,)
    if architecture == "gemma3":
      out[b + "pre_feedforward_layernorm.weight"] = (h,)
      out[b + "post_feedforward_layernorm.weight"] = (h,)
  out["model.norm.weight"] = (h,)
  if not c["tie_word_embeddings"]:
    out["lm_head.weight"] = (v, h)
  return out


def _fmt_list(names, limit: int = 20) -> str:
  names = sorted(names)
  shown = ", ".join(names[:limit])
  if len(names) > limit:
    shown += f", ... ({len(names) - limit} more)"
  return shown


_ALLOWED_DTYPES = ("float32", "bfloat16")


def validate(checkpoint) -> None:
  """Checks a :class:`~penzai_lm.checkpoints.Checkpoint` against its layout.

  Raises:
    ValueError: on an unsupported architecture, missing tensors, unexpected
      extra tensors, shape mismatches or non-float dtypes; the message lists
      every offending tensor (up to 20 of each kind).
  """
  arch = checkpoint.architecture
  _check_architecture(arch)
  expected = expected_tensor_shapes(arch, checkpoint.config)
  tensors = checkpoint.tensors
  src = getattr(checkpoint, "source", "<unknown>")
  problems = []
  missing = [n for n in expected if n not in tensors]
  if missing:
    problems.append(f"missing {len(missing)} tensor(s): {_fmt_list(missing)}")
  extra = [n for n in tensors if n not in expected]
  if extra:
    problems.append(
        f"unexpected extra {len(extra)} tensor(s): {_fmt_list(extra)}"
    )
  bad_shapes = [
      f"{n}: expected {expected[n]}, got {tuple(tensors[n].shape)}"
      for n in expected
      if n in tensors and tuple(tensors[n].shape) != tuple(expected[n])
  ]
  if bad_shapes:
    shown = "; ".join(bad_shapes[:20])
    if len(bad_shapes) > 20:
      shown += f"; ... ({len(bad_shapes) - 20} more)"
    problems.append(f"{len(bad_shapes)} shape mismatch(es): {shown}")
  bad_dtypes = [
      f"{n}: {np.dtype(t.dtype).name}"
      for n, t in tensors.items()
      if np.dtype(t.dtype).name not in _ALLOWED_DTYPES
  ]
  if bad_dtypes:
    problems.append(
        "tensors must be float32 or bfloat16, got "
        + ", ".join(bad_dtypes[:20])
    )
  if problems:
    raise ValueError(
        f"Checkpoint {src} does not match the {arch} layout "
        f"({ARCHITECTURE_CLASSES[arch]}): " + "; ".join(problems)
    )
