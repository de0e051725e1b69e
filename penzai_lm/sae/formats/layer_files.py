"""Which files a circuit-tracer ``config.yaml`` may load, block by block.

A config's ``transcoders`` list names one file per block. A config is
data from wherever it was downloaded, so the files it names are confined:

* a relative path must stay inside the config's folder, both as written
  (no ``..`` out of it) and once links are resolved (a link that leads out
  counts as outside), except that a config inside a Hugging Face cache
  snapshot (``.../models--org--repo/snapshots/<revision>/...``) may follow
  links into that repository's ``blobs`` folder, which is how the cache
  stores every file;
* an absolute path is held to the same rule (circuit-tracer writes
  absolute paths into the folder it saves to);
* absolute paths elsewhere and ``hf://org/repo/file`` (read from the local
  Hugging Face cache; nothing is downloaded) are loaded only when the
  caller asks (``load_transcoders(..., allow_outside=True)``); with it,
  relative paths may leave the folder too.

Without a list, the folder's files matching the format's pattern
(``layer_{i}.safetensors``, ``W_enc_{i}.safetensors``) are the blocks, one
per block from 0 on; two files for one block (``layer_0`` and
``layer_00``) are refused as ambiguous. The same confinement applies to
them (a planted link out of the folder is refused).
"""

from __future__ import annotations

import os
from pathlib import Path
import re
from urllib.parse import parse_qs
from urllib.parse import urlparse

from penzai_lm.file_access import inside
from penzai_lm.sae.formats.errors import SAEFormatError
from penzai_lm.sae.formats.errors import where

CONFIG = "config.yaml"
_ASK = ("pass allow_outside=True to penzai_lm.sae.load_transcoders if you"
        " trust this config")


def _hf_blobs(directory: Path) -> Path | None:
  """The ``blobs`` folder of the Hugging Face cache repository holding
  ``directory`` (a snapshot or a folder in one), or None."""
  resolved = Path(os.path.realpath(directory))
  for part in (resolved, *resolved.parents):
    if part.parent.name == "snapshots" and part.parent.parent.name.startswith(
        ("models--", "datasets--")):
      return part.parent.parent / "blobs"
  return None


def confined(path: Path, directory: Path, what: str) -> Path:
  """``path`` if it stays inside ``directory`` (module docstring), else an
  `SAEFormatError` naming ``what`` (the config file and field)."""
  base = Path(os.path.normpath(directory.absolute()))
  lexical = Path(os.path.normpath(base / path))
  if lexical == base or not lexical.is_relative_to(base):
    raise SAEFormatError(f"{what} leads out of the config's folder"
                         f" {directory}; {_ASK}.")
  blobs = _hf_blobs(directory)
  if not (inside(lexical, directory) or (
      blobs is not None and inside(lexical, blobs))):
    raise SAEFormatError(
        f"{what} is a link that leads out of the config's folder {directory}"
        f" (to {os.path.realpath(lexical)}); {_ASK}.")
  return lexical


def _relative(path: Path, directory: Path) -> Path | None:
  """Absolute ``path`` relative to ``directory`` (as given or with links
  resolved), or None if it is not under it."""
  for root in (directory.absolute(), Path(os.path.realpath(directory))):
    try:
      return path.relative_to(root)
    except ValueError:
      pass
  return None


def _hf_cached(uri: str, what: str) -> Path:
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
      f"{what} is {uri}, which is not in the local Hugging Face cache"
      " (penzai_lm downloads nothing): fetch it first, e.g."
      f" `huggingface-cli download {parsed.netloc}/{repo} {file}`, or list"
      " local paths instead.")


def _listed(listed, directory: Path, allow_outside: bool) -> list[Path]:
  cfg_path = directory / CONFIG
  if not isinstance(listed, list) or not all(isinstance(p, str)
                                             for p in listed):
    raise SAEFormatError(f"{where(cfg_path, 'transcoders')} must be a list"
                         " of paths.")
  out = []
  for i, entry in enumerate(listed):
    what = f"{where(cfg_path, f'transcoders[{i}]')} ({entry!r})"
    if entry.startswith("hf://"):
      if not allow_outside:
        raise SAEFormatError(f"{what} is read from the Hugging Face cache,"
                             f" outside the config's folder; {_ASK}.")
      path = _hf_cached(entry, where(cfg_path, f"transcoders[{i}]"))
    elif Path(entry).is_absolute() and not allow_outside:
      # circuit-tracer writes absolute paths into the folder it saves to.
      relative = _relative(Path(entry), directory)
      if relative is None:
        raise SAEFormatError(f"{what} is an absolute path outside the"
                             f" config's folder {directory.absolute()};"
                             f" {_ASK}.")
      path = confined(relative, directory, what)
    else:
      path = (directory / entry if allow_outside
              else confined(Path(entry), directory, what))
    if not path.is_file():
      raise SAEFormatError(f"{what}: {path} does not exist (or is not a"
                           " regular file).")
    out.append(path)
  return out


def layer_paths(config: dict, directory: Path, pattern: str | None = None,
                *, allow_outside: bool = False) -> list[Path]:
  """The per-block files, block ``i`` at index ``i``: the config's list,
  else the folder's files matching ``pattern`` (block number in group 1),
  confined as the module docstring says.

  Raises:
    SAEFormatError: naming the config file and field, or the files.
  """
  listed = config.get("transcoders")
  if listed is not None:
    return _listed(listed, directory, allow_outside)
  found: dict[int, Path] = {}
  for path in sorted(directory.iterdir()):
    m = re.fullmatch(pattern, path.name)
    if not m:
      continue
    block = int(m.group(1))
    if block in found:
      raise SAEFormatError(
          f"{directory}: {found[block].name} and {path.name} are both block"
          f" {block}; the transcoder to load is ambiguous. Remove one, or"
          f" list the files in {CONFIG}'s 'transcoders'.")
    found[block] = (path if allow_outside else confined(
        Path(path.name), directory, str(path)))
  if not found or sorted(found) != list(range(len(found))):
    raise SAEFormatError(
        f"{directory}: {CONFIG} lists no transcoders and the files matching"
        f" {pattern!r} are blocks {sorted(found)}; circuit-tracer needs one"
        " per block from 0 on.")
  return [found[i] for i in range(len(found))]
