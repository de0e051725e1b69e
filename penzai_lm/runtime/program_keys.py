"""Fingerprints of traced programs: canonical texts of what they are traced
from (`describe`), and the versions they depend on (`versions`).

A fingerprint is only made of values it can name exactly: types and
functions importable from the packages in `KNOWN_MODULES`, dataclasses,
enums, numbers, strings and containers; anything else raises `Unnamed`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib
import pathlib
import types

import jax
import numpy as np

# Modules whose types and functions may appear in a fingerprint: their code
# is pinned by the versions (jax, penzai) or the source digest (penzai_lm).
KNOWN_MODULES = ("penzai_lm", "penzai", "jax", "jaxlib", "numpy",
                  "ml_dtypes", "builtins", "functools", "collections",
                  "types", "typing", "enum")

# JAX settings that change what tracing produces.
TRACE_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision",
                "jax_threefry_partitionable", "jax_default_prng_impl",
                "jax_numpy_dtype_promotion", "jax_enable_custom_prng")


class Unnamed(Exception):
  """A value a fingerprint cannot name exactly."""


def known(module: str | None) -> bool:
  return module is not None and module.split(".")[0] in KNOWN_MODULES


def importable_name(obj) -> str:
  """``module:qualname`` of a type or function that resolves back to it."""
  module = getattr(obj, "__module__", None)
  qualname = getattr(obj, "__qualname__", None)
  if not (known(module) and isinstance(qualname, str)) or "<" in qualname:
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
    return f"enum:{importable_name(type(obj))}.{obj.name}"
  if obj is type(None):  # Pytree nodes of None; not named in builtins.
    return "name:NoneType"
  if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
    return f"name:{importable_name(obj)}"
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
    return f"{importable_name(type(obj))}({fields})"
  if callable(obj) and known(getattr(obj, "__module__", None)):
    # Wrapped functions (jax.jit's, custom_jvp's) are named like functions.
    return f"name:{importable_name(obj)}"
  raise Unnamed(obj)


def source_digest() -> str:
  """A digest of penzai_lm's sources (Python and the kernels')."""
  root = pathlib.Path(__file__).resolve().parents[1]
  digest = hashlib.sha256()
  for path in sorted(root.rglob("*")):
    if path.suffix in (".py", ".cc", ".h") and path.is_file():
      digest.update(str(path.relative_to(root)).encode())
      digest.update(path.read_bytes())
  return digest.hexdigest()


@functools.cache  # The code this process runs, not files edited since.
def versions(file_format: int) -> str:
  """The versions a program depends on: the store's file format, jax,
  jaxlib, penzai and a digest of penzai_lm's sources."""
  import jaxlib  # pylint: disable=g-import-not-at-top
  import penzai  # pylint: disable=g-import-not-at-top
  return describe((
      file_format, jax.__version__, jaxlib.__version__,
      getattr(penzai, "__version__", "?"), source_digest()))


def aval_key(x) -> tuple:
  """(shape, dtype, weak type) of an array, scalar or ShapeDtypeStruct."""
  dtype = x.dtype if hasattr(x, "dtype") else np.result_type(type(x))
  return (np.shape(x), np.dtype(dtype), bool(getattr(x, "weak_type", False)))


def the_device(leaves) -> jax.Device | None:
  """The one device the arguments are on (the default one for host
  values); None if they span several."""
  devices = set()
  for x in leaves:
    if isinstance(x, jax.Array):
      devices |= x.sharding.device_set
  if len(devices) > 1:
    return None
  return devices.pop() if devices else jax.devices()[0]
