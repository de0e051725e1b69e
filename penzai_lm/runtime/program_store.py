"""Generation programs kept on disk as exported StableHLO.

With JAX's persistent compilation cache a new process skips XLA's compile,
but not tracing, which is most of a program's cost once XLA's is cached
(measurements: docs/design.md, "Measurements behind the code"). A
`ProgramStore` keeps each program's `jax.export` form so that a new
process skips tracing too.

Keys. A program is keyed on a fingerprint of everything it is traced from:
the program's name and static shapes, the model's structure with every
static field (layer types, axis names, configs, functions), the arguments'
structure and shapes, the compiler options, the device kind, the JAX flags
that change tracing, and the versions of jax, jaxlib, penzai and
penzai_lm's own sources. A fingerprint is only made of values it can name
exactly: types and functions importable from penzai, penzai_lm, jax or
numpy, dataclasses, enums, numbers, strings and containers. A model with
anything else in its structure (a layer class defined in a notebook, a
lambda) has no fingerprint and its programs are traced as usual, as are
programs of sharded models. The sources enter as one digest of every
``.py``, ``.cc`` and ``.h`` file of penzai_lm (read once per process): a
program runs the code of whatever penzai_lm functions it calls, directly
or not, and no narrower set of files is known to contain all of them, so
any edit retires every stored program (never a stale one served). The
programs an edit retires are left behind under keys no process asks for;
the size bound below removes them.

Format. A file is a header line -- ``PZLM-PROGRAM <format> <payload size>
<payload sha256>`` -- then the payload: one line of JSON describing the
outputs' pytree structure, then the bytes of ``Exported.serialize()``
(flatbuffers). Nothing read back can run code: the JSON is parsed by
`json` and rebuilt by `_decode_tree`, which names pytree node types only
by ``module:qualname`` of types already imported from penzai, penzai_lm,
jax or numpy (never importing anything) and builds their metadata from
plain values (numbers, strings, containers, dtypes, enums, types, and
penzai's `StructStaticMetadata`); the exported program is read by
`jax.export.deserialize`. Files of another format (format 2 was a pickle)
are never deserialized. A program whose output structure holds anything
else is served but not written (a warning says so).

Trust. The programs read back are compiled and run with the user's
rights, so the directory must be the user's own: it is created ``0700``
(files ``0600``), and an existing one that another user owns or that is
group- or world-writable is refused with `UnsafeDirectory` (when the
store is made, and before each read or write). A file whose header, size
or hash does not match (a flipped bit, a truncation), that is of another
format, or that does not deserialize or lower is damaged: a warning names
it, it is removed, and the program is traced again and written over it.

Bound. The programs kept take at most ``max_bytes`` (default
`DEFAULT_MAX_BYTES`, 1 GiB) of files: after each write the least recently
used ones are removed until the rest fit (recency is the file's
modification time, refreshed on every load), never the file just written
(a single program larger than the bound is kept alone). Files are written
to a temporary name and renamed, so concurrent processes see a program
whole or not at all; one removed while another process reads it is
traced again there.

Every program the store serves, stored or just traced, is compiled from
its exported form (``jax.jit(exported.call)``), so a new process asks XLA's
persistent cache for exactly the module the first process compiled.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import time
from typing import Any
import warnings

import jax

from penzai_lm.kernels.build import TARGETS as KERNEL_TARGETS
from penzai_lm.paths import unsafe_reason
from penzai_lm.paths import UnsafeDirectory
from penzai_lm.runtime.program_keys import aval_key
from penzai_lm.runtime.program_keys import describe
from penzai_lm.runtime.program_keys import the_device
from penzai_lm.runtime.program_keys import TRACE_FLAGS
from penzai_lm.runtime.program_keys import Unnamed
from penzai_lm.runtime.program_keys import versions
from penzai_lm.runtime.program_trees import decode_tree
from penzai_lm.runtime.program_trees import encode_tree

# Format 2 was a pickle; 3 is JSON (the output tree) and jax.export's bytes.
_FORMAT = 3
_SUFFIX = ".pzlm-program"
_MAGIC = b"PZLM-PROGRAM"  # Header: magic, format, payload size, sha256.
# 1 GiB. Weights are a program's arguments, not its constants, so a file
# holds code alone (a 3-layer test model's: 30-50 kB).
DEFAULT_MAX_BYTES = 1 << 30
# Temporary files of a write older than this were left by a killed process.
_STALE_TMP_SECONDS = 3600
class StoredProgram:
  """A compiled program made from an exported one, called like the
  ``jax.jit`` program it replaces (pytrees in, pytrees out)."""

  def __init__(self, compiled, in_tree, out_tree):
    self._compiled = compiled
    self._in_tree = in_tree
    self._out_tree = out_tree

  def __call__(self, *args):
    leaves, in_tree = jax.tree_util.tree_flatten(args)
    if in_tree != self._in_tree:
      raise TypeError(f"arguments of structure {in_tree}, expected"
                      f" {self._in_tree}")
    return jax.tree_util.tree_unflatten(self._out_tree,
                                        self._compiled(*leaves))

  def as_text(self) -> str:
    return self._compiled.as_text()

  def cost_analysis(self):
    return self._compiled.cost_analysis()

  def memory_analysis(self):
    return self._compiled.memory_analysis()


@dataclasses.dataclass(frozen=True)
class LoweredProgram:
  """An exported program lowered for XLA, not yet compiled."""
  lowered: Any
  in_tree: Any
  out_tree: Any

  @property
  def out_info(self):
    """The outputs' ``jax.ShapeDtypeStruct``s, in their pytree."""
    return jax.tree_util.tree_unflatten(self.out_tree, self.lowered.out_info)

  def compile(self, options: dict | None = None) -> StoredProgram:
    compiled = (self.lowered.compile(compiler_options=dict(options))
                if options else self.lowered.compile())
    return StoredProgram(compiled, self.in_tree, self.out_tree)


@dataclasses.dataclass
class StoreStats:
  """What a `ProgramStore` did in this process."""
  loaded: int = 0    # Programs read back instead of traced.
  saved: int = 0     # Programs traced, exported and written.
  unnamed: int = 0   # Programs traced as usual: no fingerprint.
  unexported: int = 0  # Programs jax.export refused (traced as usual).
  damaged: int = 0   # Files that failed their check: traced, rewritten.
  evicted: int = 0   # Files removed to keep the store under its bound.


class ProgramStore:
  """Exported generation programs in a directory (see the module docstring).

  Attributes:
    directory: Where the programs are kept.
    max_bytes: The most bytes of program files kept (least recently used
      removed first).
    stats: Counts of loads, saves and programs without a fingerprint.
  """

  def __init__(self, directory: str | os.PathLike, *,
               max_bytes: int = DEFAULT_MAX_BYTES):
    """Makes a store; its directory is created on the first write.

    Raises:
      ValueError: for an empty path or a ``max_bytes`` that is not a
        positive integer.
      UnsafeDirectory: if the directory exists and is not the user's own
        (see the module docstring).
    """
    if not str(directory):
      raise ValueError("ProgramStore needs a directory, got an empty path.")
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or (
        max_bytes < 1):
      raise ValueError("ProgramStore's max_bytes must be a positive integer"
                       f" (bytes), got {max_bytes!r}.")
    self.directory = pathlib.Path(directory).expanduser()
    self.max_bytes = max_bytes
    self.stats = StoreStats()
    self._warned = False
    self._check_directory()

  def key(self, name: str, static: Any, args: tuple, options: dict,
          donate: tuple[int, ...]) -> str | None:
    """The program's file key, or None where it has no fingerprint."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    device = the_device(leaves)
    if device is None:
      return None
    avals = tuple(aval_key(x) for x in leaves)
    try:
      text = describe((name, static, treedef, avals, device.platform,
                       device.device_kind,
                       tuple(sorted(options.items())), donate, tuple(
                           str(getattr(jax.config, flag, None))
                           for flag in TRACE_FLAGS)))
    except Unnamed:
      self.stats.unnamed += 1
      return None
    return hashlib.sha256((versions(_FORMAT) + text).encode()).hexdigest()

  def lower(self, key: str, fn, static, args: tuple,
            donate: tuple[int, ...]) -> "LoweredProgram | None":
    """The program for ``key``, read back or traced, exported and written,
    and lowered from its exported form either way (XLA compiles it on
    `LoweredProgram.compile`).

    Returns None where the program cannot be exported (the caller then
    compiles it as usual); a program that cannot be written is still
    served, with a warning.
    """
    leaves, in_tree = jax.tree_util.tree_flatten(args)
    flat_donate = _leaf_indices(args, donate)
    stored = self._read(key)
    if stored is not None:
      exported, out_tree = stored
      try:
        lowered = jax.jit(exported.call,
                          donate_argnums=flat_donate).lower(*leaves)
      except Exception as e:  # pylint: disable=broad-except
        # Intact by its hash, yet not a program for these arguments.
        self._discard(self._path(key), f"it does not lower ({e})")
      else:
        self.stats.loaded += 1
        _touch(self._path(key))
        return LoweredProgram(lowered, in_tree, out_tree)
    try:
      exported, out_tree = _export(fn, static, in_tree, leaves,
                                   _lowering_platform(the_device(leaves)))
    except Exception as e:  # pylint: disable=broad-except
      # E.g. a patch with a host callback, which jax.export refuses.
      self.stats.unexported += 1
      self._warn(f"a {type(e).__name__} while exporting it ({e})")
      return None
    try:
      self._write(key, exported, out_tree)
      self.stats.saved += 1
    except UnsafeDirectory:
      raise
    except (OSError, ValueError, Unnamed) as e:
      self._warn(f"it could not be written to {self.directory} ({e!r})")
    lowered = jax.jit(exported.call, donate_argnums=flat_donate).lower(*leaves)
    return LoweredProgram(lowered, in_tree, out_tree)

  def _warn(self, why: str) -> None:
    if not self._warned:
      self._warned = True
      warnings.warn(f"penzai_lm: a generation program is not kept on disk:"
                    f" {why}. It is traced again in every new process.",
                    stacklevel=4)

  def _path(self, key: str) -> pathlib.Path:
    return self.directory / f"{key}{_SUFFIX}"

  def _discard(self, path: pathlib.Path, why: str) -> None:
    """Warns about a damaged program file and removes it."""
    self.stats.damaged += 1
    warnings.warn(f"penzai_lm: ignoring the damaged stored program {path}:"
                  f" {why}. The program is traced again and the file"
                  " replaced.", stacklevel=5)
    try:
      if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
      else:
        path.unlink()
    except OSError:
      pass  # A read-only store: the fresh program is not written either.

  def _check_directory(self) -> bool:
    """Whether the directory exists (a directory of the user's own).

    Raises:
      UnsafeDirectory: if it is not the user's own.
    """
    if not os.path.lexists(self.directory):
      return False
    problem = unsafe_reason(self.directory)
    if problem is None:
      # A path that cannot be stat'ed: the read or write that follows says.
      return os.path.isdir(self.directory)
    why, fix = problem
    raise UnsafeDirectory(
        f"penzai_lm: refusing the program store directory {self.directory}:"
        f" it is {why}. Programs read back from it are compiled and run, so"
        f" it must be a directory of your own that only you can write: {fix}"
        "choose another directory (Engine(program_store=...), or another"
        " jax_compilation_cache_dir for the \"auto\" store), or turn the"
        " store off (program_store=None).")

  def _read(self, key: str):
    """The stored ``(exported, out_tree)``, or None (missing or damaged)."""
    if not self._check_directory():
      return None
    path = self._path(key)
    try:
      data = path.read_bytes()
    except FileNotFoundError:
      return None
    except OSError as e:  # E.g. a directory under the name.
      self._discard(path, f"it cannot be read ({e})")
      return None
    why, payload = _check(data)
    if why is not None:
      self._discard(path, why)
      return None
    # Only json and jax.export read the payload: nothing in it can run.
    tree, newline, blob = payload.partition(b"\n")
    try:
      if not newline:
        raise ValueError("no output structure")
      out_tree = decode_tree(json.loads(tree))
      exported = jax.export.deserialize(bytearray(blob))
      if out_tree.num_leaves != len(exported.out_avals):
        raise ValueError(f"{out_tree.num_leaves} outputs in its structure,"
                         f" {len(exported.out_avals)} in its program")
    except Exception as e:  # pylint: disable=broad-except
      self._discard(path, f"it does not deserialize ({e})")
      return None
    return exported, out_tree

  def _write(self, key: str, exported, out_tree) -> None:
    tree = json.dumps(encode_tree(out_tree), separators=(",", ":"))
    if decode_tree(json.loads(tree)) != out_tree:  # Else never read back.
      raise ValueError(f"its output structure does not survive JSON: {tree}")
    payload = tree.encode() + b"\n" + bytes(exported.serialize())
    header = b"%s %d %d %s\n" % (_MAGIC, _FORMAT, len(payload),
                                 hashlib.sha256(payload).hexdigest().encode())
    if not self._check_directory():
      self.directory.parent.mkdir(parents=True, exist_ok=True)
      try:
        self.directory.mkdir(mode=0o700)
      except FileExistsError:
        pass  # Made by another process meanwhile: checked below.
      self._check_directory()
    fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.",
                               suffix=".tmp")  # Mode 0600.
    try:
      with os.fdopen(fd, "wb") as f:
        f.write(header + payload)
      os.replace(tmp, self._path(key))
    except BaseException:
      os.unlink(tmp)
      raise
    self._evict(keep=self._path(key))

  def _evict(self, keep: pathlib.Path) -> None:
    """Removes the least recently used program files (not ``keep``) until
    the rest take at most ``max_bytes``, and temporary files left by killed
    writers. Safe against other processes doing the same."""
    files, total, now = [], 0, time.time()
    try:
      entries = list(os.scandir(self.directory))
    except OSError:
      return
    for entry in entries:
      try:
        if not entry.is_file(follow_symlinks=False):
          continue
        st = entry.stat(follow_symlinks=False)
      except OSError:
        continue  # Removed meanwhile.
      if entry.name.startswith(".") and entry.name.endswith(".tmp"):
        if now - st.st_mtime > _STALE_TMP_SECONDS:
          _remove(entry.path)
      elif entry.name.endswith(_SUFFIX):
        total += st.st_size
        if entry.name != keep.name:
          files.append((st.st_mtime_ns, entry.name, st.st_size))
    for _, name, size in sorted(files):
      if total <= self.max_bytes:
        break
      if _remove(self.directory / name):
        self.stats.evicted += 1
      total -= size  # Gone either way (or removed by another process).


def _touch(path: pathlib.Path) -> None:
  """Marks ``path`` as just used (its modification time)."""
  try:
    os.utime(path)
  except OSError:
    pass  # Removed meanwhile, or a read-only store.


def _remove(path) -> bool:
  try:
    os.unlink(path)
  except OSError:
    return False
  return True


def _check(data: bytes) -> tuple[str | None, bytes]:
  """``(None, payload)`` for an intact file, else ``(why, b"")``."""
  header, newline, payload = data.partition(b"\n")
  fields = header.split(b" ")
  if not newline or len(fields) != 4 or fields[0] != _MAGIC:
    return "it has no program header", b""
  if fields[1] != str(_FORMAT).encode():
    return f"its format is {fields[1]!r}, expected {_FORMAT}", b""
  if fields[2] != str(len(payload)).encode():
    return (f"{len(payload)} bytes follow its header, which records"
            f" {fields[2].decode(errors='replace')}"), b""
  if hashlib.sha256(payload).hexdigest().encode() != fields[3]:
    return "its sha256 differs from the one recorded when it was written", b""
  return None, payload


def _lowering_platform(device) -> str:
  """The platform name `jax.export` lowers for on ``device``: a GPU
  device's ``platform`` is "gpu", but programs are lowered for "cuda" or
  "rocm" (exporting for "gpu" made every stored program fail to load on a
  GPU: "exported for platforms ('gpu',) but it is used on ('cuda',)")."""
  if device.platform != "gpu":
    return device.platform
  version = str(getattr(device.client, "platform_version", "")).lower()
  return "rocm" if "rocm" in version else "cuda"


def _export(fn, static, in_tree, leaves, platform: str):
  """``fn(static, *args)`` exported as a function of the flat leaves."""
  out_trees = []

  def flat(*flat_args):
    out = fn(static, *jax.tree_util.tree_unflatten(in_tree, flat_args))
    out_leaves, out_tree = jax.tree_util.tree_flatten(out)
    out_trees.append(out_tree)
    return out_leaves

  checks = [jax.export.DisabledSafetyCheck.custom_call(t)
            for t in KERNEL_TARGETS]
  exported = jax.export.export(jax.jit(flat), platforms=[platform],
                               disabled_checks=checks)(*leaves)
  return exported, out_trees[0]


def _leaf_indices(args: tuple, positions: tuple[int, ...]) -> tuple[int, ...]:
  """Flat leaf indices of the arguments at ``positions``."""
  out, start = [], 0
  for i, arg in enumerate(args):
    n = len(jax.tree_util.tree_leaves(arg))
    if i in positions:
      out.extend(range(start, start + n))
    start += n
  return tuple(out)


def auto_directory(jax_cache_dir: str | os.PathLike) -> pathlib.Path:
  """Where an `Engine`'s "auto" store keeps programs: inside JAX's
  persistent cache directory (whose clean-up only touches its own
  ``*-cache`` files)."""
  return pathlib.Path(jax_cache_dir).expanduser() / "penzai_lm_programs"
