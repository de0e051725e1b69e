"""Reads Hugging Face model directories (config.json + safetensors).

Supported classes: those of the architecture specs
(:mod:`penzai_lm.checkpoints.specs`): LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Gemma3ForCausalLM (also the text part of
Gemma3ForConditionalGeneration) and GPT2LMHeadModel. The spec says which
classes and ``model_type`` values select it, and which tensors to drop or
rename. No torch is needed: tensors are read one at a time by
:mod:`~penzai_lm.checkpoints.safetensors_io`.

`open_hf_dir` checks a directory without reading tensor data and returns a
`LazyCheckpoint`; `read_hf_dir` reads every tensor of it.
"""

from __future__ import annotations

import functools
import os
import re
import struct
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from penzai_lm.checkpoints import layout
from penzai_lm.checkpoints.architectures import spec_for
from penzai_lm.checkpoints.checkpoint import CORRUPT_HINT
from penzai_lm.checkpoints.checkpoint import Checkpoint
from penzai_lm.checkpoints.checkpoint import CheckpointError
from penzai_lm.checkpoints.checkpoint import CheckpointFileNotFoundError
from penzai_lm.checkpoints.checkpoint import LazyCheckpoint
from penzai_lm.checkpoints.checkpoint import check_path_exists
from penzai_lm.checkpoints.checkpoint import resolve_dtype
from penzai_lm.checkpoints.safetensors_io import TensorLocation
from penzai_lm.checkpoints.safetensors_io import check_float_dtypes
from penzai_lm.checkpoints.safetensors_io import read_tensor
from penzai_lm.checkpoints.spec_types import ArchitectureSpec
from penzai_lm.checkpoints.spec_types import frozen_map
from penzai_lm.checkpoints.specs import SPECS
from penzai_lm.checkpoints.validation import CONFIG_HINT
from penzai_lm.checkpoints.validation import check_layer_count
from penzai_lm.checkpoints.file_checks import check_safetensors_header
from penzai_lm.checkpoints.json_files import parse_json
from penzai_lm.checkpoints.json_files import short_repr
from penzai_lm.checkpoints.validation import layer_indices


def _class_table(
    specs: Sequence[ArchitectureSpec],
) -> dict[str, ArchitectureSpec]:
  """HF class name -> spec, wrapper classes included."""
  return {cls: spec for spec in specs for cls in spec.hf.all_classes}


def _model_type_table(
    specs: Sequence[ArchitectureSpec],
) -> dict[str, ArchitectureSpec]:
  """config.json ``model_type`` -> spec."""
  return {t: spec for spec in specs for t in spec.hf.all_model_types}


# HF class name -> canonical architecture.
SUPPORTED_HF_CLASSES: Mapping[str, str] = frozen_map(
    {cls: spec.name for cls, spec in _class_table(SPECS).items()}
)

# Non-parameter buffers some checkpoints of any architecture carry.
_ROTARY_BUFFER = re.compile(r"\.rotary_emb\.inv_freq$")  # old llama files


def _supported_text(specs: Sequence[ArchitectureSpec]) -> str:
  """The supported classes, for error messages."""
  text = "Hugging Face classes " + ", ".join(
      cls for spec in specs for cls in spec.hf.classes
  )
  wrappers = [
      cls
      for spec in specs
      if spec.hf.multimodal
      for cls in spec.hf.multimodal.classes
  ]
  if wrappers:
    text += f" (and the text model of {', '.join(wrappers)})"
  return text


def _detect_architecture(
    config: dict[str, Any], path: Path, specs: Sequence[ArchitectureSpec]
) -> tuple[ArchitectureSpec, str]:
  """Returns (the spec, HF class name or model_type that selected it)."""
  where = path / "config.json"
  classes = config.get("architectures") or []
  if not isinstance(classes, list) or not all(
      isinstance(c, str) for c in classes
  ):
    raise CheckpointError(
        f"{where}: key 'architectures' = {short_repr(classes)} must be a list of"
        f' class names, such as ["LlamaForCausalLM"]; {CONFIG_HINT}'
    )
  if not isinstance(config.get("model_type"), (str, type(None))):
    raise CheckpointError(
        f"{where}: key 'model_type' = {short_repr(config['model_type'])} must be"
        f' a string, such as "llama"; {CONFIG_HINT}'
    )
  by_class = _class_table(specs)
  for cls in classes:
    if cls in by_class:
      return by_class[cls], cls
  model_type = config.get("model_type")
  by_type = _model_type_table(specs)
  if not classes and model_type in by_type:
    return by_type[model_type], model_type
  what = ", ".join(classes) if classes else f"model_type {model_type!r}"
  raise CheckpointError(
      layout.unsupported_architecture_message(
          f"{what} in {where}", _supported_text(specs)
      )
  )


def _read_config(path: Path) -> dict[str, Any]:
  cfg_path = path / "config.json"
  if not cfg_path.is_file():
    raise CheckpointFileNotFoundError(
        f"{path} has no config.json; a Hugging Face model directory needs"
        " config.json and model.safetensors (or model.safetensors.index.json)"
    )
  config = parse_json(cfg_path.read_bytes(), str(cfg_path))
  if not isinstance(config, dict):
    raise CheckpointError(
        f"{cfg_path} does not hold a JSON object; {CORRUPT_HINT}"
    )
  return config


def _weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
  """The safetensors files, and the index's tensor -> shard map if sharded."""
  index = path / "model.safetensors.index.json"
  single = path / "model.safetensors"
  if index.is_file():
    weight_map = parse_json(index.read_bytes(), str(index))
    weight_map = (
        weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    )
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) for v in weight_map.values()
    ):
      raise CheckpointError(
          f"{index}: key 'weight_map' must be an object of tensor name ->"
          f" shard file name; {CORRUPT_HINT}"
      )
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
      raise CheckpointFileNotFoundError(
          f"{index} lists shard(s) missing from {path}: {', '.join(missing)};"
          " download the missing shard(s) (or the whole model) again"
      )
    return [path / f for f in files], weight_map
  if single.is_file():
    return [single], None
  others = sorted(
      p.name
      for p in path.iterdir()
      if p.suffix in (".bin", ".pt", ".pth", ".safetensors", ".gguf")
  )
  hint = f" (found {', '.join(others)}; only safetensors are supported)" if others else ""
  raise CheckpointFileNotFoundError(
      f"{path} has no model.safetensors or model.safetensors.index.json{hint}"
  )


def _read_header(file: Path) -> tuple[dict[str, Any], int]:
  """A safetensors file's checked header entries, and its data offset."""
  size = file.stat().st_size
  with open(file, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise CheckpointError(
          f"{file} is too short for a safetensors file; {CORRUPT_HINT}"
      )
    (n,) = struct.unpack("<Q", head)
    if n > size - 8:
      raise CheckpointError(
          f"{file}: header length {n} exceeds the file ({size} bytes);"
          f" {CORRUPT_HINT}"
      )
    header = parse_json(f.read(n), f"the safetensors header of {file}")
  return check_safetensors_header(str(file), header, 8 + n, size), 8 + n


def _canonical_namer(spec: ArchitectureSpec):
  """File tensor name -> plain CausalLM state_dict name, or None to drop."""
  dropped = [_ROTARY_BUFFER, *(re.compile(p) for p in spec.hf.dropped_tensors)]
  renames = [(re.compile(p), r) for p, r in spec.hf.tensor_renames]

  def canonical(name: str) -> str | None:
    if any(p.search(name) for p in dropped):
      return None
    for pattern, replacement in renames:
      name, n = pattern.subn(replacement, name, count=1)
      if n:
        break
    return name

  return canonical


def _read_headers(
    spec: ArchitectureSpec, files: list[Path], weight_map: dict[str, str] | None
) -> dict[Path, tuple[dict[str, Any], int, dict[str, str]]]:
  """Every file's checked header, data offset and kept names (-> canonical).

  Raises:
    CheckpointError: a bad header, a tensor in two shards, or one the index
      places in a shard that lacks it.
  """
  canonical = _canonical_namer(spec)
  out, seen = {}, {}
  for file in files:
    entries, base = _read_header(file)
    keep = {}
    for name in entries:
      if name in seen:
        raise CheckpointError(
            f"{file.parent}: tensor {name!r} appears in more than one shard"
            f" ({seen[name]}, {file.name}); {CORRUPT_HINT}"
        )
      seen[name] = file.name
      if (c := canonical(name)) is not None:
        keep[name] = c
    out[file] = (entries, base, keep)
  for name, shard in (weight_map or {}).items():
    if seen.get(name) != shard:
      raise CheckpointError(
          f"{files[0].parent / 'model.safetensors.index.json'} places tensor"
          f" {name!r} in {shard}, but {shard} has no such tensor;"
          f" {CORRUPT_HINT}"
      )
  return out


def _text_config(
    config: dict[str, Any], spec: ArchitectureSpec, hf_class: str, where: str
) -> dict[str, Any]:
  """The text-model part of a multimodal wrapper's config; else the config."""
  wrapper = spec.hf.multimodal
  if wrapper is None:
    return config
  is_wrapper_type = config.get("model_type") == wrapper.model_type
  if hf_class not in wrapper.classes and not (
      is_wrapper_type and "text_config" in config
  ):
    return config
  text = config.get("text_config") or {}
  if not isinstance(text, dict):
    raise CheckpointError(
        f"{where}: key 'text_config' = {short_repr(text)} must be an"
        f" object (the text model's config); {CONFIG_HINT}"
    )
  text = dict(text)
  for key in (
      "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"
  ):
    if key not in text and key in config:
      text[key] = config[key]
  for key, value in wrapper.text_defaults.items():
    text.setdefault(key, value)
  return text


def _read_tensor(
    locations: dict[str, TensorLocation], name: str, dtype: np.dtype
) -> np.ndarray:
  """Canonical tensor ``name``, from where ``locations`` says it is."""
  return read_tensor(locations[name], dtype)


def open_hf_dir(
    path: str | os.PathLike,
    *,
    specs: Sequence[ArchitectureSpec] = SPECS,
) -> LazyCheckpoint:
  """Checks a Hugging Face model directory; reads no tensor data.

  Everything is checked before it is trusted, in an order that keeps a bad
  file cheap: safetensors headers against their files, then the config's
  layer count and values against the tensors the headers list, then the
  shapes the config implies against the headers' shapes, then the
  tensors' dtypes. Tensor data is read (and checked for NaN/inf) by
  `LazyCheckpoint.read`, one tensor at a time.

  Args:
    path: Directory with ``config.json`` and ``model.safetensors`` (or a
      sharded ``model.safetensors.index.json`` with its shards).
    specs: The architectures to recognize (default: the built-in ones).

  Raises:
    As `read_hf_dir`, except for the errors about tensor data.
  """
  path = check_path_exists(path, "Model directory")
  if not path.is_dir():
    raise CheckpointError(
        f"{path} is not a directory (use read_gguf for GGUF files)"
    )
  raw = _read_config(path)
  spec, hf_class = _detect_architecture(raw, path, specs)
  where = str(path / "config.json")
  text = _text_config(raw, spec, hf_class, where)
  if text is not raw:
    where += " (text_config)"
  headers = _read_headers(spec, *_weight_files(path))

  names = [c for _, _, keep in headers.values() for c in keep.values()]
  key = spec.layout.layer_count_key
  check_layer_count(
      text.get(key, spec.config_defaults.get(key)),
      layer_indices(names, spec.layout.layer_prefix),
      where=where, key=key, prefix=spec.layout.layer_prefix, fix=CONFIG_HINT,
      defaulted=key not in text,
  )
  config = layout.normalize_config(spec, text, source=where)
  if config["tie_word_embeddings"]:
    # HF ties lm_head to the embedding and ignores a stored copy.
    for _, _, keep in headers.values():
      for name in [n for n, c in keep.items() if c == "lm_head.weight"]:
        del keep[name]
  locations = {
      c: TensorLocation(file, name, entries[name], base)
      for file, (entries, base, keep) in headers.items()
      for name, c in keep.items()
  }
  shapes = {c: tuple(loc.entry["shape"]) for c, loc in locations.items()}
  layout.validate_shapes(spec, config, shapes, str(path))
  check_float_dtypes(locations.values())
  return LazyCheckpoint(
      architecture=spec.name, config=config, shapes=shapes, source=str(path),
      reader=functools.partial(_read_tensor, locations),
  )


def read_hf_dir(
    path: str | os.PathLike,
    dtype=np.float32,
    *,
    specs: Sequence[ArchitectureSpec] = SPECS,
) -> Checkpoint:
  """Reads a Hugging Face model directory into a canonical :class:`Checkpoint`.

  Everything is checked before it is trusted, in an order that keeps a bad
  file cheap (see `open_hf_dir`); only then is any tensor data read (and
  checked for NaN/inf).

  Args:
    path: Directory with ``config.json`` and ``model.safetensors`` (or a
      sharded ``model.safetensors.index.json`` with its shards).
    dtype: float32 (default) or bfloat16.
    specs: The architectures to recognize (default: the built-in ones).

  Raises:
    CheckpointFileNotFoundError (a FileNotFoundError and a CheckpointError):
      the directory, config.json, the weights or a shard are missing.
    CheckpointError (a ValueError): unsupported architecture, unreadable or
      corrupt files, nonsensical config values, a config that disagrees with
      the tensors, NaN/inf weights.
  """
  dtype = resolve_dtype(dtype)
  lazy = open_hf_dir(path, specs=specs)
  ckpt = lazy.materialize(dtype)
  layout.validate(ckpt, spec_for(lazy.architecture, specs))
  return ckpt
