"""penzai_lm's cache folders (the bottom floor: imports nothing of penzai_lm).

Everything penzai_lm keeps on disk lives under `cache_dir()`, one folder
per use, each named here (and made by its user):

* `models_dir()`: the default models (`penzai_lm.fetch`);
* `kernels_dir()`: the compiled CPU kernels (`penzai_lm.kernels.build`;
  ``$PENZAI_LM_KERNEL_CACHE`` overrides it);
* `tokenizers_dir()`: parsed vocabularies
  (`penzai_lm.tokenizer.vocab_cache`);
* `jax_cache_dir()`: the CLI's persistent XLA compilation cache, with the
  runtime's program store inside (``$PENZAI_LM_JAX_CACHE`` overrides it).

The cache folder is ``$PENZAI_LM_CACHE`` if set, else
``$XDG_CACHE_HOME/penzai_lm``, else ``~/.cache/penzai_lm``. Folders are
created ``0700``. A folder whose contents penzai_lm runs (compiled kernels,
stored programs) must be the user's own, as ssh wants of its keys:
`unsafe_reason` says why one is not (another user's, or writable by its
group or others), and its users refuse it.
"""

from __future__ import annotations

import os
import pathlib
import stat


class CacheDirError(ValueError):
  """The cache directory an environment variable names cannot be used."""


class UnsafeDirectory(ValueError):
  """A folder whose contents would be run that is not the user's own."""


def unsafe_reason(path: str | os.PathLike) -> tuple[str, str] | None:
  """Why the existing folder ``path`` may not hold code penzai_lm runs, as
  ``(why, fix)`` (``fix`` may be empty), or None if it is a directory of
  the user's own that only they can write. A missing folder is None."""
  try:
    st = os.stat(path)
  except OSError:
    return None
  if not stat.S_ISDIR(st.st_mode):
    return "not a directory", ""
  if hasattr(os, "getuid") and st.st_uid != os.getuid():
    return f"owned by user id {st.st_uid}, not by you ({os.getuid()})", ""
  if hasattr(os, "getuid") and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
    who = "others" if st.st_mode & stat.S_IWOTH else "its group"
    return (f"writable by {who} (mode {stat.S_IMODE(st.st_mode):o})",
            f"run `chmod 700 {path}` if only you use it, or ")
  return None


def private_dir(path: str | os.PathLike) -> pathlib.Path:
  """``path``, created ``0700`` (its missing parents too) if it is missing.

  Raises:
    CacheDirError: if it cannot be created, saying why.
  """
  path = pathlib.Path(path)
  if not path.is_dir():
    try:
      path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
      raise CacheDirError(
          f"penzai_lm cannot create the folder {path}:"
          f" {_why_not_a_directory(path, e)}. Set PENZAI_LM_CACHE to a"
          " directory penzai_lm may create and write (or unset it).") from e
  return path


def cache_dir() -> pathlib.Path:
  """Returns the cache directory (created if missing).

  ``$PENZAI_LM_CACHE`` if set, else ``$XDG_CACHE_HOME/penzai_lm``, else
  ``~/.cache/penzai_lm``.

  Raises:
    CacheDirError: If the directory cannot be created (e.g. the variable
      names a file); the message names the variable and the path.
  """
  env = os.environ.get("PENZAI_LM_CACHE")
  if env:
    path, source = pathlib.Path(env).expanduser(), f"PENZAI_LM_CACHE={env}"
  else:
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
      base, source = pathlib.Path(xdg).expanduser(), f"XDG_CACHE_HOME={xdg}"
    else:
      base = pathlib.Path.home() / ".cache"
      source = f"the home directory {pathlib.Path.home()}"
    path = base / "penzai_lm"
  try:
    if not path.is_dir():
      path.mkdir(mode=0o700, parents=True, exist_ok=True)
  except OSError as e:
    raise CacheDirError(
        f"penzai_lm's cache directory {path} (from {source}) cannot be "
        f"created: {_why_not_a_directory(path, e)}. Set PENZAI_LM_CACHE to "
        "a directory penzai_lm may create and write (or unset it)."
    ) from e
  return path


def _why_not_a_directory(path: pathlib.Path, error: OSError) -> str:
  for part in (path, *path.parents):
    if part.exists() and not part.is_dir():
      return f"{part} is a file, not a directory"
  return error.strerror or str(error)


def models_dir() -> pathlib.Path:
  """Where `penzai_lm.fetch` keeps the default models."""
  return cache_dir() / "models"


def kernels_dir() -> pathlib.Path:
  """Where the compiled CPU kernels are kept (``$PENZAI_LM_KERNEL_CACHE``
  if set)."""
  return _overridden("PENZAI_LM_KERNEL_CACHE") or cache_dir() / "kernels"


def tokenizers_dir() -> pathlib.Path:
  """Where parsed vocabularies are kept."""
  return cache_dir() / "tokenizers"


def jax_cache_dir() -> pathlib.Path:
  """The CLI's persistent XLA compilation cache (``$PENZAI_LM_JAX_CACHE``
  if set)."""
  return _overridden("PENZAI_LM_JAX_CACHE") or cache_dir() / "jax"


def _overridden(variable: str) -> pathlib.Path | None:
  """The folder the environment ``variable`` names, if set."""
  value = os.environ.get(variable)
  return pathlib.Path(value).expanduser() if value else None
