"""Token-id inputs: prompts and id lists, checked and normalised on the host.

Everything here raises a ``ValueError`` (``TypeError`` for arguments of the
wrong kind) that says what is wrong and how to fix it; nothing is mutated.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from penzai import pz


def is_int(value: Any) -> bool:
  """A Python or numpy integer (not a bool)."""
  if isinstance(value, np.generic):
    value = value.item()
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_sequence(value: Any) -> bool:
  """A list-like of values (an array with at least one axis; not a str)."""
  if isinstance(value, (np.ndarray, jax.Array)):
    return value.ndim > 0
  return isinstance(value, Sequence) and not isinstance(
      value, (str, bytes, bytearray, memoryview))


# Prompts.


def normalize_prompts(
    prompts: Any, vocab_size: int, batch_axis: str | None = None
) -> list[np.ndarray]:
  """Turns the accepted prompt forms into a list of int32 id arrays.

  Accepted forms: one prompt as a list of ints (or a 1-D array); a list of
  such lists (ragged is fine); a 2-D array (rows); a ``pz.nx.NamedArray``
  with a ``seq`` axis and at most one batch axis.

  Args:
    prompts: The prompts.
    vocab_size: Ids must lie in ``[0, vocab_size)``.
    batch_axis: If given, the only batch axis name a NamedArray may use.

  Returns:
    One int32 array per prompt.

  Raises:
    ValueError / TypeError: with a description of the problem.
  """
  if isinstance(prompts, pz.nx.NamedArrayBase):
    rows = _named_prompts(prompts, batch_axis)
  elif isinstance(prompts, (np.ndarray, jax.Array)):
    array = np.asarray(prompts)
    if array.ndim == 1:
      rows = [array]
    elif array.ndim == 2:
      rows = list(array)
    else:
      raise ValueError(
          f"prompts as an array must be 1-D (one prompt) or 2-D (one row per"
          f" prompt); got shape {array.shape}.")
  elif isinstance(prompts, (bytes, bytearray, memoryview)):
    raise TypeError(
        f"prompts must be token ids, not {type(prompts).__name__}: decode"
        " and encode them (tokenizer.encode(data.decode('utf-8'))), or to"
        " generate from text use generate_text(model, tokenizer, text).")
  elif isinstance(prompts, str):
    raise TypeError(
        "prompts must be token ids, not text: encode them"
        " (tokenizer.encode(text)), or to generate from text use"
        " penzai_lm.generation.generate_text(model, tokenizer, text).")
  elif is_sequence(prompts):
    items = list(prompts)
    if not items:
      raise ValueError("prompts is empty: pass at least one prompt.")
    if all(is_int(i) for i in items):
      rows = [np.asarray([int(i) for i in items])]
    elif all(is_sequence(i) for i in items):
      rows = [_row_array(i, r) for r, i in enumerate(items)]
    elif any(isinstance(i, str) for i in items):
      raise TypeError(
          "prompts must be token ids, not text: encode them"
          " (tokenizer.encode(text)), or to generate from text use"
          " generate_text(model, tokenizer, prompts).")
    else:
      odd = [i for i in items if not (is_int(i) or is_sequence(i))]
      # Else ids and lists are mixed: show the first list.
      bad = odd[0] if odd else next(i for i in items if is_sequence(i))
      raise ValueError(
          "prompts must be a list of token ids (one prompt) or a list of"
          " lists of token ids (a batch); got a list that mixes ids and"
          f" other values (such as {bad!r}; token ids are ints, not bools"
          " or floats).")
  else:
    raise TypeError(
        "prompts must be a list of token ids, a list of such lists, a numpy"
        " array or a pz.nx.NamedArray with a 'seq' axis; got"
        f" {type(prompts).__name__}.")

  out = []
  for i, row in enumerate(rows):
    row = _row_array(row, i)
    if row.ndim != 1:
      raise ValueError(
          f"prompt {i} must be a flat list of token ids, got shape"
          f" {row.shape}.")
    if row.size == 0:
      raise ValueError(
          f"prompt {i} is empty; every prompt needs at least one token (e.g."
          " the BOS token).")
    if row.dtype == object or not (np.issubdtype(row.dtype, np.integer)):
      raise ValueError(
          f"prompt {i} must contain integer token ids, got dtype"
          f" {row.dtype}.")
    low, high = int(row.min()), int(row.max())
    if low < 0 or high >= vocab_size:
      bad = low if low < 0 else high
      raise ValueError(
          f"prompt {i} contains token id {bad}, outside the model's"
          f" vocabulary [0, {vocab_size}).")
    out.append(row.astype(np.int32))
  return out


def _row_array(row: Any, index: int) -> np.ndarray:
  """``np.asarray(row)``, with our message for a nested (ragged) row."""
  try:
    return np.asarray(row)
  except (ValueError, TypeError, OverflowError):
    raise ValueError(
        f"prompt {index} must be a flat list of token ids, got {row!r}."
        ) from None


def _named_prompts(prompts, batch_axis):
  if prompts.positional_shape:
    raise ValueError(
        f"the prompt NamedArray has positional axes {prompts.positional_shape};"
        " tag every axis, e.g. pz.nx.wrap(ids).tag('batch', 'seq').")
  names = list(prompts.named_shape)
  if "seq" not in names:
    raise ValueError(
        f"the prompt NamedArray has axes {dict(prompts.named_shape)} but needs"
        " a 'seq' axis (and at most one batch axis).")
  others = [n for n in names if n != "seq"]
  if len(others) > 1:
    raise ValueError(
        f"the prompt NamedArray has axes {dict(prompts.named_shape)}: only"
        " 'seq' and one batch axis are allowed.")
  if others and batch_axis is not None and others[0] != batch_axis:
    raise ValueError(
        f"the prompt NamedArray's batch axis is {others[0]!r}, but the cached"
        f" model's batch axis is {batch_axis!r}; rename it with"
        f" .untag({others[0]!r}).tag({batch_axis!r}).")
  if not np.issubdtype(prompts.dtype, np.integer):
    raise ValueError(
        f"the prompt NamedArray must hold integer ids, got {prompts.dtype}.")
  if others:
    return list(np.asarray(prompts.unwrap(others[0], "seq")))
  return [np.asarray(prompts.unwrap("seq"))]


def token_list(name: str, ids: Any, vocab_size: int) -> tuple[int, ...]:
  out = []
  for token in ids:
    if isinstance(token, np.generic):
      token = token.item()
    if not is_int(token):
      raise ValueError(f"{name}: token ids must be integers, got {token!r}.")
    if not 0 <= token < vocab_size:
      raise ValueError(
          f"{name}: token id {token} is outside the vocabulary"
          f" [0, {vocab_size}).")
    out.append(int(token))
  return tuple(out)
