"""Freed heap memory goes back to the system after long compiles."""

import ctypes
import sys

import pytest

from penzai_lm.generation import Engine
from penzai_lm.runtime import freed_memory
from penzai_lm.runtime import program_cache
from tests.generation.conftest import prompts


def _rss_kb() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1])
  raise AssertionError("no VmRSS in /proc/self/status")


def test_release_returns_freed_heap_pages():
  if freed_memory._malloc_trim() is None:  # pylint: disable=protected-access
    pytest.skip(f"SKIPPED LOUDLY: no glibc malloc_trim on {sys.platform};"
                " release_freed_memory does nothing here")
  # 64 MB in 48 KB blocks (below malloc's mmap threshold: they come from
  # the heap), then one block after them so that freeing them leaves a
  # hole, not a heap top that free() gives back by itself.
  blocks = [ctypes.create_string_buffer(48 << 10) for _ in range(1365)]
  for b in blocks:
    ctypes.memset(b, 1, len(b))
  pin = ctypes.create_string_buffer(48 << 10)
  del blocks
  before = _rss_kb()
  assert freed_memory.release_freed_memory()
  after = _rss_kb()
  assert before - after > 32 << 10, (before, after)
  del pin


def test_the_program_cache_trims_after_long_compiles(model, monkeypatch):
  calls = []
  monkeypatch.setattr(program_cache, "release_freed_memory",
                      lambda: calls.append(1))
  monkeypatch.setattr(program_cache, "TRIM_AFTER_COMPILE_S", 0.0)
  Engine().generate(model, prompts([3, 5]), max_new_tokens=2, temperature=0.0)
  assert calls  # one per compiled program
  compiled = len(calls)
  monkeypatch.setattr(program_cache, "TRIM_AFTER_COMPILE_S", 1e9)
  Engine().generate(model, prompts([3, 5]), max_new_tokens=2, temperature=0.0)
  assert len(calls) == compiled
