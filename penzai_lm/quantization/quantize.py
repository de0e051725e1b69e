"""`quantize(model, format)`: a model's projections as quantized layers.

Every `pz.nn.Linear` that contracts an axis (the attention and MLP
projections, an untied ``lm_head``) and the tied unembedding
(`pz.nn.EmbeddingDecode`) become `QuantizedLinear` layers, and the lookup
of a tied table reads its rows from the quantized unembedding
(`QuantizedEmbeddingLookup`: no float table is kept); norms and everything
else keep their float weights. The model
keeps its structure otherwise (layer stacks, hooks, labels with ``.qs`` /
``.scale`` / ``.mins`` in place of ``.weights``), so `pz.select` patches,
captures and the engine work on it as on the float model.

On a CPU whose kernels take Q4_0 and Q4_1 with float activations in tiles
of 16 outputs (`penzai_lm.kernels.ops.q4_float_tiles`: AVX-512), those
weights lie in the tiles (``tiled``), as llama.cpp repacks Q4_0 when it
loads it: one copy, read by the decode products, the prompts'
dequantization and a tied table's lookup alike.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.checkpoints.tensor_io import aligned_empty
from penzai_lm.kernels import ops
from penzai_lm.kernels import tiles
from penzai_lm.quantization import formats
from penzai_lm.quantization import tiled
from penzai_lm.quantization.layers import QuantizedEmbeddingLookup
from penzai_lm.quantization.layers import QuantizedLinear

# A format, or label -> a format, the weight of each stacked layer (kept
# blocks, `gguf_formats.kept_weights`), or None (leave the layer as it is).
FormatChoice = str | Callable[[str], str | list[formats.QuantizedWeight]
                              | None]


def _kept_parts(value, stack, out_names, in_names, parts, label):
  """``parts`` (one weight per stacked layer), checked against ``value``."""
  sizes = value.named_shape
  layers = int(np.prod([sizes[a] for a in stack]))
  shape = (int(np.prod([sizes[a] for a in out_names])),
           int(np.prod([sizes[a] for a in in_names])))
  if len(parts) != layers or any(p.shape != shape for p in parts):
    raise ValueError(
        f"{label}: {layers} weights of shape {shape} were wanted, and"
        f" {[p.shape for p in parts]} were given.")
  if len({p.format for p in parts}) != 1:
    raise ValueError(f"{label}: the layers of a stack share one layout;"
                     f" got {sorted({p.format for p in parts})}.")
  return parts


def quantized_targets(model) -> dict[str, tuple[tuple[str, ...],
                                                 tuple[str, ...] | None]]:
  """The weights `quantize` turns into quantized ones, by label: ``(output
  axes, contracted axes)`` (None, for a table: every axis but its
  rows). Works on a model whose weights are still slots."""
  targets = {}
  for layer in pz.select(model).at_instances_of(pz.nn.Linear).where(
      lambda layer: bool(layer.in_axis_names)).get_sequence():
    targets[layer.weights.label] = (tuple(layer.out_axis_names),
                                    tuple(layer.in_axis_names))
  for layer in pz.select(model).at_instances_of(
      pz.nn.EmbeddingDecode).get_sequence():
    targets[layer.table.embeddings.label] = (
        (layer.table.vocabulary_axis,), None)
  return targets


def quantize_array(array: np.ndarray, axes: tuple[str, ...],
                   out_names: tuple[str, ...],
                   in_names: tuple[str, ...] | None, format: str,  # pylint: disable=redefined-builtin
                   label: str) -> list[formats.QuantizedWeight]:
  """One `formats.QuantizedWeight` per stacked layer of a float weight
  whose dimensions are named ``axes`` (what `quantize` makes of it)."""
  if in_names is None:  # A table: everything but the rows is contracted.
    in_names = tuple(a for a in axes if a not in out_names)
  stack = [a for a in axes if a not in (*out_names, *in_names)]
  order = [axes.index(a) for a in (*stack, *out_names, *in_names)]
  sizes = dict(zip(axes, array.shape))
  # A weight on a GPU is quantized there (`formats.quantize`).
  xp = jnp if formats.on_accelerator(array) else np
  data = xp.transpose(array, order).reshape(
      int(np.prod([sizes[a] for a in stack])),
      int(np.prod([sizes[a] for a in out_names])),
      int(np.prod([sizes[a] for a in in_names])))
  try:
    return [formats.quantize(w, format) for w in data]
  except ValueError as e:
    raise ValueError(f"{label}: {e}") from e


def _quantized_layer(param, in_names, out_names, choice, base):
  """A `QuantizedLinear` for the weight parameter ``param`` (``choice``: a
  format, or the kept weight of each stacked layer); its parameters are
  labeled ``{base}.qs`` etc."""
  if isinstance(param, pz.ParameterSlot) or not hasattr(param, "value"):
    raise ValueError(f"cannot quantize {param!r}: bind its weights first.")
  value = param.value
  stack = [a for a in value.named_axes if a not in (*in_names, *out_names)]
  if isinstance(choice, str):
    axes = tuple(value.named_axes)
    array = value.order_as(*axes).data_array
    parts = quantize_array(
        array if formats.on_accelerator(array) else np.asarray(array), axes,
        out_names, in_names, choice, param.label)
  else:
    parts = _kept_parts(value, stack, out_names, in_names, list(choice),
                        param.label)
  fmt = parts[0].format
  sizes = value.named_shape
  stack_axes = [(a, sizes[a]) for a in stack]
  wrap = type(param) if isinstance(param, pz.Parameter) else pz.ParameterValue

  def named(arrays, second, suffix):
    if formats.on_accelerator(arrays[0]):  # quantized on a GPU: stays there
      data = jnp.stack(arrays).reshape(*[s for _, s in stack_axes],
                                       *arrays[0].shape)
      return wrap(value=pz.nx.wrap(data).tag(*stack, "quant_out", second),
                  label=f"{base}.{suffix}")
    # One copy, into an aligned buffer that the device array then aliases
    # on CPU (np.stack + jnp.asarray would make two).
    first = np.asarray(arrays[0])
    data = aligned_empty((len(arrays), *first.shape), first.dtype)
    for i, a in enumerate(arrays):
      data[i] = np.asarray(a)
    data = data.reshape(*[s for _, s in stack_axes], *first.shape)
    array = pz.nx.wrap(jax.device_put(data)).tag(*stack, "quant_out", second)
    return wrap(value=array, label=f"{base}.{suffix}")

  mins = None
  if parts[0].mins is not None:
    mins = named([p.mins for p in parts], "quant_groups", "mins")
  return QuantizedLinear(
      qs=named([p.qs for p in parts], "quant_in", "qs"),
      scale=named([p.scale for p in parts], "quant_groups", "scale"),
      mins=mins,
      in_axes=tuple((a, sizes[a]) for a in in_names),
      out_axes=tuple((a, sizes[a]) for a in out_names),
      format=fmt)


def in_rows(model):
  """``model`` with every quantized weight that lies in the kernels' tiles
  back in rows (`QuantizedLinear.in_rows`; a tied table's lookup and
  unembedding share one set): the layout `penzai_lm.shard` splits and a
  reader of the blocks expects. New arrays; ``model`` keeps its tiles."""
  made = {}  # the tiles' qs array's id -> (it, the rows' parameters)

  def back(layer):
    key = id(layer.qs.value.data_array)
    if key not in made:
      made[key] = (layer.qs.value.data_array, tiled.rows_params(
          layer.qs, layer.scale, layer.mins, layer.format))
    qs, scale, mins = made[key][1]
    return dataclasses.replace(layer, qs=qs, scale=scale, mins=mins,
                               tiled=False)

  return (pz.select(model)
          .at_instances_of((QuantizedLinear, QuantizedEmbeddingLookup))
          .where(lambda layer: layer.tiled).apply(back))


def quantize(model, format: FormatChoice = "int8", *,  # pylint: disable=redefined-builtin
             cpu_tiles: bool = True):
  """Returns ``model`` with its projections quantized.

  Args:
    model: A model with bound weights (e.g. from `penzai_lm.load`).
    format: A weight format (`penzai_lm.quantization.FORMATS`: "int8",
      "q8_0", "q4_0", "q4_1"), or a function from a layer's weight label to
      a format, to the `QuantizedWeight` of each of its stacked layers
      (`penzai_lm.quantization.kept_weights` gives a GGUF file's own), or
      to None (leave that layer in float).
    cpu_tiles: Put the Q4_0 and Q4_1 weights made on the CPU in the
      kernels' tiles where they take them there (`ops.q4_float_tiles`), the rows
      of each deleted once its tiles are made. False keeps rows
      (`penzai_lm.load` does, for a model that goes to a mesh).

  Raises:
    ValueError: for an unknown format, a model with nothing to quantize,
      or a weight whose contracted size a block format cannot split.
  """
  choose = format if callable(format) else (lambda label: format)
  if not callable(format) and format not in formats.FORMATS:
    raise ValueError(f"unknown weight format {format!r}; choose one of"
                     f" {formats.FORMATS}.")
  count = 0
  memo = {}  # Tiles made so far (a tied table's lookup shares them).

  def in_tiles(layer: QuantizedLinear) -> QuantizedLinear:
    """``layer`` (this call's own) with a Q4_0 or Q4_1 weight on the CPU in
    tiles, where the kernels take it there."""
    if not (cpu_tiles and layer.format in tiles.FLOAT_FORMATS
            and tiled.on_host(layer.qs.value.data_array)
            and ops.available() and ops.q4_float_tiles()):
      return layer
    return tiled.into_tiles(layer, memo, donate=True)

  def linear(layer: pz.nn.Linear):
    nonlocal count
    fmt = choose(layer.weights.label)
    if fmt is None:
      return layer
    count += 1
    return in_tiles(_quantized_layer(
        layer.weights, layer.in_axis_names, layer.out_axis_names, fmt,
        layer.weights.label.removesuffix(".weights")))

  tied = {}  # Table label -> its quantized unembedding.

  def decode(layer: pz.nn.EmbeddingDecode):
    nonlocal count
    table = layer.table
    param = table.embeddings
    fmt = choose(param.label)
    if fmt is None:
      return layer
    count += 1
    in_names = tuple(a for a in param.value.named_shape
                     if a != table.vocabulary_axis)
    tied[param.label] = in_tiles(_quantized_layer(
        param, in_names, (table.vocabulary_axis,), fmt,
        f"{param.label.removesuffix('.embeddings')}/decode"))
    return tied[param.label]

  def lookup(layer: pz.nn.EmbeddingLookup):
    # The lookup reads the unembedding's rows: no float table is kept.
    q = tied[layer.table.embeddings.label]
    return QuantizedEmbeddingLookup(
        qs=q.qs, scale=q.scale, mins=q.mins, embedding_axes=q.in_axes,
        format=q.format, dtype=jnp.dtype(
            layer.table.embeddings.value.dtype).name, tiled=q.tiled)

  model = (pz.select(model).at_instances_of(pz.nn.Linear)
           .where(lambda layer: bool(layer.in_axis_names))
           .apply(linear))
  model = pz.select(model).at_instances_of(pz.nn.EmbeddingDecode).apply(
      decode)
  model = (pz.select(model).at_instances_of(pz.nn.EmbeddingLookup)
           .where(lambda layer: layer.table.embeddings.label in tied)
           .apply(lookup))
  if not count:
    raise ValueError("the model has no projections to quantize (no"
                     " pz.nn.Linear contracts an axis, and no"
                     " EmbeddingDecode); is it a penzai_lm model?")
  return model
