"""`load_sae`, `load_transcoders` and `save_sae`: one entry point per kind.

`load_sae` recognizes the format from the path:

=====================================  ======================================
path                                   format
=====================================  ======================================
a directory with ``cfg.json``          SAELens (`formats.saelens`)
``params.npz`` (or its directory)      Gemma Scope 1 (`formats.gemma_scope`)
``params.safetensors`` (or its         Gemma Scope 2
directory); any safetensors file
with lower-case ``w_enc``
a safetensors file with ``W_enc``      one circuit-tracer transcoder (needs
(and no ``cfg.json`` beside it)        ``point=``)
=====================================  ======================================

`load_transcoders` reads a circuit-tracer ``config.yaml`` (a directory with
one, or the file): a `TranscoderSet` or a `CrossLayerTranscoder`.
"""

from __future__ import annotations

import os
from pathlib import Path

from penzai_lm.sae.autoencoder import SparseAutoencoder
from penzai_lm.sae.formats import circuit_tracer
from penzai_lm.sae.formats import clt_files
from penzai_lm.sae.formats import gemma_scope
from penzai_lm.sae.formats import saelens
from penzai_lm.sae.formats import tensor_files
from penzai_lm.sae.formats.cross_layer import CrossLayerTranscoder
from penzai_lm.sae.formats.errors import SAEFormatError


def _existing(path) -> Path:
  if not isinstance(path, (str, os.PathLike)):
    raise TypeError(f"path must be a str or os.PathLike, got"
                    f" {type(path).__name__}.")
  path = Path(path).expanduser()
  if not path.exists():
    raise FileNotFoundError(f"{path} does not exist.")
  return path


def load_sae(path, *, model=None, point: str | None = None,
             output_point: str | None = None, input_axes=None, dtype=None,
             fold_norm: bool = True) -> SparseAutoencoder:
  """Loads a sparse autoencoder or transcoder from disk (formats above).

  Args:
    path: A directory or file.
    model: The model it is for (or its `TransformerConfig`): checks that
      its points exist there (``blocks.99`` of a 30-block model is an
      error) and the sizes, and gives the head layout of attention-output SAEs (SAELens
      ``hook_z``, Gemma Scope ``-att``), which need it (or ``input_axes``).
    point: The point it reads, overriding the file's hook name (needed when
      the file names none or one penzai_lm does not know); the arrays then
      read that point as they are (no norm weights folded in).
    output_point: The point a transcoder writes, overriding the file's.
    input_axes: The input's axes, ``{"name": size, ...}`` or ``((name,
      size), ...)`` flattened in the file's order (overrides the point's).
    dtype: The dtype to load in (default: SAELens's ``dtype`` field, else
      float32).
    fold_norm: For a file whose hook is TransformerLens's
      ``ln2.hook_normalized`` (the pre-MLP norm's output before its
      weights), fold ``model``'s weights of that norm into the arrays so
      that the autoencoder reads (and an SAE writes) ``mlp_in``, which is
      after them (`penzai_lm.sae.formats.norm_fold`); this needs the model
      itself. False loads the arrays as they are, which is right only if
      the norm's weights are all 1.

  Returns:
    A checked `SparseAutoencoder` whose config names its points.

  Raises:
    FileNotFoundError: if ``path`` does not exist.
    SAEFormatError: for a file that is not one of the formats, or is
      malformed, or (``fold_norm``) whose hook is before a norm's weights
      when ``model`` is not a model or a weight is nearly zero; the message
      names the file and field.
  """
  path = _existing(path)
  kwargs = dict(model=model, point=point, output_point=output_point,
                input_axes=input_axes, dtype=dtype)
  if not isinstance(fold_norm, bool):
    raise TypeError(f"fold_norm must be True or False, got {fold_norm!r}.")
  if path.is_dir():
    for name in (saelens.CFG, gemma_scope.GS1_FILE, gemma_scope.GS2_FILE):
      if (path / name).exists():  # The reader refuses a FIFO or device.
        return load_sae(path / name, fold_norm=fold_norm, **kwargs)
    if (path / circuit_tracer.CONFIG).exists():
      raise SAEFormatError(f"{path} is a circuit-tracer directory"
                           f" ({circuit_tracer.CONFIG}): load it with"
                           " penzai_lm.sae.load_transcoders.")
    raise SAEFormatError(
        f"{path} holds none of {saelens.CFG} (SAELens),"
        f" {gemma_scope.GS1_FILE} (Gemma Scope), {gemma_scope.GS2_FILE}"
        " (Gemma Scope 2); pass the file itself if it has another name.")
  if path.name == saelens.CFG or (path.name == saelens.WEIGHTS and (
      path.parent / saelens.CFG).exists()):
    return saelens.read_saelens(path.parent, fold_norm=fold_norm, **kwargs)
  if path.suffix == ".npz":
    return gemma_scope.read_gemma_scope_1(path, **kwargs)
  if path.suffix != ".safetensors":
    raise SAEFormatError(f"{path}: not an autoencoder file penzai_lm reads"
                         " (cfg.json, .npz or .safetensors).")
  names = tensor_files.safetensors_locations(path)
  if "w_enc" in names:
    return gemma_scope.read_gemma_scope_2(path, **kwargs)
  if "W_enc" in names:
    if point is None:
      raise SAEFormatError(
          f"{path} is a circuit-tracer transcoder file, which names no"
          " points: pass point= (e.g. 'blocks.3.mlp_in'; output_point"
          " defaults to that block's mlp_out), or load the directory's"
          " config.yaml with load_transcoders.")
    return circuit_tracer.read_layer_file(
        path, point=point, output_point=output_point, model=model,
        dtype=dtype)
  raise SAEFormatError(
      f"{path} holds neither 'W_enc' (SAELens, circuit-tracer) nor 'w_enc'"
      f" (Gemma Scope 2); it holds {sorted(names)}.")


def load_transcoders(path, *, model=None, input_point: str | None = None,
                     output_point: str | None = None, dtype=None,
                     allow_outside: bool = False, fold_norm: bool = True
                     ) -> circuit_tracer.TranscoderSet | CrossLayerTranscoder:
  """Loads circuit-tracer transcoders from a ``config.yaml`` (or its
  directory): a `TranscoderSet` (``model_kind: transcoder_set``) or a
  `CrossLayerTranscoder`.

  The files the config lists are confined to its folder (relative paths
  that stay inside it, links included; `formats.layer_files`); every block
  has the same sizes.

  Args:
    path: The directory or the ``config.yaml``.
    model: The model (or config): each block must exist in it (no more
      blocks than the model has) and its sizes match.
    input_point, output_point: Block-relative points (``"mlp_in"``,
      ``"mlp_out"``) overriding ``feature_input_hook`` /
      ``feature_output_hook`` (the arrays then read and write them as they
      are).
    dtype: The dtype to load in (default float32, as circuit-tracer).
    allow_outside: Also load absolute paths, ``hf://`` files (from the
      local Hugging Face cache) and relative paths that leave the config's
      folder; only for configs you trust.
    fold_norm: As for `load_sae`: with ``feature_input_hook:
      ln2.hook_normalized`` (circuit-tracer's "gemma" transcoders), fold
      each block's pre-MLP norm weights from ``model`` (needed) into its
      encoder and skip, so that it reads ``mlp_in``; False uses the arrays
      as they are.

  Raises:
    FileNotFoundError: if ``path`` does not exist.
    SAEFormatError: for malformed or missing files, or files outside the
      config's folder, naming the file and field.
  """
  if not isinstance(allow_outside, bool):
    raise TypeError(f"allow_outside must be True or False, got"
                    f" {allow_outside!r}.")
  path = _existing(path)
  directory = path if path.is_dir() else path.parent
  if not (directory / circuit_tracer.CONFIG).exists():
    raise SAEFormatError(f"{directory} has no {circuit_tracer.CONFIG}.")
  config = circuit_tracer.read_config(directory)
  read = (circuit_tracer.read_transcoder_set
          if config["model_kind"] == "transcoder_set"
          else clt_files.read_clt)
  return read(directory, config, model=model, input_point=input_point,
              output_point=output_point, dtype=dtype,
              allow_outside=allow_outside, fold_norm=fold_norm)


def save_sae(sae: SparseAutoencoder, directory, *, model_name: str | None = None,
             context_size: int | None = None, prepend_bos: bool | None = None,
             metadata: dict | None = None) -> Path:
  """Saves ``sae`` in SAELens's format (``cfg.json`` +
  ``sae_weights.safetensors``), readable by ``sae_lens.SAE.load_from_disk``
  and by `load_sae`.

  The points become TransformerLens hook names (`formats.hook_names`);
  ``mlp_in`` is written as ``mlp.hook_in`` (the MLP's input, after the
  pre-MLP norm's weights, as circuit-tracer and TransformerLens 3's bridge
  name it), not ``ln2.hook_normalized``, which is before them.

  Args:
    sae: The autoencoder.
    directory: Created if needed; existing files of these names are
      replaced, each written to a temporary file and renamed into place
      (never through a link planted there: `penzai_lm.file_access`).
    model_name: Recorded as ``metadata.model_name``.
    context_size, prepend_bos: Recorded as ``metadata.context_size`` /
      ``metadata.prepend_bos``: the window length the autoencoder was
      trained on and whether a BOS was prepended to each window (SAELens's
      ``ActivationsStore.from_sae`` needs both and ``hook_name``).
    metadata: More ``metadata`` fields: a dict of str keys and JSON values,
      none of the keys save_sae writes itself (``hook_name``,
      ``model_name``, ``sae_lens_version``...).

  Returns:
    The directory.

  Raises:
    ValueError: for an autoencoder SAELens cannot represent, or metadata
      that sets a key save_sae writes.
    TypeError: for metadata that is not JSON.
  """
  extra = {}
  if context_size is not None:
    if isinstance(context_size, bool) or not isinstance(
        context_size, int) or context_size <= 0:
      raise ValueError(f"context_size must be an int > 0, got"
                       f" {context_size!r}.")
    extra["context_size"] = context_size
  if prepend_bos is not None:
    if not isinstance(prepend_bos, bool):
      raise TypeError(f"prepend_bos must be True or False, got"
                      f" {prepend_bos!r}.")
    extra["prepend_bos"] = prepend_bos
  if extra and metadata is not None and not isinstance(metadata, dict):
    raise TypeError(f"metadata must be a dict with str keys, got"
                    f" {metadata!r}.")
  clash = sorted(set(extra) & set(metadata or {}))
  if clash:
    raise ValueError(f"metadata sets {clash}, also passed as arguments;"
                     " pass each once.")
  merged = {**(metadata or {}), **extra} if extra else metadata
  return saelens.write_saelens(sae, directory, model_name=model_name,
                               metadata=merged)
