"""Running a benchmark child under a memory watchdog."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

MIN_AVAILABLE_GB = 1.0


def run_watched(cmd: list[str], log: Path, limit_gb: float) -> dict:
  """Runs ``cmd``, killing it if its RSS passes ``limit_gb`` or the
  machine's MemAvailable falls under `MIN_AVAILABLE_GB`; returns
  ``{"rc", "started", "max_rss_gb", "stopped"}`` (``stopped``: None, or
  why it was killed)."""
  env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
  started, max_rss, stopped = time.time(), 0.0, None
  with open(log, "w") as out:
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                            env=env)
    while proc.poll() is None:
      rss = _kib(f"/proc/{proc.pid}/status", "VmRSS") / 2**20
      available = _kib("/proc/meminfo", "MemAvailable") / 2**20
      max_rss = max(max_rss, rss)
      if rss > limit_gb or available < MIN_AVAILABLE_GB:
        stopped = (f"stopped at {rss:.1f} GB"
                   + ("" if rss > limit_gb else
                      f" ({available:.1f} GB left on the machine)"))
        proc.kill()
        proc.wait()
        break
      time.sleep(0.5)
  return {"rc": proc.returncode, "started": started, "max_rss_gb": max_rss,
          "stopped": stopped, "load": os.getloadavg()[0]}


def _kib(path: str, key: str) -> float:
  """A ``kB`` field of a /proc status file (0 once the process is gone)."""
  try:
    for line in Path(path).read_text().splitlines():
      if line.startswith(key + ":"):
        return float(line.split()[1])
  except (FileNotFoundError, ProcessLookupError):
    pass
  return 0.0
