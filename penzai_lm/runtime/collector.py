"""Python's cyclic garbage collector, paused while programs are traced and
models prepared.

Tracing a program and preparing a model (penzai's selectors rebuilding the
layer tree) allocate hundreds of thousands of container objects, most of
which survive until the work ends. Each allocation counts towards the
collector's thresholds, so the collector runs full collections in the middle
of that work, and each walks every object the process holds (JAX, the
model, the tokenizer: a few hundred thousand). A first SmolLM2 request ran
three of them before its first token. `collector_paused` keeps them out of
that work: objects are freed by reference counting as always, and the
collector resumes (and collects what it was owed) when the outermost pause
ends. `docs/cpu-speed.md` ("The collector paused") has the measurements.

The collector has one switch for the whole process, so the contract is
about what a pause leaves behind: a collector that was enabled when a pause
began is enabled when it ends, and one that was disabled then (by the user,
or by a pause in another thread) is left disabled. A pause that nests in
another's leaves the switch to the outer one; a collector that another
thread disables while a pause runs is enabled again when that pause ends.
Nothing else of ``gc``'s settings is touched.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collector_paused():
  """Pauses Python's cyclic garbage collector for the ``with`` block (see the
  module docstring): enabled again afterwards only if it was enabled
  before."""
  if not gc.isenabled():
    yield
    return
  gc.disable()
  try:
    yield
  finally:
    gc.enable()
