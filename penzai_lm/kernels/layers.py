"""Layers that run decoding's small products on penzai_lm's CPU kernels.

`KernelLinear` and `KernelEmbeddingDecode` are `pz.nn.Linear` and
`pz.nn.EmbeddingDecode` (subclasses: the same weights, fields and
selections) whose products with at most `MAX_ROWS` rows of activations
(decoding) go to `penzai_lm.kernels.ops`. Larger bfloat16 and float32
products (prefill) become one ``dot_general`` with float32 results, which
XLA runs on its native GEMMs (`WIDE_DTYPES`); other larger ones and
anything the kernels do not cover (parallel axes, views, other dtypes) use
penzai's own contraction. `KernelEmbeddingLookup` copies embedding rows in
a kernel. The engine swaps them in for models on one CPU device
(`with_cpu_kernels`); user models are never changed in place.

Axis conventions: a weight whose data lists the contracted axes first is
"in-major" (``[K, N]``, how penzai's own layers lay out projections), one
that lists them last is "out-major" (``[N, K]``: loaded projections, as
checkpoints store them, and embedding tables). Either is read as it lies,
with no transpose.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from penzai import pz

from penzai_lm.kernels import build
from penzai_lm.kernels import ops
from penzai_lm.kernels.attention import KernelCachedAttention
from penzai_lm.model.cache_attention import InPlaceKVCachingAttention
from penzai_lm.model.devices import devices_of

# Weight dtypes whose products go to the kernels. For 16-bit weights XLA
# first writes a float32 copy. float32 weights decode faster end to end on
# the kernels (with decode attention in a kernel too), although the
# products alone are slower than XLA's at one row. See docs/design.md.
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                 jnp.dtype(jnp.float32))

# Rows up to which the kernels beat XLA's GEMM: above a few dozen rows a
# product is compute-bound and XLA's blocked GEMM wins.
MAX_ROWS = 16

# Larger bfloat16 and float32 products (prefill) are written as one matrix
# product with float32 results and the rows first. In bfloat16 XLA:CPU then
# runs them on YNNPACK's bf16 dot where the CPU has bf16 instructions, and
# on float32 copies of both operands where it has not
# (`wide_bf16_in_float32`). For float32 weights in the
# loaders' output-major order, penzai's contraction lets XLA copy every
# weight transposed; this product reads them as they lie. float16 gains
# nothing and keeps penzai's contraction. See docs/design.md.
WIDE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@functools.cache
def wide_bf16_in_float32() -> bool:
  """Whether the larger bfloat16 products convert both operands to float32
  before XLA's dot: on an x86-64 CPU without ``avx512_bf16`` or
  ``amx_bf16``. There YNNPACK's bf16 dot has no bf16 instructions to run
  on, and on an AVX2-only CPU it ran ~1.5x slower than the float32 dot on
  converted operands (docs/design.md). The products are the same: bfloat16
  values and their pairwise products are exact in float32."""
  flags = build.cpu_flags()
  return bool(flags) and not {"avx512_bf16", "amx_bf16"} & flags


def kernel_contract(names, left, right):
  """penzai's ``contract(names, left, right)`` through the kernels, where
  ``right`` (a weight) has exactly ``names`` plus output axes; None where
  the kernels do not apply."""
  if not (isinstance(left, pz.nx.NamedArray)
          and isinstance(right, pz.nx.NamedArray)):
    return None
  if (left.positional_shape or right.positional_shape or not names
      or jnp.dtype(right.dtype) not in KERNEL_DTYPES):
    return None
  axes, k = list(right.named_axes), len(names)
  if set(axes[:k]) == set(names):
    out_major, in_axes, out_axes = False, axes[:k], axes[k:]
  elif set(axes[-k:]) == set(names):
    out_major, in_axes, out_axes = True, axes[-k:], axes[:-k]
  else:
    return None
  if (not set(names) <= set(left.named_shape)
      or set(out_axes) & set(left.named_shape)):
    return None
  row_axes = [a for a in left.named_axes if a not in names]
  rows = math.prod(left.named_shape[a] for a in row_axes)
  wide = rows > MAX_ROWS
  same_wide_dtype = (jnp.dtype(left.dtype) == jnp.dtype(right.dtype)
                     and jnp.dtype(right.dtype) in WIDE_DTYPES)
  if rows == 0 or (wide and not same_wide_dtype):
    return None
  sizes = right.named_shape
  n_in = math.prod(sizes[a] for a in in_axes)
  n_out = math.prod(sizes[a] for a in out_axes)
  x = left.order_as(*row_axes, *in_axes).data_array.reshape(rows, n_in)
  w = right.data_array.reshape(
      (n_out, n_in) if out_major else (n_in, n_out))
  if wide:
    if jnp.dtype(x.dtype) == jnp.bfloat16 and wide_bf16_in_float32():
      x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    y = jax.lax.dot_general(
        x, w, (((1,), (1,) if out_major else (0,)), ((), ())),
        preferred_element_type=jnp.float32)
  else:
    y = ops.dense(x, w, out_major=out_major)
  y = y.astype(jnp.result_type(left.dtype, right.dtype)).reshape(
      *(left.named_shape[a] for a in row_axes),
      *(sizes[a] for a in out_axes))
  return pz.nx.NamedArray(
      named_axes=collections.OrderedDict(
          [(a, left.named_shape[a]) for a in row_axes]
          + [(a, sizes[a]) for a in out_axes]),
      data_array=y)


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # pylint: disable=unexpected-keyword-arg
class KernelLinear(pz.nn.Linear):
  """A `pz.nn.Linear` whose small products run on the CPU kernels."""

  def __call__(self, in_array, **side_inputs):
    out = kernel_contract(self.in_axis_names, in_array, self.weights.value)
    return super().__call__(in_array, **side_inputs) if out is None else out


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # pylint: disable=unexpected-keyword-arg
class KernelEmbeddingDecode(pz.nn.EmbeddingDecode):
  """A `pz.nn.EmbeddingDecode` whose small products run on the kernels."""

  def __call__(self, out_embeddings, **side_inputs):
    table = self.table.embeddings.value
    names = tuple(a for a in table.named_shape
                  if a != self.table.vocabulary_axis)
    out = kernel_contract(names, out_embeddings, table)
    if out is None:
      return super().__call__(out_embeddings, **side_inputs)
    return out


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # pylint: disable=unexpected-keyword-arg
class KernelEmbeddingLookup(pz.nn.EmbeddingLookup):
  """A `pz.nn.EmbeddingLookup` that gathers whole rows of a vocabulary-major
  table.

  penzai's lookup indexes the table per token (a vmapped index) and returns
  the embedding axes first. For a bfloat16 table XLA:CPU compiles that
  gather as a float32, transposed copy of the whole table, hoisted out of
  the decode loop but made on every decode call (integer bitcasts, which
  help cache writes, do not: XLA copies the bitcast table). This one copies
  the rows it needs in a kernel (`ops.rows`) and returns the token axes
  first, as the blocks lay out the residual stream.
  """

  def __call__(self, token_index, **side_inputs):
    table = self.table.embeddings.value
    vocab = self.table.vocabulary_axis
    if not (isinstance(table, pz.nx.NamedArray)
            and isinstance(token_index, pz.nx.NamedArray)
            and not table.positional_shape
            and not token_index.positional_shape
            and next(iter(table.named_axes)) == vocab
            and not set(token_index.named_shape) & set(table.named_shape)):
      return super().__call__(token_index, **side_inputs)
    data = table.data_array.reshape(table.data_array.shape[0], -1)
    rows = ops.rows(data, token_index.data_array).reshape(
        *token_index.data_array.shape, *table.data_array.shape[1:])
    return pz.nx.NamedArray(
        named_axes=collections.OrderedDict(
            list(token_index.named_axes.items())
            + list(table.named_axes.items())[1:]),
        data_array=rows)


def on_one_cpu(model) -> bool:
  """Whether every array of ``model`` is on one and the same CPU device."""
  devices = devices_of(model)
  return (devices is not None and len(devices) <= 1
          and all(d.platform == "cpu" for d in devices))


def with_cpu_kernels(model, *, int8_activations: bool = False,
                     donate: bool = False):
  """``model`` with its plain Linear, EmbeddingLookup and EmbeddingDecode
  layers replaced by their kernel versions, its plain cached attention layers by
  `KernelCachedAttention`, and every layer with a ``use_cpu_kernel`` field
  (`penzai_lm.quantization.QuantizedLinear`) switched on; unchanged if the
  kernels are unavailable.

  Args:
    model: A penzai model.
    int8_activations: Also switch on the ``int8_activations`` field of the
      layers that have one (quantized layers: their small products then
      quantize the activations to int8 blocks, `ops.q8`, and so do their
      prompts where the CPU has AMX tiles, `ops.int8_gemm_isa`, or the
      weight lies in tiles and the int8 dots have VNNI,
      `ops.int8_tile_prompts`). Layers already on the kernels keep their
      setting unless this is set. Q4_0, Q8_0, Q4_1 and q8_16 weights (and
      Q8_0 weights of 5-bit values, Q5_0's) move into the kernels' tiles
      (`penzai_lm.kernels.tiles`): new arrays, made while ``model`` still
      holds its own.
    donate: With ``int8_activations``, delete each weight's arrays as it
      moves into tiles, as JAX deletes donated buffers, so that memory
      never holds both copies: ``model`` can no longer run. For
      ``model = with_cpu_kernels(model, int8_activations=True,
      donate=True)``.

  Raises:
    ValueError: For ``donate`` without ``int8_activations`` (nothing would
      move, so nothing would be deleted).
  """
  if donate and not int8_activations:
    raise ValueError(
        "with_cpu_kernels: donate=True deletes the weights that move into"
        " the kernels' tiles, which only int8_activations=True moves; pass"
        " int8_activations=True too, or leave donate off.")
  if not ops.available():
    return model
  model = (pz.select(model).at_instances_of(InPlaceKVCachingAttention)
           .where(lambda layer: type(layer) is InPlaceKVCachingAttention)
           .apply(KernelCachedAttention.swap))
  # One pass over the tree for the layer swaps (each whole-tree selection
  # rebuilds the model). None of these layers holds another. Layers that
  # know how to go on the kernels (`on_cpu_kernels`: the quantized ones,
  # whose weights may move into the kernels' tiles) go through again with
  # int8_activations, so that a tied table's lookup and unembedding share
  # one set of tiles (`memo`).
  memo = {}
  return (pz.select(model).at_subtrees_where(
      lambda x: (type(x) in _SWAPS
                 or getattr(x, "use_cpu_kernel", None) is False
                 or (int8_activations and hasattr(x, "on_cpu_kernels"))
                 or (int8_activations
                     and getattr(x, "int8_activations", None) is False)))
          .apply(functools.partial(_kernel_layer, memo=memo, donate=donate,
                                   int8_activations=int8_activations)))


def _kernel_layer(layer, int8_activations: bool, memo: dict, donate: bool):
  swap = _SWAPS.get(type(layer))
  if swap is not None:
    return swap(layer)
  # A layer with a ``use_cpu_kernel`` field; one that knows how to go on the
  # kernels says so.
  if hasattr(layer, "on_cpu_kernels"):
    return layer.on_cpu_kernels(
        int8_activations or getattr(layer, "int8_activations", False), memo,
        donate=donate)
  if int8_activations and hasattr(layer, "int8_activations"):
    return dataclasses.replace(layer, use_cpu_kernel=True,
                               int8_activations=True)
  return dataclasses.replace(layer, use_cpu_kernel=True)


# Plain penzai layers (not subclasses, whose calls may differ) -> kernels.
_SWAPS = {
    pz.nn.Linear: lambda layer: KernelLinear(
        weights=layer.weights, in_axis_names=layer.in_axis_names,
        out_axis_names=layer.out_axis_names),
    pz.nn.EmbeddingLookup: lambda layer: KernelEmbeddingLookup(
        table=layer.table),
    pz.nn.EmbeddingDecode: lambda layer: KernelEmbeddingDecode(
        table=layer.table),
}
