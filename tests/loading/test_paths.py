"""What `penzai_lm.load` reads from a name or a path (`penzai_lm.model_paths`).

Names never resolve through the working directory, and FIFOs, devices and
sockets are refused before anything opens them. Each FIFO test has a
watchdog that writes to the FIFO after a while: a loader that opened it
fails the test instead of hanging the run.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import pytest

import penzai_lm
from penzai_lm import fetch
from tests.loading.test_streaming import _write_family

_LIMIT_S = 20.0


@contextlib.contextmanager
def _watchdog(fifo):
  """Unblocks a reader of ``fifo`` after `_LIMIT_S` (then sends garbage)."""
  done = threading.Event()

  def feed():
    if not done.wait(_LIMIT_S):
      with open(fifo, "wb") as f:
        f.write(b"not a model")

  thread = threading.Thread(target=feed, daemon=True)
  thread.start()
  try:
    yield
  finally:
    done.set()


def test_a_model_named_like_a_file_in_the_working_directory_is_the_named_one(
    tmp_path, monkeypatch):
  """A directory called ``smollm2-135m-instruct`` in the working directory
  (here a valid Mistral model) is not loaded for the name; the named model
  (a Llama stand-in for the cache's file) is."""
  work = tmp_path / "work"
  _write_family(work / "smollm2-135m-instruct", "mistral", "F32")
  named = _write_family(tmp_path / "cache-model", "llama", "F32")
  asked = []
  monkeypatch.setattr(fetch, "fetch_model",
                      lambda name: asked.append(name) or named)
  llama = penzai_lm.load_model(named).config
  mistral = penzai_lm.load_model(work / "smollm2-135m-instruct").config
  assert llama != mistral
  monkeypatch.chdir(work)
  assert penzai_lm.load_model("smollm2-135m-instruct").config == llama
  assert asked == ["smollm2-135m-instruct"]
  # Written as a path, the working directory's model is loaded.
  assert penzai_lm.load_model("./smollm2-135m-instruct").config == mistral
  assert asked == ["smollm2-135m-instruct"]


def test_a_fifo_as_the_model_path_is_refused_up_front(tmp_path):
  fifo = tmp_path / "model.gguf"
  os.mkfifo(fifo)
  start = time.monotonic()
  with _watchdog(fifo), pytest.raises(ValueError, match="FIFO"):
    penzai_lm.load(str(fifo))
  assert time.monotonic() - start < _LIMIT_S / 2


def test_a_fifo_inside_a_model_directory_is_refused_up_front(tmp_path):
  model = _write_family(tmp_path / "model", "llama", "F32")
  (model / "config.json").unlink()
  os.mkfifo(model / "config.json")
  start = time.monotonic()
  with (_watchdog(model / "config.json"),
        pytest.raises(ValueError, match=r"config.json \(in the model "
                      r"directory .*\) is a FIFO")):
    penzai_lm.load(model)
  assert time.monotonic() - start < _LIMIT_S / 2


@pytest.mark.parametrize("kind", ["character device", "socket"])
def test_devices_and_sockets_are_refused(tmp_path, kind):
  if kind == "socket":
    path = tmp_path / "model.gguf"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
  else:
    path = "/dev/zero"  # Endless: read to the end, it never ends.
    if not os.path.exists(path):
      pytest.skip("no /dev/zero")
  try:
    with pytest.raises(ValueError, match=f"is a {kind}"):
      penzai_lm.load_model(path)
  finally:
    if kind == "socket":
      server.close()


def test_fifos_are_refused_by_the_direct_readers_too(tmp_path):
  """`open_checkpoint`, `read_checkpoint`, `Tokenizer.from_gguf` and
  `Tokenizer.from_hf` refuse a FIFO themselves (not only `load`)."""
  # pylint: disable-next=g-import-not-at-top
  from penzai_lm import checkpoints
  from penzai_lm.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
  fifo = tmp_path / "model.gguf"
  os.mkfifo(fifo)
  model = _write_family(tmp_path / "model", "llama", "F32")
  (model / "tokenizer.json").unlink(missing_ok=True)
  os.mkfifo(model / "tokenizer.json")
  start = time.monotonic()
  with _watchdog(fifo), _watchdog(model / "tokenizer.json"):
    for read in (checkpoints.open_checkpoint, checkpoints.read_checkpoint,
                 Tokenizer.from_gguf):
      with pytest.raises(ValueError, match="is a FIFO"):
        read(fifo)
    with pytest.raises(ValueError, match=r"tokenizer.json \(in the model "
                       r"directory .*\) is a FIFO"):
      Tokenizer.from_hf(model)
  assert time.monotonic() - start < _LIMIT_S / 2
