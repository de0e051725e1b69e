"""Cross-layer transcoder files (circuit-tracer's and Gemma Scope 2's).

The layouts are in `penzai_lm.sae.formats.circuit_tracer`'s docstring.
Every block's files must agree on ``d_transcoder`` and ``d_model`` (the
message names the two files that differ), and with ``model=`` the CLT's
blocks must exist in the model and ``d_model`` be its hidden size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from penzai_lm.sae.formats import hook_names
from penzai_lm.sae.formats import tensor_files
from penzai_lm.sae.formats.assemble import resolve_dtype
from penzai_lm.sae.formats.circuit_tracer import file_hooks
from penzai_lm.sae.formats.circuit_tracer import points
from penzai_lm.sae.formats.circuit_tracer import warn_negative
from penzai_lm.sae.formats.cross_layer import CrossLayerTranscoder
from penzai_lm.sae.formats.errors import SAEFormatError
from penzai_lm.sae.formats.errors import check_shape
from penzai_lm.sae.formats.errors import check_unexpected
from penzai_lm.sae.formats.errors import require_tensor
from penzai_lm.sae.formats.errors import where
from penzai_lm.sae.formats.layer_files import CONFIG
from penzai_lm.sae.formats.layer_files import confined
from penzai_lm.sae.formats.layer_files import layer_paths
from penzai_lm.sae.formats.norm_fold import NormReader
from penzai_lm.sae.formats.norm_fold import fold_clt_inputs


def _same_size(sizes: list[tuple[Path, int, int]], file: Path, f: int,
               d: int) -> None:
  """Records block ``file``'s ``(d_transcoder, d_model)``; refuses one
  that differs from the first block's."""
  sizes.append((file, f, d))
  first, f0, d0 = sizes[0]
  if (f, d) != (f0, d0):
    raise SAEFormatError(
        f"{file} has d_transcoder={f}, d_model={d} but {first} has"
        f" d_transcoder={f0}, d_model={d0}; every block of a cross-layer"
        " transcoder has the same sizes (the files come from different"
        " transcoders).")


def _encoder_2d(t, key: str, file: Path, meaning: str) -> np.ndarray:
  w = require_tensor(t, key, file)
  if w.ndim != 2:
    raise SAEFormatError(f"{file}: tensor {key!r} has shape"
                         f" {list(w.shape)}, expected {meaning}.")
  return w


def _gemma_scope_2(files: list[Path]) -> dict:
  n, per, sizes = len(files), [], []
  for file in files:
    t = tensor_files.read_safetensors(file)
    check_unexpected(t, ("w_enc", "w_dec", "b_enc", "b_dec", "threshold",
                         "affine_skip_connection"), file,
                     "Gemma Scope 2 cross-layer transcoder block")
    d, f = _encoder_2d(t, "w_enc", file, "[d_model, d_sae]").shape
    _same_size(sizes, file, f, d)
    check_shape(require_tensor(t, "w_dec", file), (f, n, d), file, "w_dec",
                "[d_sae, n_layers, d_in]")
    for key, shape in (("b_enc", (f,)), ("b_dec", (d,)), ("threshold", (f,))):
      check_shape(require_tensor(t, key, file), shape, file, key, str(shape))
    if "affine_skip_connection" in t:
      check_shape(t["affine_skip_connection"], (d, d), file,
                  "affine_skip_connection", "[d_model, d_model]")
    per.append(t)
  skips = ["affine_skip_connection" in t for t in per]
  if any(skips) and not all(skips):
    raise SAEFormatError(
        f"{files[skips.index(not skips[0])]} and {files[0]} disagree on"
        " 'affine_skip_connection'; a CLT's blocks all have one or none.")
  return dict(
      w_enc=np.stack([t["w_enc"].T for t in per]),
      b_enc=np.stack([t["b_enc"] for t in per]),
      w_dec=[t["w_dec"][:, i:] for i, t in enumerate(per)],
      b_dec=np.stack([t["b_dec"] for t in per]),
      threshold=np.stack([t["threshold"] for t in per]),
      w_skip=(np.stack([t["affine_skip_connection"] for t in per])
              if all(skips) else None))


def _circuit_tracer(directory: Path, encs: list[Path],
                    allow_outside: bool) -> dict:
  n, sizes = len(encs), []
  parts = {"w_enc": [], "b_enc": [], "b_dec": [], "threshold": [],
           "w_dec": []}
  for i, file in enumerate(encs):
    t = tensor_files.read_safetensors(file)
    w = _encoder_2d(t, f"W_enc_{i}", file, "[d_transcoder, d_model]")
    f, d = w.shape
    _same_size(sizes, file, f, d)
    parts["w_enc"].append(w)
    parts["b_enc"].append(check_shape(require_tensor(t, f"b_enc_{i}", file),
                                      (f,), file, f"b_enc_{i}",
                                      "[d_transcoder]"))
    parts["b_dec"].append(check_shape(require_tensor(t, f"b_dec_{i}", file),
                                      (d,), file, f"b_dec_{i}", "[d_model]"))
    if f"threshold_{i}" in t:
      parts["threshold"].append(check_shape(
          t[f"threshold_{i}"].reshape(-1), (f,), file, f"threshold_{i}",
          "[d_transcoder]"))
    name = f"W_dec_{i}.safetensors"
    dec_file = (directory / name if allow_outside
                else confined(Path(name), directory, str(directory / name)))
    if not dec_file.is_file():
      raise SAEFormatError(f"{directory} has W_enc_{i}.safetensors but no"
                           f" {name}; the CLT is incomplete.")
    dec = tensor_files.read_safetensors(dec_file)
    parts["w_dec"].append(check_shape(
        require_tensor(dec, f"W_dec_{i}", dec_file), (f, n - i, d), dec_file,
        f"W_dec_{i}", "[d_transcoder, n_layers - i, d_model]"))
  if parts["threshold"] and len(parts["threshold"]) != n:
    raise SAEFormatError(f"{directory}: only some blocks have a threshold_i;"
                         " a CLT's blocks share one activation.")
  return dict(w_enc=np.stack(parts["w_enc"]), b_enc=np.stack(parts["b_enc"]),
              w_dec=parts["w_dec"], b_dec=np.stack(parts["b_dec"]),
              threshold=(np.stack(parts["threshold"]) if parts["threshold"]
                         else None), w_skip=None)


def _check_model(arrays: dict, read: str, write: str, model,
                 cfg_path: Path) -> None:
  """The last block exists in ``model`` and ``d_model`` is its width."""
  n, _, d = arrays["w_enc"].shape
  config = hook_names.model_config(model)
  for point in (read, write):
    last = f"blocks.{n - 1}.{hook_names.split_point(point)[1]}"
    hook_names.check_in_model(last, model, f"{cfg_path}: the CLT's {n}"
                              " blocks")
    hook_names.point_axes(last, d, config, f"{cfg_path}: the CLT's d_model")


def _fold(arrays: dict, config: dict, cfg_path: Path, input_point,
          output_point, model, fold_norm: bool) -> dict:
  """``arrays`` with each block's pre-MLP norm weights folded into its
  encoder and skip when the input hook is before them (`norm_fold`)."""
  in_hook, out_hook = file_hooks(config, input_point, output_point)
  norms = NormReader(model, fold_norm)
  n = arrays["w_enc"].shape[0]
  if out_hook is not None and hook_names.normalized_norm(out_hook):
    raise SAEFormatError(
        f"{where(cfg_path, 'feature_output_hook')} is {out_hook!r}, before"
        " a norm's weights; a cross-layer transcoder writing there is not"
        " supported (pass output_point=).")
  per = [norms.weights(in_hook, f"blocks.{l}.mlp_in",
                       where(cfg_path, "feature_input_hook"))
         for l in range(n)]
  return arrays if per[0] is None else fold_clt_inputs(arrays, per)


def read_clt(directory: Path, config: dict, *, model=None, input_point=None,
             output_point=None, dtype=None, allow_outside=False,
             fold_norm=True) -> CrossLayerTranscoder:
  """Loads the CLT ``config`` (``directory``'s ``config.yaml``) describes,
  with each block's norm weights folded in where the input hook is before
  them (`norm_fold`)."""
  cfg_path = directory / CONFIG
  if config.get("transcoders") is not None:
    arrays = _gemma_scope_2(layer_paths(config, directory,
                                        allow_outside=allow_outside))
  else:
    arrays = _circuit_tracer(
        directory, layer_paths(config, directory, r"W_enc_(\d+)\.safetensors",
                               allow_outside=allow_outside), allow_outside)
  warn_negative(arrays["threshold"], directory)
  read, write = points(config, cfg_path, 0, input_point, output_point, model)
  if model is not None:
    _check_model(arrays, read, write, model, cfg_path)
  arrays = _fold(arrays, config, cfg_path, input_point, output_point, model,
                 fold_norm)
  return CrossLayerTranscoder.from_arrays(
      **arrays, input_point=hook_names.split_point(read)[1],
      output_point=hook_names.split_point(write)[1],
      dtype=resolve_dtype(dtype, None, cfg_path))
