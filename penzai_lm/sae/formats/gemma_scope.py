"""Gemma Scope's releases, as Google publishes them.

Gemma Scope 1 (``google/gemma-scope-*``): one ``params.npz`` per SAE with
``W_enc`` ``[d_model, d_sae]``, ``W_dec`` ``[d_sae, d_model]``, ``b_enc``,
``b_dec``, ``threshold`` (JumpReLU), no config. The point comes from the
path as SAELens reads it: ``layer_{i}`` in a folder name, and the release
name's suffix (``-res`` -> ``resid_post``, ``-mlp`` -> ``mlp_out``, ``-att``
-> ``attn.head_out``, ``-transcoders`` -> a transcoder from ``mlp_in`` to
``mlp_out``, as circuit-tracer uses them); otherwise pass ``point=``.

Gemma Scope 2 (``google/gemma-scope-2-*``): ``params.safetensors`` with
lower-case ``w_enc`` ``[d_in, d_sae]``, ``w_dec`` ``[d_sae, d_out]``,
``b_enc``, ``b_dec``, ``threshold`` and, for affine transcoders,
``affine_skip_connection`` ``[d_in, d_out]`` (input-major: SAELens and
circuit-tracer transpose it into their ``W_skip``). A sidecar
``config.json`` (``architecture: "jump_relu"``, ``hf_hook_point_in``,
``hf_hook_point_out`` for transcoders, ``affine_connection``) names the
points in Hugging Face terms; without one the folder name is read as
SAELens does (``layer_{i}`` and ``resid_post`` / ``attn_out`` /
``mlp_out`` / ``transcoder``). Cross-layer transcoder files (``w_dec``
``[d_sae, n_layers, d_in]``) are read by `penzai_lm.sae.load_transcoders`.
"""

from __future__ import annotations

from pathlib import Path
import re

from penzai_lm.sae.autoencoder import SparseAutoencoder
from penzai_lm.sae.formats import hook_names
from penzai_lm.sae.formats import tensor_files
from penzai_lm.sae.formats.assemble import make_autoencoder
from penzai_lm.sae.formats.assemble import resolve_dtype
from penzai_lm.sae.formats.errors import SAEFormatError
from penzai_lm.sae.formats.errors import check_shape
from penzai_lm.sae.formats.errors import read_json
from penzai_lm.sae.formats.errors import check_unexpected
from penzai_lm.sae.formats.errors import most_common
from penzai_lm.sae.formats.errors import require_tensor
from penzai_lm.sae.formats.errors import where

GS1_FILE = "params.npz"
GS2_FILE = "params.safetensors"
SIDECAR = "config.json"
_RELEASE_KINDS = {"-res": "resid_post", "-mlp": "mlp_out",
                  "-att": "attn.head_out", "-transcoders": "mlp_in"}
_GS2_KINDS = (("transcoder", "mlp_in"), ("resid_post", "resid_post"),
              ("attn_out", "attn.head_out"), ("mlp_out", "mlp_out"))


def _layer_in(path: Path) -> int | None:
  for part in reversed(path.parts):
    m = re.search(r"layer_(\d+)", part)
    if m:
      return int(m.group(1))
  return None


def _gs1_points(path: Path) -> tuple[str | None, bool]:
  """(point read, is a transcoder) from a Gemma Scope 1 path."""
  layer = _layer_in(path)
  for part in path.parts:
    # "gemma-scope-2b-pt-res" is Gemma Scope 1 (for Gemma 2 2B);
    # "gemma-scope-2-270m-pt-res" is Gemma Scope 2.
    if "gemma-scope" not in part or "gemma-scope-2-" in part:
      continue
    for suffix, kind in _RELEASE_KINDS.items():
      if part.endswith(suffix) or f"{suffix}/" in part:
        point = None if layer is None else f"blocks.{layer}.{kind}"
        return point, suffix == "-transcoders"
  return None, False


def _jumprelu_arrays(tensors, path, keys) -> dict:
  """Shape-checked arrays in `from_arrays`'s layout; ``keys`` maps our
  names to the file's."""
  w_enc = require_tensor(tensors, keys["w_enc"], path)
  if w_enc.ndim != 2:
    raise SAEFormatError(f"{path}: tensor {keys['w_enc']!r} has shape"
                         f" {list(w_enc.shape)}, expected [d_in, d_sae].")
  d_in, d_sae = w_enc.shape
  w_dec = require_tensor(tensors, keys["w_dec"], path)
  if w_dec.ndim != 2:
    raise SAEFormatError(
        f"{path}: tensor {keys['w_dec']!r} has shape {list(w_dec.shape)},"
        " expected [d_sae, d_out] (a 3-D decoder is a cross-layer"
        " transcoder: load it with penzai_lm.sae.load_transcoders).")
  b_dec = require_tensor(tensors, keys["b_dec"], path)
  # d_out as most sizes say (an SAE's is d_in), so the odd tensor is named.
  d_out = most_common(w_dec.shape[1], b_dec.shape[0] if b_dec.ndim == 1
                      else -1, d_in)
  shapes = {"w_dec": ((d_sae, d_out), "[d_sae, d_out]"),
            "b_enc": ((d_sae,), "[d_sae]"), "b_dec": ((d_out,), "[d_out]"),
            "threshold": ((d_sae,), "[d_sae]"),
            "w_skip": ((d_in, d_out), "[d_in, d_out]")}
  out = {"w_enc": w_enc}
  for name, (shape, meaning) in shapes.items():
    key = keys[name]
    if name == "w_skip" and key not in tensors:
      continue
    out[name] = check_shape(require_tensor(tensors, key, path), shape, path,
                            key, meaning)
  return out


def read_gemma_scope_1(file: Path, *, model=None, point=None,
                       output_point=None, input_axes=None, dtype=None
                       ) -> SparseAutoencoder:
  """Loads a Gemma Scope 1 ``params.npz`` (module docstring)."""
  tensors = tensor_files.read_npz(file)
  tensors = {("W_" + k[2:] if k.startswith("w_") else k): v
             for k, v in tensors.items()}
  keys = {"w_enc": "W_enc", "w_dec": "W_dec", "b_enc": "b_enc",
          "b_dec": "b_dec", "threshold": "threshold", "w_skip": "W_skip"}
  check_unexpected(tensors, keys.values(), file, "Gemma Scope JumpReLU SAE")
  arrays = _jumprelu_arrays(tensors, file, keys)
  found, transcoder = _gs1_points(file)
  transcoder = transcoder or output_point is not None
  return make_autoencoder(
      file, arrays, activation="jumprelu", transcoder=transcoder,
      point=point or found, output_point=output_point, model=model,
      input_axes=input_axes, dtype=resolve_dtype(dtype, None, file),
      size_fields=("W_enc's d_model", "W_dec's d_model"))


def _gs2_sidecar(file: Path) -> dict | None:
  sidecar = file.parent / SIDECAR
  if not sidecar.exists():  # A FIFO or device is refused by read_json.
    return None
  cfg = read_json(sidecar)
  if not isinstance(cfg, dict):
    raise SAEFormatError(f"{sidecar} is not a JSON object.")
  arch = cfg.get("architecture")
  if arch != "jump_relu":
    raise SAEFormatError(f"{where(sidecar, 'architecture')} is {arch!r};"
                         " Gemma Scope 2 autoencoders are 'jump_relu'.")
  return cfg


def _gs2_points(file: Path, cfg: dict | None, point, output_point):
  """(point, output point, transcoder) from the sidecar or the path."""
  sidecar = file.parent / SIDECAR
  if cfg is not None:
    found = []
    for key in ("hf_hook_point_in", "hf_hook_point_out"):
      name = cfg.get(key)
      if name is None:
        found.append(None)
        continue
      mapped = (hook_names.from_hugging_face(name) if isinstance(name, str)
                else None)
      given = point if key.endswith("in") else output_point
      if mapped is None and given is None:
        raise SAEFormatError(
            f"{where(sidecar, key)} is {name!r}, which is not a point"
            " penzai_lm knows; pass point= / output_point= (known:"
            f" model.layers.{{i}}.{sorted(hook_names.HF_BLOCK_HOOKS)}).")
      found.append(mapped)
    transcoder = cfg.get("hf_hook_point_out") is not None or bool(
        cfg.get("affine_connection"))
    read, write = found
  else:
    layer = _layer_in(file)
    folder = str(file.parent)
    kind = next((k for key, k in _GS2_KINDS if key in folder), None)
    read = None if layer is None or kind is None else f"blocks.{layer}.{kind}"
    transcoder = kind == "mlp_in"
    write = f"blocks.{layer}.mlp_out" if transcoder and read else None
  transcoder = transcoder or output_point is not None
  return point or read, output_point or write, transcoder


def read_gemma_scope_2(file: Path, *, model=None, point=None,
                       output_point=None, input_axes=None, dtype=None
                       ) -> SparseAutoencoder:
  """Loads a Gemma Scope 2 ``params.safetensors`` (module docstring)."""
  cfg = _gs2_sidecar(file)
  tensors = tensor_files.read_safetensors(file)
  keys = {"w_enc": "w_enc", "w_dec": "w_dec", "b_enc": "b_enc",
          "b_dec": "b_dec", "threshold": "threshold",
          "w_skip": "affine_skip_connection"}
  check_unexpected(tensors, keys.values(), file, "Gemma Scope 2 JumpReLU SAE")
  arrays = _jumprelu_arrays(tensors, file, keys)
  read, write, transcoder = _gs2_points(file, cfg, point, output_point)
  transcoder = transcoder or "w_skip" in arrays
  return make_autoencoder(
      file, arrays, activation="jumprelu", transcoder=transcoder, point=read,
      output_point=write, model=model, input_axes=input_axes,
      dtype=resolve_dtype(dtype, None, file),
      size_fields=("w_enc's d_in", "w_dec's d_out"))
