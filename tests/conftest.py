"""Session-wide test setup.

XLA compilation is most of this suite's time on CPU, and many tests compile
the same programs (same tiny configs, same buckets) through engines and
models of their own. A persistent compilation cache in a fresh directory
per test run lets identical programs compile once per run; nothing is
shared between runs (CI stays hermetic). The directory is made by the
first process (pytest's, or pytest-xdist's controller) and reaches the
workers and the processes tests start (notebook kernels, CLI runs) through
JAX's environment variables, so a program one worker compiled (or the
engine's `ProgramStore` exported) is read back by the other. Tests count
compilations through `Engine.compilations`, which this does not change.
"""

import gc
import os
import shutil
import sys
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


_SHARED = "PENZAI_LM_TEST_RUN_CACHE"  # Set by the process that made it.


def pytest_configure(config):
  if not hasattr(config, "workerinput"):  # pytest's (or xdist's controller).
    _check_grouping(config)
  cache = os.environ.get(_SHARED)
  if cache is None:  # The first process of the run: it owns the directory.
    cache = tempfile.mkdtemp(prefix="penzai_lm_jax_cache_")
    os.environ[_SHARED] = cache
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
    os.environ.pop(_SHARED, None)
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
                     "tests/interp/test_decompose_hf.py",
                     "tests/evals/test_lm_eval_parity.py",
                     "tests/interp/test_patching.py",
                     "tests/test_readme.py")


def _real_model_turn(item) -> int:
  """Within `_REAL_MODEL_FILES`: the README's processes first (nothing
  loaded in the worker yet), then every SmolLM2 test, then every Gemma 3
  one (`tests/real_models.py` holds one model of each kind at a time)."""
  path = item.nodeid.split("::")[0]
  if path not in _REAL_MODEL_FILES or path == "tests/test_readme.py":
    return 0
  params = getattr(getattr(item, "callspec", None), "params", {})
  return 2 if "gemma3-270m" in params.values() else 1


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
  items.sort(key=lambda item: (not _heavy(item), _real_model_turn(item)))
  for item in items:
    path = item.nodeid.split("::")[0]
    item.add_marker(pytest.mark.xdist_group(
        "real_models" if path in _REAL_MODEL_FILES else path))


def _check_grouping(config) -> None:
  """Refuses to run where pytest-xdist's ``--dist loadgroup`` would ignore
  the groups (pytest 9.2 with pytest-xdist <= 3.8: pytest-xdist#1386): the
  real-model files then loaded the models on both workers (over 10 GB
  each) and every file was split between them."""
  import xdist  # pylint: disable=g-import-not-at-top
  version = lambda v: tuple(int(x) for x in v.split(".")[:2] if x.isdigit())
  if (getattr(config.option, "dist", None) == "loadgroup"
      and version(pytest.__version__) >= (9, 2)
      and version(xdist.__version__) <= (3, 8)):
    raise pytest.UsageError(
        f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__}"
        " ignores --dist loadgroup's groups (pytest-xdist#1386): install"
        " 'pytest<9.2' (pip install -e '.[test]' does), or run with -n 0.")


def _drop_programs() -> None:
  from penzai_lm.generation import default_engine  # pylint: disable=g-import-not-at-top
  default_engine().clear()
  jax.clear_caches()
  gc.collect()


@pytest.hookimpl(tryfirst=True)  # Before pytest-xdist's worker reports.
def pytest_sessionfinish(session):
  """Frees the real models and compiled programs before the worker tells
  pytest-xdist it is done, not in pytest's garbage collection at exit:
  execnet sends a worker SIGINT when it is still running 5 s after it was
  told to stop (``gateway_base._terminate_execution``), and a clean run
  ended with that KeyboardInterrupt's traceback, raised inside JAX's
  garbage-collection callback."""
  del session
  _forget_real_models()
  _drop_programs()


def _forget_real_models() -> None:
  real_models = sys.modules.get("tests.real_models")
  if real_models is not None:
    real_models.ours.cache_clear()
    real_models.theirs.cache_clear()


def _real_model_file(item) -> bool:
  return item.nodeid.split("::")[0] in _REAL_MODEL_FILES


def pytest_runtest_teardown(item, nextitem):
  """Drops compiled programs when a worker moves on to another file.

  Programs of one file's tiny models are rarely used by another, but JAX's
  jit caches and the default engine keep them (and their executables)
  until the process ends: a worker that had run ~800 tests ended at 10.2
  GB RSS. Programs shared across files are compiled again from the run's
  persistent cache. The real models go when the worker leaves their files:
  it held Gemma 3 and its transformers twin for the 26 minutes of tests
  after them (6.1 GB RSS; 3.7 GB once they were freed at the end).
  """
  if nextitem is None or nextitem.path != item.path:
    if _real_model_file(item) and (nextitem is None
                                   or not _real_model_file(nextitem)):
      _forget_real_models()
    _drop_programs()
