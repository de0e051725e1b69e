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
* Config values: positive integer sizes, a sane layer count, head counts that
  divide, even head dims, finite positive RoPE bases and factors, finite
  non-negative norm epsilons (:func:`check_config_values`; ``normalize_config``
  runs it too, so that no caller can make it build a billion layer types).
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


class _Checker:
  """Formats the errors of one config check."""

  def __init__(self, where: str, label: Callable[[str], str], fix: str):
    self.where, self.label, self.fix = where, label, fix

  def fail(self, key: str, value: Any, problem: str) -> None:
    raise CheckpointError(
        f"{self.where}: {self.label(key)} = {value!r} {problem}; {self.fix}"
    )

  def int_at_least(self, key: str, value: Any, low: int) -> None:
    if not _is_int(value) or value < low:
      kind = "positive" if low > 0 else "non-negative"
      self.fail(key, value, f"must be a {kind} integer")

  def number(self, key: str, value: Any, positive: bool) -> None:
    ok = _is_real(value) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
      kind = "positive" if positive else "non-negative"
      self.fail(key, value, f"must be a finite {kind} number")

  def rope(self, key: str, params: Any) -> None:
    if not isinstance(params, Mapping):
      return
    for k, v in params.items():
      if isinstance(v, Mapping):
        self.rope(f"{key}.{k}", v)
      elif k in _ROPE_POSITIVE and v is not None:
        self.number(f"{key}.{k}", v, positive=True)


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
    CheckpointError: naming the first bad key: a non-positive or non-integer
      size, more than :data:`MAX_LAYERS` layers, head counts that do not
      divide, an odd RoPE head dim, a NaN/inf/negative RoPE base, factor,
      softcap or norm epsilon.
  """
  c = {**spec.config_defaults, **config}
  check = _Checker(where, label, fix)
  for key in _POSITIVE_INTS + _NON_NEGATIVE_INTS:
    if c.get(key) is not None:
      check.int_at_least(key, c[key], 0 if key in _NON_NEGATIVE_INTS else 1)
  for key in _POSITIVE_NUMBERS + _NON_NEGATIVE_NUMBERS:
    if c.get(key) is not None:
      check.number(key, c[key], positive=key in _POSITIVE_NUMBERS)
  for key in _ROPE_DICTS:
    check.rope(key, c.get(key))
  layers_key = spec.layout.layer_count_key
  if c.get(layers_key) is not None and c[layers_key] > MAX_LAYERS:
    check.fail(
        layers_key, c[layers_key],
        f"is more layers than any real model has (at most {MAX_LAYERS})",
    )
  _check_divisibility(spec, c, check)


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
