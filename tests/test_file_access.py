"""`penzai_lm.file_access`: regular files only when reading, atomic writes
that never follow a link."""

import os
import threading

import pytest

from penzai_lm import file_access


def finishes(call, seconds=20):
  """Runs ``call`` in a thread; returns (done, result or exception). A read
  that blocks (a FIFO opened without O_NONBLOCK) shows as not done."""
  out = {}

  def run():
    try:
      out["value"] = call()
    except BaseException as e:  # pylint: disable=broad-except
      out["error"] = e
  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  thread.join(seconds)
  return not thread.is_alive(), out


def test_reading_refuses_a_fifo_without_blocking(tmp_path):
  fifo = tmp_path / "cfg.json"
  os.mkfifo(fifo)
  done, out = finishes(lambda: file_access.read_regular(fifo, what="a cfg"))
  assert done, "reading a FIFO blocked"
  assert isinstance(out.get("error"), ValueError)
  assert "cfg.json (a cfg) is a FIFO (named pipe), not a regular file" in str(
      out["error"])
  with pytest.raises(ValueError, match="is a directory, not a regular file"):
    file_access.open_regular(tmp_path, what="a cfg")
  with pytest.raises(ValueError, match="is a character device"):
    file_access.read_regular("/dev/zero", what="weights")


def test_reading_follows_links_and_bounds_the_size(tmp_path):
  target = tmp_path / "blob"
  target.write_bytes(b"x" * 100)
  (tmp_path / "link").symlink_to(target)
  assert file_access.read_regular(tmp_path / "link", what="w") == b"x" * 100
  with pytest.raises(ValueError, match="is 100 bytes; at most 99"):
    file_access.read_regular(target, what="w", max_bytes=99)
  with pytest.raises(FileNotFoundError):
    file_access.read_regular(tmp_path / "missing", what="w")


def test_write_atomic_replaces_a_planted_link_not_its_target(tmp_path):
  victim = tmp_path / "victim.txt"
  victim.write_text("keep me")
  folder = tmp_path / "out"
  folder.mkdir()
  (folder / "cfg.json").symlink_to(victim)
  file_access.write_atomic(folder / "cfg.json", b"{}")
  assert victim.read_text() == "keep me"
  assert not (folder / "cfg.json").is_symlink()
  assert (folder / "cfg.json").read_bytes() == b"{}"
  file_access.write_atomic(folder / "cfg.json", [b"a", memoryview(b"bc")])
  assert (folder / "cfg.json").read_bytes() == b"abc"
  assert sorted(p.name for p in folder.iterdir()) == ["cfg.json"]


def test_write_atomic_refuses_special_files_and_leaves_nothing(tmp_path):
  os.mkfifo(tmp_path / "pipe")
  with pytest.raises(ValueError, match="is a FIFO .*replaces only regular"):
    file_access.write_atomic(tmp_path / "pipe", b"x")
  (tmp_path / "dir").mkdir()
  with pytest.raises(ValueError, match="is a directory"):
    file_access.write_atomic(tmp_path / "dir", b"x")

  def failing():
    yield b"partial"
    raise RuntimeError("disk full")
  (tmp_path / "old").write_bytes(b"old")
  with pytest.raises(RuntimeError, match="disk full"):
    file_access.write_atomic(tmp_path / "old", failing())
  assert (tmp_path / "old").read_bytes() == b"old"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "old", "pipe"]


def test_inside_resolves_links(tmp_path):
  (tmp_path / "a").mkdir()
  (tmp_path / "a" / "in").write_text("")
  (tmp_path / "out").write_text("")
  (tmp_path / "a" / "escape").symlink_to(tmp_path / "out")
  assert file_access.inside(tmp_path / "a" / "in", tmp_path / "a")
  assert not file_access.inside(tmp_path / "a" / "escape", tmp_path / "a")
  assert not file_access.inside(tmp_path / "a" / ".." / "out", tmp_path / "a")
