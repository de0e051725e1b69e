"""From arrays read out of a file to a checked `SparseAutoencoder`.

Every reader ends here: it has the weights in `SparseAutoencoder.from_arrays`'s
layout (``w_enc`` ``[d_in, d_sae]``, ``w_dec`` ``[d_sae, d_out]``, ``w_skip``
``[d_in, d_out]``) and the points it found in the file (or the caller's
overrides); this module picks the value axes, builds the `SAEConfig` and turns
construction errors into errors about the file.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from penzai_lm.sae.autoencoder import SparseAutoencoder
from penzai_lm.sae.formats import hook_names
from penzai_lm.sae.formats.errors import SAEFormatError
from penzai_lm.sae.sae_config import SAEConfig

_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16,
                                       jnp.float16, jnp.float64))


def resolve_dtype(dtype, stored: str | None, path) -> jnp.dtype:
  """The dtype to load in: the caller's, else the file's (``stored``, a
  name such as "float32" or "torch.bfloat16"), else float32. Only
  float64, float32, bfloat16 and float16 are accepted: an 8-bit float
  (``torch.float8_e4m3fn``) keeps too little of the weights and is refused
  rather than converted, as are names JAX has no dtype for.

  Raises:
    ValueError: for the caller's unusable ``dtype``.
    SAEFormatError: for the file's, naming ``path`` and the field.
  """
  name = dtype if dtype is not None else stored
  if name is None:
    return jnp.dtype(jnp.float32)
  if isinstance(name, str):
    name = name.removeprefix("torch.")
  try:
    resolved = jnp.dtype(name)
  except (TypeError, ValueError):
    resolved = None
  if resolved not in _DTYPES:
    why = (f" ({resolved.itemsize * 8}-bit floats keep too little of the"
           " weights)" if resolved is not None and jnp.issubdtype(
               resolved, jnp.floating) and resolved.itemsize < 2 else "")
    choices = ", ".join(str(d) for d in _DTYPES)
    if dtype is not None:
      raise ValueError(f"dtype must be one of {choices}, got {dtype!r}{why}.")
    raise SAEFormatError(f"{path}: field 'dtype' is {stored!r}, not one of"
                         f" {choices}{why}; pass dtype= to load it in one of"
                         " those.")
  return resolved


def _user_axes(input_axes, size: int, path) -> tuple[tuple[str, int], ...]:
  if isinstance(input_axes, dict):
    input_axes = tuple(input_axes.items())
  axes = tuple(tuple(a) for a in input_axes)
  flat = int(np.prod([n for _, n in axes])) if axes else 0
  if flat != size:
    raise ValueError(f"input_axes {dict(axes)} hold {flat} values, but"
                     f" {path} reads {size}.")
  return axes


def make_autoencoder(path, arrays: dict[str, np.ndarray], *, activation: str,
                     transcoder: bool, point: str | None,
                     output_point: str | None, model=None, input_axes=None,
                     dtype=None, k: int | None = None,
                     apply_b_dec_to_input: bool = False,
                     normalize_activations: str = "none",
                     rescale_acts_by_decoder_norm: bool = False,
                     size_fields=("d_in", "d_out")) -> SparseAutoencoder:
  """Builds the autoencoder (see the module docstring).

  Args:
    path: The file, for messages.
    arrays: ``w_enc``, ``b_enc``, ``w_dec``, ``b_dec`` and optionally
      ``threshold`` / ``w_skip``, shapes already checked.
    activation, k, apply_b_dec_to_input, normalize_activations,
      rescale_acts_by_decoder_norm: as in `SAEConfig`.
    transcoder: Whether it writes another point than it reads.
    point, output_point: penzai_lm points (from the file or the caller).
    model: A model or `TransformerConfig` (sizes checked, head layout), or
      None.
    input_axes: The caller's input axes (overrides the point's).
    dtype: A jnp dtype.
    size_fields: How the file names ``d_in`` and ``d_out`` (messages).
  """
  config = hook_names.model_config(model)
  if point is not None:
    hook_names.split_point(point)
    hook_names.check_in_model(point, model, f"{path}: the point it reads")
  d_in, d_sae = arrays["w_enc"].shape
  d_out = arrays["w_dec"].shape[1]
  if transcoder and output_point is None:
    layer = None if point is None else hook_names.split_point(point)[0]
    if layer is None:
      raise SAEFormatError(
          f"{path}: the transcoder's points are unknown (no hook names in"
          " the file); pass point='blocks.{i}.mlp_in' and"
          " output_point='blocks.{i}.mlp_out' (or the points it was trained"
          " on).")
    output_point = f"blocks.{layer}.mlp_out"
  if output_point is not None:
    hook_names.split_point(output_point)
    hook_names.check_in_model(output_point, model,
                              f"{path}: the point it writes")
  in_where = f"{path}: {size_fields[0]}"
  if input_axes is not None:
    in_axes = _user_axes(input_axes, d_in, path)
  else:
    in_axes = hook_names.point_axes(point, d_in, config, in_where)
  if transcoder:
    out_axes = hook_names.point_axes(output_point, d_out, config,
                                     f"{path}: {size_fields[1]}")
  else:
    out_axes = in_axes
  try:
    sae_config = SAEConfig(
        activation=activation, num_features=d_sae, input_axes=in_axes,
        output_axes=out_axes, k=k,
        apply_b_dec_to_input=apply_b_dec_to_input,
        normalize_activations=normalize_activations,
        rescale_acts_by_decoder_norm=rescale_acts_by_decoder_norm,
        hook_point=point, output_point=output_point if transcoder else None)
  except ValueError as e:
    raise SAEFormatError(f"{path}: {e}") from e
  return SparseAutoencoder.from_arrays(sae_config, dtype=dtype, **arrays)
