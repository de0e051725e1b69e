"""Sanity checks run before a checkpoint file's contents are trusted.

A downloaded model file must never take the machine down nor load silently
broken. The readers run each check at the earliest point it can run:

* File layout, before any tensor data is touched (`file_checks`): GGUF
  tensor types, shapes and offsets against the file length,
  ``general.alignment`` and each other; safetensors header entries against
  the file, their dtype x shape and each other.
* Config against tensors, before anything sized by the config is built: the
  claimed layer count against the layers the checkpoint has tensors for
  (:func:`check_layer_count`).
* Config values: positive integer sizes (below 2**31), a sane layer count,
  head counts that divide, even head dims, finite positive RoPE bases and
  factors, finite non-negative norm epsilons, no null where a model needs a
  value, RoPE scaling dicts with the keys their ``rope_type`` needs, integer
  token ids, a boolean ``tie_word_embeddings``, one ``layer_types`` entry
  per layer (:func:`check_config_values`; ``normalize_config`` runs it too,
  so that no caller can make it build a billion layer types).
* Weights, as each tensor is converted: no NaN or inf (:func:`check_finite`).

Every failure is a :class:`~penzai_lm.checkpoints.checkpoint.CheckpointError`
(a ``ValueError``) whose message says what is wrong, where (file, tensor or
key) and how to fix it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from penzai_lm.checkpoints.checkpoint import CheckpointError
from penzai_lm.checkpoints.spec_types import ArchitectureSpec
from penzai_lm.checkpoints.tensor_io import all_finite

# The deepest public LMs have ~130 layers; anything past this is a corrupt or
# hostile config, and checking it up front keeps per-layer loops short.
MAX_LAYERS = 4096
# Sizes index int32 arrays (and the largest real ones, vocabularies and
# context lengths, are below 2**25): a larger one is corrupt or hostile.
MAX_SIZE = 2**31 - 1

CONFIG_HINT = (
    "fix the value (compare with the model's original config.json) or"
    " re-download the model"
)
METADATA_HINT = (
    "the file's metadata is corrupt or was written by a broken converter;"
    " re-download or re-convert the model"
)
NONFINITE_HINT = (
    "the weights are corrupt (or were saved from a diverged run);"
    " re-download or re-convert the checkpoint"
)

def _is_int(v: Any) -> bool:
  return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
  return isinstance(v, numbers.Real) and not isinstance(v, bool)


# ---- Config against tensors -----------------------------------------------


def layer_indices(names: Iterable[str], prefix: str) -> set[int]:
  """The layer indices of tensor names ``{prefix}{index}.…``."""
  out = set()
  for name in names:
    if name.startswith(prefix):
      head = name[len(prefix):].split(".", 1)[0]
      if head.isdigit():
        out.add(int(head))
  return out


def check_layer_count(
    claimed: Any,
    present: set[int],
    *,
    where: str,
    key: str,
    prefix: str,
    fix: str,
    defaulted: bool = False,
) -> None:
  """Raises if the config claims more layers than there are tensors for.

  Runs before anything is sized by the claimed count, so a config claiming a
  billion layers fails at once. Fewer claimed layers than present are left to
  the layout check, which names the extra tensors. Non-integer counts are left
  to :func:`check_config_values`.

  Args:
    claimed: The config's layer count.
    present: Layer indices the checkpoint has tensors for.
    where, key, prefix, fix: For the message: the config's file, the key of
      the count, the per-layer tensor name prefix, how to fix it.
    defaulted: The key is absent and ``claimed`` is the default.
  """
  if not _is_int(claimed) or claimed <= len(present):
    return
  have = f"{len(present)} layers"
  if present:
    have += f" ({prefix}{min(present)} .. {prefix}{max(present)})"
  says = (
      f"has no {key}, whose default is {claimed},"
      if defaulted
      else f"says {key}={claimed}"
  )
  raise CheckpointError(
      f"{where} {says} but the checkpoint has tensors for {have}; {fix}"
  )


# ---- Config values --------------------------------------------------------

_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "sliding_window_pattern",
    "_sliding_window_pattern", "n_embd", "n_layer", "n_head", "n_positions",
    "n_inner",
)
# sliding_window 0 is odd but harmless until used; the model rejects it then.
_NON_NEGATIVE_INTS = ("sliding_window",)
_POSITIVE_NUMBERS = (
    "rope_theta", "rope_local_base_freq", "query_pre_attn_scalar",
    "final_logit_softcapping", "attn_logit_softcapping",
)
_NON_NEGATIVE_NUMBERS = ("rms_norm_eps", "layer_norm_epsilon")
_ROPE_DICTS = ("rope_scaling", "rope_parameters")
_ROPE_POSITIVE = (
    "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings",
)
# The keys each rope_type needs, as transformers' ``validate_rope`` requires
# them (``original_max_position_embeddings`` defaults to
# ``max_position_embeddings`` there, and in ``normalize_config``).
_ROPE_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}
# Nested rope_parameters (Gemma 3): one dict per attention kind.
_ROPE_LAYER_KINDS = ("full_attention", "sliding_attention")
# Keys whose spec default is a value but that a config may set to null:
# derived (head_dim, num_key_value_heads) or off (windows, soft-caps).
_NULLABLE = (
    "num_key_value_heads", "head_dim", "sliding_window", "n_inner",
    "final_logit_softcapping", "attn_logit_softcapping",
    "sliding_window_pattern", "_sliding_window_pattern",
)
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)


class _Checker:
  """Formats the errors of one config check."""

  def __init__(self, where: str, label: Callable[[str], str], fix: str):
    self.where, self.label, self.fix = where, label, fix

  def fail(self, key: str, value: Any, problem: str) -> None:
    raise CheckpointError(
        f"{self.where}: {self.label(key)} = {_short_repr(value)} {problem};"
        f" {self.fix}"
    )

  def int_at_least(self, key: str, value: Any, low: int) -> None:
    if not _is_int(value) or value < low:
      kind = "positive" if low > 0 else "non-negative"
      self.fail(key, value, f"must be a {kind} integer")
    if value > MAX_SIZE:
      self.fail(key, value, f"is larger than any model size (at most {MAX_SIZE})")

  def number(self, key: str, value: Any, positive: bool) -> None:
    # The model computes in float32: a value that overflows to inf (or a
    # positive one that rounds to 0) there is as broken as inf (or 0).
    kind = "positive" if positive else "non-negative"
    ok = _is_real(value) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
      self.fail(key, value, f"must be a finite {kind} number")
    if value and not _F32_TINY <= value <= _F32_MAX:
      self.fail(key, value, f"must be a finite {kind} number in float32's"
                f" range ({_F32_TINY:.3g} to {_F32_MAX:.3g})")

  def rope(self, key: str, params: Any) -> None:
    """A RoPE dict: null, one dict, or one per attention kind (Gemma 3)."""
    if params is None:
      return
    if not isinstance(params, Mapping):
      self.fail(
          key, params, "must be an object such as {\"rope_type\": \"linear\","
          " \"factor\": 2.0}, or null for plain RoPE",
      )
    if any(k in params for k in _ROPE_LAYER_KINDS):
      for k, v in params.items():
        self.rope(f"{key}.{k}", v)
      return
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str):
      self.fail(f"{key}.rope_type", kind,
                "must be a string such as \"linear\" or \"llama3\"")
    missing = [k for k in _ROPE_REQUIRED.get(kind, ()) if params.get(k) is None]
    if missing:
      self.fail(
          key, params, f"lacks {', '.join(map(repr, missing))}, which"
          f" rope_type {kind!r} needs",
      )
    for k, v in params.items():
      if k in _ROPE_POSITIVE and (v is not None or k == "rope_theta"):
        self.number(f"{key}.{k}", v, positive=True)

  def token_ids(self, key: str, value: Any) -> None:
    """A token id, or (``eos_token_id``) a list of them; null allowed."""
    if value is None:
      return
    many = key == "eos_token_id" and isinstance(value, (list, tuple))
    if not all(_is_int(i) for i in (value if many else [value])):
      lists = " or a list of them" if key == "eos_token_id" else ""
      self.fail(key, value, f"must be a token id (an integer){lists}, or null")


def _short_repr(value: Any, limit: int = 80) -> str:
  """``repr(value)``, cut to ``limit`` characters (a config value can be a
  4000-digit number or a whole dict)."""
  if _is_int(value) and abs(value) >= 10**limit:
    return f"<an integer of more than {limit} digits>"
  text = repr(value)
  return text if len(text) <= limit else text[: limit - 3] + "..."


def check_config_values(
    spec: ArchitectureSpec,
    config: Mapping[str, Any],
    *,
    where: str = "config",
    label: Callable[[str], str] = lambda key: f"key {key!r}",
    fix: str = CONFIG_HINT,
) -> None:
  """Checks the values of a (raw or normalized) config; None means unset.

  Args:
    spec: The architecture; its defaults fill keys the config lacks.
    config: The config.
    where: Its source (a file), for messages.
    label: Config key -> how messages name it (e.g. the GGUF metadata key).
    fix: How to fix a bad value, for messages.

  Raises:
    CheckpointError: naming the first bad key: a non-positive, non-integer
      or larger than :data:`MAX_SIZE` size, more than :data:`MAX_LAYERS`
      layers, head counts that do not divide, an odd RoPE head dim, a
      NaN/inf/negative RoPE base, factor, softcap or norm epsilon, a null
      that the model needs a value for, a RoPE dict that is not one or lacks
      a key its ``rope_type`` needs, a token id that is not an integer, a
      ``tie_word_embeddings`` that is not a boolean, or ``layer_types`` that
      are not one string per layer.
  """
  c = {**spec.config_defaults, **config}
  check = _Checker(where, label, fix)
  for key in _POSITIVE_INTS + _NON_NEGATIVE_INTS:
    if c.get(key) is not None:
      check.int_at_least(key, c[key], 0 if key in _NON_NEGATIVE_INTS else 1)
  for key in _POSITIVE_NUMBERS + _NON_NEGATIVE_NUMBERS:
    if c.get(key) is not None:
      check.number(key, c[key], positive=key in _POSITIVE_NUMBERS)
  _check_nulls(spec, config, check)
  for key in _ROPE_DICTS:
    check.rope(key, c.get(key))
  for key in _TOKEN_IDS:
    check.token_ids(key, c.get(key))
  tie = c.get("tie_word_embeddings")
  if tie is not None and not isinstance(tie, bool):
    check.fail("tie_word_embeddings", tie, "must be true or false")
  _check_layer_types(spec, c, check)
  layers_key = spec.layout.layer_count_key
  if c.get(layers_key) is not None and c[layers_key] > MAX_LAYERS:
    check.fail(
        layers_key, c[layers_key],
        f"is more layers than any real model has (at most {MAX_LAYERS})",
    )
  _check_divisibility(spec, c, check)


def _check_nulls(
    spec: ArchitectureSpec, config: Mapping[str, Any], check: _Checker
) -> None:
  """A size or constant set to null that the model needs a value for.

  Null means "unset" only where the architecture's own default is null, or
  where null has a meaning (`_NULLABLE`: derived, or off).
  """
  needed = {
      k for k, v in spec.config_defaults.items()
      if v is not None and k not in _NULLABLE
  }
  if spec.rope is not None:
    needed.add("rope_theta")
    if spec.rope.local_theta is not None:
      needed.add("rope_local_base_freq")
  for key in _POSITIVE_INTS + _POSITIVE_NUMBERS + _NON_NEGATIVE_NUMBERS:
    if key in needed and key in config and config[key] is None:
      check.fail(key, None, "(null) must be set: the model needs a value")


def _check_layer_types(
    spec: ArchitectureSpec, c: Mapping[str, Any], check: _Checker
) -> None:
  """``layer_types``: null, or one attention kind (a string) per layer."""
  kinds = c.get("layer_types")
  if kinds is None:
    return
  if not isinstance(kinds, (list, tuple)) or not all(
      isinstance(k, str) for k in kinds
  ):
    check.fail(
        "layer_types", kinds, "must be a list with one string per layer"
        " (\"full_attention\" or \"sliding_attention\")",
    )
  layers = c.get(spec.layout.layer_count_key)
  if spec.sliding_layers is not None and _is_int(layers) and (
      len(kinds) != layers
  ):
    check.fail(
        "layer_types", kinds,
        f"has {len(kinds)} entries, but the model has {layers} layers",
    )


def _check_divisibility(
    spec: ArchitectureSpec, c: Mapping[str, Any], check: _Checker
) -> None:
  """Head counts that divide, and an even RoPE head dim."""
  label = check.label
  for whole, part in (
      ("num_attention_heads", "num_key_value_heads"),
      ("n_embd", "n_head"),
  ):
    if c.get(whole) is not None and c.get(part) is not None:
      if c[whole] % c[part]:
        check.fail(
            whole, c[whole], f"is not a multiple of {label(part)} = {c[part]}"
        )
  if spec.rope is None or c.get("num_attention_heads") is None:
    return
  head_dim = c.get("head_dim")
  if head_dim is None and c.get("hidden_size") is not None:
    heads = c["num_attention_heads"]
    if c["hidden_size"] % heads:
      check.fail(
          "hidden_size", c["hidden_size"],
          f"is not a multiple of {label('num_attention_heads')} = {heads}"
          " (and no head_dim is given)",
      )
    head_dim = c["hidden_size"] // heads
  if head_dim is not None and head_dim % 2:
    check.fail(
        "head_dim", head_dim, "is odd, but RoPE rotates pairs of dimensions"
    )


# ---- Weights ---------------------------------------------------------------


def check_finite(arr: np.ndarray, where: str) -> None:
  """Raises if ``arr`` holds NaN or inf; ``where`` names file and tensor.

  One pass per tensor in cache-sized steps (~1.5 ns per value); the counts
  in the message are only computed on failure.
  """
  if all_finite(arr):
    return
  values = np.asarray(arr, dtype=np.float32).reshape(-1)
  nan = int(np.isnan(values).sum())
  inf = int(np.isinf(values).sum())
  first = int(np.flatnonzero(~np.isfinite(values))[0])
  raise CheckpointError(
      f"{where} holds {nan} NaN and {inf} infinite value(s) (first at flat"
      f" index {first}); {NONFINITE_HINT}"
  )
