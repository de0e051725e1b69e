"""`QuantizedLinear`: a linear layer whose weight stays quantized.

It contracts ``in_axes`` of its input into ``out_axes``, like the
`pz.nn.Linear` it replaces. Its arrays are named arrays over ``quant_out``
(the N outputs, flattened in ``out_axes`` order), ``quant_in`` (the K
contracted values flattened in ``in_axes`` order, or K / 2 bytes of 4-bit
pairs) and ``quant_groups`` (scale groups along K), plus any stacking axis
(``blocks`` in a layer stack), so `pz.nn.LayerStack` and the engine slice
them like any other weight. Formats: `penzai_lm.quantization.formats`.

On CPU the engine sets ``use_cpu_kernel``: products of up to
`penzai_lm.kernels.layers.MAX_ROWS` rows (decoding), and with
``int8_activations`` prompts on AMX or on a weight in tiles (with VNNI),
read the quantized blocks in the kernels (so do Q4_0 and Q4_1 weights in
tiles with float activations: `penzai_lm.kernels.tiles.float_product`);
everything else dequantizes to the activations' dtype and contracts with
penzai's `contract` (on GPU, XLA fuses that), or on CPU in bfloat16 and
float32 as `penzai_lm.kernels.layers.kernel_contract` does.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import jax
import jax.numpy as jnp
from penzai import pz
from penzai.nn.linear_and_affine import contract

from penzai_lm.kernels import ops
from penzai_lm.kernels import tiles
from penzai_lm.kernels.layers import MAX_ROWS
from penzai_lm.kernels.layers import kernel_contract
from penzai_lm.quantization import formats
from penzai_lm.quantization import tiled

QUANT_AXES = tiled.ROW_AXES


def _static(**kwargs):
  return dataclasses.field(metadata={"pytree_node": False}, **kwargs)


def _flat_arrays(qs, scale, mins):
  """A quantized weight's parameters as ``[N, ...]`` jax arrays."""
  return tiled.flat_arrays(((qs, "quant_in"), (scale, "quant_groups"),
                            (mins, "quant_groups")), QUANT_AXES)


def _with_mins(arrays) -> list:
  """``(qs, scale)`` or ``(qs, scale, mins)`` as ``[qs, scale, mins or
  None]``."""
  qs, scale, *mins = arrays
  return [qs, scale, mins[0] if mins else None]


@pz.pytree_dataclass
class QuantizedLinear(pz.nn.Layer):
  """A linear layer with a quantized weight (see the module docstring).

  Attributes:
    qs: The quantized values (``quant_out``, ``quant_in``).
    scale: Scales (``quant_out``, ``quant_groups``).
    mins: Offsets of 4-bit formats (``quant_out``, ``quant_groups``), else
      None.
    in_axes: ``(name, size)`` of the contracted input axes, in the order K
      is flattened.
    out_axes: ``(name, size)`` of the output axes, in the order N is
      flattened.
    format: The weight layout (`penzai_lm.quantization.formats.LAYOUTS`).
    use_cpu_kernel: Run small products on the CPU kernels (set by the
      engine for models on one CPU device).
    tiled: ``qs`` and ``scale`` (and ``mins``) hold a Q4_0, Q8_0, Q4_1 or
      q8_16 weight in tiles of 16 outputs (`penzai_lm.kernels.tiles`; axes
      ``quant_tiles`` and ``quant_tile_bytes`` / ``quant_tile_scales``),
      which the int8-activation products, and Q4_0's and Q4_1's float
      products, read as one stream; ``mins`` is None but for Q4_1 and q8_16. A Q8_0
      weight of 5-bit values (Q5_0 blocks) lies in Q5_0 tiles. Everything
      else reads the weight back in rows. Set by `on_cpu_kernels` with
      ``int8_activations``, and for Q4_0 and Q4_1 on an AVX-512 CPU by
      `penzai_lm.quantization.quantize` (`ops.q4_float_tiles`).
    int8_activations: In the decode kernels (at most `MAX_ROWS` rows),
      quantize the activations to int8 blocks of 32 and take integer dot
      products (llama.cpp's scheme; `penzai_lm.kernels.ops.q8`): faster,
      and off by the activations' rounding. Prompts (`ops.GEMM_ROWS` rows
      or more) do the same on the AMX tiles where the CPU has them
      (`ops.int8_gemm_isa`), else on the weight's tiles (``tiled``) where
      the int8 dots have VNNI (`ops.int8_tile_prompts`), else run in
      float. Applies to every layout with ``K % 32 == 0``; other
      shapes ignore it. Set by
      ``penzai_lm.kernels.with_cpu_kernels(model, int8_activations=True)``.
  """

  qs: pz.ParameterLike[pz.nx.NamedArray]
  scale: pz.ParameterLike[pz.nx.NamedArray]
  mins: pz.ParameterLike[pz.nx.NamedArray] | None
  in_axes: tuple[tuple[str, int], ...] = _static()
  out_axes: tuple[tuple[str, int], ...] = _static()
  format: str = _static()
  use_cpu_kernel: bool = _static(default=False)
  int8_activations: bool = _static(default=False)
  tiled: bool = _static(default=False)

  def _arrays(self):
    """The weight's arrays as ``[N, ...]`` jax arrays, in rows."""
    if self.tiled:
      return _with_mins(tiles.from_tiles(*self._tiles()))
    return _flat_arrays(self.qs, self.scale, self.mins)

  def _tiles(self):
    """A tiled weight's ``qs``, ``scale`` (and ``mins``, Q4_1's and
    q8_16's) as ``[T, ...]`` jax arrays."""
    return tiled.tile_arrays(self.qs, self.scale, self.mins)

  def on_cpu_kernels(self, int8_activations: bool,
                     memo: dict | None = None, *,
                     donate: bool = False) -> QuantizedLinear:
    """This layer on the CPU kernels (`penzai_lm.kernels.with_cpu_kernels`
    calls it, with one ``memo`` per call, and ``donate``:
    `tiled.tiled_params`):
    ``use_cpu_kernel`` set, and with ``int8_activations`` that too, and a
    weight of ``N % 16 == 0`` outputs and ``K % 32 == 0`` in a format
    `penzai_lm.kernels.tiles` holds moved into tiles (``tiled``)."""
    if not int8_activations:
      return dataclasses.replace(self, use_cpu_kernel=True)
    return tiled.into_tiles(
        dataclasses.replace(self, use_cpu_kernel=True, int8_activations=True),
        memo, donate)

  def in_rows(self) -> QuantizedLinear:
    """This layer with its weight in rows (``tiled`` off), as `quantize`
    makes it where it keeps rows: for reading the blocks or saving them
    (new arrays, the same labels; the layer itself if already in rows). A
    whole model: `penzai_lm.quantization.in_rows`."""
    if not self.tiled:
      return self
    qs, scale, mins = tiled.rows_params(self.qs, self.scale, self.mins,
                                        self.format)
    return dataclasses.replace(self, qs=qs, scale=scale, mins=mins,
                               tiled=False)

  def dequantized(self, dtype=jnp.float32) -> pz.nx.NamedArray:
    """The weight as a float named array over ``in_axes`` and ``out_axes``."""
    return self._named(*self._arrays(), dtype)

  def _named(self, qs, scale, mins, dtype,
             kernel: bool = False) -> pz.nx.NamedArray:
    if kernel and self.format in formats.FOUR_BIT:
      # The same values, faster than XLA:CPU's own (8-bit layouts: as fast;
      # docs/design.md). Q4_0's offsets are -8 scales (formats.py).
      if self.format == "q4_0":
        mins = scale * -8
      w = ops.dequantize(qs, scale, mins).astype(dtype)
    else:
      w = formats.dequantize(qs, scale, mins, self.format, dtype)
    return self._tagged(w)

  def _tagged(self, w) -> pz.nx.NamedArray:
    """An ``[N, K]`` float weight as a named array."""
    sizes = [s for _, s in self.out_axes] + [s for _, s in self.in_axes]
    names = [a for a, _ in self.out_axes] + [a for a, _ in self.in_axes]
    return pz.nx.wrap(w.reshape(sizes)).tag(*names)

  def _kernel_product(self, flat, x8: bool):
    """``flat @ w.T`` on the kernels for the weight in rows."""
    qs, scale, mins = self._arrays()
    if self.format in formats.FOUR_BIT:
      # Q4_0's mins are -8 scales: the kernels derive them, unread.
      return ops.q4(flat, qs, scale, None if self.format == "q4_0" else mins,
                    int8_activations=x8)
    if mins is not None:
      return ops.q8_16(flat, qs, scale, mins, int8_activations=x8)
    return ops.q8(flat, qs, scale, int8_activations=x8)

  def _rows_out(self, x: pz.nx.NamedArray, row_axes: list[str],
                y: jax.Array) -> pz.nx.NamedArray:
    """``y: f32[rows, N]`` as x's row axes and this layer's output axes."""
    shape = [x.named_shape[a] for a in row_axes] + [
        s for _, s in self.out_axes]
    return pz.nx.NamedArray(
        named_axes=collections.OrderedDict(
            [(a, x.named_shape[a]) for a in row_axes]
            + list(self.out_axes)),
        data_array=y.astype(x.dtype).reshape(shape))

  def __call__(self, x: pz.nx.NamedArray, **_unused_side_inputs):
    in_names = [a for a, _ in self.in_axes]
    for name, size in self.in_axes:
      if x.named_shape.get(name) != size:
        raise ValueError(
            f"QuantizedLinear ({self.qs.label}) contracts {name!r} of size"
            f" {size}; its input has axes {dict(x.named_shape)}.")
    row_axes = [a for a in x.named_axes if a not in in_names]
    rows = math.prod(x.named_shape[a] for a in row_axes)
    # Decoding on the kernels, and with int8_activations a prompt's rows
    # too: on the AMX tiles where the CPU has them (`ops.int8_gemm_isa`),
    # else on the weight's tiles of 16 outputs where the int8 dots have
    # VNNI (`tiled`, `ops.int8_tile_prompts`: 4x XLA's float GEMM on its
    # dequantized weight, docs/cpu-speed.md). Other prompts stay in float
    # (below): Q4_0 and Q4_1 in tiles on `tiles.float_gemm`, the rest on
    # XLA's GEMM; there the int8 products in rows were 25-35% slower, and
    # in tiles without VNNI slower too.
    k = math.prod(s for _, s in self.in_axes)
    groups = (k // 16,) if self.format == "q8_16" else (1, k // 32)
    x8 = self.int8_activations and k % 32 == 0 and (
        self.tiled or self.scale.value.named_shape["quant_groups"] in groups)
    prompt_x8 = (self.use_cpu_kernel and x8 and rows >= ops.GEMM_ROWS
                 and ops.int8_gemm_isa() == "amx")
    in_tiles = self.tiled and x8 and not prompt_x8 and (
        rows <= MAX_ROWS or ops.int8_tile_prompts())
    if (self.use_cpu_kernel and not x.positional_shape
        and (0 < rows <= MAX_ROWS or prompt_x8 or (rows > 0 and in_tiles))):
      flat = x.order_as(*row_axes, *in_names).data_array.reshape(rows, k)
      if in_tiles:
        y = tiles.product(flat, *self._tiles())
      elif self.tiled and self.format in tiles.FLOAT_FORMATS and not x8:
        y = tiles.float_product(flat, *self._tiles())  # float activations
      else:
        y = self._kernel_product(flat, x8)
      return self._rows_out(x, row_axes, y)
    if not self.use_cpu_kernel:
      return contract(in_names, x, self.dequantized(x.dtype))
    # A prefill on CPU: Q4_0 and Q4_1 in tiles on a GEMM that decodes the
    # tiles as it goes; the rest on XLA's GEMM (below).
    if (self.tiled and self.format in tiles.FLOAT_FORMATS
        and not x.positional_shape and ops.float_gemm()):
      qs, scale, *mins = self._tiles()
      flat = x.order_as(*row_axes, *in_names).data_array.reshape(rows, k)
      y = tiles.float_gemm(flat, qs, scale, *mins)
      return self._rows_out(x, row_axes, y)
    # XLA's GEMM on the rows (WIDE_DTYPES). The weight is
    # dequantized from a scale copied once the input is ready: left free,
    # XLA:CPU's scheduler dequantized every layer's weights up front, all
    # alive at once, their pages faulted in afresh on every call (see
    # docs/design.md).
    if self.tiled:  # dequantized from the tiles as they lie
      qs, scale, *mins = self._tiles()
      w = self._tagged(tiles.dequantize(
          qs, ops.after(x.data_array, scale), *mins).astype(x.dtype))
    else:
      qs, scale, mins = self._arrays()
      w = self._named(qs, ops.after(x.data_array, scale), mins, x.dtype,
                      kernel=True)
    y = kernel_contract(in_names, x, w)
    return contract(in_names, x, w) if y is None else y


@pz.pytree_dataclass
class QuantizedEmbeddingLookup(pz.nn.Layer):
  """Token embeddings read from the quantized rows of a tied table.

  `penzai_lm.quantization.quantize` puts it in place of the
  `pz.nn.EmbeddingLookup` of a model whose tied unembedding it quantizes:
  it holds that `QuantizedLinear`'s parameters (the same values, so the
  model keeps no float table at all: SmolLM2's is 113 MB in float32,
  Gemma 3 270M's 671 MB) and dequantizes the rows of the tokens it looks
  up, as llama.cpp reads a quantized ``token_embd``.

  Attributes:
    qs: The tied `QuantizedLinear`'s ``qs`` (``quant_out`` is the
      vocabulary).
    scale: Its ``scale``.
    mins: Its ``mins``, or None.
    embedding_axes: ``(name, size)`` of the embedding axes, in the order K
      is flattened (the tied layer's ``in_axes``).
    format: The weight layout.
    dtype: The embeddings' dtype (the float table's).
    use_cpu_kernel: Gather the rows with the CPU row kernel (set by the
      engine, as for `QuantizedLinear`).
    tiled: The table lies in tiles of 16 rows, as its unembedding holds it
      on the int8-activation kernels (`on_cpu_kernels`: one copy for both);
      the rows are gathered from the tiles.
  """

  qs: pz.ParameterLike[pz.nx.NamedArray]
  scale: pz.ParameterLike[pz.nx.NamedArray]
  mins: pz.ParameterLike[pz.nx.NamedArray] | None
  embedding_axes: tuple[tuple[str, int], ...] = _static()
  format: str = _static()
  dtype: str = _static()
  use_cpu_kernel: bool = _static(default=False)
  tiled: bool = _static(default=False)

  def on_cpu_kernels(self, int8_activations: bool,
                     memo: dict | None = None, *,
                     donate: bool = False) -> QuantizedEmbeddingLookup:
    """This layer on the CPU kernels, as `QuantizedLinear.on_cpu_kernels`:
    with ``int8_activations`` a table in a format of the tiles moves into
    the tiles its unembedding takes (the same arrays, through ``memo``)."""
    layer = dataclasses.replace(self, use_cpu_kernel=True)
    return tiled.into_tiles(layer, memo, donate) if int8_activations else layer

  def __call__(self, token_index: pz.nx.NamedArray, **_unused_side_inputs):
    if token_index.positional_shape:
      raise ValueError("QuantizedEmbeddingLookup takes token ids with named"
                       f" axes only; got {token_index!r}.")
    ids = token_index.data_array.reshape(-1).astype(jnp.int32)
    if self.tiled:
      return self._embeddings(token_index, _with_mins(tiles.rows(
          ids, *tiled.tile_arrays(self.qs, self.scale, self.mins))))
    if self.use_cpu_kernel:
      take = ops.rows
    else:
      take = lambda table, index: table[index]  # pylint: disable=unnecessary-lambda-assignment
    rows = [None if a is None else take(a, ids)
            for a in _flat_arrays(self.qs, self.scale, self.mins)]
    return self._embeddings(token_index, rows)

  def _embeddings(self, token_index, rows) -> pz.nx.NamedArray:
    """The looked-up tokens' embeddings from their rows' arrays."""
    embeddings = formats.dequantize(*rows, self.format, jnp.dtype(self.dtype))
    return pz.nx.NamedArray(
        named_axes=collections.OrderedDict(
            list(token_index.named_axes.items()) + list(self.embedding_axes)),
        data_array=embeddings.reshape(
            *token_index.data_array.shape,
            *[s for _, s in self.embedding_axes]))
