"""circuit-tracer's transcoders: ``config.yaml`` and the files it lists.

``config.yaml`` (as circuit-tracer's ``load_transcoders`` reads it):

* ``model_kind``: "transcoder_set" (one transcoder per block) or
  "cross_layer_transcoder";
* ``feature_input_hook`` / ``feature_output_hook``: TransformerLens hook
  names without the block (``mlp.hook_in``, ``ln2.hook_normalized``,
  ``hook_resid_mid``; ``hook_mlp_out``, ``mlp.hook_out``), mapped by
  `penzai_lm.sae.formats.hook_names`; ``ln2.hook_normalized`` (Gemma
  Scope transcoders' "gemma" config) is before the pre-MLP norm's weights,
  which are folded into each block's encoder and skip from ``model=``
  (`penzai_lm.sae.formats.norm_fold`; ``fold_norm=False`` skips that);
* ``transcoders``: optional list of per-block files, paths relative to the
  config's directory and confined to it, or (only with ``allow_outside``)
  absolute paths and ``hf://org/repo/file`` (found in the local Hugging
  Face cache; nothing is downloaded): see
  `penzai_lm.sae.formats.layer_files`. Without it, the directory's
  ``layer_{i}.safetensors`` (sets) or ``W_enc_{i}.safetensors`` +
  ``W_dec_{i}.safetensors`` (CLTs).

Every block's transcoder must have the same sizes (``d_model`` read and
written, ``d_transcoder``); with ``model=`` each block must exist in the
model and its sizes match it.

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
import warnings

import numpy as np
import yaml

from penzai_lm.sae.autoencoder import SparseAutoencoder
from penzai_lm.sae.formats import gemma_scope
from penzai_lm.sae.formats import hook_names
from penzai_lm.sae.formats import tensor_files
from penzai_lm.sae.formats.assemble import make_autoencoder
from penzai_lm.sae.formats.assemble import resolve_dtype
from penzai_lm.sae.formats.errors import SAEFormatError
from penzai_lm.sae.formats.errors import check_shape
from penzai_lm.sae.formats.errors import check_unexpected
from penzai_lm.sae.formats.errors import config_field
from penzai_lm.sae.formats.errors import most_common
from penzai_lm.sae.formats.errors import read_file
from penzai_lm.sae.formats.errors import require_tensor
from penzai_lm.sae.formats.errors import where
from penzai_lm.sae.formats.layer_files import CONFIG
from penzai_lm.sae.formats.layer_files import layer_paths
from penzai_lm.sae.formats.norm_fold import NormReader
from penzai_lm.sae.formats.norm_fold import fold_autoencoder

KINDS = ("transcoder_set", "cross_layer_transcoder")
_THRESHOLD = "activation_function.threshold"


@dataclasses.dataclass(frozen=True)
class TranscoderSet:
  """One transcoder per block, as circuit-tracer's ``TranscoderSet``.

  Attributes:
    transcoders: Block ``i``'s transcoder at index ``i``.
    input_hook, output_hook: The config's hook names.
    norm_folded: Whether the pre-MLP norm's weights were folded into the
      arrays (a hook such as ``ln2.hook_normalized`` is before them; the
      transcoders read ``mlp_in``, after them: `norm_fold`).
  """

  transcoders: tuple[SparseAutoencoder, ...]
  input_hook: str
  output_hook: str
  norm_folded: bool = False

  def __len__(self) -> int:
    return len(self.transcoders)

  def __getitem__(self, layer: int) -> SparseAutoencoder:
    return self.transcoders[layer]

  def __iter__(self):
    return iter(self.transcoders)


def read_config(directory: Path) -> dict:
  """The checked ``config.yaml`` of ``directory`` (a regular file; YAML
  that does not parse, nests too deeply or is not a mapping is an
  `SAEFormatError` naming it)."""
  path = directory / CONFIG
  text = read_file(path, "a circuit-tracer config")
  try:
    config = yaml.safe_load(text)
  except RecursionError as e:
    raise SAEFormatError(
        f"Cannot parse {path}: it nests YAML lists or mappings too deeply"
        " for a config; the file is corrupt or not circuit-tracer's.") from e
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


def points(config, cfg_path, layer, input_point, output_point, model):
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


def warn_negative(threshold: np.ndarray, path) -> None:
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
  w_enc, w_dec, b_enc, b_dec = (require_tensor(tensors, key, file) for key
                                in ("W_enc", "W_dec", "b_enc", "b_dec"))
  for key, value, ndim in (("W_enc", w_enc, 2), ("W_dec", w_dec, 2),
                           ("b_enc", b_enc, 1), ("b_dec", b_dec, 1)):
    if value.ndim != ndim:
      raise SAEFormatError(f"{file}: tensor {key!r} has shape"
                           f" {list(value.shape)}; it must have {ndim}"
                           " dimension(s).")
  # The sizes most tensors agree on, so that the odd one is named.
  f = most_common(w_enc.shape[0], w_dec.shape[0], b_enc.shape[0])
  d = most_common(w_enc.shape[1], w_dec.shape[1], b_dec.shape[0])
  arrays = {
      "w_enc": check_shape(w_enc, (f, d), file, "W_enc",
                           "[d_transcoder, d_model]").T,
      "b_enc": check_shape(b_enc, (f,), file, "b_enc", "[d_transcoder]"),
      "b_dec": check_shape(b_dec, (d,), file, "b_dec", "[d_model]"),
      "w_dec": check_shape(w_dec, (f, d), file, "W_dec",
                           "[d_transcoder, d_model]"),
  }
  threshold = tensors.get(_THRESHOLD, tensors.get("threshold"))
  if threshold is not None:
    arrays["threshold"] = check_shape(threshold.reshape(-1), (f,), file,
                                      _THRESHOLD, "[d_transcoder]")
    warn_negative(arrays["threshold"], file)
  if "W_skip" in tensors:
    arrays["w_skip"] = check_shape(tensors["W_skip"], (d, d), file, "W_skip",
                                   "[d_model, d_model]").T
  return make_autoencoder(
      file, arrays, activation="jumprelu" if threshold is not None else "relu",
      transcoder=True, point=point, output_point=output_point, model=model,
      dtype=resolve_dtype(dtype, None, file),
      size_fields=("b_dec's d_model", "b_dec's d_model"))


def _sizes(sae: SparseAutoencoder) -> tuple[int, int, int]:
  c = sae.config
  return c.input_size, c.num_features, c.output_size


def file_hooks(config: dict, input_point, output_point):
  """The config's (input, output) hooks where they name the points (None
  where the caller's point overrides them)."""
  return (config["feature_input_hook"] if input_point is None else None,
          config["feature_output_hook"] if output_point is None else None)


def read_transcoder_set(directory: Path, config: dict, *, model=None,
                        input_point=None, output_point=None, dtype=None,
                        allow_outside=False, fold_norm=True
                        ) -> TranscoderSet:
  """The set's transcoders, one per listed block, of one size, with the
  norm's weights folded in where a hook is before them (`norm_fold`)."""
  cfg_path = directory / CONFIG
  files = layer_paths(config, directory, r"layer_(\d+)\.safetensors",
                      allow_outside=allow_outside)
  norms = NormReader(model, fold_norm)
  in_hook, out_hook = file_hooks(config, input_point, output_point)
  out, folded = [], False
  for layer, file in enumerate(files):
    read, write = points(config, cfg_path, layer, input_point, output_point,
                          model)
    sae = read_layer_file(file, point=read, output_point=write, model=model,
                          dtype=dtype)
    fold_in = norms.weights(in_hook, read,
                            where(cfg_path, "feature_input_hook"))
    fold_out = norms.weights(out_hook, write,
                             where(cfg_path, "feature_output_hook"))
    folded = folded or fold_in is not None or fold_out is not None
    out.append(fold_autoencoder(sae, fold_in, fold_out, file))
    if _sizes(out[-1]) != _sizes(out[0]):
      raise SAEFormatError(
          f"{file} is a transcoder of (d_in, d_transcoder, d_out) ="
          f" {_sizes(out[-1])} but {files[0]} of {_sizes(out[0])}; a"
          " transcoder set's blocks all have one size (the files come from"
          " different sets or models).")
  return TranscoderSet(tuple(out), config["feature_input_hook"],
                       config["feature_output_hook"], norm_folded=folded)
