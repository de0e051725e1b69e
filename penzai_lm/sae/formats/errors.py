"""Errors about autoencoder files, and the checks every reader shares.

Every problem with a file's contents is an `SAEFormatError` (a
`penzai_lm.checkpoints.CheckpointError`, so a ``ValueError``) whose message
names the file, the field or tensor, what was expected and how to fix it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np

from penzai_lm.checkpoints.checkpoint import CheckpointError
from penzai_lm.checkpoints.json_files import parse_json
from penzai_lm.file_access import read_regular

MAX_CONFIG_BYTES = 16 << 20  # Configs are kilobytes; this bounds a bad one.


class SAEFormatError(CheckpointError):
  """An autoencoder file cannot be read: a missing or malformed field or
  tensor, a wrong shape, an unsupported architecture, a corrupt file."""


def where(path: str | Path, field: str | None = None) -> str:
  """``"<path>"`` or ``"<path>: field 'x'"`` for messages."""
  return str(path) if field is None else f"{path}: field {field!r}"


def require_tensor(tensors: Mapping[str, np.ndarray], key: str,
                   path: str | Path, *, why: str = "") -> np.ndarray:
  """``tensors[key]``, or an error naming the file, the key and the keys
  that are there."""
  if key not in tensors:
    raise SAEFormatError(
        f"{path} has no tensor {key!r}{why}; it holds"
        f" {sorted(tensors) or 'no tensors'}. The file is incomplete or not"
        " in the format it was read as.")
  return tensors[key]


def check_shape(array: np.ndarray, expected: tuple[int, ...], path, key: str,
                meaning: str) -> np.ndarray:
  """Raises unless ``array.shape == expected``; ``meaning`` spells the
  expected shape in the format's terms (e.g. ``"[d_in, d_sae]"``)."""
  if tuple(array.shape) != tuple(expected):
    raise SAEFormatError(
        f"{path}: tensor {key!r} has shape {list(array.shape)}, expected"
        f" {meaning} = {list(expected)}. The weights do not match the"
        " config (or each other).")
  return array


def most_common(*sizes: int) -> int:
  """The size most of ``sizes`` agree on (the first on a tie): the size a
  format's tensors should share, so that a check names the odd tensor."""
  return max(sizes, key=sizes.count)


def check_unexpected(tensors: Mapping[str, Any], allowed, path,
                     what: str) -> None:
  """Raises if ``tensors`` holds keys outside ``allowed`` (an architecture
  mix-up would otherwise load silently wrong)."""
  extra = sorted(set(tensors) - set(allowed))
  if extra:
    raise SAEFormatError(
        f"{path} holds tensors {extra} that a {what} does not have (it has"
        f" {sorted(allowed)}); the config's architecture does not match the"
        " weights.")


def config_field(config: Mapping[str, Any], key: str, path, *, kind=None,
                 default: Any = ...) -> Any:
  """A config field, type-checked: ``kind`` is "int" (positive), "bool",
  "str" or None (anything). Missing with no default is an error."""
  if key not in config or config[key] is None:
    if default is ...:
      raise SAEFormatError(f"{where(path, key)} is missing; the file is"
                           " incomplete or not in this format.")
    return default
  value = config[key]
  ok = {
      None: True,
      "int": isinstance(value, int) and not isinstance(value, bool)
             and value > 0,
      "bool": isinstance(value, bool),
      "str": isinstance(value, str),
  }[kind]
  if not ok:
    wanted = {"int": "a positive integer", "bool": "true or false",
              "str": "a string"}[kind]
    raise SAEFormatError(f"{where(path, key)} is {value!r}; it must be"
                         f" {wanted}.")
  return value


def read_file(path: Path, what: str) -> bytes:
  """A regular file's bytes (`penzai_lm.file_access.read_regular`), at most
  `MAX_CONFIG_BYTES`; a FIFO, device or oversized file is an
  `SAEFormatError` naming it."""
  try:
    return read_regular(path, what=what, max_bytes=MAX_CONFIG_BYTES)
  except ValueError as e:
    raise SAEFormatError(str(e)) from e


def read_json(path: Path) -> Any:
  """A JSON config file's value; a file that is not regular or does not
  parse is an `SAEFormatError` naming it."""
  try:
    return parse_json(read_file(Path(path), "a JSON config"), str(path))
  except CheckpointError as e:
    if isinstance(e, SAEFormatError):
      raise
    raise SAEFormatError(str(e)) from e
