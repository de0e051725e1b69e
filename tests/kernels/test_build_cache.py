"""The kernel library's cache (`penzai_lm.kernels.build`): where it lives,
what its name is made of, and damaged libraries rebuilt instead of loaded.

Damage is tried on a tiny library (one function, compiled once per module;
a "build" copies it), and once end to end on a copy of the real library in
a new process, where a truncated library used to end the process with
SIGBUS on every run; that "rebuild" copies the intact library too, so no
test here compiles the kernels.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import warnings

import jaxlib
import pytest

from penzai_lm.kernels import build

REPO = pathlib.Path(__file__).resolve().parents[2]
COMPILER = build.find_compiler()
needs_compiler = pytest.mark.skipif(COMPILER is None,
                                    reason="no C++ compiler")


@pytest.fixture(scope="module")
def tiny_library(tmp_path_factory):
  """A shared library whose ``pzlm_probe()`` returns 42."""
  directory = tmp_path_factory.mktemp("tiny")
  source = directory / "probe.cc"
  source.write_text('extern "C" int pzlm_probe() { return 42; }\n')
  out = directory / "probe.so"
  subprocess.run([COMPILER, "-shared", "-fPIC", str(source), "-o", str(out)],
                 check=True, capture_output=True)
  return out


def _truncate(path):
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def _same_size_garbage(path):
  path.write_bytes(b"\0" * path.stat().st_size)


def _directory(path):
  path.unlink()
  path.mkdir()


def _no_record(path):
  build._sidecar(path).unlink()


@needs_compiler
@pytest.mark.parametrize("damage", [
    _truncate, _same_size_garbage, lambda path: path.write_bytes(b""),
    _directory, _no_record])
def test_a_damaged_library_is_rebuilt_with_a_warning(tmp_path, tiny_library,
                                                      damage):
  builds = []

  def fake_build(out):
    builds.append(out)
    shutil.copyfile(tiny_library, out)

  library = tmp_path / "kernels-0123.so"
  assert build.cached_library(library, fake_build) == library
  assert build.check_library(library) is None
  damage(library)
  assert build.check_library(library) is not None
  with pytest.warns(UserWarning, match=f"{library} is damaged"):
    build.cached_library(library, fake_build)
  assert len(builds) == 2
  assert ctypes.CDLL(str(library)).pzlm_probe() == 42
  # Intact again: loaded as it is.
  build.cached_library(library, fake_build)
  assert len(builds) == 2
  # No temporary files are left beside it.
  assert sorted(p.name for p in tmp_path.iterdir()
                if not p.name.endswith(".lock")) == [
                    library.name, library.name + ".sha256"]


def test_a_failed_build_leaves_no_library(tmp_path):
  def failing_build(out):
    out.write_bytes(b"half a library")
    raise OSError("the compiler crashed")

  library = tmp_path / "kernels-0123.so"
  with pytest.raises(OSError, match="crashed"):
    build.cached_library(library, failing_build)
  assert not [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")]


def test_the_library_is_cached_under_penzai_lm_cache(tmp_path, monkeypatch):
  monkeypatch.delenv("PENZAI_LM_KERNEL_CACHE", raising=False)
  monkeypatch.setenv("PENZAI_LM_CACHE", str(tmp_path / "cache"))
  path = build.library_path("g++")
  assert path.parent == tmp_path / "cache" / "kernels"
  # Named by its key (a hash), never by file metadata.
  assert path.name == f"kernels-{build.library_key('g++')[:32]}.so"
  monkeypatch.setenv("PENZAI_LM_KERNEL_CACHE", str(tmp_path / "kernels"))
  assert build.library_path("g++").parent == tmp_path / "kernels"


def test_the_key_covers_jaxlib_the_compiler_the_flags_and_the_sources(
    monkeypatch, tmp_path):
  key = build.library_key("g++")
  assert build.library_key("g++") == key
  source = tmp_path / "rows.cc"
  source.write_text(build._SOURCES[-1].read_text() + "\n// edited\n")
  changes = [
      lambda m: m.setattr(jaxlib, "__version__", "0.0.1"),
      lambda m: m.setattr(build, "_compiler_identity", lambda c: "g++ 99.0"),
      lambda m: m.setattr(build, "_FLAGS", build._FLAGS + ("-g",)),
      lambda m: m.setattr(build, "_cpu_fingerprint", lambda: "avx9"),
      lambda m: m.setattr(build, "_SOURCES", build._SOURCES[:-1] + (source,)),
  ]
  for change in changes:
    with monkeypatch.context() as m:
      change(m)
      assert build.library_key("g++") != key
  assert build.library_key("g++") == key


def test_the_compiler_identity_includes_its_version():
  if shutil.which("g++") is None:
    pytest.skip("no g++")
  version = subprocess.run(["g++", "--version"], capture_output=True,
                           text=True).stdout
  assert version and version in build._compiler_identity("g++")


_RUN_KERNELS = """
import shutil, warnings
warnings.simplefilter("always")
from penzai_lm.kernels import build
# The "rebuild" copies the intact library: no compile in this test.
build._compile = lambda compiler, out: shutil.copyfile({intact!r}, out)
print("kernels:", build.cpu_kernels() is not None)
"""


@needs_compiler
def test_a_truncated_real_library_is_rebuilt_not_loaded(tmp_path):
  """In a new process (a SIGBUS there must not end the test run)."""
  from penzai_lm.kernels import ops  # pylint: disable=g-import-not-at-top
  if not ops.available():
    pytest.skip("the kernels did not build here")
  intact = build.library_path(COMPILER)
  cache = tmp_path / "kernels"
  cache.mkdir()
  copy = cache / intact.name
  shutil.copyfile(intact, copy)
  shutil.copyfile(build._sidecar(intact), build._sidecar(copy))
  _truncate(copy)
  out = subprocess.run(
      [sys.executable, "-c", textwrap.dedent(_RUN_KERNELS.format(
          intact=str(intact)))],
      cwd=REPO, capture_output=True, text=True, timeout=300,
      env={**os.environ, "PENZAI_LM_KERNEL_CACHE": str(cache),
           "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
  assert "kernels: True" in out.stdout
  assert f"{copy} is damaged" in out.stderr
  assert copy.read_bytes() == intact.read_bytes()


# --- Loading runs code: only from a folder of the user's own --------------

_PLANTED = ("__attribute__((constructor)) static void planted(void) {{"
            ' FILE* f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')


def _plant(cache: pathlib.Path, marker: pathlib.Path) -> pathlib.Path:
  """A library at the kernels' path whose constructor writes ``marker``,
  with a sidecar that matches it (as an attacker would write one)."""
  source = cache / "planted.c"
  source.write_text("#include <stdio.h>\n" + _PLANTED.format(marker=marker))
  library = cache / build.library_path(COMPILER).name
  subprocess.run([COMPILER, "-x", "c", "-shared", "-fPIC", str(source), "-o",
                  str(library)], check=True, capture_output=True)
  source.unlink()
  build._sidecar(library).write_text(
      f"{library.stat().st_size} {build._sha256(library)}\n")
  return library


def _cpu_kernels_in(cache: pathlib.Path, intact: pathlib.Path | None = None):
  """``build.cpu_kernels()`` in a new process with ``cache`` as the kernel
  cache (a "rebuild" copies ``intact``)."""
  script = "import warnings\nwarnings.simplefilter('always')\n"
  script += "import shutil\nfrom penzai_lm.kernels import build\n"
  if intact is not None:
    script += ("build._compile = lambda compiler, out: shutil.copyfile("
               f"{str(intact)!r}, out)\n")
  script += "print('kernels:', build.cpu_kernels() is not None)\n"
  return subprocess.run(
      [sys.executable, "-c", script], cwd=REPO, capture_output=True,
      text=True, timeout=300,
      env={**os.environ, "PENZAI_LM_KERNEL_CACHE": str(cache),
           "JAX_PLATFORMS": "cpu"})


@needs_compiler
@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_library_in_a_folder_others_can_write_is_never_loaded(tmp_path,
                                                                  mode):
  cache = tmp_path / "kernels"
  cache.mkdir()
  marker = tmp_path / "constructor-ran"
  _plant(cache, marker)
  cache.chmod(mode)
  out = _cpu_kernels_in(cache)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "kernels: False" in out.stdout
  assert not marker.exists()  # Its code never ran.
  assert f"refusing to load the CPU kernels from the folder {cache}" in (
      out.stderr)
  assert f"chmod 700 {cache}" in out.stderr
  # The same library in a folder of the user's own is loaded: the check,
  # not the library, kept it out.
  cache.chmod(0o700)
  out = _cpu_kernels_in(cache)
  assert marker.exists()


@needs_compiler
def test_a_library_others_can_write_is_never_loaded(tmp_path):
  cache = tmp_path / "kernels"
  cache.mkdir(mode=0o700)
  marker = tmp_path / "constructor-ran"
  library = _plant(cache, marker)
  library.chmod(0o666)
  out = _cpu_kernels_in(cache)
  assert "kernels: False" in out.stdout
  assert not marker.exists()
  assert f"the library {library}" in out.stderr


def test_the_kernel_folder_is_created_private(tmp_path, monkeypatch):
  monkeypatch.setenv("PENZAI_LM_KERNEL_CACHE", str(tmp_path / "a" / "kernels"))
  library = build.library_path("g++")
  build.cached_library(library, lambda out: out.write_bytes(b"x"))
  assert (library.parent.stat().st_mode & 0o777) == 0o700


@needs_compiler
def test_a_library_that_matches_its_record_but_does_not_load_is_rebuilt_once(
    tmp_path):
  """A library of another system (intact by its sidecar, not loadable) is
  rebuilt quietly, and the next process loads it without a word."""
  from penzai_lm.kernels import ops  # pylint: disable=g-import-not-at-top
  if not ops.available():
    pytest.skip("the kernels did not build here")
  intact = build.library_path(COMPILER)
  cache = tmp_path / "kernels"
  cache.mkdir(mode=0o700)
  foreign = cache / intact.name
  foreign.write_bytes(b"not a library for this system\n")
  build._sidecar(foreign).write_text(
      f"{foreign.stat().st_size} {build._sha256(foreign)}\n")
  for _ in range(2):
    out = _cpu_kernels_in(cache, intact)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "kernels: True" in out.stdout
    assert "penzai_lm:" not in out.stderr  # No warning, either time.
  assert foreign.read_bytes() == intact.read_bytes()


@needs_compiler
def test_the_kernels_build_where_there_is_a_compiler():
  """A compile error must fail the suite: every kernel test skips without
  the library, and the build only warns (then decoding falls back to XLA)."""
  if os.environ.get("PENZAI_LM_CPU_KERNELS", "1") == "0":
    pytest.skip("PENZAI_LM_CPU_KERNELS=0 turns the kernels off")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    library = build.cpu_kernels()
  assert library is not None, [str(w.message) for w in caught]
