"""Which arguments are paths, and which paths a model may be read from.

The rule (`is_path`): any ``os.PathLike`` is a path; a string is a path when
it contains a path separator, starts with ``.`` or ``~``, or ends in
``.gguf`` (any case). Every other string is a model name, looked up in
`penzai_lm.fetch.KNOWN_MODELS` only and never on disk: a file named
``smollm2-135m-instruct`` in the working directory is not loaded in place of
the model (``./smollm2-135m-instruct`` loads it).

A model path must be a regular file or a directory, and a directory's
files that the loaders open (by suffix, `_LOADED_SUFFIXES`) must be
regular: FIFOs, devices and sockets are refused from ``stat`` alone, before
anything opens them (opening a FIFO blocks until a writer comes; a device
can be endless).
"""

from __future__ import annotations

import os
import pathlib
import stat


def is_path(name_or_path: str | os.PathLike[str]) -> bool:
  """Whether `resolve_model_path` takes the argument as a path, not a name.

  Any ``os.PathLike`` is a path; a string is one when it contains a path
  separator, starts with ``.`` or ``~``, or ends in ``.gguf`` (any case).
  Model names are none of these, so every other string is a name.
  """
  if not isinstance(name_or_path, str):
    return True
  separators = {"/", os.sep, os.altsep} - {None}
  return (any(sep in name_or_path for sep in separators)
          or name_or_path.startswith((".", "~"))
          or name_or_path.lower().endswith(".gguf"))


_SPECIAL = ((stat.S_ISFIFO, "a FIFO (named pipe)"),
            (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
# Files a directory's loaders open (config, weights, tokenizer, template).
_LOADED_SUFFIXES = (".json", ".safetensors", ".gguf", ".model", ".jinja",
                    ".txt")


def _refuse_special(path: pathlib.Path, mode: int, inside: str = "") -> None:
  for test, kind in _SPECIAL:
    if test(mode):
      raise ValueError(
          f"{path}{inside} is {kind}, not a regular file; a model is a .gguf "
          "file or a Hugging Face directory of regular files. Reading it "
          "could block or never end, so it is refused."
      )


def check_model_path(path: pathlib.Path) -> None:
  """Raises ValueError unless ``path`` is a regular file or a directory
  whose loadable files are regular (`stat` only; nothing is opened)."""
  try:
    os.stat(path)
  except FileNotFoundError:
    raise ValueError(f"{path} does not exist.") from None
  except OSError as e:
    raise ValueError(f"{path} cannot be read: {e}.") from e
  refuse_special(path)


def refuse_special(path: str | os.PathLike[str]) -> None:
  """Raises ValueError if ``path``, or a loadable file of the directory it
  names, is a FIFO, device or socket (`stat` only; nothing is opened). A
  path that does not exist is left to the caller's own error."""
  path = pathlib.Path(path).expanduser()
  try:
    mode = os.stat(path).st_mode
  except OSError:
    return
  _refuse_special(path, mode)
  if stat.S_ISDIR(mode):
    for entry in sorted(path.iterdir()):
      if entry.suffix in _LOADED_SUFFIXES:
        try:
          _refuse_special(entry, os.stat(entry).st_mode,
                          f" (in the model directory {path})")
        except OSError:
          pass  # A dangling link: the loader says which file is missing.
