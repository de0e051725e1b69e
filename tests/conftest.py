"""Session-wide test setup.

XLA compilation is most of this suite's time on CPU, and many tests compile
the same programs (same tiny configs, same buckets) through engines and
models of their own. A persistent compilation cache in a fresh directory
per test process lets identical programs compile once per run; nothing is
shared between runs (CI stays hermetic). The same directory goes to the
processes tests start (notebook kernels, CLI runs) through JAX's
environment variables. Tests count compilations through
`Engine.compilations`, which this does not change.
"""

import os
import shutil
import tempfile

import jax
import pytest

_CACHE = pytest.StashKey[str]()
_PREVIOUS = pytest.StashKey[dict]()
_SETTINGS = {
    "jax_compilation_cache_dir": None,  # Set per process below.
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
}


def pytest_configure(config):
  cache = tempfile.mkdtemp(prefix="penzai_lm_jax_cache_")
  config.stash[_CACHE] = cache
  config.stash[_PREVIOUS] = {
      name: getattr(jax.config, name) for name in _SETTINGS}
  for name, value in {**_SETTINGS, "jax_compilation_cache_dir": cache}.items():
    jax.config.update(name, value)
    os.environ[name.upper()] = str(value)


def pytest_unconfigure(config):
  for name, value in config.stash.get(_PREVIOUS, {}).items():
    jax.config.update(name, value)
    os.environ.pop(name.upper(), None)
  cache = config.stash.get(_CACHE, None)
  if cache:
    shutil.rmtree(cache, ignore_errors=True)


def _heavy(item) -> bool:
  """Files that take minutes: the real-model parity tests and notebooks."""
  return (item.get_closest_marker("slow") is not None
          or str(item.path).endswith(".ipynb"))


# Files that load the real models and transformers' twins (9.3 GB and 6.9
# GB peak alone): run by one worker, one after the other, sharing the
# models (`tests/real_models.py`). On two workers at once the machine's
# 24 GB ran out (a worker was OOM-killed). tests/test_readme.py loads the
# default model in processes of its own: one at a time with the others too.
_REAL_MODEL_FILES = ("tests/loading/test_real_models.py",
                     "tests/interp/test_hf_parity.py",
                     "tests/interp/test_patching.py",
                     "tests/test_readme.py")


@pytest.hookimpl(tryfirst=True)  # Before pytest-xdist reads the groups.
def pytest_collection_modifyitems(config, items):
  """Heavy files first (a stable sort: the order is otherwise unchanged),
  and one pytest-xdist group per file (``--dist loadgroup``), but one for
  all of `_REAL_MODEL_FILES`.

  pytest-xdist hands whole groups to its two workers in collection order;
  with a minutes-long file collected late, one worker ran it alone at the
  end (a fresh-clone run: 27.6 min of tests for 45 min of CPU).
  """
  del config
  items.sort(key=lambda item: not _heavy(item))
  for item in items:
    path = item.nodeid.split("::")[0]
    item.add_marker(pytest.mark.xdist_group(
        "real_models" if path in _REAL_MODEL_FILES else path))
