"""Per-row option values read on the host and checked.

A per-row value is one value for every row or a sequence with one per row:
Python numbers and sequences, numpy arrays, or concrete ``jax.Array``s
(`host_value` reads them; a traced value is refused). Every check raises a
``ValueError`` naming the option, the row and what it must be.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def positive_int(name: str, value: Any) -> int:
  if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
      or value < 1):
    raise ValueError(f"{name} must be a positive integer, got {value!r}.")
  return int(value)


def host_value(name: str, value: Any) -> Any:
  """``value`` with its concrete JAX arrays read onto the host.

  Per-row options are host-side request values: a ``jax.Array`` (at any
  depth of lists, tuples and dict values) becomes a numpy array, and a 0-d
  array (numpy or JAX) the Python scalar it holds, so that it is accepted
  wherever a list or a number is. Anything else is returned as is (the
  same object when nothing was converted).

  Args:
    name: The option's name, for the error message.
    value: The option's value.

  Returns:
    The value with numpy arrays and Python scalars in place of JAX arrays.

  Raises:
    ValueError: For a traced value (an argument of a function under
      ``jax.jit``, ``vmap`` or ``grad``): it has no value on the host.
  """
  if isinstance(value, jax.core.Tracer):
    raise ValueError(
        f"{name} is a traced JAX value (it comes from inside jax.jit, vmap"
        " or grad); sampling and request options are read on the host when"
        " the request is built: pass concrete values (numbers, lists, numpy"
        " arrays or jax.Arrays computed outside the transformation).")
  if isinstance(value, (jax.Array, np.ndarray)):
    array = np.asarray(value)
    if array.dtype.kind not in "biuf" and jnp.issubdtype(array.dtype,
                                                          jnp.floating):
      array = array.astype(np.float32)  # bfloat16 and other ml_dtypes.
    return array.item() if array.ndim == 0 else array
  if isinstance(value, (list, tuple)):
    items = [host_value(name, v) for v in value]
    if all(a is b for a, b in zip(items, value)):
      return value
    return items if isinstance(value, list) else tuple(items)
  if isinstance(value, Mapping):
    items = {k: host_value(name, v) for k, v in value.items()}
    if all(items[k] is v for k, v in value.items()):
      return value
    return items
  return value


def is_sequence(value: Any) -> bool:
  if isinstance(value, (np.ndarray, jax.Array)):
    return value.ndim > 0
  return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def per_row(name: str, value: Any, batch_size: int) -> list[Any]:
  """Broadcasts a scalar or checks a per-row sequence's length."""
  if isinstance(value, np.ndarray) and value.ndim > 1:
    raise ValueError(f"{name} must be a scalar or a 1-D sequence with one value"
                     f" per row, got an array of shape {value.shape}.")
  if not is_sequence(value):
    return [value] * batch_size
  values = list(value)
  if len(values) != batch_size:
    raise ValueError(
        f"got {len(values)} values for {name} but the batch has {batch_size} "
        f"rows; pass a single value to use it for every row, or exactly one "
        f"value per row.")
  return values


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def as_float(name: str, row: int, value: Any) -> float:
  """A finite number that stays finite as float32 (how it is stored)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"{name}[{row}] must be a real number, got {value!r}.")
  try:
    value = float(value)
  except OverflowError:  # A huge int or Fraction.
    value = float("inf") if value > 0 else float("-inf")
  if not np.isfinite(value):
    raise ValueError(f"{name}[{row}] must be finite, got {value!r}.")
  if abs(value) > _FLOAT32_MAX:
    raise ValueError(
        f"{name}[{row}] must be finite as float32 (|value| <="
        f" {_FLOAT32_MAX:.4g}, the range of the stored setting), got"
        f" {value!r}.")
  return value


def as_int(name: str, row: int, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(f"{name}[{row}] must be an integer, got {value!r} of type "
                     f"{type(value).__name__}.")
  return int(value)


def check_rows(name: str, values: list[Any], ok, requirement: str,
                checked: list[Any] | None = None) -> None:
  """Raises for the first row whose value (``checked[row]`` if given: the
  value as stored) breaks ``ok``; the message shows ``values[row]``."""
  for row, v in enumerate(values):
    if not ok(v if checked is None else checked[row]):
      raise ValueError(
          f"{name}[{row}] = {v!r} is invalid: {name} {requirement}.")


def token_id(what: str, token: Any, vocab_size: int) -> int:
  if isinstance(token, bool) or not isinstance(token, numbers.Integral):
    raise ValueError(f"{what}: token ids must be integers, got {token!r}.")
  if not 0 <= token < vocab_size:
    raise ValueError(f"{what}: token id {token} is outside the vocabulary "
                     f"[0, {vocab_size}).")
  return int(token)


def logit_bias_rows(bias: Any, batch_size: int,
                vocab_size: int) -> np.ndarray | None:
  """Turns a dict or a list of per-row dicts into a dense array."""
  if bias is None:
    return None
  if isinstance(bias, Mapping):
    row_values = [bias] * batch_size
  elif is_sequence(bias) and all(
      b is None or isinstance(b, Mapping) for b in bias):
    row_values = [b or {} for b in per_row("logit_bias", bias, batch_size)]
  else:
    raise ValueError("logit_bias must be a dict {token_id: bias} for every row "
                     "or a list with one such dict per row, got "
                     f"{type(bias).__name__}.")
  dense = np.zeros((batch_size, vocab_size), np.float32)
  for row, mapping in enumerate(row_values):
    for token, value in mapping.items():
      token = token_id(f"logit_bias[{row}]", token, vocab_size)
      dense[row, token] = as_float(f"logit_bias[{row}]", token, value)
  return dense


def banned_rows(banned: Any, batch_size: int, vocab_size: int) -> np.ndarray | None:
  """Turns a list of ids or a list of per-row lists into a dense mask."""
  if banned is None:
    return None
  if not is_sequence(banned):
    raise ValueError("banned_tokens must be a list of token ids for every row "
                     f"or a list of lists (one per row), got {banned!r}.")
  items = list(banned)
  if items and all(is_sequence(b) for b in items):
    row_values = per_row("banned_tokens", items, batch_size)
  elif any(is_sequence(b) for b in items):
    raise ValueError("banned_tokens mixes token ids and lists; pass either one "
                     "list of ids for every row or one list per row.")
  else:
    row_values = [items] * batch_size
  mask = np.zeros((batch_size, vocab_size), bool)
  for row, tokens in enumerate(row_values):
    for token in tokens:
      mask[row, token_id(f"banned_tokens[{row}]", token, vocab_size)] = True
    if mask[row].all():
      raise ValueError(f"banned_tokens[{row}] bans the whole vocabulary; at "
                       "least one token must stay allowed.")
  return mask
