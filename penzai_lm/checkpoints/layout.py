"""The canonical (Hugging Face) checkpoint layout: configs and tensor shapes.

Every reader in this package produces tensors named and shaped exactly like the
``state_dict()`` of the corresponding ``transformers`` causal-LM class, and a
config dict with the keys of that class's ``config.json`` (defaults filled in
the way transformers 5.x fills them). For each supported architecture, this
package knows:

* how to complete a raw config dict (:func:`normalize_config`, defined in
  :mod:`~penzai_lm.checkpoints.config_normalization` and re-exported here);
* which tensors the architecture needs and their shapes
  (:func:`expected_tensor_shapes`);
* how to check a checkpoint against that (:func:`validate`), also from the
  tensor shapes of file headers alone, before any data is read
  (:func:`validate_shapes`).

A config claiming a huge layer count cannot make :func:`expected_tensor_shapes`
loop for minutes: normalization rejects more than
:data:`~penzai_lm.checkpoints.validation.MAX_LAYERS` layers, and the readers
compare the count with the layers present before that
(:func:`~penzai_lm.checkpoints.validation.check_layer_count`).

The tensors come from the spec's layout
(:class:`~penzai_lm.checkpoints.spec_types.DecoderLayout` or
:class:`~penzai_lm.checkpoints.spec_types.Conv1DLayout`). The per-architecture
tables (:data:`ARCHITECTURE_CLASSES`, ...) live in
:mod:`~penzai_lm.checkpoints.architectures` and are re-exported here too.
"""

from __future__ import annotations

import types
from typing import Any, Mapping, Sequence

import numpy as np

from penzai_lm.checkpoints.architectures import ARCHITECTURE_CLASSES
from penzai_lm.checkpoints.architectures import MODEL_TYPES
from penzai_lm.checkpoints.architectures import SUPPORTED_ARCHITECTURES
from penzai_lm.checkpoints.architectures import spec_for
from penzai_lm.checkpoints.architectures import unsupported_architecture_message
from penzai_lm.checkpoints.checkpoint import CheckpointError
from penzai_lm.checkpoints.config_normalization import GUARANTEED_CONFIG_KEYS
from penzai_lm.checkpoints.config_normalization import normalize_config
from penzai_lm.checkpoints.spec_types import ArchitectureSpec
from penzai_lm.checkpoints.spec_types import Conv1DLayout
from penzai_lm.checkpoints.spec_types import DecoderLayout
from penzai_lm.checkpoints.spec_types import Flag
from penzai_lm.checkpoints.specs import SPECS


def expected_tensor_shapes(
    architecture: str | ArchitectureSpec,
    config: Mapping[str, Any],
    specs: Sequence[ArchitectureSpec] = SPECS,
) -> dict[str, tuple[int, ...]]:
  """The complete set of HF ``state_dict`` tensors for ``architecture``.

  Tied embeddings (``tie_word_embeddings``) mean no ``lm_head.weight``.

  Args:
    architecture: One of :data:`SUPPORTED_ARCHITECTURES`, or a spec.
    config: A config dict (raw or normalized; it is normalized here).
    specs: The specs to look ``architecture`` up in.

  Returns:
    Mapping from tensor name to shape, in a stable order.
  """
  spec = spec_for(architecture, specs)
  c = normalize_config(spec, config)
  if isinstance(spec.layout, Conv1DLayout):
    return _conv1d_shapes(spec.layout, c)
  return _decoder_shapes(spec.layout, c)


def _conv1d_shapes(
    layout: Conv1DLayout, c: Mapping[str, Any]
) -> dict[str, tuple[int, ...]]:
  """The tensors of a GPT-2-style model (``GPT2LMHeadModel``)."""
  out: dict[str, tuple[int, ...]] = {}
  e, v, p = c["n_embd"], c["vocab_size"], c["n_positions"]
  inner = c["n_inner"] if c["n_inner"] is not None else layout.mlp_ratio * e
  out["transformer.wte.weight"] = (v, e)
  out["transformer.wpe.weight"] = (p, e)
  for i in range(c["n_layer"]):
    b = f"transformer.h.{i}."
    out[b + "ln_1.weight"] = (e,)
    out[b + "ln_1.bias"] = (e,)
    # GPT-2 uses Conv1D: weights are stored (in_features, out_features).
    out[b + "attn.c_attn.weight"] = (e, 3 * e)
    out[b + "attn.c_attn.bias"] = (3 * e,)
    out[b + "attn.c_proj.weight"] = (e, e)
    out[b + "attn.c_proj.bias"] = (e,)
    out[b + "ln_2.weight"] = (e,)
    out[b + "ln_2.bias"] = (e,)
    out[b + "mlp.c_fc.weight"] = (e, inner)
    out[b + "mlp.c_fc.bias"] = (inner,)
    out[b + "mlp.c_proj.weight"] = (inner, e)
    out[b + "mlp.c_proj.bias"] = (e,)
  out["transformer.ln_f.weight"] = (e,)
  out["transformer.ln_f.bias"] = (e,)
  if not c["tie_word_embeddings"]:
    out["lm_head.weight"] = (v, e)
  return out


def _flag(flag: Flag, c: Mapping[str, Any]) -> bool:
  """A layout flag's value: the constant, or the config key it names."""
  return bool(c[flag]) if isinstance(flag, str) else flag


def _decoder_shapes(
    layout: DecoderLayout, c: Mapping[str, Any]
) -> dict[str, tuple[int, ...]]:
  """The tensors of a Llama-style decoder."""
  h, v = c["hidden_size"], c["vocab_size"]
  inter = c["intermediate_size"]
  nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
  qkv_bias = _flag(layout.qkv_bias, c)
  o_bias = _flag(layout.output_bias, c)
  mlp_bias = _flag(layout.mlp_bias, c)
  out: dict[str, tuple[int, ...]] = {}
  out["model.embed_tokens.weight"] = (v, h)
  for i in range(c["num_hidden_layers"]):
    b = f"model.layers.{i}."
    a = b + "self_attn."
    projections = {"q": nh * hd, "k": nkv * hd, "v": nkv * hd}
    if layout.fused_qkv:
      projections = {"qkv": nh * hd + 2 * nkv * hd}
    for proj, rows in projections.items():
      out[a + f"{proj}_proj.weight"] = (rows, h)
      if qkv_bias:
        out[a + f"{proj}_proj.bias"] = (rows,)
    out[a + "o_proj.weight"] = (h, nh * hd)
    if o_bias:
      out[a + "o_proj.bias"] = (h,)
    if layout.qk_norm:
      out[a + "q_norm.weight"] = (hd,)
      out[a + "k_norm.weight"] = (hd,)
    m = b + "mlp."
    mlp = {"gate": (inter, h), "up": (inter, h), "down": (h, inter)}
    if layout.fused_gate_up:
      mlp = {"gate_up": (2 * inter, h), "down": (h, inter)}
    for proj, shape in mlp.items():
      out[m + f"{proj}_proj.weight"] = shape
      if mlp_bias:
        out[m + f"{proj}_proj.bias"] = shape[:1]
    out[b + "input_layernorm.weight"] = (h,)
    out[b + "post_attention_layernorm.weight"] = (h,)
    if layout.sandwich_norms:
      out[b + "pre_feedforward_layernorm.weight"] = (h,)
      out[b + "post_feedforward_layernorm.weight"] = (h,)
  out["model.norm.weight"] = (h,)
  if not c["tie_word_embeddings"]:
    out["lm_head.weight"] = (v, h)
  return out


def _fmt_list(names, limit: int = 20) -> str:
  """Sorted, comma-separated ``names``, cut after ``limit``."""
  names = sorted(names)
  shown = ", ".join(names[:limit])
  if len(names) > limit:
    shown += f", ... ({len(names) - limit} more)"
  return shown


_ALLOWED_DTYPES = ("float32", "bfloat16")


def validate(checkpoint, spec: ArchitectureSpec | None = None) -> None:
  """Checks a :class:`~penzai_lm.checkpoints.Checkpoint` against its layout.

  Args:
    checkpoint: The checkpoint.
    spec: Its architecture's spec; by default the built-in spec named
      ``checkpoint.architecture``.

  Raises:
    ValueError: on an unsupported architecture.
    CheckpointError (a ValueError): on missing tensors, unexpected extra
      tensors, shape mismatches or non-float dtypes; the message lists every
      offending tensor (up to 20 of each kind).
  """
  arch = checkpoint.architecture
  spec = spec or spec_for(arch)
  expected = expected_tensor_shapes(spec, checkpoint.config)
  tensors = checkpoint.tensors
  src = getattr(checkpoint, "source", "<unknown>")
  problems = []
  missing = [n for n in expected if n not in tensors]
  if missing:
    problems.append(f"missing {len(missing)} tensor(s): {_fmt_list(missing)}")
  extra = [n for n in tensors if n not in expected]
  if extra:
    problems.append(
        f"unexpected extra {len(extra)} tensor(s): {_fmt_list(extra)}"
    )
  bad_shapes = [
      f"{n}: expected {expected[n]}, got {tuple(tensors[n].shape)}"
      for n in expected
      if n in tensors and tuple(tensors[n].shape) != tuple(expected[n])
  ]
  if bad_shapes:
    shown = "; ".join(bad_shapes[:20])
    if len(bad_shapes) > 20:
      shown += f"; ... ({len(bad_shapes) - 20} more)"
    problems.append(f"{len(bad_shapes)} shape mismatch(es): {shown}")
  bad_dtypes = [
      f"{n}: {np.dtype(t.dtype).name}"
      for n, t in tensors.items()
      if np.dtype(t.dtype).name not in _ALLOWED_DTYPES
  ]
  if bad_dtypes:
    problems.append(
        "tensors must be float32 or bfloat16, got "
        + ", ".join(bad_dtypes[:20])
    )
  if problems:
    raise CheckpointError(
        f"Checkpoint {src} does not match the {arch} layout "
        f"({spec.hf_class}): " + "; ".join(problems) + "; the config and the"
        " tensors disagree: if config.json or the GGUF metadata was edited,"
        " restore it, otherwise re-download the checkpoint"
    )


def validate_shapes(
    spec: ArchitectureSpec,
    config: Mapping[str, Any],
    shapes: Mapping[str, Sequence[int]],
    source: str = "<unknown>",
) -> None:
  """:func:`validate` from tensor names and shapes alone.

  Readers call this with the shapes in a file's header, so a config that
  disagrees with its tensors fails before gigabytes of data are read.

  Args:
    spec: The architecture's spec.
    config: The normalized config.
    shapes: HF tensor name -> shape.
    source: The checkpoint's path, for messages.

  Raises:
    CheckpointError: as :func:`validate`.
  """
  # Zero-stride views stand in for the tensors: no memory, whatever the shape.
  stubs = {
      n: np.broadcast_to(np.float32(0), tuple(int(d) for d in s))
      for n, s in shapes.items()
  }
  validate(
      types.SimpleNamespace(
          architecture=spec.name, config=config, tensors=stubs, source=source
      ),
      spec,
  )


__all__ = [
    "ARCHITECTURE_CLASSES",
    "GUARANTEED_CONFIG_KEYS",
    "MODEL_TYPES",
    "SUPPORTED_ARCHITECTURES",
    "expected_tensor_shapes",
    "normalize_config",
    "unsupported_architecture_message",
    "validate",
    "validate_shapes",
]
