"""circuit-tracer for the parity tests, installed on first use.

circuit-tracer 0.5 pins ``transformers<=4.57.3``, while the rest of the
suite (and sae-lens, which is in the test extra) runs a newer transformers;
its transcoder code needs only torch, numpy, safetensors and PyYAML. So it
is not in the test extra: the first test session installs it without its
dependencies into the penzai_lm cache (``test-deps/``) and puts that folder
on ``sys.path``. Without a network it is not installed and its parity tests
skip, saying why.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

CIRCUIT_TRACER = "circuit-tracer==0.5.0"


def _install_circuit_tracer() -> None:
  try:
    import circuit_tracer  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    return
  except ImportError:
    pass
  from penzai_lm.fetch import cache_dir  # pylint: disable=g-import-not-at-top
  target = cache_dir() / "test-deps" / CIRCUIT_TRACER.replace("==", "-")
  if not (target / "circuit_tracer").is_dir():
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = pathlib.Path(tempfile.mkdtemp(dir=target.parent))
    try:
      done = subprocess.run(
          [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
           "--target", str(staging), CIRCUIT_TRACER],
          capture_output=True, text=True, timeout=300, check=False)
      if done.returncode == 0:
        try:  # Another test worker may have finished first: keep its copy.
          os.replace(staging, target)
        except OSError:
          pass
    finally:
      shutil.rmtree(staging, ignore_errors=True)
  if (target / "circuit_tracer").is_dir():
    sys.path.insert(0, str(target))


_install_circuit_tracer()
