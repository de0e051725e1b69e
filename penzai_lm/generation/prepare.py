"""Models made ready for the engine's compiled programs.

`prepare_model` turns a user's model into what the programs take: layer
stacks unstacked (see below), converted to cached mode for the request's
batch and cache size (an uncached `TransformerLM`), frozen, split into
stateless layers and state, and flattened. Results are cached per model
identity and bucket, so a second request spends about a millisecond here.
Constant initial state (empty caches, positions) is described by shape and
fill value and created inside the programs, so nothing cache-sized is kept
or transferred.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.model import KVCachingTransformerLM


# Layer stacks are unstacked for decoding.
#
# A scanned LayerStack slices every stacked weight inside its loop body, and
# XLA on CPU materializes each slice: every decode step copies all the
# weights once more (SmolLM2-sized, batch 1: 8 tok/s stacked against 34
# unstacked), and the per-layer caches are sliced and re-stacked too.
# Decoding therefore runs on an equivalent model whose stacks are replaced by
# a Sequential of per-layer blocks (per-layer state variables get one
# variable per layer). The unstacked weights are cached for the most recent
# models (keyed on the identity of their arrays).

# Set to False to decode with the model's layer stacks as they are (for
# benchmarks comparing the two).
UNSTACK_LAYER_STACKS = True

class _IdentityCache:
  """A small LRU cache keyed on a model's identity (see `_model_key`).

  Entries hold weak references to the model's leaves (strong ones where
  weak ones are impossible): an entry whose model has been garbage collected
  is dropped, so the cache never keeps an old model alive.
  """

  def __init__(self, size: int):
    self.size = size
    self._entries: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()

  @staticmethod
  def _refs(leaves):
    refs = []
    for x in leaves:
      try:
        refs.append(weakref.ref(x))
      except TypeError:
        refs.append(lambda x=x: x)
    return refs

  @staticmethod
  def _alive(refs, leaves=None):
    if leaves is None:
      return all(r() is not None for r in refs)
    return all(r() is x for r, x in zip(refs, leaves))

  def get(self, key, leaves):
    with self._lock:
      entry = self._entries.get(key)
      if entry is None:
        return None
      if not self._alive(entry[0], leaves):
        del self._entries[key]
        return None
      self._entries.move_to_end(key)
      return entry[1]

  def put(self, key, leaves, value) -> None:
    with self._lock:
      for k in [k for k, e in self._entries.items() if not self._alive(e[0])]:
        del self._entries[k]
      self._entries[key] = (self._refs(leaves), value)
      while len(self._entries) > self.size:
        self._entries.popitem(last=False)

  def clear(self) -> None:
    with self._lock:
      self._entries.clear()


_UNSTACKED = _IdentityCache(2)


def _slice_axis(tree, axis: str, index: int):
  return (pz.select(tree).at_instances_of(pz.nx.NamedArrayBase)
          .where(lambda x: axis in x.named_shape)
          .apply(lambda x: x[{axis: index}]))


def _unstack(stack: pz.nn.LayerStack) -> pz.nn.Sequential:
  """An equivalent Sequential of the blocks of a LayerStack."""
  axis, n = stack.stack_axis, stack.stack_axis_size
  pure, variables = pz.unbind_state_vars(pz.freeze_params(
      stack.stacked_sublayers))
  per_layer = {}
  for var in variables:
    behavior = var.metadata.get("layerstack_axes", {}).get(axis)
    if behavior == pz.nn.LayerStackVarBehavior.PER_LAYER:
      metadata = dict(var.metadata)
      axes = dict(metadata["layerstack_axes"])
      del axes[axis]
      if axes:
        metadata["layerstack_axes"] = axes
      else:
        del metadata["layerstack_axes"]
      per_layer[var.label] = [
          pz.StateVariable(
              value=_slice_axis(var.value, axis, i),
              label=f"{var.label}/{axis}_{i}", metadata=metadata)
          for i in range(n)
      ]
  blocks = []
  for i in range(n):
    block = _slice_axis(pure, axis, i)
    block = (pz.select(block).at_instances_of(pz.StateVariableSlot)
             .where(lambda slot: slot.label in per_layer)
             .apply(lambda slot: pz.StateVariableSlot(
                 label=f"{slot.label}/{axis}_{i}")))  # noqa: B023
    block_vars = [per_layer[v.label][i] if v.label in per_layer else v
                  for v in variables]
    blocks.append(pz.bind_variables(block, block_vars))
  return pz.nn.Sequential(blocks)


def _model_key(model):
  """A hashable key identifying a model's structure and current arrays.

  Variables (parameters, state) are pytree leaves: their identity and the
  identity of their current value are part of the key, so assigning a new
  value to a parameter gives a new key. Returns ``(key, leaves)``; keep the
  leaves alive as long as the key is used (ids are only unique then).
  """
  leaves, treedef = jax.tree_util.tree_flatten(model)
  ids = tuple((id(x), id(x.value)) if isinstance(x, pz.AbstractVariable)
              else id(x) for x in leaves)
  return (treedef, ids), leaves


def unstack_layers(model):
  """Replaces every `pz.nn.LayerStack` of a model by a Sequential of its
  blocks (the same computation; parameters are frozen). Cached."""
  if not UNSTACK_LAYER_STACKS:
    return model
  key, leaves = _model_key(model)
  hit = _UNSTACKED.get(key, leaves)
  if hit is not None:
    return hit
  selection = pz.select(model).at_instances_of(pz.nn.LayerStack)
  unstacked = selection.apply(_unstack) if selection.count() else model
  _UNSTACKED.put(key, leaves, unstacked)
  return unstacked


# Prepared (converted, frozen, flattened) models, cached per bucket.

_PREPARED = _IdentityCache(4)


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A model ready for the compiled programs.

  Attributes:
    model_leaves: Arrays of the stateless model (weights first of all).
    treedef: Its pytree structure (static in the programs).
    state_treedef: Structure of the initial state (a list of
      StateVariableValue).
    state_spec: Per state leaf, ``(shape, dtype, fill)`` for a constant
      array (built inside the program, so nothing cache-sized is kept or
      transferred) or None for an array passed in ``state_args``.
    state_args: The non-constant initial state arrays.
    state_shapes: The shape of every state leaf.
    cache_labels: Labels of the cached model's ``(cache_end_index,
      kv_positions, previous_tokens)`` state, or None without a cache.
  """

  model_leaves: list
  treedef: Any
  state_treedef: Any
  state_spec: tuple
  state_args: list
  state_shapes: tuple = ()
  cache_labels: tuple | None = None

  @property
  def state_static(self) -> tuple:
    """The state's part of the prefill program's static arguments."""
    return (self.state_treedef, self.state_spec, self.state_shapes,
            self.cache_labels)


def _constant_fill(x):
  """The value of a constant array (all elements equal), else None."""
  x = jnp.asarray(x)
  if x.size == 0:
    return None
  first = x.reshape(-1)[0]
  if bool(jnp.all(x == first)):
    value = first.item()
    return value
  return None


def _prepare_runnable(runnable) -> Prepared:
  stateless, state0 = pz.unbind_state_vars(
      pz.freeze_params(runnable), freeze=True)
  model_leaves, treedef = jax.tree_util.tree_flatten(stateless)
  state_leaves, state_treedef = jax.tree_util.tree_flatten(list(state0))
  spec, args = [], []
  for x in state_leaves:
    fill = _constant_fill(x) if hasattr(x, "shape") else None
    if fill is None:
      spec.append(None)
      args.append(x)
    else:
      spec.append((tuple(np.shape(x)), np.dtype(x.dtype), fill))
  labels = None
  if isinstance(runnable, KVCachingTransformerLM):
    labels = (runnable.cache_end_index.label, runnable.kv_positions.label,
              runnable.previous_tokens.label)
  return Prepared(model_leaves, treedef, state_treedef, tuple(spec), args,
                  tuple(tuple(np.shape(x)) for x in state_leaves), labels)


def prepare_model(model, kind: str, plan) -> Prepared:
  """Converts (cached mode, unstacked layers, no overflow callback), freezes
  and flattens a model for a plan's batch and cache size. Cached."""
  key, leaves = _model_key(model)
  key = (key, kind, plan.use_cache, plan.cache_len, plan.batch,
         plan.batch_axis, UNSTACK_LAYER_STACKS)
  hit = _PREPARED.get(key, leaves)
  if hit is not None:
    return hit
  _check_bound(model)
  if kind == "cached":
    runnable = _without_overflow_callback(unstack_layers(model))
  elif plan.use_cache:
    runnable = _without_overflow_callback(
        KVCachingTransformerLM.from_uncached(
            unstack_layers(model), plan.cache_len,
            {plan.batch_axis: plan.batch}))
  else:
    runnable = model
  prepared = _prepare_runnable(runnable)
  _PREPARED.put(key, leaves, prepared)
  return prepared


def _check_bound(model) -> None:
  unbound = pz.select(model).at_instances_of(pz.ParameterSlot).count()
  if unbound:
    raise ValueError(
        f"the model has {unbound} unbound parameter slot(s); load weights"
        " (pz.bind_variables) or build it with a seed before generating.")


def _without_overflow_callback(cached):
  """The loop never overflows the cache by construction (it stops at
  ``cache_full``), so the model's run-time overflow check (a host callback,
  which keeps programs out of JAX's persistent cache) is turned off where
  the model supports it."""
  names = {f.name for f in dataclasses.fields(cached)}
  if "runtime_overflow_check" in names and cached.runtime_overflow_check:
    return dataclasses.replace(cached, runtime_overflow_check=False)
  return cached


def clear_caches() -> None:
  """Drops the cached unstacked and prepared models."""
  _UNSTACKED.clear()
  _PREPARED.clear()
