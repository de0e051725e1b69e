"""Turns canonical (Hugging Face) tensors into the model's parameters.

The family adapter (`penzai_lm.loading.families`) maps tensor names and
layouts to parameter labels; this module reads the tensors one at a time,
casts them, stacks the blocks' tensors along ``blocks`` when the model uses
a layer stack, and places each finished parameter on the device before the
next one is read. Its conventions:

* Adapters look tensors up in a mapping that reads a tensor when it is
  looked up (`_Tensors`). Vectors (norm scales, biases) come as float32, so
  that an adapter's norm offset (Gemma's ``1 + w``) rounds once, as it
  always did; matrices come in the parameter dtype, and adapters only
  rearrange them (reshape, transpose, slice), which commutes with the cast.
  So the parameters are bitwise those of casting the float32 checkpoint,
  and a bfloat16 file loads as bfloat16 without a float32 copy.
* Every finished array is C-contiguous and 64-byte aligned
  (`penzai_lm.checkpoints.tensor_io`) and goes through one hook,
  ``place(label, axes, array) -> jax.Array`` (`Place`; by default
  `place_on_default_device`, which on CPU aliases the array instead of
  copying it). ``label`` is the full parameter label, ``axes`` its axis
  names: what a sharding rule needs.
* A layer-stacked parameter is one ``(num_layers, ...)`` buffer, filled
  layer by layer as the blocks are read and placed when full, so no
  per-layer copies are stacked afterwards. One block's tensors are in
  flight at a time.
* Tensors named in ``shape_only`` are not read: their parameters hold a
  ``jax.ShapeDtypeStruct``, for a caller that replaces them right away
  (``load(..., quantize="keep")`` puts the file's blocks there, so the
  float weights it would throw away never take memory).
* Parameters a `Taken` wants are handed to it as they are read, a stack's
  one layer at a time, and not kept: they too hold only their shapes
  (``load(..., quantize="int8")`` quantizes each layer's weights as it
  reads them, so no float stack is ever whole).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import collections
import dataclasses

import jax
import numpy as np
from penzai import pz

from penzai_lm.checkpoints import Checkpoint
from penzai_lm.checkpoints import LazyCheckpoint
from penzai_lm.checkpoints.tensor_io import aligned_empty
from penzai_lm.checkpoints.tensor_io import copy_into
from penzai_lm.checkpoints.tensor_io import is_aligned
from penzai_lm.loading.families import ADAPTERS
from penzai_lm.loading.families import FamilyAdapter
from penzai_lm.loading.families import adapter_for
from penzai_lm.model import TransformerConfig

# ``place(label, axes, array) -> jax.Array``: puts one finished parameter
# (a host array of the parameter dtype) where it belongs.
Place = Callable[[str, tuple[str, ...], np.ndarray], jax.Array]


def place_on_default_device(
    label: str, axes: tuple[str, ...], array: np.ndarray
) -> jax.Array:
  """The default `Place`: ``jax.device_put`` onto the default device."""
  del label, axes  # One device: nothing to decide.
  return jax.device_put(array)


@dataclasses.dataclass(frozen=True)
class Taken:
  """Parameters a caller consumes as they are read instead of keeping them.

  Attributes:
    wants: Whether it takes the parameter with this (full) label.
    take: ``take(label, axes, array)``: one finished array of it, each
      layer of a stack in turn (``axes`` without ``blocks``).
  """

  wants: Callable[[str], bool]
  take: Callable[[str, tuple[str, ...], np.ndarray], Any]


class _ShapeOnly(np.ndarray):
  """A tensor that is not read (`shape_only`): zero strides, no data.

  Adapters reshape, slice and transpose it like any array (views keep the
  class); the parameter made from it holds only its shape.
  """


def _shape_only(shape, dtype) -> _ShapeOnly:
  return np.broadcast_to(np.zeros((), dtype), shape).view(_ShapeOnly)


class _Tensors(Mapping[str, np.ndarray]):
  """A checkpoint's tensors for an adapter, read when looked up.

  Every lookup reads (and the caller owns) a new array: vectors as
  ``vector_dtype`` (None: as stored, for eager checkpoints), matrices as
  ``dtype``; names in ``shape_only`` give a `_ShapeOnly` array instead.
  """

  def __init__(self, source, dtype: np.dtype, vector_dtype,
               on_read: Callable[[int], Any], shape_only=frozenset()):
    self._source, self._dtype = source, dtype
    self._vector_dtype, self._on_read = vector_dtype, on_read
    self._shape_only = shape_only

  def __getitem__(self, name: str) -> np.ndarray:
    shape = self._source.shapes[name]
    dtype = self._vector_dtype if len(shape) <= 1 else self._dtype
    if name in self._shape_only:
      self._on_read(int(np.prod(shape)) * self._dtype.itemsize)
      return _shape_only(shape, dtype)
    array = self._source.read(name, dtype)
    self._on_read(array.size * self._dtype.itemsize)
    return array

  def __iter__(self) -> Iterator[str]:
    return iter(self._source.shapes)

  def __len__(self) -> int:
    return len(self._source.shapes)


class _EagerSource:
  """A `Checkpoint` read like a `LazyCheckpoint` (copies, not views)."""

  def __init__(self, checkpoint: Checkpoint):
    self.architecture = checkpoint.architecture
    self._tensors = checkpoint.tensors
    self.shapes = {n: tuple(t.shape) for n, t in checkpoint.tensors.items()}

  def read(self, name: str, dtype=None) -> np.ndarray:
    return np.array(self._tensors[name], dtype=dtype)  # None: as stored


def _finished(data: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """``data`` as a C-contiguous aligned array of ``dtype``; no copy if it is
  one already (a buffer the loader read and owns)."""
  data = np.asarray(data)
  if data.dtype == dtype and is_aligned(data):
    return data
  out = aligned_empty(data.shape, dtype)
  copy_into(out, data)
  return out


def _fill_stacks(adapter, config, tensors, dtype, stacks,
                 taken: Taken | None = None, prefix: str = "") -> None:
  """Reads the blocks one by one into ``stacks``: key -> (buffer, axes);
  what ``taken`` wants (by ``prefix + key``) goes to it instead, and its
  buffer holds only the shape."""
  n = config.num_layers
  wants = {}
  for i in range(n):
    layer = adapter.layer_tensors(config, tensors, i)
    if i and set(layer) != set(stacks):
      raise ValueError(
          f"Block {i} has parameters {sorted(layer)}, block 0"
          f" {sorted(stacks)}: they cannot be stacked."
      )
    for key in list(layer):
      data, axes = layer.pop(key)  # Dropped after the copy: one in flight.
      if i == 0:
        wants[key] = (taken is not None and taken.wants(prefix + key)
                      and not isinstance(data, _ShapeOnly))
        make = (_shape_only if isinstance(data, _ShapeOnly) or wants[key]
                else aligned_empty)
        stacks[key] = (make((n, *data.shape), dtype), tuple(axes))
      buffer = stacks[key][0]
      if tuple(data.shape) != buffer.shape[1:]:
        raise ValueError(
            f"Block {i}'s {key} has shape {tuple(data.shape)}, block 0's"
            f" {buffer.shape[1:]}: they cannot be stacked."
        )
      if isinstance(data, _ShapeOnly) != (
          isinstance(buffer, _ShapeOnly) and not wants[key]):
        raise ValueError(f"Block {i}'s {key} is read in some blocks and"
                         " not in others: it cannot be stacked.")
      if wants[key]:
        taken.take(prefix + key, tuple(axes), _finished(data, dtype))
      elif not isinstance(buffer, _ShapeOnly):
        copy_into(buffer[i], data)
      del data


def stream_parameters(
    source: LazyCheckpoint | Checkpoint,
    config: TransformerConfig,
    name: str = "transformer",
    *,
    adapters: Mapping[str, FamilyAdapter] = ADAPTERS,
    place: Place = place_on_default_device,
    on_read: Callable[[int], Any] = lambda nbytes: None,
    shape_only: frozenset[str] = frozenset(),
    taken: Taken | None = None,
) -> list[pz.Parameter]:
  """Parameters for ``build_transformer(config)``, one tensor at a time.

  Args:
    source: The checkpoint: a `LazyCheckpoint` (read as it goes) or a
      `Checkpoint`.
    config: The configuration derived from it.
    name: The model's parameter label prefix.
    adapters: Architecture name -> family adapter (default: the built-in
      ones).
    place: Puts each finished parameter on its device(s).
    on_read: Called with the bytes (in the parameter dtype) of each tensor
      read, e.g. a progress bar's ``update``.
    shape_only: Tensor (HF) names not to read: their parameters are
      ``pz.ParameterValue`` s of a ``jax.ShapeDtypeStruct`` of their shape,
      for the caller to put in place and replace.
    taken: Parameters handed to the caller as they are read (see `Taken`),
      which then hold only their shapes, like ``shape_only`` ones.

  Returns:
    Parameters to bind with ``pz.bind_variables`` (and the ``shape_only``
    placeholders).
  """
  adapter = adapter_for(source.architecture, adapters)
  dtype = np.dtype(config.parameter_dtype)
  if isinstance(source, Checkpoint):
    source, vector_dtype = _EagerSource(source), None
  else:
    vector_dtype = np.dtype(np.float32)
  tensors = _Tensors(source, dtype, vector_dtype, on_read,
                     frozenset(shape_only))

  def make(label, data, axes):
    label, axes = f"{name}/{label}", tuple(axes)
    # A whole tensor the caller takes (a stack's layers went to it one by
    # one in `_fill_stacks`, and its buffer is already shape-only).
    if taken is not None and taken.wants(label) and not isinstance(
        data, _ShapeOnly):
      taken.take(label, axes, _finished(data, dtype))
      data = _shape_only(data.shape, dtype)
    if isinstance(data, _ShapeOnly):  # A value (a Parameter would convert
      return pz.ParameterValue(value=pz.nx.NamedArray(  # it to an array).
          named_axes=collections.OrderedDict(zip(axes, data.shape)),
          data_array=jax.ShapeDtypeStruct(data.shape, dtype)), label=label)
    value = place(label, axes, _finished(data, dtype))
    return pz.Parameter(value=pz.nx.wrap(value).tag(*axes), label=label)

  params = []
  outside = adapter.global_tensors(config, tensors)
  for key in list(outside):
    params.append(make(key, *outside.pop(key)))
  if config.use_layer_stack:
    stacks = {}
    _fill_stacks(adapter, config, tensors, dtype, stacks, taken,
                 prefix=f"{name}/blocks/")
    for key in list(stacks):
      buffer, axes = stacks.pop(key)
      params.append(make(f"blocks/{key}", buffer, ("blocks", *axes)))
  else:
    for i in range(config.num_layers):
      layer = adapter.layer_tensors(config, tensors, i)
      for key in list(layer):
        params.append(make(f"block_{i}/{key}", *layer.pop(key)))
  return params


def parameters_from_checkpoint(
    checkpoint: Checkpoint | LazyCheckpoint,
    config: TransformerConfig,
    name: str = "transformer",
    *,
    adapters: Mapping[str, FamilyAdapter] = ADAPTERS,
) -> list[pz.Parameter]:
  """Parameters for a model built by ``build_transformer(config)``.

  Args:
    checkpoint: The checkpoint, in canonical (Hugging Face) form: read
      (`read_checkpoint`) or opened (`open_checkpoint`).
    config: The configuration derived from it.
    name: The model's parameter label prefix.
    adapters: Architecture name -> family adapter (default: the built-in
      ones).

  Returns:
    Parameters to bind with ``pz.bind_variables``, on the default device.
  """
  return stream_parameters(checkpoint, config, name, adapters=adapters)
