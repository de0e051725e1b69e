"""Steering (control) vectors: one direction per block, and their arithmetic.

A control vector is one direction per transformer block, added to the
residual stream at every token position. :class:`ControlVector` holds one
and combines them the way llama.cpp does (``scaled``, ``+``, ``restricted``)
and steers a model with them (``apply``);
:mod:`penzai_lm.interp.control_vector_files` reads and writes them as
llama.cpp / repeng ``.gguf`` files and documents that format and its sources.

Numbering used by this module
-----------------------------
:class:`ControlVector` is keyed by the **0-based penzai_lm block index**
``i``; ``directions[i]`` is added to the residual stream *after* block ``i``
(the output of block ``i``, TransformerLens's ``blocks.{i}.hook_resid_post``,
Hugging Face's ``hidden_states[i + 1]``), before the next block and before
the final norm. In a file, tensor ``direction.{i}`` holds ``directions[i]``
(same number; llama.cpp has no slot for block 0, so a vector for block 0 is
usable in penzai_lm but cannot be saved).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Mapping
import warnings

import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.interp import interventions
from penzai_lm.model import points as points_lib


def _is_int(value) -> bool:
  """Whether ``value`` is an integer (numpy ones included), but not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _block_index(key) -> int:
  """Checks a direction key and returns it as a Python int."""
  if not _is_int(key):
    raise ValueError(
        f"direction keys must be integer block indices, got {key!r}"
        f" ({type(key).__name__})"
    )
  key = int(key)
  if key < 0:
    raise ValueError(
        f"block index {key} is negative: directions are keyed by the 0-based"
        " block index i (added after block i); negative indices are not"
        " allowed, use num_layers + i"
    )
  return key


def _as_direction(block: int, value) -> np.ndarray:
  """Checks one direction and returns a read-only float32 copy."""
  array = np.asarray(value)
  if array.dtype.kind not in "fiu":
    raise ValueError(
        f"direction for block {block} has dtype {array.dtype}; expected real"
        " numbers (it is stored as float32)"
    )
  if array.ndim != 1:
    raise ValueError(
        f"direction for block {block} has shape {array.shape}; expected a 1-D"
        " vector of the model's hidden size (one vector per block)"
    )
  if array.size == 0:
    raise ValueError(f"direction for block {block} is empty")
  with np.errstate(over="ignore"):  # Overflow to inf is reported below.
    array = np.array(array, dtype=np.float32, copy=True)
  bad = int(np.count_nonzero(~np.isfinite(array)))
  if bad:
    raise ValueError(
        f"direction for block {block} has {bad} non-finite value(s) (NaN or"
        " inf, after conversion to float32)"
    )
  array.setflags(write=False)
  return array


def _check_factor(factor, what: str = "scale factor") -> float:
  if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
    raise ValueError(f"{what} must be a real number, got {factor!r}")
  factor = float(factor)
  if not math.isfinite(factor):
    raise ValueError(f"{what} must be finite, got {factor}")
  return factor


def _check_strength(strength) -> float | list[float]:
  """A finite real strength, or a list of them (one per row)."""
  if isinstance(strength, (str, bytes)) or not isinstance(
      strength, (list, tuple, np.ndarray, jnp.ndarray)):
    return _check_factor(strength, "strength")
  array = np.asarray(strength)
  if array.ndim != 1 or not array.size or array.dtype.kind not in "fiu":
    raise ValueError(
        "strength must be a real number or a non-empty 1-D list of them (one"
        f" per row), got {strength!r}")
  return [_check_factor(float(s), f"strength[{i}]")
          for i, s in enumerate(array)]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ControlVector:
  """A steering vector: one direction per block, added to the residual stream.

  Attributes:
    directions: ``{i: vector}`` keyed by the 0-based penzai_lm block index;
      ``vector`` (float32, shape ``(hidden_size,)``) is added to the residual
      stream after block ``i`` (``blocks.{i}.hook_resid_post``), at every
      position. Blocks without a key are left alone. In a llama.cpp file it
      is the tensor ``direction.{i}`` (same number). Values are copied to
      read-only float32 arrays, sorted by block.
    model_hint: Free-form name of the model the vector was made for
      (``controlvector.model_hint``; e.g. ``"llama"`` or ``"mistral"``), or
      None. Informational only: nothing checks it against a model.

  Raises:
    ValueError: on construction, if ``directions`` is empty, a key is not a
      non-negative integer, a vector is not 1-D real numbers, is empty or has
      NaN/inf values, or the vectors differ in size.
  """

  directions: dict[int, np.ndarray]
  model_hint: str | None = None

  def __post_init__(self):
    if not isinstance(self.directions, Mapping):
      raise ValueError(
          "directions must be a dict {block_index: vector}, got"
          f" {type(self.directions).__name__}"
      )
    if not self.directions:
      raise ValueError(
          "a ControlVector needs at least one direction (a dict"
          " {block_index: vector})"
      )
    checked = {}
    by_size = {}
    for key, value in self.directions.items():
      block = _block_index(key)
      if block in checked:
        raise ValueError(f"block {block} is given twice")
      checked[block] = _as_direction(block, value)
      by_size.setdefault(checked[block].shape[0], []).append(block)
    if len(by_size) > 1:
      described = "; ".join(
          f"size {size}: blocks {blocks}" for size, blocks in by_size.items()
      )
      raise ValueError(
          "all directions must have the same size (the model's hidden size),"
          f" got {described}"
      )
    if self.model_hint is not None and not isinstance(self.model_hint, str):
      raise ValueError(
          f"model_hint must be a str or None, got {self.model_hint!r}"
      )
    object.__setattr__(self, "directions", dict(sorted(checked.items())))
    object.__setattr__(self, "model_hint", self.model_hint or None)

  @property
  def hidden_size(self) -> int:
    """The length of every direction (the model's residual width)."""
    return next(iter(self.directions.values())).shape[0]

  @property
  def blocks(self) -> tuple[int, ...]:
    """The steered block indices, ascending."""
    return tuple(self.directions)

  def scaled(self, factor: float) -> ControlVector:
    """Returns every direction multiplied by ``factor`` (float32 arithmetic).

    This is what ``--control-vector-scaled FILE factor`` does to a file's
    vectors in llama.cpp. A negative factor steers the opposite way.

    Args:
      factor: A finite real number.

    Returns:
      A new ControlVector with the same blocks and model hint.
    """
    f = np.float32(_check_factor(factor))
    return ControlVector(
        directions={i: v * f for i, v in self.directions.items()},
        model_hint=self.model_hint,
    )

  def __add__(self, other: ControlVector) -> ControlVector:
    """Sums two control vectors block by block, as llama.cpp combines files.

    Blocks present in only one operand are kept as they are. The model hint
    is kept when both agree (or one is None); if they differ, a warning is
    issued and the left operand's hint is kept (as repeng does).

    Raises:
      ValueError: if the hidden sizes differ.
    """
    if not isinstance(other, ControlVector):
      return NotImplemented
    if other.hidden_size != self.hidden_size:
      raise ValueError(
          f"cannot add control vectors of hidden sizes {self.hidden_size} and"
          f" {other.hidden_size}: they are for different models (llama.cpp"
          " also refuses this combination)"
      )
    hint = self.model_hint
    if hint is None:
      hint = other.model_hint
    elif other.model_hint is not None and other.model_hint != hint:
      warnings.warn(
          f"adding control vectors with different model hints ({hint!r} and"
          f" {other.model_hint!r}); keeping {hint!r}",
          stacklevel=2,
      )
    directions = dict(self.directions)
    for i, v in other.directions.items():
      directions[i] = directions[i] + v if i in directions else v
    return ControlVector(directions=directions, model_hint=hint)

  def __radd__(self, other) -> ControlVector:
    # Lets ``sum(vectors)`` work (it starts from 0).
    if isinstance(other, numbers.Number) and other == 0:
      return self
    return NotImplemented

  def restricted(self, start: int, end: int) -> ControlVector:
    """Keeps only the blocks ``start <= i <= end`` (both ends inclusive).

    This is llama.cpp's ``--control-vector-layer-range START END``. The
    numbers are the same in both places: llama.cpp's layer ``il`` (and file
    tensor ``direction.{il}``) is penzai_lm block ``i = il``, so
    ``--control-vector-layer-range 10 20`` is ``restricted(10, 20)``. (In
    llama.cpp, ``START <= 0`` means 1 and ``END <= 0`` means the last layer;
    here ``start=0`` keeps block 0.)

    Args:
      start: First block kept (>= 0).
      end: Last block kept (>= start).

    Returns:
      A new ControlVector.

    Raises:
      ValueError: if the range is invalid or keeps no direction.
    """
    for name, value in (("start", start), ("end", end)):
      if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
      if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    if start > end:
      raise ValueError(f"empty layer range: start {start} > end {end}")
    kept = {i: v for i, v in self.directions.items() if start <= i <= end}
    if not kept:
      raise ValueError(
          f"no direction in blocks {start}..{end}; this vector has blocks"
          f" {list(self.blocks)}"
      )
    return ControlVector(directions=kept, model_hint=self.model_hint)

  def for_layers(self, num_layers: int) -> np.ndarray:
    """Stacks the directions for a model with ``num_layers`` blocks.

    Args:
      num_layers: The model's number of blocks.

    Returns:
      A float32 array ``(num_layers, hidden_size)``; row ``i`` is the vector
      added after block ``i``, zeros where there is no direction. For a
      stacked penzai_lm model, ``pz.nx.wrap(a).tag("blocks", "embedding")``.

    Raises:
      ValueError: if a direction is for a block ``>= num_layers`` (llama.cpp
        would silently ignore it; here it most likely means the vector is for
        another model; use :meth:`restricted` to drop such blocks).
    """
    if not _is_int(num_layers) or num_layers < 1:
      raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    too_deep = [i for i in self.directions if i >= num_layers]
    if too_deep:
      raise ValueError(
          f"directions for blocks {too_deep} but the model has only"
          f" {num_layers} blocks (0..{num_layers - 1}); the vector is probably"
          " for another model, or use"
          f" restricted(0, {num_layers - 1}) to drop them"
      )
    out = np.zeros((int(num_layers), self.hidden_size), dtype=np.float32)
    for i, v in self.directions.items():
      out[i] = v
    return out

  def apply(self, model, strength=1.0, *, where="all",
            batch_axis: str = "batch"):
    """Returns ``model`` steered by this vector (llama.cpp's
    ``--control-vector``): ``strength * directions[i]`` is added at
    ``blocks.{i}.resid_post`` for every block ``i`` of the vector, at the
    tokens ``where`` selects.

    On per-layer blocks each steered block gets an `AddVector`; in a layer
    stack one `AddVector` holds a direction per block along ``blocks`` (zero
    for blocks without one), which the stack's scan slices, so any vector
    (and any strength or rule: they are arrays) shares one compiled
    program. Both layouts compute the same thing.

    Args:
      model: A `TransformerLM` or `KVCachingTransformerLM` (patched or not).
      strength: A finite real factor (``apply(m, s)`` steers like
        ``scaled(s).apply(m)``), or one per row (a list or 1-D array:
        ``apply(m, [0, 4, 8])`` steers three prompts of one `generate` call
        by 0, 4 and 8; see `penzai_lm.interp.interventions` for rows).
      where: Which tokens: ``"all"`` (llama.cpp's behaviour), ``"prompt"``,
        ``"generated"`` or a `TokenRule` (which may itself be per row).
      batch_axis: The batch axis per-row strengths are tagged with.

    Returns:
      The steered model (the input is unchanged).

    Raises:
      ValueError: if the vector's size is not the model's hidden size, it
        has directions for blocks the model does not have, ``strength`` is
        not a finite real number or a 1-D list of them, or ``where`` is not
        a rule.
      TypeError: if ``model`` is not a penzai_lm model.
    """
    config = getattr(model, "config", None)
    if config is None:
      raise TypeError(
          "expected a penzai_lm TransformerLM or KVCachingTransformerLM, got"
          f" {type(model).__name__}"
      )
    strength = _check_strength(strength)
    if self.hidden_size != config.hidden_size:
      raise ValueError(
          f"the control vector has size {self.hidden_size} but the model's"
          f" hidden size is {config.hidden_size}: it is for another model"
          f" (model_hint={self.model_hint!r})"
      )
    stacked = self.for_layers(config.num_layers)  # Checks the blocks.

    def steer(vector):
      return interventions.AddVector.build(
          vector, strength=strength, where=where, batch_axis=batch_axis)

    hooks = points_lib.hook_points(model, "resid_post")
    if points_lib.is_stacked(hooks.get_sequence()[0]):
      vector = pz.nx.wrap(jnp.asarray(stacked)).tag("blocks", "embedding")
      return hooks.insert_before(steer(vector))
    for i, direction in self.directions.items():
      model = points_lib.insert_at(model, f"blocks.{i}.resid_post",
                                   steer(direction))
    return model

  def __eq__(self, other) -> bool:
    if not isinstance(other, ControlVector):
      return NotImplemented
    return (
        self.model_hint == other.model_hint
        and self.directions.keys() == other.directions.keys()
        and all(
            np.array_equal(v, other.directions[i])
            for i, v in self.directions.items()
        )
    )

  __hash__ = None  # Holds arrays.

  def __repr__(self) -> str:
    return (
        f"ControlVector(blocks={list(self.blocks)},"
        f" hidden_size={self.hidden_size}, model_hint={self.model_hint!r})"
    )
