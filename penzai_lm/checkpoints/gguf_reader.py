"""Reads llama.cpp GGUF files into the canonical (Hugging Face) form.

Supported GGUF architectures: ``llama`` (HF ``LlamaForCausalLM``) and ``gemma3``
(HF ``Gemma3ForCausalLM``). Tensors are dequantized once with
``gguf.quants.dequantize`` (any type gguf-py knows: F32/F16/BF16, Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0, K-quants, ...) and converted to HF conventions:

* GGUF lists shapes as ``[in, out]``; the numpy arrays are ``(out, in)``, which
  is already HF's ``nn.Linear`` layout.
* llama.cpp permutes the rows of llama q/k projections (and biases) for its
  interleaved-pair RoPE; they are un-permuted here to HF's rotate-half layout.
* gemma3 files store RMSNorm weights as ``1 + w``; HF's Gemma3RMSNorm stores
  ``w`` (and computes ``x * (1 + w)``), so 1 is subtracted (in float32).
* A missing ``output.weight`` means tied embeddings: no ``lm_head.weight`` and
  ``tie_word_embeddings=True``.

Config fields the file does not carry are filled with the architecture's
documented defaults (those of llama.cpp, which wrote the file, and of
transformers' own GGUF loader).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from penzai_lm.checkpoints import layout
from penzai_lm.checkpoints.checkpoint import CORRUPT_HINT
from penzai_lm.checkpoints.checkpoint import Checkpoint
from penzai_lm.checkpoints.checkpoint import CheckpointError
from penzai_lm.checkpoints.checkpoint import check_path_exists
from penzai_lm.checkpoints.checkpoint import resolve_dtype
from penzai_lm.checkpoints.checkpoint import to_dtype

GGUF_MAGIC = b"GGUF"
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "gemma3")

# Gemma 3 facts not stored in its GGUF files (llama.cpp hard-codes them too).
GEMMA3_ROPE_LOCAL_BASE_FREQ = 10_000.0
GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every 6th layer (5, 11, 17, ...) is global

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_BLOCK_NAMES = {
    "llama": {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
    "gemma3": {
        "attn_norm": "input_layernorm",
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_q_norm": "self_attn.q_norm",
        "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([A-Za-z0-9_]+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^([A-Za-z0-9_]+)\.(weight|bias)$")

_MISSING = object()


def hf_tensor_name(architecture: str, gguf_name: str) -> str | None:
  """HF state_dict name of a GGUF tensor, or None if it has no HF counterpart."""
  m = _BLOCK_RE.match(gguf_name)
  if m:
    layer, kind, suffix = m.groups()
    hf = _BLOCK_NAMES[architecture].get(kind)
    return None if hf is None else f"model.layers.{layer}.{hf}.{suffix}"
  m = _TOP_RE.match(gguf_name)
  if m and m.group(1) in _TOP_LEVEL_NAMES:
    return f"{_TOP_LEVEL_NAMES[m.group(1)]}.{m.group(2)}"
  return None


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undoes llama.cpp's ``permute`` of q/k rows (weights or biases).

  llama.cpp writes ``w.reshape(n, 2, d//n//2, ...).swapaxes(1, 2)``; this is
  its inverse.
  """
  d = w.shape[0]
  if d % (2 * n_head):
    raise CheckpointError(
        f"cannot un-permute a q/k tensor with {d} rows into {n_head} heads"
    )
  return (
      w.reshape(n_head, d // n_head // 2, 2, *w.shape[1:])
      .swapaxes(1, 2)
      .reshape(w.shape)
  )


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's ``permute`` (HF layout -> GGUF layout), for tests and writers."""
  d = w.shape[0]
  return (
      w.reshape(n_head, 2, d // n_head // 2, *w.shape[1:])
      .swapaxes(1, 2)
      .reshape(w.shape)
  )


def _field(reader, key: str, default: Any = _MISSING) -> Any:
  field = reader.fields.get(key)
  if field is None:
    if default is _MISSING:
      raise CheckpointError(
          f"GGUF file {getattr(reader, 'path', '?')} lacks required metadata"
          f" key {key!r}"
      )
    return default
  value = field.contents()
  if isinstance(value, np.generic):
    value = value.item()
  return value


def _int(x):
  return None if x is None else int(x)


def _llama3_rope_scaling(
    factors: np.ndarray, theta: float, head_dim: int
) -> dict[str, Any]:
  """Recovers HF ``rope_scaling`` (rope_type llama3) from ``rope_freqs``.

  llama.cpp stores Llama 3.1+'s frequency correction as a tensor of per-pair
  factors computed from (factor, low_freq_factor, high_freq_factor,
  original_max_position_embeddings); the parameters are recovered by matching
  against the usual values.
  """
  factors = np.asarray(factors, dtype=np.float64).reshape(-1)
  factor = float(factors.max())
  freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))

  def compute(low, high, old):
    low_wl, high_wl = old / low, old / high
    out = []
    for f in freqs:
      wl = 2 * math.pi / f
      if wl < high_wl:
        out.append(1.0)
      elif wl > low_wl:
        out.append(factor)
      else:
        smooth = (old / wl - low) / (high - low)
        out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out)

  for old in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
    for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0)):
      if len(factors) == len(freqs) and np.allclose(
          compute(low, high, old), factors, rtol=1e-4, atol=1e-5
      ):
        return {
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": old,
        }
  raise CheckpointError(
      "GGUF llama file has a rope_freqs tensor whose values do not match Llama"
      " 3 style RoPE scaling; this frequency scaling is not supported"
  )


def _rope_scaling_from_metadata(reader, arch: str) -> dict[str, Any] | None:
  kind = _field(reader, f"{arch}.rope.scaling.type", None)
  if kind in (None, "none"):
    return None
  factor = _field(reader, f"{arch}.rope.scaling.factor", None)
  if factor is None:
    return None
  factor = float(factor)
  if kind == "linear":
    return {"rope_type": "linear", "factor": factor}
  if kind == "yarn":
    out = {"rope_type": "yarn", "factor": factor}
    orig = _field(reader, f"{arch}.rope.scaling.original_context_length", None)
    if orig is not None:
      out["original_max_position_embeddings"] = int(orig)
    return out
  raise CheckpointError(
      f"GGUF file uses RoPE scaling type {kind!r}, which is not supported"
      " (supported: none, linear, yarn)"
  )


def _config_from_gguf(reader, arch: str, gguf_names: set[str], vocab: int) -> dict:
  p = arch + "."
  hidden = int(_field(reader, p + "embedding_length"))
  heads = _field(reader, p + "attention.head_count")
  kv_heads = _field(reader, p + "attention.head_count_kv", heads)
  if isinstance(heads, list) or isinstance(kv_heads, list):
    raise CheckpointError(
        "GGUF file has per-layer head counts, which are not supported"
    )
  heads, kv_heads = int(heads), int(kv_heads)
  head_dim = _field(reader, p + "attention.key_length", None)
  if head_dim is None and arch == "llama":
    head_dim = _field(reader, p + "rope.dimension_count", None)
  if head_dim is None:
    head_dim = hidden // heads if arch == "llama" else 256
  head_dim = int(head_dim)
  raw: dict[str, Any] = {
      "vocab_size": vocab,
      "hidden_size": hidden,
      "intermediate_size": int(_field(reader, p + "feed_forward_length")),
      "num_hidden_layers": int(_field(reader, p + "block_count")),
      "num_attention_heads": heads,
      "num_key_value_heads": kv_heads,
      "head_dim": head_dim,
      "rms_norm_eps": float(
          _field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)
      ),
      "tie_word_embeddings": "output.weight" not in gguf_names,
  }
  ctx = _field(reader, p + "context_length", None)
  if ctx is not None:
    raw["max_position_embeddings"] = int(ctx)
  for key, hf_key in (
      ("bos_token_id", "bos_token_id"),
      ("eos_token_id", "eos_token_id"),
      ("padding_token_id", "pad_token_id"),
  ):
    v = _field(reader, "tokenizer.ggml." + key, None)
    if v is not None:
      raw[hf_key] = int(v)
  theta = _field(reader, p + "rope.freq_base", None)
  scaling = _rope_scaling_from_metadata(reader, arch)

  if arch == "llama":
    raw["rope_theta"] = float(theta) if theta is not None else 10000.0
    raw["hidden_act"] = "silu"
    raw["attention_bias"] = "blk.0.attn_q.bias" in gguf_names
    raw["mlp_bias"] = "blk.0.ffn_gate.bias" in gguf_names
    if scaling is not None:
      raw["rope_scaling"] = scaling
  else:  # gemma3
    layers = raw["num_hidden_layers"]
    raw["rope_theta"] = float(theta) if theta is not None else 1_000_000.0
    raw["rope_local_base_freq"] = GEMMA3_ROPE_LOCAL_BASE_FREQ
    if scaling is not None:
      raw["rope_scaling"] = scaling
    raw["sliding_window_pattern"] = GEMMA3_SLIDING_WINDOW_PATTERN
    window = _field(reader, p + "attention.sliding_window", None)
    if window is not None:
      raw["sliding_window"] = int(window)
    # llama.cpp: 1/sqrt(head_dim), except Gemma 3 27B (62 layers), which uses
    # 1/sqrt(hidden_size / num_heads). For every other size this equals
    # transformers' default of 256.
    if layers == 62:
      raw["query_pre_attn_scalar"] = hidden // heads
    else:
      raw["query_pre_attn_scalar"] = head_dim
    raw["attention_bias"] = "blk.0.attn_q.bias" in gguf_names
    raw["hidden_activation"] = "gelu_pytorch_tanh"
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
      v = _field(reader, p + key, None)
      if v is not None:
        raw[key] = float(v)
  return layout.normalize_config(arch, raw)


def _fast_reader_class():
  import gguf  # pylint: disable=g-import-not-at-top

  class FastGGUFReader(gguf.GGUFReader):
    """A ``gguf.GGUFReader`` that slices a plain ndarray view of its memmap.

    GGUFReader makes a few numpy views per metadata value (two per token of a
    262k-token vocabulary); views of an ``np.memmap`` go through Python-level
    ``__array_finalize__``, which makes opening ~3x slower. The parsed fields
    and tensors are identical; tensor ``data`` are plain ndarray views of the
    same read-only mapping.
    """

    @property
    def data(self):
      return self._plain_data

    @data.setter
    def data(self, value):
      self._memmap = value
      self._plain_data = value.view(np.ndarray)

  return FastGGUFReader


_FAST_READER = None


def open_gguf_reader(path: str | os.PathLike):
  """Opens ``path`` with a (faster) ``gguf.GGUFReader``; no checks."""
  global _FAST_READER
  if _FAST_READER is None:
    _FAST_READER = _fast_reader_class()
  return _FAST_READER(path, "r")


def _open_reader(path: Path):
  size = path.stat().st_size
  with open(path, "rb") as f:
    magic = f.read(4)
  if magic != GGUF_MAGIC:
    if len(magic) < 4:
      raise CheckpointError(
          f"{path} is not a GGUF file: it is only {size} bytes long"
          f" ({CORRUPT_HINT})"
      )
    raise CheckpointError(
        f"{path} is not a GGUF file (starts with {magic!r}, expected"
        f" {GGUF_MAGIC!r})"
    )
  try:
    reader = open_gguf_reader(path)
  except Exception as e:  # gguf raises ValueError/IndexError/KeyError/...
    raise CheckpointError(
        f"Cannot read GGUF file {path}: {type(e).__name__}: {e}; {CORRUPT_HINT}"
    ) from e
  for t in reader.tensors:
    if t.data_offset + t.n_bytes > size:
      raise CheckpointError(
          f"GGUF file {path}: tensor {t.name!r} extends past the end of the"
          f" file ({size} bytes); {CORRUPT_HINT}"
      )
  return reader


def read_gguf_architecture(reader) -> str:
  arch = _field(reader, "general.architecture", None)
  if arch is None:
    raise CheckpointError(
        "GGUF file has no general.architecture key; " + CORRUPT_HINT
    )
  return str(arch)


def read_gguf(path: str | os.PathLike, dtype=np.float32) -> Checkpoint:
  """Reads a GGUF model file into a canonical :class:`Checkpoint`.

  Args:
    path: Path to a ``.gguf`` file of architecture ``llama`` or ``gemma3``.
    dtype: float32 (default) or bfloat16 (``ml_dtypes.bfloat16``, or the
      strings "bfloat16"/"bf16").

  Returns:
    The checkpoint, with ``gguf_reader`` set to the open reader.

  Raises:
    FileNotFoundError: if ``path`` does not exist.
    CheckpointError (a ValueError): not a GGUF file, truncated or corrupt file,
      unsupported architecture, tensors that do not fit the architecture.
  """
  import gguf  # pylint: disable=g-import-not-at-top

  dtype = resolve_dtype(dtype)
  path = check_path_exists(path, "GGUF file")
  if path.is_dir():
    raise CheckpointError(
        f"{path} is a directory, not a GGUF file (use read_hf_dir for Hugging"
        " Face model directories)"
    )
  reader = _open_reader(path)
  arch = read_gguf_architecture(reader)
  if arch not in SUPPORTED_GGUF_ARCHITECTURES:
    raise CheckpointError(
        layout.unsupported_architecture_message(
            f"{arch!r} in GGUF file {path}",
            "GGUF architectures " + ", ".join(SUPPORTED_GGUF_ARCHITECTURES),
        )
    )

  by_name = {t.name: t for t in reader.tensors}
  if "token_embd.weight" not in by_name:
    raise CheckpointError(f"GGUF file {path} has no token_embd.weight tensor")
  vocab = int(by_name["token_embd.weight"].shape[-1])
  config = _config_from_gguf(reader, arch, set(by_name), vocab)

  extra_gguf = {}
  unknown = []
  hf_names = {}
  for name in by_name:
    if arch == "llama" and name == "rope_freqs.weight":
      extra_gguf[name] = by_name[name]
      continue
    hf = hf_tensor_name(arch, name)
    if hf is None:
      unknown.append(name)
    else:
      hf_names[name] = hf
  if unknown:
    raise CheckpointError(
        f"GGUF file {path} ({arch}) has tensors with no Hugging Face"
        f" counterpart: {', '.join(sorted(unknown))}"
    )

  def dequant(t) -> np.ndarray:
    try:
      arr = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
      raise CheckpointError(
          f"GGUF file {path}: tensor {t.name!r} has type"
          f" {t.tensor_type.name}, which gguf-py cannot dequantize"
      ) from e
    except Exception as e:
      raise CheckpointError(
          f"GGUF file {path}: cannot decode tensor {t.name!r}: {e};"
          f" {CORRUPT_HINT}"
      ) from e
    want = tuple(int(d) for d in reversed(t.shape.tolist()))
    if arr.dtype != np.float32:
      arr = arr.astype(np.float32)
    elif arr.base is not None or not arr.flags.writeable:
      arr = np.array(arr)  # detach F32 views from the memory-mapped file
    if tuple(arr.shape) != want:
      arr = arr.reshape(want)
    return arr

  if "rope_freqs.weight" in extra_gguf:
    scaling = _llama3_rope_scaling(
        dequant(extra_gguf["rope_freqs.weight"]),
        config["rope_theta"],
        config["head_dim"],
    )
    raw = dict(config)
    raw.pop("rope_parameters", None)
    raw["rope_scaling"] = scaling
    config = layout.normalize_config(arch, raw)

  heads = config["num_attention_heads"]
  kv_heads = config["num_key_value_heads"]
  tensors: dict[str, np.ndarray] = {}
  for gname, hf in hf_names.items():
    arr = dequant(by_name[gname])
    if arch == "llama":
      if ".self_attn.q_proj." in hf:
        arr = unpermute_rows(arr, heads)
      elif ".self_attn.k_proj." in hf:
        arr = unpermute_rows(arr, kv_heads)
    elif arch == "gemma3" and gname.endswith("norm.weight"):
      arr = arr - np.float32(1.0)
    tensors[hf] = to_dtype(arr, dtype)

  ckpt = Checkpoint(
      architecture=arch,
      config=config,
      tensors=tensors,
      source=str(path),
      gguf_reader=reader,
  )
  layout.validate(ckpt)
  return ckpt
