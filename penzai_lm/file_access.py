"""Opening the files penzai_lm reads and writes (the bottom floor).

Every reader of autoencoder, transcoder and control-vector files opens its
files here, and every writer writes here, so one rule holds everywhere:

* Reading (`open_regular`, `read_regular`): only regular files. A FIFO,
  device, socket or directory is refused with a ``ValueError`` naming the
  file, before anything is read: the path is checked with ``stat``, then
  opened with ``O_NONBLOCK`` (opening a FIFO does not wait for a writer)
  and checked again with ``fstat`` on what was opened. Symbolic links are
  followed (the Hugging Face cache stores its files as links); confining
  paths to a folder is the caller's business (`inside`).
* Writing (`write_atomic`): the data goes to a new temporary file in the
  destination's folder (created with ``O_EXCL | O_NOFOLLOW``, so never
  through a planted link), is flushed to disk and renamed over the
  destination with ``os.replace``. An existing destination that is a
  regular file is replaced; one that is a symbolic link is replaced by the
  new file (the link's target is never written); anything else (a
  directory, FIFO, device, socket) is refused. A reader never sees a
  half-written file, and a failure leaves the destination as it was.
"""

from __future__ import annotations

from collections.abc import Iterable
import os
import pathlib
import secrets
import stat
from typing import BinaryIO

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
          | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0))


def _kind(mode: int) -> str:
  for test, kind in _KINDS:
    if test(mode):
      return kind
  return "not a regular file"


def _refuse(path, mode: int, what: str) -> None:
  if not stat.S_ISREG(mode):
    raise ValueError(
        f"{path} ({what}) is {_kind(mode)}, not a regular file; reading it"
        " could block or never end, so it is refused. Pass the path of a"
        " regular file.")


def open_regular(path: str | os.PathLike, *, what: str) -> BinaryIO:
  """Opens ``path`` for binary reading if it is a regular file.

  Args:
    path: The file (links are followed).
    what: What the file is, for messages (e.g. ``"SAELens cfg.json"``).

  Returns:
    An unbuffered binary file object (blocking reads), to be closed by the
    caller (``with open_regular(...) as f``).

  Raises:
    FileNotFoundError: (or another ``OSError``) if it cannot be opened.
    ValueError: if it is not a regular file (module docstring).
  """
  path = pathlib.Path(path)
  _refuse(path, os.stat(path).st_mode, what)
  fd = os.open(path, _FLAGS)
  try:
    _refuse(path, os.fstat(fd).st_mode, what)
    if hasattr(os, "set_blocking"):
      os.set_blocking(fd, True)
    return os.fdopen(fd, "rb", buffering=0)
  except BaseException:
    os.close(fd)
    raise


def read_regular(path: str | os.PathLike, *, what: str,
                 max_bytes: int | None = None) -> bytes:
  """The bytes of the regular file ``path`` (see `open_regular`).

  Args:
    path: The file.
    what: What it is, for messages.
    max_bytes: If given, a larger file is refused before it is read.

  Raises:
    OSError: if it cannot be opened or read.
    ValueError: if it is not a regular file, or holds more than
      ``max_bytes`` bytes.
  """
  with open_regular(path, what=what) as f:
    size = os.fstat(f.fileno()).st_size
    if max_bytes is not None and size > max_bytes:
      raise ValueError(
          f"{path} ({what}) is {size} bytes; at most {max_bytes} are"
          " expected of such a file, so it is refused (it is not the file"
          " it is named as).")
    chunks, total = [], 0
    while True:
      chunk = f.read(1 << 20)
      if not chunk:
        return b"".join(chunks)
      total += len(chunk)
      if max_bytes is not None and total > max_bytes:
        raise ValueError(f"{path} ({what}) grew past {max_bytes} bytes while"
                         " it was read; it is refused.")
      chunks.append(chunk)


def inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
  """Whether ``path``, links resolved, lies inside ``folder`` (links
  resolved): a link that leads out of the folder is outside."""
  resolved = pathlib.Path(os.path.realpath(path))
  root = pathlib.Path(os.path.realpath(folder))
  return resolved == root or root in resolved.parents


def write_atomic(path: str | os.PathLike,
                 data: bytes | Iterable[bytes]) -> None:
  """Writes ``data`` (bytes, or an iterable of bytes-like chunks) to
  ``path`` atomically, never through a link (module docstring).

  The new file has mode ``0o666`` less the process umask, as ``open``
  gives.

  Raises:
    ValueError: if ``path`` exists and is neither a regular file nor a
      symbolic link (a directory, FIFO, device or socket).
    OSError: if the folder cannot be written; nothing is left behind.
  """
  path = pathlib.Path(path)
  try:
    mode = os.lstat(path).st_mode
  except FileNotFoundError:
    mode = None
  if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
    raise ValueError(
        f"{path} exists and is {_kind(mode)}; penzai_lm replaces only"
        " regular files (or links, without writing through them). Remove it"
        " or choose another destination.")
  if isinstance(data, (bytes, bytearray, memoryview)):
    data = (data,)
  tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
  flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
           | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0))
  fd = os.open(tmp, flags, 0o666)
  try:
    with os.fdopen(fd, "wb") as f:
      for chunk in data:
        f.write(chunk)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except FileNotFoundError:
      pass
    raise
