"""Addressing hook points by name, and inserting layers at them.

Names follow TransformerLens (`penzai_lm.model.hooks` lists them):
``embed``, ``blocks.{i}.resid_pre`` ... ``blocks.{i}.resid_post``,
``final_norm``. They mean the same on both layouts of a model:

* per-layer blocks (``use_layer_stack=False``): ``blocks.3.X`` is the hook
  point of block 3, and a layer inserted there runs in block 3 only;
* a layer stack: the stack holds one hook point per name for all blocks;
  a layer inserted at ``blocks.3.X`` is wrapped in `AtLayers`, which runs
  it where the scan is at block 3 and passes the value through elsewhere
  (which blocks is data, along the ``blocks`` axis: no recompile to move
  it, one compiled loop for any choice).

A name that does not exist in the model (``blocks.30.resid_post`` in a
30-block model, a misspelt point) is an error, never an empty selection.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable

import jax
import jax.numpy as jnp
from penzai import pz

from penzai_lm.model.hooks import BLOCK_POINTS
from penzai_lm.model.hooks import HookPoint
from penzai_lm.model.hooks import MODEL_POINTS

_BLOCK_NAME = re.compile(r"^blocks\.(-?\d+)\.(.+)$")


@dataclasses.dataclass(frozen=True)
class Point:
  """A parsed point name.

  Attributes:
    name: The full name, e.g. ``"blocks.3.resid_post"``.
    point: The hook point's own name, e.g. ``"resid_post"``.
    layer: The block index, or None for ``embed`` / ``final_norm``.
  """

  name: str
  point: str
  layer: int | None


def _config(model):
  config = getattr(model, "config", None)
  if config is None:
    raise TypeError(
        "expected a penzai_lm TransformerLM or KVCachingTransformerLM, got"
        f" {type(model).__name__}.")
  return config


def point_names(model) -> list[str]:
  """Every point name of a model, in the order values flow."""
  num_layers = _config(model).num_layers
  return ["embed", *(f"blocks.{i}.{p}" for i in range(num_layers)
                     for p in BLOCK_POINTS), "final_norm"]


def parse_point(model, name: str) -> Point:
  """Parses and checks a point name against a model.

  Raises:
    ValueError: for a name the model does not have (with the closest one).
  """
  if not isinstance(name, str):
    raise TypeError(f"a point name must be a str, got {name!r}.")
  num_layers = _config(model).num_layers
  if name in MODEL_POINTS:
    return Point(name, name, None)
  m = _BLOCK_NAME.match(name)
  if m is not None and m.group(2) not in BLOCK_POINTS and has_point(
      model, m.group(2), int(m.group(1))):
    return Point(name, m.group(2), int(m.group(1)))  # Added by a splice.
  if m is None or m.group(2) not in BLOCK_POINTS:
    point = m.group(2) if m else name
    added = _added_points(model)
    close = difflib.get_close_matches(
        point, BLOCK_POINTS + MODEL_POINTS + tuple(added), 1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    spliced = ("" if added else " Points such as"
               " 'blocks.6.resid_post.sae.features' exist once an"
               " autoencoder is spliced in (penzai_lm.sae.splice).")
    raise ValueError(
        f"unknown point {name!r}{hint}. Points are 'embed', 'final_norm' and"
        f" 'blocks.{{i}}.P' with P one of {', '.join(BLOCK_POINTS + added)}."
        + spliced)
  layer = int(m.group(1))
  if not 0 <= layer < num_layers:
    raise ValueError(
        f"{name!r} does not exist: the model has {num_layers} blocks"
        f" (blocks.0 to blocks.{num_layers - 1}).")
  return Point(name, m.group(2), layer)


def _added_points(model) -> tuple[str, ...]:
  """Block point names added to the model (by splices), in model order."""
  names = (h.point for h in pz.select(model).at_instances_of(HookPoint)
           .get_sequence() if h.layer is not None)
  return tuple(n for n in dict.fromkeys(names) if n not in BLOCK_POINTS)


def has_point(model, point: str, layer: int) -> bool:
  """Whether block ``layer`` of ``model`` has a hook point named ``point``
  (e.g. ``"resid_post.sae.features"``, added by a splice)."""
  def matches(h: HookPoint) -> bool:
    if h.point != point or h.layer is None:
      return False
    if is_stacked(h):
      return 0 <= layer < h.layer.named_shape["blocks"]
    return int(h.layer.data_array) == layer
  return bool(pz.select(model).at_instances_of(HookPoint).where(
      matches).count())


def hook_points(model, point: str):
  """The selection of every hook point named ``point`` (an error if none)."""
  selection = (pz.select(model).at_instances_of(HookPoint)
               .where(lambda h: h.point == point))
  if not selection.count():
    raise ValueError(
        f"the model has no {point!r} hook point; models from"
        " penzai_lm.build_transformer and penzai_lm.load have them (a model"
        " built before hook points existed must be rebuilt).")
  return selection


def is_stacked(hook_point: HookPoint) -> bool:
  """Whether a hook point sits in a layer stack."""
  return hook_point.layer is not None and "blocks" in (
      hook_point.layer.named_shape)


class Intervention(pz.nn.Layer):
  """Base of penzai_lm's intervention layers (`penzai_lm.interp`'s
  `AddVector`, `Ablate`, `Clamp`, ..., `penzai_lm.sae`'s feature edits).

  Contract: an identity-shaped layer that changes the value at the point it
  is inserted at and works on that value's unit axes only, so every unit
  axis of its arrays (``embedding``, ``neurons``, head axes, ...) must be
  one of the value's (`check_fits` refuses it otherwise). A user's own
  layer need not subclass it (it may hold arrays over other axes, e.g. an
  encoder over ``embedding`` at a head point).
  """


@pz.pytree_dataclass
class AtLayers(pz.nn.Layer):
  """Runs ``inner`` only in some blocks of a layer stack.

  Attributes:
    inner: The layer to run.
    active: Bool named array over ``blocks``; inside the stack's scan each
      block sees its own scalar.
  """

  inner: pz.nn.Layer
  active: pz.nx.NamedArray

  def __call__(self, x, /, **side_inputs):
    y = self.inner(x, **side_inputs)
    return pz.nx.nmap(jnp.where)(self.active, y, x)


def insert_at(model, names: str | Iterable[str], layer: pz.nn.Layer, *,
              after_hook: bool = False):
  """Inserts ``layer`` at the named point(s).

  Layers go right before the point's `HookPoint`, after any inserted
  earlier, so they run in the order inserted and the hook point marks the
  value with every intervention applied (what captures record, which sit
  right after it: ``after_hook=True``).

  Args:
    model: A `TransformerLM` (or a cached one).
    names: One point name or several (e.g. the same point in some blocks:
      ``[f"blocks.{i}.resid_post" for i in (3, 5)]``).
    layer: The layer to insert (an identity-shaped layer: it receives and
      returns the point's value).

  Returns:
    The patched model (the input is unchanged).

  Raises:
    ValueError: for a name the model does not have, or a layer whose
      arrays do not fit the point (`check_fits`).
    TypeError: if ``layer`` is not a ``pz.nn.Layer``.
  """
  names = [names] if isinstance(names, str) else list(names)
  if not names:
    raise ValueError("names is empty: give at least one point name.")
  by_point: dict[str, list[int | None]] = {}
  for point in (parse_point(model, n) for n in names):
    check_fits(model, point, layer)
    by_point.setdefault(point.point, []).append(point.layer)
  for point, layers in by_point.items():
    model = _insert(model, point, layers, layer, after_hook)
  return model


def _insert(model, point: str, layers: list[int | None], layer, after_hook):
  selection = hook_points(model, point)
  first = selection.get_sequence()[0]
  if layers != [None] and is_stacked(first):
    count = first.layer.named_shape["blocks"]
    active = jnp.zeros((count,), bool).at[jnp.asarray(layers)].set(True)
    layer = AtLayers(inner=layer, active=pz.nx.wrap(active).tag("blocks"))
  elif layers != [None]:
    wanted = set(layers)
    selection = selection.where(lambda h: int(h.layer.data_array) in wanted)
  if after_hook:
    return selection.insert_after(layer)
  return selection.insert_before(layer)


# ---------------------------------------------- checks at insertion time

# The unit axes of the points' values (`penzai_lm.model.hooks`); any other
# axis of an inserted layer's array (``batch``, ``seq``, ...) is a token axis.
_UNIT_AXES = ("embedding", "neurons", "projection", "heads", "head_groups",
              "query_heads", "features")


def point_value_axes(config, point: str,
                     seq: int | None = None) -> dict[str, int]:
  """The unit axes of a point's value and their sizes (besides the token
  axes). ``attn.pattern``'s ``kv_seq`` grows with the tokens: it is listed
  only when ``seq`` (the keys' length) is given."""
  common, query_only = config.head_axes
  heads = {**common, **query_only}
  if point == "attn.pattern":
    return heads if seq is None else {**heads, "kv_seq": seq}
  if point == "attn.head_out":
    return {**heads, "projection": config.head_dim}
  if point == "mlp.neurons":
    return {"neurons": config.mlp_hidden_size}
  return {"embedding": config.hidden_size}


def check_fits(model, point: Point, layer) -> None:
  """Checks, before the model runs, that ``layer`` can sit at ``point``.

  Every named array of the layer is checked: a unit axis the point's value
  has (``embedding``, ``neurons``, head axes, ``projection``) must have the
  value's size; a ``blocks`` axis needs a layer stack with that many
  blocks; penzai_lm's interventions may not have unit axes the value lacks.
  (Unchecked, these fail only when the model runs, with penzai's
  "Inconsistent named axes in nmap".)

  Raises:
    TypeError: if ``layer`` is not a ``pz.nn.Layer``.
    ValueError: naming the point, the array and the expected size.
  """
  if not isinstance(layer, pz.nn.Layer):
    what = getattr(layer, "__name__", type(layer).__name__)
    raise TypeError(
        f"insert_at needs a pz.nn.Layer, got {what!r}"
        f" ({type(layer).__name__}). Wrap a function in a layer: an"
        " elementwise one as pz.nn.Elementwise(fn), anything else as a"
        " @pz.pytree_dataclass subclass of pz.nn.Layer whose __call__(self,"
        " x, /, **side_inputs) returns the new value, with its arrays as"
        " fields (data: changing them does not recompile, while every new"
        " function object is a new program).")
  config = _config(model)
  first = hook_points(model, point.point).get_sequence()[0]
  # Points added by a splice (penzai_lm.sae) carry their value's axes.
  own = getattr(first, "value_axes", None)
  expected = dict(own) if own else point_value_axes(config, point.point)
  stacked = is_stacked(first)
  arrays = pz.select(layer).at_instances_of(pz.nx.NamedArrayBase)
  for path, array in arrays.selected_by_path.items():
    where = f"{type(layer).__name__}{jax.tree_util.keystr(path)}"
    for axis, size in array.named_shape.items():
      if axis == "blocks":
        if point.layer is None or not stacked:
          raise ValueError(
              f"{where} has a 'blocks' axis, but {point.name} is not in a"
              " layer stack; give one value (no 'blocks' axis), or insert"
              " it in a stacked model.")
        if size != config.num_layers:
          raise ValueError(
              f"{where} has {size} 'blocks' but the model has"
              f" {config.num_layers}.")
      elif axis in expected and size != expected[axis]:
        raise ValueError(
            f"{where} has axis {axis!r} of size {size}, but the value at"
            f" {point.name} has {axis!r} of size {expected[axis]}: give an"
            f" array of size {expected[axis]} (is it for another model?).")
      elif (axis in _UNIT_AXES and axis not in expected
            and isinstance(layer, Intervention)):
        raise ValueError(
            f"{where} has axis {axis!r}, but the value at {point.name} has"
            f" unit axes {expected} (besides the token axes); insert it at a"
            " point that has that axis (see penzai_lm.model.hooks).")
