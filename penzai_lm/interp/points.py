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
  if m is None or m.group(2) not in BLOCK_POINTS:
    point = m.group(2) if m else name
    close = difflib.get_close_matches(point, BLOCK_POINTS + MODEL_POINTS, 1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(
        f"unknown point {name!r}{hint}. Points are 'embed', 'final_norm' and"
        f" 'blocks.{{i}}.P' with P one of {', '.join(BLOCK_POINTS)}.")
  layer = int(m.group(1))
  if not 0 <= layer < num_layers:
    raise ValueError(
        f"{name!r} does not exist: the model has {num_layers} blocks"
        f" (blocks.0 to blocks.{num_layers - 1}).")
  return Point(name, m.group(2), layer)


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
    ValueError: for a name the model does not have.
  """
  names = [names] if isinstance(names, str) else list(names)
  if not names:
    raise ValueError("names is empty: give at least one point name.")
  by_point: dict[str, list[int | None]] = {}
  for point in (parse_point(model, n) for n in names):
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
