"""Quantized weights: int8 per channel, llama.cpp's Q8_0 / Q4_0 / Q4_1
blocks, and a GGUF file's own blocks (K-quants included), kept quantized in
`QuantizedLinear` layers and read by the CPU kernels while decoding."""

from penzai_lm.quantization.formats import FORMATS
from penzai_lm.quantization.formats import QuantizedWeight
from penzai_lm.quantization.formats import LAYOUTS
from penzai_lm.quantization.gguf_formats import kept_tensor_names
from penzai_lm.quantization.gguf_formats import kept_weights
from penzai_lm.quantization.layers import QuantizedEmbeddingLookup
from penzai_lm.quantization.layers import QuantizedLinear
from penzai_lm.quantization.quantize import in_rows
from penzai_lm.quantization.quantize import quantize
from penzai_lm.quantization.quantize import quantize_array
from penzai_lm.quantization.quantize import quantized_targets
