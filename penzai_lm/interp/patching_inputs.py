"""Input checks of `penzai_lm.interp.patching.patching_sweep`: every
argument a user can get wrong, with what is wrong and how to fix it."""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.interp.tracing import GaussianNoise
from penzai_lm.model import points as points_lib
from penzai_lm.model.hooks import BLOCK_POINTS
from penzai_lm.model.hooks import MODEL_POINTS
from penzai_lm.model.transformer import check_tokens

SWEEP_AXIS = "sweep"

Position = int | tuple[int, ...]


def check_tokens_arg(model, tokens, what: str) -> pz.nx.NamedArray:
  """A named int32 token array: ``seq`` (one prompt) or batch axes too."""
  if not isinstance(tokens, pz.nx.NamedArrayBase):
    try:
      array = np.asarray(tokens)
    except ValueError as e:  # Ragged nested lists.
      raise ValueError(
          f"{what} must be one list of token ids or a list of equally long"
          " lists (prompts of the same length).") from e
    if array.dtype == object or array.ndim not in (1, 2):
      raise ValueError(
          f"{what} must be one list of token ids or a list of equally long"
          f" lists (prompts of the same length); got shape {array.shape}.")
    if array.size and not np.issubdtype(array.dtype, np.integer):
      raise ValueError(f"{what} must hold integer token ids, got"
                       f" {array.dtype}.")
    axes = ("seq",) if array.ndim == 1 else ("batch", "seq")
    tokens = pz.nx.wrap(jnp.asarray(array, jnp.int32)).tag(*axes)
  check_tokens(tokens, model.config.vocab_size, what)
  if SWEEP_AXIS in tokens.named_shape:
    raise ValueError(
        f"{what} has a {SWEEP_AXIS!r} axis: that name is the sweep's own"
        " batch axis; rename it.")
  if not tokens.named_shape["seq"]:
    raise ValueError(f"{what} is empty.")
  return tokens


def check_point(model, point: str) -> str:
  if not isinstance(point, str):
    raise ValueError(f"point must be a str such as 'resid_pre', got"
                     f" {point!r}.")
  if point in MODEL_POINTS:
    raise ValueError(
        f"point {point!r} is not inside a block; a sweep patches a block"
        f" point (one of {', '.join(BLOCK_POINTS)}).")
  if point.startswith("blocks."):
    raise ValueError(
        f"point {point!r} names one block; give the point without it"
        " (e.g. point='resid_pre') and choose blocks with layers=[...].")
  points_lib.parse_point(model, f"blocks.0.{point}")  # Misspellings.
  return point


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_layers(model, layers) -> tuple[int, ...]:
  num_layers = model.config.num_layers
  if layers is None:
    return tuple(range(num_layers))
  layers = [layers] if _is_int(layers) else list(layers)
  if not layers:
    raise ValueError("layers is empty: give at least one block index.")
  bad = [l for l in layers if not _is_int(l)]
  if bad:
    raise ValueError(f"layers must be ints (block indices), got {bad}.")
  out = [l for l in layers if not 0 <= l < num_layers]
  if out:
    raise ValueError(
        f"layers {out} do not exist: the model has {num_layers} blocks"
        f" (0 to {num_layers - 1}).")
  if len(set(layers)) != len(layers):
    raise ValueError(f"layers has duplicates: {layers}.")
  return tuple(int(l) for l in layers)


def check_positions(positions, seq: int) -> tuple[Position, ...]:
  if positions is None:
    return tuple(range(seq))
  if isinstance(positions, str):
    if positions != "all":
      raise ValueError(
          f"positions={positions!r}: give None (each position), 'all' (all"
          " positions patched together) or a list of positions.")
    return (tuple(range(seq)),)
  positions = [positions] if _is_int(positions) else list(positions)
  if not positions:
    raise ValueError("positions is empty: give at least one position.")
  checked = []
  for p in positions:
    group = p if isinstance(p, (tuple, list)) else (p,)
    if not group or not all(_is_int(q) for q in group):
      raise ValueError(
          f"each position must be an int or a non-empty tuple of ints"
          f" (patched together), got {p!r}.")
    out = [q for q in group if not 0 <= q < seq]
    if out:
      raise ValueError(
          f"positions {out} are outside the prompts' {seq} tokens (0 to"
          f" {seq - 1}).")
    checked.append(int(p) if _is_int(p) else tuple(int(q) for q in p))
  if len(set(checked)) != len(checked):
    raise ValueError(f"positions has duplicates: {positions}.")
  return tuple(checked)


def check_batch_size(batch_size) -> int | float:
  if batch_size is None:
    return float("inf")
  if not _is_int(batch_size) or batch_size < 1:
    raise ValueError(f"batch_size must be a positive int or None, got"
                     f" {batch_size!r}.")
  return int(batch_size)


def check_window(window) -> int:
  if not _is_int(window) or window < 1:
    raise ValueError(f"window must be an int >= 1 (blocks restored together),"
                     f" got {window!r}.")
  return int(window)


def check_corrupt(corrupt, corrupted_tokens) -> None:
  """Checks ``corrupt`` of `patching_sweep` and `attribution_patching`
  (before the tokens').

  Raises:
    ValueError: for neither corrupted tokens nor ``corrupt``, or a
      ``corrupt`` that is not a `GaussianNoise`.
  """
  if corrupted_tokens is None and corrupt is None:
    raise ValueError(
        "give corrupted_tokens (a corrupted prompt) or corrupt= (e.g."
        " GaussianNoise(positions=[...]) on the subject's tokens), or both.")
  if corrupt is not None and not isinstance(corrupt, GaussianNoise):
    raise ValueError(f"corrupt must be a GaussianNoise, got {corrupt!r}.")
