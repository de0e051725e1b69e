"""The engine's compiled programs, cached by name, plan and argument shapes.

Programs are compiled ahead of time (``jit(...).lower(...).compile()``) so
the compile time of each request is measured exactly; the weights are
arguments, so one program serves every model with the same structure and
shapes. `PROGRAMS.compilations` counts compilations (tests use it to check
that nothing recompiles on the hot path).
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
from typing import Any

import jax
import numpy as np


# XLA options per program on CPU. XLA's YNNPACK fusions run the decode
# step's small attention products slowly: without them SmolLM2 decodes 12%
# faster at a 2048-token cache and 16% faster at batch 8 (equal at batch 1);
# the prefill keeps them (3% faster at batch 1).
CPU_COMPILER_OPTIONS: dict[str, dict[str, Any]] = {
    "decode": {"xla_cpu_experimental_ynn_fusion_type": ""},
}


class ProgramCache:
  """Compiled programs keyed on (name, static plan, argument structure and
  shapes). Thread-safe; compile time is measured per call."""

  def __init__(self):
    self._programs: dict[Any, Any] = {}
    self._lock = threading.Lock()
    self._warned = False
    self.compilations = 0

  def get(self, name, fn, static, args, donate=()):
    leaves, treedef = jax.tree_util.tree_flatten(args)
    key = (name, static, treedef, tuple(_aval_key(x) for x in leaves))
    try:
      hash(key)
    except TypeError:
      # A layer with an unhashable static field: compile without caching.
      if not self._warned:
        self._warned = True
        warnings.warn(
            "the model has an unhashable static field (e.g. a list or dict in"
            " a layer's metadata); generation programs cannot be cached and"
            " are recompiled on every call. Use tuples or frozen"
            " dataclasses for static layer fields.")
      key = None
    with self._lock:
      program = None if key is None else self._programs.get(key)
    if program is not None:
      return program, 0.0
    start = time.perf_counter()
    jitted = jax.jit(functools.partial(fn, static), donate_argnums=donate)
    program = _compile(jitted.lower(*args), name)
    elapsed = time.perf_counter() - start
    with self._lock:
      if key is not None:
        self._programs.setdefault(key, program)
      self.compilations += 1
    return program, elapsed

  def size(self, name: str | None = None) -> int:
    with self._lock:
      return sum(1 for k in self._programs if name is None or k[0] == name)

  def clear(self) -> None:
    with self._lock:
      self._programs.clear()


def _compile(lowered, name: str):
  options = {}
  if jax.default_backend() == "cpu":
    options = CPU_COMPILER_OPTIONS.get(name, {})
  if options:
    try:
      return lowered.compile(compiler_options=dict(options))
    except Exception as e:  # pylint: disable=broad-except
      # An XLA without these options: compile with its defaults.
      warnings.warn(f"XLA rejected the CPU options {options}: {e}")
      CPU_COMPILER_OPTIONS.pop(name, None)
  return lowered.compile()


def _aval_key(x):
  dtype = x.dtype if hasattr(x, "dtype") else np.result_type(type(x))
  return (np.shape(x), np.dtype(dtype), bool(getattr(x, "weak_type", False)))


PROGRAMS = ProgramCache()


def cache_size(name: str | None = None) -> int:
  """Number of compiled programs held ("prefill", "decode" or all)."""
  return PROGRAMS.size(name)
