"""The compiled-program cache of a `Runtime`.

`ProgramCache`: compiled programs keyed on (name, static shapes and
  layout, argument structure and shapes), least recently used evicted past
  ``size``. A compiled program is small next to the model, so the bound
  is about notebooks that patch and generate many times.
  Tracing (`ProgramCache.lower`) runs on the caller's thread, under its JAX
  settings; XLA's compile (`Pending.compile`) may run on another
  (`ProgramCache.lower_ahead` and `Pending.start_compile`: a request's
  decode program compiles while its prefill runs).
It is thread-safe (a runtime, the default one included, is shared by
every thread that generates): a lock guards the LRU, and concurrent misses
of one key wait for the first thread's program instead of each compiling
their own (a compilation takes seconds).
"""

from __future__ import annotations

import collections
import functools
import threading
import time
import warnings
from typing import Any, Callable

import jax

from penzai_lm.runtime.collector import collector_paused
from penzai_lm.runtime.freed_memory import TRIM_AFTER_COMPILE_S
from penzai_lm.runtime.freed_memory import release_freed_memory
from penzai_lm.runtime.program_keys import aval_key
from penzai_lm.runtime.program_store import ProgramStore


class InFlight:
  """Keys being made, so that concurrent misses make each value once.

  Used under the cache's lock: `claim` says whether the caller makes the
  value (True) or must wait for the maker (an event) and look again.
  """

  def __init__(self):
    self._events: dict = {}

  def claim(self, key) -> threading.Event | None:
    """None if the caller now makes ``key``, else the event to wait on."""
    event = self._events.get(key)
    if event is None:
      self._events[key] = threading.Event()
    return event

  def release(self, key) -> None:
    """Called (under the lock) when the maker is done, even on failure:
    waiters look again and, without a value, one of them makes it."""
    event = self._events.pop(key, None)
    if event is not None:
      event.set()

  def busy(self, key) -> bool:
    """Whether ``key`` is being made."""
    return key in self._events


def _program_key(name: str, static: Any, args: tuple):
  """A program's cache key; None if its static parts are unhashable."""
  leaves, treedef = jax.tree_util.tree_flatten(args)
  key = (name, static, treedef, tuple(aval_key(x) for x in leaves))
  try:
    hash(key)
  except TypeError:
    return None
  return key


class ProgramCache:
  """Compiled programs, LRU-bounded. Thread-safe.

  Programs with a `ProgramStore` (``store()`` asked on each miss) are read
  back from disk instead of traced where the store has them.

  Attributes:
    size: Programs kept at most.
    compilations: Programs compiled so far (tests count these to check that
      nothing recompiles on the hot path).
  """

  def __init__(self, size: int,
               store: Callable[[], ProgramStore | None] | None = None):
    self.size = size
    self._store = store
    self.compilations = 0
    self._programs: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()
    self._making = InFlight()
    self._warned = False

  def get(self, name: str, fn: Callable, static: Any, args: tuple,
          compiler_options: Callable[[], dict[str, Any]],
          donate: tuple[int, ...] = ()):
    """The program ``jit(partial(fn, static))`` compiled for ``args`` with
    the XLA options ``compiler_options()`` (asked on a miss only).

    Returns:
      ``(compiled, seconds spent compiling)`` (0 on a hit; the time spent
      waiting when another thread was compiling it).
    """
    return self.lower(name, fn, static, args, compiler_options,
                      donate).compile()

  def lower(self, name: str, fn: Callable, static: Any, args: tuple,
            compiler_options: Callable[[], dict[str, Any]],
            donate: tuple[int, ...] = ()) -> "Pending":
    """Like `get`, but returns after tracing (in the caller's thread, with
    its JAX settings): XLA compiles on `Pending.compile`, which another
    thread may call. ``args`` may be ``jax.ShapeDtypeStruct``s. Tracing
    runs with Python's cyclic collector paused (`collector.py`)."""
    key = _program_key(name, static, args)
    if key is None:
      self._warn_unhashable()
    start, waited = time.perf_counter(), False
    while key is not None:
      with self._lock:
        program = self._programs.get(key)
        if program is not None:
          self._programs.move_to_end(key)
          return Pending(self, key, start, program=program, waited=waited)
        event = self._making.claim(key)
      if event is None:
        break  # This thread makes it.
      event.wait()
      waited = True
    try:
      options = dict(compiler_options())
      store = self._store() if self._store is not None else None
      lowered = None
      with collector_paused():
        if store is not None:
          store_key = store.key(name, static, args, options, donate)
          if store_key is not None:
            lowered = store.lower(store_key, fn, static, args, donate)
        if lowered is None:
          lowered = jax.jit(functools.partial(fn, static),
                            donate_argnums=donate).lower(*args)
    except BaseException:
      self._release(key)
      raise
    return Pending(self, key, start, lowered=lowered, options=options)

  def lower_ahead(self, name: str, fn: Callable, static: Any, args: tuple,
                  compiler_options: Callable[[], dict[str, Any]],
                  donate: tuple[int, ...] = ()) -> "Pending | None":
    """Traces a program now, for XLA to compile later; None if it is cached
    or being made. The caller then owns the program's making: it calls
    `Pending.start_compile` (or `Pending.compile`), or `Pending.abandon` if
    it gives up, since until then a `get` of the program waits for it."""
    key = _program_key(name, static, args)
    if key is None:
      return None  # `get` warns and compiles it as usual.
    with self._lock:
      if key in self._programs or self._making.busy(key):
        return None
    pending = self.lower(name, fn, static, args, compiler_options, donate)
    return None if pending.done else pending

  def _finish(self, key, program) -> None:
    with self._lock:
      self.compilations += 1
      if key is not None:
        self._programs[key] = program
        while len(self._programs) > self.size:
          self._programs.popitem(last=False)

  def _release(self, key) -> None:
    if key is not None:
      with self._lock:
        self._making.release(key)

  def items(self, name: str | None = None) -> list[tuple[Any, Any]]:
    """``(key, compiled)`` pairs held, oldest first (``key[0]`` is the
    program's name)."""
    with self._lock:
      return [(k, p) for k, p in self._programs.items()
              if name is None or k[0] == name]

  def clear(self) -> None:
    with self._lock:
      self._programs.clear()

  def _warn_unhashable(self) -> None:
    if not self._warned:
      self._warned = True
      warnings.warn(
          "the model has an unhashable static field (e.g. a list or dict in"
          " a layer's metadata); generation programs cannot be cached and"
          " are recompiled on every call. Use tuples or frozen"
          " dataclasses for static layer fields.")


class Pending:
  """A program of a `ProgramCache` between tracing and XLA's compile.

  Attributes:
    done: Whether the program is already compiled (a cache hit).
    start: When the cache was asked for it (``time.perf_counter()``).
  """

  def __init__(self, cache: ProgramCache, key, start: float, *,
               program=None, waited: bool = False, lowered=None,
               options: dict | None = None):
    self._cache, self._key, self.start = cache, key, start
    self._program, self._waited = program, waited
    self._lowered, self._options = lowered, options or {}
    self._thread: threading.Thread | None = None
    self._outcome: tuple | None = None
    self._error: BaseException | None = None
    self.done = program is not None

  @property
  def out_info(self):
    """The outputs' ``jax.ShapeDtypeStruct``s (None for a cache hit)."""
    return None if self._lowered is None else self._lowered.out_info

  def start_compile(self) -> None:
    """Has XLA compile the program on another thread from now on; `compile`
    then waits for it, and raises what it raised. A compile nobody waits
    for that fails is left to the cache's next `get`, which compiles again
    and raises."""
    if self.done or self._thread is not None:
      return
    # Not a daemon: at interpreter exit Python waits for it. A daemon
    # thread still inside XLA's compiler when Python finalizes is stopped by
    # a forced unwind through C++ frames, which aborts the process
    # ("FATAL: exception not rethrown", exit -6: a CLI run cancelled by
    # Ctrl-C while the decode program compiled did this).
    self._thread = threading.Thread(
        target=self._compile_in_thread, daemon=False,
        name=f"penzai_lm compile {self._key[0] if self._key else ''}")
    self._thread.start()

  def abandon(self) -> None:
    """Gives up a program traced but not to be compiled (its caller
    failed): the cache's next `get` of it compiles it instead of waiting
    for this one."""
    if not self.done and self._thread is None:
      self._cache._release(self._key)  # pylint: disable=protected-access

  def compile(self):
    """``(compiled, seconds)`` as `ProgramCache.get` returns them."""
    if self._thread is not None:
      self._thread.join()
      if self._error is not None:
        raise self._error
      return self._outcome
    return self._compile_here()

  def _compile_here(self):
    if self.done:
      seconds = time.perf_counter() - self.start if self._waited else 0.0
      return self._program, seconds
    compile_start = time.perf_counter()
    try:
      program = (self._lowered.compile(self._options) if self._options
                 else self._lowered.compile())
      self._cache._finish(self._key, program)  # pylint: disable=protected-access
    finally:
      self._cache._release(self._key)  # pylint: disable=protected-access
    self._program, self.done = program, True
    if time.perf_counter() - compile_start >= TRIM_AFTER_COMPILE_S:
      # XLA's scratch memory, freed into malloc's arenas, goes back to the
      # system instead of staying in the process's resident size.
      release_freed_memory()
    return program, time.perf_counter() - self.start

  def _compile_in_thread(self) -> None:
    try:
      self._outcome = self._compile_here()
    except BaseException as e:  # pylint: disable=broad-except
      self._error = e  # Raised by `compile` in the thread that waits.
