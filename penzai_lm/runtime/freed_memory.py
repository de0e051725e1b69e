"""Handing memory the process has freed back to the system.

XLA's compiler allocates and frees a few hundred MB while it builds a
program; glibc's malloc keeps freed memory in its arenas (one per thread
that allocated it), so a process's resident size stays at every compile's
high-water mark. `release_freed_memory` calls glibc's ``malloc_trim(0)``,
which returns the free pages of every arena; `ProgramCache` calls it after
each long compile. Nothing is changed in malloc's settings. Elsewhere
(macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

# Compiles shorter than this are not followed by a trim: they free little,
# and a trim walks the whole heap (~30 ms at a 1 GB heap).
TRIM_AFTER_COMPILE_S = 0.5


@functools.cache
def _malloc_trim():
  if not sys.platform.startswith("linux"):
    return None
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    trim = libc.malloc_trim
  except (OSError, AttributeError):
    return None  # not glibc
  trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
  return trim


def release_freed_memory() -> bool:
  """Returns the process's free heap pages to the system (glibc only).

  Returns:
    Whether malloc had pages to return (False also where there is no
    ``malloc_trim``).
  """
  trim = _malloc_trim()
  return bool(trim(0)) if trim is not None else False
