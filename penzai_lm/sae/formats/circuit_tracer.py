"""circuit-tracer's transcoders: ``config.yaml`` and the files it lists.

``config.yaml`` (as circuit-tracer's ``load_transcoders`` reads it):

* ``model_kind``: "transcoder_set" (one transcoder per block) or
  "cross_layer_transcoder";
* ``feature_input_hook`` / ``feature_output_hook``: TransformerLens hook
  names without the block (``mlp.hook_in``, ``ln2.hook_normalized``,
  ``hook_resid_mid``; ``hook_mlp_out``, ``mlp.hook_out``), mapped by
  `penzai_lm.sae.formats.hook_names`;
* ``transcoders``: optional list of per-block files, local paths (relative
  to the config's directory) or ``hf://org/repo/file`` (found in the local
  Hugging Face cache; nothing is downloaded). Without it, the directory's
  ``layer_{i}.safetensors`` (sets) or ``W_enc_{i}.safetensors`` +
  ``W_dec_{i}.safetensors`` (CLTs).

Per-block transcoder files: circuit-tracer's safetensors (``W_enc``
``[d_transcoder, d_model]``, ``W_dec`` ``[d_transcoder, d_model]``,
``b_enc``, ``b_dec``, ``activation_function.threshold`` for JumpReLU,
``W_skip`` ``[d_model, d_model]`` applied as ``x @ W_skip.T``); Gemma Scope
``params.npz`` (``W_enc`` ``[d_model, d_transcoder]``); Gemma Scope 2
safetensors (lower-case keys, see `penzai_lm.sae.formats.gemma_scope`).
Each becomes a `SparseAutoencoder` transcoder from
``blocks.{i}.<input>`` to ``blocks.{i}.<output>``.

JumpReLU: circuit-tracer computes ``pre * (pre > threshold)``, penzai_lm's
autoencoders ``relu(pre) * (pre > threshold)``; they agree for thresholds
>= 0 (every released transcoder); a negative threshold gets a warning.

CLT files: ``W_enc_{i}.safetensors`` holds ``W_enc_{i}`` ``[d_transcoder,
d_model]``, ``b_enc_{i}``, ``b_dec_{i}`` and ``threshold_{i}``;
``W_dec_{i}.safetensors`` holds ``W_dec_{i}`` ``[d_transcoder, n_layers -
i, d_model]``. Gemma Scope 2 CLTs list one file per block with ``w_enc``
``[d_model, d_transcoder]``, ``w_dec`` ``[d_transcoder, n_layers,
d_model]`` (targets before the block are unused), ``b_enc``, ``b_dec``,
``threshold`` and optionally ``affine_skip_connection``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
import re
from urllib.parse import parse_qs
from urllib.parse import urlparse
import warnings

import numpy as np
import yaml

from penzai_lm.sae.autoencoder import SparseAutoencoder
from penzai_lm.sae.formats import gemma_scope
from penzai_lm.sae.formats import hook_names
from penzai_lm.sae.formats import tensor_files
from penzai_lm.sae.formats.assemble import make_autoencoder
from penzai_lm.sae.formats.assemble import resolve_dtype
from penzai_lm.sae.formats.cross_layer import CrossLayerTranscoder
from penzai_lm.sae.formats.errors import SAEFormatError
from penzai_lm.sae.formats.errors import check_shape
from penzai_lm.sae.formats.errors import check_unexpected
from penzai_lm.sae.formats.errors import config_field
from penzai_lm.sae.formats.errors import require_tensor
from penzai_lm.sae.formats.errors import where

CONFIG = "config.yaml"
KINDS = ("transcoder_set", "cross_layer_transcoder")
_THRESHOLD = "activation_function.threshold"


@dataclasses.dataclass(frozen=True)
class TranscoderSet:
  """One transcoder per block, as circuit-tracer's ``TranscoderSet``.

  Attributes:
    transcoders: Block ``i``'s transcoder at index ``i``.
    input_hook, output_hook: The config's hook names.
  """

  transcoders: tuple[SparseAutoencoder, ...]
  input_hook: str
  output_hook: str

  def __len__(self) -> int:
    return len(self.transcoders)

  def __getitem__(self, layer: int) -> SparseAutoencoder:
    return self.transcoders[layer]

  def __iter__(self):
    return iter(self.transcoders)


def read_config(directory: Path) -> dict:
  path = directory / CONFIG
  try:
    config = yaml.safe_load(path.read_text())
  except (yaml.YAMLError, UnicodeDecodeError) as e:
    raise SAEFormatError(f"Cannot parse {path}: {e}") from e
  if not isinstance(config, dict):
    raise SAEFormatError(f"{path} is not a YAML mapping.")
  kind = config_field(config, "model_kind", path, kind="str")
  if kind not in KINDS:
    raise SAEFormatError(f"{where(path, 'model_kind')} is {kind!r};"
                         f" supported: {list(KINDS)}.")
  for key in ("feature_input_hook", "feature_output_hook"):
    config_field(config, key, path, kind="str")
  return config


def _hf_cached(uri: str, field: str, cfg_path: Path) -> Path:
  """The local Hugging Face cache's copy of ``hf://org/repo/file``."""
  parsed = urlparse(uri)
  repo, _, file = parsed.path.lstrip("/").partition("/")
  revision = parse_qs(parsed.query).get("revision", [None])[0]
  found = None
  try:
    from huggingface_hub import try_to_load_from_cache  # pylint: disable=g-import-not-at-top
    found = try_to_load_from_cache(f"{parsed.netloc}/{repo}", file,
                                   revision=revision)
  except ImportError:
    pass
  if isinstance(found, str):
    return Path(found)
  raise SAEFormatError(
      f"{where(cfg_path, field)} is {uri}, which is not in the local Hugging"
      " Face cache (penzai_lm downloads nothing): fetch it first, e.g."
      f" `huggingface-cli download {parsed.netloc}/{repo} {file}`, or list"
      " local paths instead.")


def _listed_paths(config: dict, directory: Path,
                  pattern: str | None = None) -> list[Path]:
  """The per-block files, block ``i`` at index ``i``: the config's list,
  else the directory's files matching ``pattern`` (block number in group
  1)."""
  cfg_path = directory / CONFIG
  listed = config.get("transcoders")
  if listed is not None:
    if not isinstance(listed, list) or not all(isinstance(p, str)
                                               for p in listed):
      raise SAEFormatError(f"{where(cfg_path, 'transcoders')} must be a list"
                           " of paths.")
    out = []
    for i, entry in enumerate(listed):
      field = f"transcoders[{i}]"
      path = (_hf_cached(entry, field, cfg_path) if entry.startswith("hf://")
              else directory / entry)
      if not path.is_file():
        raise SAEFormatError(f"{where(cfg_path, field)} is {entry!r}, but"
                             f" {path} does not exist.")
      out.append(path)
    return out
  found = {}
  for path in directory.iterdir():
    m = re.fullmatch(pattern, path.name)
    if m:
      found[int(m.group(1))] = path
  if not found or sorted(found) != list(range(len(found))):
    raise SAEFormatError(
        f"{directory}: {CONFIG} lists no transcoders and the files matching"
        f" {pattern!r} are blocks {sorted(found)}; circuit-tracer needs one"
        " per block from 0 on.")
  return [found[i] for i in range(len(found))]


def _points(config, cfg_path, layer, input_point, output_point, model):
  """This block's points: the caller's block-relative names, else the
  config's hooks."""
  out = []
  for key, given in (("feature_input_hook", input_point),
                     ("feature_output_hook", output_point)):
    if given is not None:
      out.append(f"blocks.{layer}.{given}")
      continue
    hook = config[key]
    point = hook_names.from_transformer_lens(hook, layer)
    if point is None:
      raise SAEFormatError(
          f"{where(cfg_path, key)} is {hook!r}, which is not a point"
          " penzai_lm knows; pass input_point= / output_point= (e.g."
          " 'mlp_in', 'mlp_out').")
    hook_names.check_mlp_hook_out(hook, point, hook_names.model_config(model),
                                  where(cfg_path, key))
    out.append(point)
  return out


def _warn_negative(threshold: np.ndarray, path) -> None:
  if threshold is not None and (threshold < 0).any():
    warnings.warn(
        f"{path}: {int((threshold < 0).sum())} JumpReLU thresholds are"
        " negative; penzai_lm zeroes negative pre-activations, circuit-tracer"
        " keeps those above the threshold.", stacklevel=4)


def read_layer_file(file: Path, *, point: str, output_point: str, model=None,
                    dtype=None) -> SparseAutoencoder:
  """One block's transcoder file in any of the layouts above."""
  if file.suffix == ".npz":
    return gemma_scope.read_gemma_scope_1(
        file, model=model, point=point, output_point=output_point,
        dtype=dtype)
  names = tensor_files.safetensors_locations(file)
  if "w_enc" in names:
    return gemma_scope.read_gemma_scope_2(
        file, model=model, point=point, output_point=output_point,
        dtype=dtype)
  tensors = tensor_files.read_safetensors(file)
  check_unexpected(tensors, ("W_enc", "W_dec", "b_enc", "b_dec", _THRESHOLD,
                             "threshold", "W_skip"), file,
                   "circuit-tracer transcoder")
  b_enc = require_tensor(tensors, "b_enc", file)
  b_dec = require_tensor(tensors, "b_dec", file)
  f, d = b_enc.shape[0], b_dec.shape[0]
  arrays = {
      "w_enc": check_shape(require_tensor(tensors, "W_enc", file), (f, d),
                           file, "W_enc", "[d_transcoder, d_model]").T,
      "b_enc": b_enc, "b_dec": b_dec,
      "w_dec": check_shape(require_tensor(tensors, "W_dec", file), (f, d),
                           file, "W_dec", "[d_transcoder, d_model]"),
  }
  threshold = tensors.get(_THRESHOLD, tensors.get("threshold"))
  if threshold is not None:
    arrays["threshold"] = check_shape(threshold.reshape(-1), (f,), file,
                                      _THRESHOLD, "[d_transcoder]")
    _warn_negative(arrays["threshold"], file)
  if "W_skip" in tensors:
    arrays["w_skip"] = check_shape(tensors["W_skip"], (d, d), file, "W_skip",
                                   "[d_model, d_model]").T
  return make_autoencoder(
      file, arrays, activation="jumprelu" if threshold is not None else "relu",
      transcoder=True, point=point, output_point=output_point, model=model,
      dtype=resolve_dtype(dtype, None, file),
      size_fields=("b_dec's d_model", "b_dec's d_model"))


def read_transcoder_set(directory: Path, config: dict, *, model=None,
                        input_point=None, output_point=None, dtype=None
                        ) -> TranscoderSet:
  cfg_path = directory / CONFIG
  files = _listed_paths(config, directory, r"layer_(\d+)\.safetensors")
  out = []
  for layer, file in enumerate(files):
    read, write = _points(config, cfg_path, layer, input_point, output_point,
                          model)
    out.append(read_layer_file(file, point=read, output_point=write,
                               model=model, dtype=dtype))
  return TranscoderSet(tuple(out), config["feature_input_hook"],
                       config["feature_output_hook"])


def _clt_arrays(directory: Path, config: dict) -> dict:
  """A CLT's arrays in `CrossLayerTranscoder.from_arrays`'s layout."""
  if config.get("transcoders") is not None:
    files = _listed_paths(config, directory)
    n, per = len(files), []
    for file in files:
      t = tensor_files.read_safetensors(file)
      check_unexpected(t, ("w_enc", "w_dec", "b_enc", "b_dec", "threshold",
                           "affine_skip_connection"), file,
                       "Gemma Scope 2 cross-layer transcoder block")
      d, f = require_tensor(t, "w_enc", file).shape
      check_shape(require_tensor(t, "w_dec", file), (f, n, d), file, "w_dec",
                  "[d_sae, n_layers, d_in]")
      for key, shape in (("b_enc", (f,)), ("b_dec", (d,)),
                         ("threshold", (f,))):
        check_shape(require_tensor(t, key, file), shape, file, key, str(shape))
      per.append(t)
    skip = all("affine_skip_connection" in t for t in per)
    return dict(
        w_enc=np.stack([t["w_enc"].T for t in per]),
        b_enc=np.stack([t["b_enc"] for t in per]),
        w_dec=[t["w_dec"][:, i:] for i, t in enumerate(per)],
        b_dec=np.stack([t["b_dec"] for t in per]),
        threshold=np.stack([t["threshold"] for t in per]),
        w_skip=(np.stack([t["affine_skip_connection"] for t in per])
                if skip else None))
  encs = _listed_paths(config, directory, r"W_enc_(\d+)\.safetensors")
  n = len(encs)
  parts = {"w_enc": [], "b_enc": [], "b_dec": [], "threshold": [],
           "w_dec": []}
  for i, file in enumerate(encs):
    t = tensor_files.read_safetensors(file)
    w = require_tensor(t, f"W_enc_{i}", file)
    if w.ndim != 2:
      raise SAEFormatError(f"{file}: tensor 'W_enc_{i}' has shape"
                           f" {list(w.shape)}, expected [d_transcoder,"
                           " d_model].")
    f, d = w.shape
    parts["w_enc"].append(w)
    parts["b_enc"].append(check_shape(require_tensor(t, f"b_enc_{i}", file),
                                      (f,), file, f"b_enc_{i}", "[d_transcoder]"))
    parts["b_dec"].append(check_shape(require_tensor(t, f"b_dec_{i}", file),
                                      (d,), file, f"b_dec_{i}", "[d_model]"))
    if f"threshold_{i}" in t:
      parts["threshold"].append(check_shape(
          t[f"threshold_{i}"].reshape(-1), (f,), file, f"threshold_{i}",
          "[d_transcoder]"))
    dec_file = directory / f"W_dec_{i}.safetensors"
    if not dec_file.is_file():
      raise SAEFormatError(f"{directory} has W_enc_{i}.safetensors but no"
                           f" W_dec_{i}.safetensors; the CLT is incomplete.")
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


def read_clt(directory: Path, config: dict, *, model=None, input_point=None,
             output_point=None, dtype=None) -> CrossLayerTranscoder:
  cfg_path = directory / CONFIG
  arrays = _clt_arrays(directory, config)
  _warn_negative(arrays["threshold"], directory)
  read, write = _points(config, cfg_path, 0, input_point, output_point, model)
  return CrossLayerTranscoder.from_arrays(
      **arrays, input_point=hook_names.split_point(read)[1],
      output_point=hook_names.split_point(write)[1],
      dtype=resolve_dtype(dtype, None, cfg_path))
