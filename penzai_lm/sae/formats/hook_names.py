"""Hook names of the reference libraries, as penzai_lm point names.

TransformerLens names (SAELens ``hook_name`` / ``hook_name_out``,
circuit-tracer ``feature_input_hook`` / ``feature_output_hook``), per
block ``blocks.{i}.``:

==========================================  ===============================
TransformerLens                             penzai_lm
==========================================  ===============================
``hook_resid_pre``                          ``resid_pre``
``hook_resid_mid``                          ``resid_mid``
``hook_resid_post``                         ``resid_post``
``hook_attn_out``                           ``attn_out``
``hook_mlp_out``                            ``mlp_out``
``attn.hook_z``                             ``attn.head_out``
``mlp.hook_post``                           ``mlp.neurons``
``mlp.hook_in``                             ``mlp_in``
``ln2.hook_normalized``                     ``mlp_in``, weights folded
                                            (see below)
``mlp.hook_out``                            ``mlp_out`` (models without a
                                            post-MLP norm: see below)
``hook_mlp_in``                             ``resid_mid`` (TransformerLens
                                            takes it before ``ln2``)
==========================================  ===============================

``ln2.hook_normalized`` is the pre-MLP norm's output *before* its weights
(TransformerLens's ``RMSNorm`` / ``LayerNorm`` hook ``x / rms`` and apply
``w`` (and ``b``) after it; circuit-tracer maps it to Hugging Face's
``_norm`` output), while ``mlp_in`` is after them. The loaders fold the
weights of the model passed as ``model=`` into the arrays
(`penzai_lm.sae.formats.norm_fold`), so that the loaded autoencoder reads
``mlp_in`` and computes what the file's did; without the model they refuse
(``fold_norm=False`` loads the arrays as they are). ``mlp.hook_in``
(circuit-tracer's MLP input, TransformerLens 3's bridge) is after the
weights and is ``mlp_in`` itself; it is the name written for ``mlp_in``.
``ln1.hook_normalized`` and ``ln_final.hook_normalized`` have no penzai_lm
point and are refused as unknown names.

circuit-tracer's ``mlp.hook_out`` is the MLP's own output: before Gemma's
post-MLP norm, which penzai_lm's ``mlp_out`` includes, so with a model of
``post_norms`` it is refused (pass the point explicitly if you mean it).

Hugging Face module names (Gemma Scope 2's ``hf_hook_point_in`` /
``hf_hook_point_out``, SAELens's ``hf_hook_name``), per
``model.layers.{i}.``: ``output`` -> ``resid_post``,
``self_attn.o_proj.input`` -> ``attn.head_out``,
``pre_feedforward_layernorm.output`` -> ``mlp_in``,
``post_feedforward_layernorm.output`` -> ``mlp_out``. Others are ambiguous
across families (Llama's ``post_attention_layernorm`` is the pre-MLP norm,
Gemma's the post-attention one) and are not guessed.

Value axes (`point_axes`): ``embedding`` for the residual points, ``neurons``
for ``mlp.neurons``, and the model's query head axes plus ``projection``
for ``attn.head_out`` (SAELens flattens ``(n_heads d_head)`` in Hugging Face
head order, which is the row-major order of those axes: see
`penzai_lm.model.hooks.head_coordinates`).
"""

from __future__ import annotations

import re
import types

from penzai_lm.model.hooks import BLOCK_POINTS
from penzai_lm.model.hooks import MODEL_POINTS
from penzai_lm.model.points import parse_point
from penzai_lm.sae.formats.errors import SAEFormatError

TL_BLOCK_HOOKS = {
    "hook_resid_pre": "resid_pre",
    "hook_resid_mid": "resid_mid",
    "hook_resid_post": "resid_post",
    "hook_attn_out": "attn_out",
    "hook_mlp_out": "mlp_out",
    "attn.hook_z": "attn.head_out",
    "mlp.hook_post": "mlp.neurons",
    "ln2.hook_normalized": "mlp_in",
    "mlp.hook_in": "mlp_in",
    "mlp.hook_out": "mlp_out",
    "hook_mlp_in": "resid_mid",
}
# Hooks on a norm's output before its weights -> that norm's TransformerLens
# weight prefix (`penzai_lm.interp.weights`): the point above is after them.
NORMALIZED_HOOKS = {"ln2.hook_normalized": "ln2"}
# The name written for each point (one that means the value stored).
POINT_TO_TL = {
    "resid_pre": "hook_resid_pre", "resid_mid": "hook_resid_mid",
    "resid_post": "hook_resid_post", "attn_out": "hook_attn_out",
    "mlp_out": "hook_mlp_out", "attn.head_out": "attn.hook_z",
    "mlp.neurons": "mlp.hook_post", "mlp_in": "mlp.hook_in",
}
HF_BLOCK_HOOKS = {
    "output": "resid_post",
    "self_attn.o_proj.input": "attn.head_out",
    "pre_feedforward_layernorm.output": "mlp_in",
    "post_feedforward_layernorm.output": "mlp_out",
}
_TL = re.compile(r"^blocks\.(\d+)\.(.+)$")
_HF = re.compile(r"^(?:model\.)?(?:language_model\.)?layers\.(\d+)\.(.+)$")
_OURS = re.compile(r"^blocks\.(\d+)\.(.+)$")


def from_transformer_lens(name: str, layer: int | None = None) -> str | None:
  """``blocks.{i}.<hook>`` (or a bare ``<hook>`` with ``layer``, as
  circuit-tracer's configs write them) as a penzai_lm point, or None."""
  m = _TL.match(name)
  if m is not None:
    layer, name = int(m.group(1)), m.group(2)
  point = TL_BLOCK_HOOKS.get(name)
  if point is None or layer is None:
    return None
  return f"blocks.{layer}.{point}"


def normalized_norm(name: str) -> str | None:
  """The norm (``"ln2"``) whose weights lie between TransformerLens hook
  ``name`` (with or without ``blocks.{i}.``) and its penzai_lm point, or
  None when the point is the hook's value."""
  m = _TL.match(name)
  return NORMALIZED_HOOKS.get(m.group(2) if m is not None else name)


def from_hugging_face(name: str) -> str | None:
  """``model.layers.{i}.<module>.<input|output>`` as a point, or None."""
  m = _HF.match(name)
  if m is None or m.group(2) not in HF_BLOCK_HOOKS:
    return None
  return f"blocks.{int(m.group(1))}.{HF_BLOCK_HOOKS[m.group(2)]}"


def to_transformer_lens(point: str) -> str | None:
  """A penzai_lm block point's TransformerLens name, or None."""
  m = _OURS.match(point)
  if m is None or m.group(2) not in POINT_TO_TL:
    return None
  return f"blocks.{m.group(1)}.{POINT_TO_TL[m.group(2)]}"


def split_point(point: str) -> tuple[int | None, str]:
  """``"blocks.3.mlp_in"`` -> ``(3, "mlp_in")``; ``"embed"`` ->
  ``(None, "embed")``.

  Raises:
    ValueError: for a name that is not a penzai_lm point.
  """
  if point in MODEL_POINTS:
    return None, point
  m = _OURS.match(point) if isinstance(point, str) else None
  if m is None or m.group(2) not in BLOCK_POINTS or m.group(2) == (
      "attn.pattern"):
    raise ValueError(
        f"{point!r} is not a point an autoencoder can read or write: use"
        f" 'blocks.{{i}}.P' with P one of"
        f" {[p for p in BLOCK_POINTS if p != 'attn.pattern']}, or one of"
        f" {list(MODEL_POINTS)}.")
  return int(m.group(1)), m.group(2)


def check_in_model(point: str | None, model, where: str) -> None:
  """Refuses a point ``model`` (a model or its `TransformerConfig`) does
  not have (``blocks.99.resid_post`` on a 30-block model), by
  `penzai_lm.model.points.parse_point`'s rule; None checks nothing.

  Raises:
    SAEFormatError: ``where`` (the file and field), then parse_point's
      message.
  """
  if point is None or model is None:
    return
  if getattr(model, "config", None) is None:
    model = types.SimpleNamespace(config=model)  # A bare config.
  try:
    parse_point(model, point)
  except ValueError as e:
    raise SAEFormatError(f"{where}: {e} The autoencoder was made for another"
                         " model, or the point is wrong.") from e


def check_mlp_hook_out(hook: str, point: str | None, config, where: str):
  """Refuses circuit-tracer's ``mlp.hook_out`` on a model whose
  ``mlp_out`` includes a post-MLP norm (they differ there)."""
  if (point is not None and hook.endswith("mlp.hook_out") and config
      is not None and getattr(config, "post_norms", False)):
    raise SAEFormatError(
        f"{where} is 'mlp.hook_out', the MLP's output before the post-MLP"
        " norm; this model normalizes it before mlp_out, so the two differ."
        " Pass output_point= (or point=) explicitly if you mean mlp_out.")


def point_axes(point: str | None, size: int, config, where: str
               ) -> tuple[tuple[str, int], ...]:
  """The value axes at ``point`` for a flat size ``size`` (see the module
  docstring); ``config`` (a `TransformerConfig` or None) checks sizes and
  gives the head layout.

  Raises:
    SAEFormatError: naming ``where`` (the file and field the size came
      from) when the sizes disagree or the head layout is unknown.
  """
  kind = None if point is None else split_point(point)[1]
  if kind == "attn.head_out":
    if config is None:
      raise SAEFormatError(
          f"{where}: an SAE on attention head outputs (attn.hook_z) reads"
          " the query head axes, which depend on the model: pass model="
          " (or its config), or input_axes=.")
    common, query = config.head_axes
    axes = (*common.items(), *query.items(), ("projection", config.head_dim))
  elif kind == "mlp.neurons":
    axes = (("neurons", config.mlp_hidden_size if config else size),)
  else:
    axes = (("embedding", config.hidden_size if config else size),)
  flat = 1
  for _, n in axes:
    flat *= n
  if flat != size:
    at = "the residual stream" if point is None else point
    raise SAEFormatError(
        f"{where} is {size}, but the model's value at {at} has"
        f" {dict(axes)} ({flat} values): the autoencoder was made for"
        " another model.")
  return tuple(axes)


def model_config(model):
  """A `TransformerConfig` from a model, a config, or None."""
  if model is None:
    return None
  return getattr(model, "config", model)
