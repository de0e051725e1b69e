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
``$XDG_CACHE_HOME/penzai_lm``, else ``~/.cache/penzai_lm``.
"""

from __future__ import annotations

import os
import pathlib


class CacheDirError(ValueError):
  """The cache directory an environment variable names cannot be used."""


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
    path.mkdir(parents=True, exist_ok=True)
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
  env = os.environ.get("PENZAI_LM_KERNEL_CACHE")
  if env:
    return pathlib.Path(env).expanduser()
  return cache_dir() / "kernels"


def tokenizers_dir() -> pathlib.Path:
  """Where parsed vocabularies are kept."""
  return cache_dir() / "tokenizers"


def jax_cache_dir() -> pathlib.Path:
  """The CLI's persistent XLA compilation cache (``$PENZAI_LM_JAX_CACHE``
  if set)."""
  env = os.environ.get("PENZAI_LM_JAX_CACHE")
  if env:
    return pathlib.Path(env)
  return cache_dir() / "jax"
