"""The cache folders (`penzai_lm.paths`): created private, and a folder of
compiled code that is not the user's own is not used."""

import os
import stat

import jax
import pytest

from penzai_lm import cli
from penzai_lm import paths


def test_folders_are_created_private(tmp_path, monkeypatch):
  monkeypatch.setenv("PENZAI_LM_CACHE", str(tmp_path / "new" / "cache"))
  assert stat.S_IMODE(paths.cache_dir().stat().st_mode) == 0o700
  made = paths.private_dir(tmp_path / "a" / "b")
  assert stat.S_IMODE(made.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode, why", [(0o777, "writable by others"),
                                       (0o770, "writable by its group")])
def test_unsafe_reason_names_the_problem_and_the_fix(tmp_path, mode, why):
  folder = tmp_path / "shared"
  folder.mkdir()
  folder.chmod(mode)
  reason, fix = paths.unsafe_reason(folder)
  assert why in reason and f"chmod 700 {folder}" in fix
  folder.chmod(0o700)
  assert paths.unsafe_reason(folder) is None
  assert paths.unsafe_reason(tmp_path / "missing") is None


def test_another_users_folder_is_unsafe(tmp_path, monkeypatch):
  monkeypatch.setattr(os, "getuid", lambda: tmp_path.stat().st_uid + 1)
  reason, _ = paths.unsafe_reason(tmp_path)
  assert "owned by user id" in reason


def test_the_cli_keeps_no_compiled_code_in_a_shared_folder(
    tmp_path, monkeypatch, capsys):
  shared = tmp_path / "jax"
  shared.mkdir()
  shared.chmod(0o777)
  monkeypatch.setenv("PENZAI_LM_JAX_CACHE", str(shared))
  before = jax.config.jax_compilation_cache_dir
  cli._enable_compilation_cache()  # pylint: disable=protected-access
  assert jax.config.jax_compilation_cache_dir == before
  assert f"not caching compiled programs in {shared}" in (
      capsys.readouterr().err)
