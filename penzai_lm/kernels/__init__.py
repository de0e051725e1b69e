"""Compiled CPU kernels for small-batch products (decoding), through the
XLA FFI: dense float32/bfloat16/float16 weights and blockwise int8 and
4-bit weights, read where they lie (no per-step float32 copy); decode
attention over the KV cache; and next-token sampling in one call
(`ops.sample`)."""

from penzai_lm.kernels.build import cpu_kernels
from penzai_lm.kernels.layers import KernelEmbeddingDecode
from penzai_lm.kernels.layers import KernelEmbeddingLookup
from penzai_lm.kernels.layers import KernelLinear
from penzai_lm.kernels.layers import on_one_cpu
from penzai_lm.kernels.layers import with_cpu_kernels
from penzai_lm.kernels.attention import KernelCachedAttention
