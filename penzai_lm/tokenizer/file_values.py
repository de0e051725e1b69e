"""Strict reading of the values tokenizer files hold.

Tokenizer files (a GGUF file's ``tokenizer.*`` metadata, a Hugging Face
``tokenizer.json``, ``tokenizer_config.json``, ``config.json``...) come from
anywhere. A value of the wrong type must not be coerced into something else
(``bool("false")`` is True; ``1.0`` is not a token id): every function here
either returns the value in its one expected form or raises a
`TokenizerFileError` that names the file and the field, and says how to fix
it.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = [
    "TokenizerFileError", "parse_bool", "parse_token_id", "parse_token_ids",
    "read_json_object",
]


class TokenizerFileError(ValueError):
  """A tokenizer file holds a value that cannot be used.

  Attributes:
    file: The file (a path, or a description such as "a GGUF file").
    field: The field (GGUF key, or JSON key path such as ``model.merges``);
      "" when the file as a whole is unreadable (not JSON, not UTF-8).
  """

  def __init__(self, file: Any, field: str, problem: str):
    self.file = str(file)
    self.field = field
    where = f"{field} in {self.file}" if field else self.file
    super().__init__(f"{where} {problem}")


def _shown(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 60 else f"{text[:57]}..."


def parse_bool(value: Any, file: Any, field: str) -> bool | None:
  """A boolean field: True/False, or the strings "true"/"false" (any case).

  None (the field is absent or null) stays None. Anything else -- numbers,
  other strings, lists -- raises, since guessing could flip the meaning.
  """
  if value is None or isinstance(value, bool):
    return value
  if isinstance(value, np.bool_):
    return bool(value)
  if isinstance(value, str) and value.strip().lower() in ("true", "false"):
    return value.strip().lower() == "true"
  raise TokenizerFileError(
      file, field,
      f"is {_shown(value)} ({type(value).__name__}), not a boolean; it must "
      "be true or false (or the strings \"true\"/\"false\").")


def parse_token_id(
    value: Any, file: Any, field: str, vocab_size: int | None = None
) -> int | None:
  """A token id: an integer (not a bool or float) in ``[0, vocab_size)``.

  None stays None (the file names no such token).
  """
  if value is None:
    return None
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, (int, np.integer)):
    raise TokenizerFileError(
        file, field,
        f"is {_shown(value)} ({type(value).__name__}); a token id must be a "
        "non-negative integer.")
  value = int(value)
  if value < 0 or (vocab_size is not None and value >= vocab_size):
    bound = "" if vocab_size is None else f" [0, {vocab_size})"
    raise TokenizerFileError(
        file, field,
        f"is {value}, outside the vocabulary{bound}; the tokenizer files are "
        "inconsistent.")
  return value


def parse_token_ids(value: Any, file: Any, field: str) -> list[int]:
  """An id or a list of ids (``eos_token_id`` may be either); None -> []."""
  if value is None:
    return []
  if isinstance(value, list):
    return [parse_token_id(v, file, f"{field}[{i}]")
            for i, v in enumerate(value) if v is not None]
  return [parse_token_id(value, file, field)]


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any]:
  """A JSON file holding an object; ``{}`` if the file does not exist.

  Raises:
    TokenizerFileError: If the file is not UTF-8 JSON or not an object.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    return {}
  try:
    data = json.loads(path.read_bytes().decode("utf-8"))
  except UnicodeDecodeError as e:
    raise TokenizerFileError(
        path, "",
        f"is not UTF-8 text (byte {e.start}); the file is corrupt, "
        "re-download it.") from e
  except json.JSONDecodeError as e:
    raise TokenizerFileError(
        path, "",
        f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
        "the file is truncated or corrupt, re-download it.") from e
  if not isinstance(data, Mapping):
    raise TokenizerFileError(
        path, "",
        f"holds a JSON {type(data).__name__}, not an object ({{...}}); "
        "the file is corrupt.")
  return dict(data)
