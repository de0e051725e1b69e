"""The runtime floor: compiled programs and the model transforms they run.

Below generation, interp and sae; above the model, kernels, quantization
and sharding. It owns:

* `Runtime` (`runtime.py`): the compiled-program cache
  (`program_cache.py`), the on-disk `ProgramStore` (`program_store.py`),
  XLA compile options (`compiler_options.py`) and the compiled forward
  pass of top-level model calls (`forward.py`); `default_runtime()`.
* The process around the programs: freed heap memory handed back after
  long compiles (`freed_memory.py`), Python's cyclic collector paused
  while programs are traced and models prepared (`collector.py`).
* Model transforms the programs run: layer stacks unstacked
  (`unstack.py`), blocks traced once (`shared_traces.py`), the state's
  shardings on a mesh (`placement.py`), and patched variants that share a
  prepared model (`derived.py`, `identity_cache.py`).
"""

from penzai_lm.runtime.program_store import ProgramStore
from penzai_lm.runtime.runtime import default_runtime
from penzai_lm.runtime.runtime import Runtime

__all__ = ["ProgramStore", "Runtime", "default_runtime"]
