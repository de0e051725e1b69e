"""Reading JSON from checkpoint files, and quoting its values in messages.

`parse_json` turns every way a hostile file can break ``json.loads`` (bad
syntax or encoding, an integer past Python's digit limit, nesting deep
enough to overflow the stack) into a `CheckpointError` that names the file,
chaining the original error.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from penzai_lm.checkpoints.checkpoint import CORRUPT_HINT
from penzai_lm.checkpoints.checkpoint import CheckpointError


def short_repr(value: Any, limit: int = 80) -> str:
  """``repr(value)`` cut to ``limit`` characters, for messages."""
  text = repr(value)
  return text if len(text) <= limit else text[: limit - 3] + "..."


# Real configs and headers nest a few levels (text_config > rope_parameters >
# full_attention); far deeper is hostile, and would overflow the stack of
# the code that copies or walks the value.
_MAX_JSON_DEPTH = 64


def parse_json(data: bytes, what: str) -> Any:
  """``json.loads(data)``; every way it fails is a `CheckpointError` naming
  ``what`` (a file, or a file's part)."""
  try:
    value = json.loads(data)
  except RecursionError as e:
    raise CheckpointError(
        f"Cannot parse {what}: it nests JSON arrays or objects too deeply;"
        f" {CORRUPT_HINT}"
    ) from e
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"Cannot parse {what}: {e}; {CORRUPT_HINT}") from e
  except ValueError as e:  # An integer past Python's digit limit.
    raise CheckpointError(
        f"Cannot parse {what}: it holds an integer of more than"
        f" {sys.get_int_max_str_digits()} digits, which no model needs;"
        f" {CORRUPT_HINT}"
    ) from e
  stack = [(value, 1)]
  while stack:
    item, depth = stack.pop()
    children = (
        item.values() if isinstance(item, dict)
        else item if isinstance(item, list) else ()
    )
    for child in children:
      if isinstance(child, (dict, list)):
        if depth >= _MAX_JSON_DEPTH:
          raise CheckpointError(
              f"{what} nests JSON arrays or objects more than"
              f" {_MAX_JSON_DEPTH} levels deep; {CORRUPT_HINT}"
          )
        stack.append((child, depth + 1))
  return value
