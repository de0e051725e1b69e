"""Measuring two tools on the same tasks: lines of user code, timings,
agreement of numbers, and the machine's description.

Used by ``benchmarks/interp_vs_transformerlens.py``.
"""

from __future__ import annotations

import inspect
import platform
import statistics
import time

import numpy as np


def lines_of(fn, extra=()) -> int:
  """Body lines of ``fn`` and of the ``extra`` functions (a string counts
  as one line of source), without comments and blank lines."""
  count = 0
  for part in (fn, *extra):
    if isinstance(part, str):
      count += 1
      continue
    body = inspect.getsource(part).splitlines()[1:]  # Without the def line.
    count += sum(1 for line in body
                 if line.strip() and not line.strip().startswith("#"))
  return count


def timed(fn, s, repeats: int):
  """``(fn(s), first call's seconds, median seconds of repeats more)``."""
  t = time.perf_counter()
  out = fn(s)
  first = time.perf_counter() - t
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn(s)
    times.append(time.perf_counter() - t)
  return out, first, statistics.median(times) if times else first


def max_diff(a, b) -> str:
  """Max |a - b| of two arrays (or lists of arrays, flattened), with the
  largest |b| for scale."""
  a = np.concatenate([np.ravel(x) for x in a]) if isinstance(a, list) else a
  b = np.concatenate([np.ravel(x) for x in b]) if isinstance(b, list) else b
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  diff = np.abs(a - b).max()
  return f"max diff {diff:.1e} (max value {np.abs(b).max():.3g})"


def cpu_name() -> str:
  with open("/proc/cpuinfo", encoding="utf-8") as f:
    for line in f:
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  return platform.processor()


def load_average() -> str:
  with open("/proc/loadavg", encoding="utf-8") as f:
    return f"load average {' '.join(f.read().split()[:3])}"
