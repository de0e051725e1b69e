"""Generation programs kept on disk as exported StableHLO.

With JAX's persistent compilation cache a new process skips XLA's compile,
but not tracing: tracing penzai's named-axis layers (nested ``vmap``s) is
most of a program's cost once XLA's is cached. Measured on SmolLM2-135M
(CPU, float32, first ``generate`` in a new process): prefill trace 1.3 s +
decode trace 1.2 s + XLA 0.5 s (cache hits); with the exported programs
read back from here, 0.42 s + 0.33 s of lowering and cache hits.

A `ProgramStore` keys each program on a fingerprint of everything it is
traced from: the program's name and static shapes, the model's structure
with every static field (layer types, axis names, configs, functions), the
arguments' structure and shapes, the compiler options, and the versions of
jax, penzai and penzai_lm's own sources. A fingerprint is only made of
values it can name exactly: types and functions importable from penzai,
penzai_lm, jax or numpy, dataclasses, enums, numbers, strings and
containers. A model with anything else in its structure (a layer class
defined in a notebook, a lambda) has no fingerprint and its programs are
traced as usual, as are programs of sharded models.

Every program the store serves, stored or just traced, is compiled from
its exported form (``jax.jit(exported.call)``), so a new process asks XLA's
persistent cache for exactly the module the first process compiled.

Files are pickles next to XLA's compiled executables; the directory must be
as trusted as that cache (both hold code that runs). Each file starts with
a header line recording the pickle's size and sha256 at write time; a file
whose header, size or hash does not match (a flipped bit, a truncation) or
that does not lower is damaged: it is never read, a warning names it, and
the program is traced again and written over it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib
import os
import pathlib
import pickle
import shutil
import tempfile
import types
from typing import Any
import warnings

import jax
import numpy as np

from penzai_lm.kernels.build import TARGETS as KERNEL_TARGETS

_FORMAT = 2
_SUFFIX = ".pzlm-program"
_MAGIC = b"PZLM-PROGRAM"  # Header: magic, format, payload size, sha256.
# Modules whose types and functions may appear in a fingerprint: their code
# is pinned by the versions (jax, penzai) or the source digest (penzai_lm).
_KNOWN_MODULES = ("penzai_lm", "penzai", "jax", "jaxlib", "numpy",
                  "ml_dtypes", "builtins", "functools", "collections",
                  "types", "typing", "enum")

# JAX settings that change what tracing produces.
_TRACE_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision",
                "jax_threefry_partitionable", "jax_default_prng_impl",
                "jax_numpy_dtype_promotion", "jax_enable_custom_prng")


class Unnamed(Exception):
  """A value a fingerprint cannot name exactly."""


def _known(module: str | None) -> bool:
  return module is not None and module.split(".")[0] in _KNOWN_MODULES


def _importable_name(obj) -> str:
  """``module:qualname`` of a type or function that resolves back to it."""
  module = getattr(obj, "__module__", None)
  qualname = getattr(obj, "__qualname__", None)
  if not (_known(module) and isinstance(qualname, str)) or "<" in qualname:
    raise Unnamed(obj)
  try:
    found = importlib.import_module(module)
    for part in qualname.split("."):
      found = getattr(found, part)
  except (ImportError, AttributeError) as e:
    raise Unnamed(obj) from e
  if found is not obj:
    raise Unnamed(obj)
  return f"{module}:{qualname}"


def describe(obj) -> str:
  """A canonical text for ``obj``, equal across processes exactly when the
  values are (for what it accepts).

  Raises:
    Unnamed: for a value it cannot name (see the module docstring).
  """
  if isinstance(obj, np.generic):  # Before float: np.float64 is one.
    return f"scalar:{obj.dtype.str}:{obj.tobytes().hex()}"
  if obj is None or isinstance(obj, (bool, int, str, bytes)):
    return f"{type(obj).__name__}:{obj!r}"
  if isinstance(obj, float):
    return f"float:{obj.hex()}"
  if isinstance(obj, jax.tree_util.PyTreeDef):
    node = obj.node_data()
    head = "leaf" if node is None else describe(node)
    return f"tree({head};{','.join(describe(c) for c in obj.children())})"
  if isinstance(obj, np.dtype):
    return f"dtype:{obj.str}:{obj.name}"
  if isinstance(obj, enum.Enum):
    return f"enum:{_importable_name(type(obj))}.{obj.name}"
  if obj is type(None):  # Pytree nodes of None; not named in builtins.
    return "name:NoneType"
  if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
    return f"name:{_importable_name(obj)}"
  if isinstance(obj, functools.partial):
    return (f"partial({describe(obj.func)};{describe(obj.args)};"
            f"{describe(obj.keywords)})")
  if isinstance(obj, (tuple, list)):
    items = ",".join(describe(x) for x in obj)
    return f"{type(obj).__name__}[{items}]"
  if isinstance(obj, (frozenset, set)):
    return f"{type(obj).__name__}{{{','.join(sorted(map(describe, obj)))}}}"
  if isinstance(obj, (dict, types.MappingProxyType)):
    items = ",".join(f"{describe(k)}={describe(v)}" for k, v in obj.items())
    return f"{type(obj).__name__}{{{items}}}"
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    fields = ",".join(f"{f.name}={describe(getattr(obj, f.name))}"
                      for f in dataclasses.fields(obj))
    return f"{_importable_name(type(obj))}({fields})"
  if callable(obj) and _known(getattr(obj, "__module__", None)):
    # Wrapped functions (jax.jit's, custom_jvp's) are named like functions.
    return f"name:{_importable_name(obj)}"
  raise Unnamed(obj)


def _source_digest() -> str:
  """A digest of penzai_lm's sources (Python and the kernels')."""
  root = pathlib.Path(__file__).resolve().parents[1]
  digest = hashlib.sha256()
  for path in sorted(root.rglob("*")):
    if path.suffix in (".py", ".cc", ".h") and path.is_file():
      digest.update(str(path.relative_to(root)).encode())
      digest.update(path.read_bytes())
  return digest.hexdigest()


@functools.cache  # The code this process runs, not files edited since.
def _versions() -> str:
  import jaxlib  # pylint: disable=g-import-not-at-top
  import penzai  # pylint: disable=g-import-not-at-top
  return describe((
      _FORMAT, jax.__version__, jaxlib.__version__,
      getattr(penzai, "__version__", "?"), _source_digest()))


def aval_key(x) -> tuple:
  """(shape, dtype, weak type) of an array, scalar or ShapeDtypeStruct."""
  dtype = x.dtype if hasattr(x, "dtype") else np.result_type(type(x))
  return (np.shape(x), np.dtype(dtype), bool(getattr(x, "weak_type", False)))


def _the_device(leaves) -> jax.Device | None:
  """The one device the arguments are on (the default one for host
  values); None if they span several."""
  devices = set()
  for x in leaves:
    if isinstance(x, jax.Array):
      devices |= x.sharding.device_set
  if len(devices) > 1:
    return None
  return devices.pop() if devices else jax.devices()[0]


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


class ProgramStore:
  """Exported generation programs in a directory (see the module docstring).

  Attributes:
    directory: Where the programs are kept.
    stats: Counts of loads, saves and programs without a fingerprint.
  """

  def __init__(self, directory: str | os.PathLike):
    if not str(directory):
      raise ValueError("ProgramStore needs a directory, got an empty path.")
    self.directory = pathlib.Path(directory).expanduser()
    self.stats = StoreStats()
    self._warned = False

  def key(self, name: str, static: Any, args: tuple, options: dict,
          donate: tuple[int, ...]) -> str | None:
    """The program's file key, or None where it has no fingerprint."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    device = _the_device(leaves)
    if device is None:
      return None
    avals = tuple(aval_key(x) for x in leaves)
    try:
      text = describe((name, static, treedef, avals, device.platform,
                       device.device_kind,
                       tuple(sorted(options.items())), donate, tuple(
                           str(getattr(jax.config, flag, None))
                           for flag in _TRACE_FLAGS)))
    except Unnamed:
      self.stats.unnamed += 1
      return None
    return hashlib.sha256((_versions() + text).encode()).hexdigest()

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
        return LoweredProgram(lowered, in_tree, out_tree)
    try:
      exported, out_tree = _export(fn, static, in_tree, leaves,
                                   _lowering_platform(_the_device(leaves)))
    except Exception as e:  # pylint: disable=broad-except
      # E.g. a patch with a host callback, which jax.export refuses.
      self.stats.unexported += 1
      self._warn(f"a {type(e).__name__} while exporting it ({e})")
      return None
    try:
      self._write(key, exported, out_tree)
      self.stats.saved += 1
    except (OSError, ImportError, ValueError) as e:
      self._warn(f"it could not be written to {self.directory} ({e})")
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

  def _read(self, key: str):
    """The stored ``(exported, out_tree)``, or None (missing or damaged)."""
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
    try:
      blob, out_tree = pickle.loads(payload)
      return jax.export.deserialize(bytearray(blob)), out_tree
    except Exception as e:  # pylint: disable=broad-except
      self._discard(path, f"it does not deserialize ({e})")
      return None

  def _write(self, key: str, exported, out_tree) -> None:
    payload = pickle.dumps((bytes(exported.serialize()), out_tree))
    header = b"%s %d %d %s\n" % (_MAGIC, _FORMAT, len(payload),
                                 hashlib.sha256(payload).hexdigest().encode())
    self.directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.",
                               suffix=".tmp")
    try:
      with os.fdopen(fd, "wb") as f:
        f.write(header + payload)
      os.replace(tmp, self._path(key))
    except BaseException:
      os.unlink(tmp)
      raise


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
