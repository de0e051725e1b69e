"""Pytree structures as JSON that reads back without running code.

`encode_tree` writes a ``PyTreeDef`` as plain JSON values; `decode_tree`
rebuilds it, naming node types only by ``module:qualname`` of types already
imported from a known package (`program_keys.KNOWN_MODULES`: nothing is
imported) and building their metadata from plain values (numbers, strings,
containers, dtypes, enums, types, and penzai's `StructStaticMetadata`).
Node shapes are checked before the tree is rebuilt.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import sys
from typing import Any

import jax
import numpy as np

from penzai_lm.runtime.program_keys import importable_name
from penzai_lm.runtime.program_keys import known
from penzai_lm.runtime.program_keys import Unnamed

# Metadata types of pytree nodes (their ``node_data()[1]``) that
# `_decode_tree` may build, from their fields: dataclasses with no code
# beyond field assignment. penzai's NamedArray (a `pz.Struct`) has one.
_METADATA_TYPES = ("penzai.core.struct:StructStaticMetadata",)


def type_name(t: type) -> str:
  if t is type(None):  # Not named in builtins.
    return "NoneType"
  return importable_name(t)


def loaded_type(name: Any) -> type:
  """The type ``name`` (``module:qualname``, as `_type_name` writes it)
  names, found in a module of a known package that is already imported:
  nothing is imported or called.

  Raises:
    ValueError: for anything else.
  """
  if name == "NoneType":
    return type(None)
  if not isinstance(name, str) or name.count(":") != 1:
    raise ValueError(f"not a type name: {name!r}")
  module, qualname = name.split(":")
  found = sys.modules.get(module) if known(module) else None
  if found is None:
    raise ValueError(f"{name!r} is not in a loaded module of a known"
                     " package")
  for part in qualname.split("."):
    if part.startswith("__"):
      raise ValueError(f"not a type name: {name!r}")
    found = getattr(found, part, None)
  if not isinstance(found, type):
    raise ValueError(f"{name!r} does not name a type")
  return found


def _encode_value(obj) -> Any:
  """JSON for a pytree node's metadata; `_decode_value` inverts it.

  Raises:
    Unnamed: for a value outside the plain vocabulary (see the module
      docstring).
  """
  if obj is None or type(obj) in (bool, int, str):  # Not subclasses.
    return obj
  if type(obj) is float:  # pylint: disable=unidiomatic-typecheck
    return {"float": obj.hex()}
  if type(obj) in (tuple, list):
    return {type(obj).__name__: [_encode_value(x) for x in obj]}
  if type(obj) in (dict, collections.OrderedDict):
    return {type(obj).__name__: [[_encode_value(k), _encode_value(v)]
                                 for k, v in obj.items()]}
  if isinstance(obj, np.dtype) and obj.names is None and not obj.hasobject:
    for text in (obj.str, obj.name):  # "<V2" is not bfloat16; its name is.
      if np.dtype(text) == obj:
        return {"dtype": text}
  if isinstance(obj, enum.Enum):
    return {"enum": [type_name(type(obj)), obj.name]}
  if isinstance(obj, type):
    return {"type": type_name(obj)}
  if dataclasses.is_dataclass(obj) and type_name(type(obj)) in (
      _METADATA_TYPES):
    return {"metadata": [type_name(type(obj)), [
        [f.name, _encode_value(getattr(obj, f.name))]
        for f in dataclasses.fields(obj)]]}
  raise Unnamed(obj)


def _decode_value(data: Any) -> Any:
  """The value `_encode_value` wrote ``data`` for.

  Raises:
    ValueError: for data it never writes.
  """
  if data is None or type(data) in (bool, int, str):
    return data
  if not (isinstance(data, dict) and len(data) == 1):
    raise ValueError(f"unexpected metadata {data!r:.80}")
  (tag, body), = data.items()
  if tag == "float" and isinstance(body, str):
    return float.fromhex(body)
  if tag in ("tuple", "list") and isinstance(body, list):
    items = [_decode_value(x) for x in body]
    return tuple(items) if tag == "tuple" else items
  if tag in ("dict", "OrderedDict") and isinstance(body, list):
    if not all(isinstance(kv, list) and len(kv) == 2 for kv in body):
      raise ValueError(f"unexpected {tag} items")
    items = [(_decode_value(k), _decode_value(v)) for k, v in body]
    return dict(items) if tag == "dict" else collections.OrderedDict(items)
  if tag == "dtype" and isinstance(body, str):
    dtype = np.dtype(body)
    if dtype.names is not None or dtype.hasobject:
      raise ValueError(f"unexpected dtype {body!r}")
    return dtype
  if tag == "enum" and isinstance(body, list) and len(body) == 2:
    cls = loaded_type(body[0])
    if not (issubclass(cls, enum.Enum) and isinstance(body[1], str)):
      raise ValueError(f"unexpected enum {body!r}")
    return cls[body[1]]
  if tag == "type":
    return loaded_type(body)
  if tag == "metadata" and isinstance(body, list) and len(body) == 2 and (
      body[0] in _METADATA_TYPES and isinstance(body[1], list)):
    cls = loaded_type(body[0])
    names = [f.name for f in dataclasses.fields(cls)]
    if [kv[0] if isinstance(kv, list) and len(kv) == 2 else None
        for kv in body[1]] != names:
      raise ValueError(f"unexpected fields for {body[0]}")
    return cls(**{k: _decode_value(v) for k, v in body[1]})
  raise ValueError(f"unexpected metadata tag {tag!r:.40}")


def encode_tree(treedef) -> Any:
  """JSON for a pytree structure: ``"*"`` for a leaf, else ``[node type,
  metadata, [children]]``.

  Raises:
    Unnamed: for a node type or metadata it cannot write.
  """
  node = treedef.node_data()
  if node is None:
    return "*"
  node_type, metadata = node
  if node_type in (collections.defaultdict, collections.deque):
    raise Unnamed(node_type)  # Built-in nodes `_check_node` cannot check.
  return [type_name(node_type), _encode_value(metadata),
          [encode_tree(c) for c in treedef.children()]]


def decode_tree(data: Any):
  """The pytree structure `_encode_tree` wrote ``data`` for.

  Raises:
    ValueError: for data it never writes, a type that is not a registered
      pytree node, or metadata that does not fit its node.
  """
  if data == "*":
    return jax.tree_util.tree_structure(0)
  if not (isinstance(data, list) and len(data) == 3 and
          isinstance(data[2], list)):
    raise ValueError(f"unexpected tree node {data!r:.80}")
  node = (loaded_type(data[0]), _decode_value(data[1]))
  children = [decode_tree(c) for c in data[2]]
  _check_node(*node, len(children))
  try:
    treedef = jax.tree_util.PyTreeDef.from_node_data_and_children(
        jax.tree_util.default_registry, node, children)
    repr(treedef)  # Runs jax's own checks, which the line above defers.
  except (RuntimeError, ValueError, TypeError) as e:
    raise ValueError(f"not a pytree node: {data[0]} ({e})") from e
  return treedef


def _check_node(node_type: type, metadata: Any, arity: int) -> None:
  """Raises ValueError unless ``metadata`` and ``arity`` fit a node of
  ``node_type`` as jax flattens one. jax's built-in nodes read their
  metadata (jax checks some of it only when the structure is used);
  registered ones keep it opaque, for their own unflatten functions."""
  if node_type in (tuple, list, type(None)) or (
      issubclass(node_type, tuple) and hasattr(node_type, "_fields")):
    fits = metadata is None and arity == (
        0 if node_type is type(None) else
        len(node_type._fields) if node_type not in (tuple, list) else arity)
  elif node_type in (dict, collections.OrderedDict):
    try:
      fits = isinstance(metadata, (list, tuple)) and (
          len(metadata) == len(set(metadata)) == arity)
    except TypeError:  # An unhashable key.
      fits = False
  else:
    fits = node_type not in (collections.defaultdict, collections.deque)
  if not fits:
    raise ValueError(f"metadata or children that do not fit a"
                     f" {node_type.__name__} node")
