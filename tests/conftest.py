"""Session-wide test setup.

XLA compilation is most of this suite's time on CPU, and many tests compile
the same programs (same tiny configs, same buckets) through engines and
models of their own. A persistent compilation cache in a fresh directory
per test session lets identical programs compile once per run; nothing is
shared between runs (CI stays hermetic). Tests count compilations through
`Engine.compilations`, which this does not change.
"""

import jax
import pytest


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory):
  previous = {name: getattr(jax.config, name) for name in (
      "jax_compilation_cache_dir",
      "jax_persistent_cache_min_compile_time_secs",
      "jax_persistent_cache_min_entry_size_bytes")}
  jax.config.update("jax_compilation_cache_dir",
                    str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  yield
  for name, value in previous.items():
    jax.config.update(name, value)
