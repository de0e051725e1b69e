"""Where the engine's device state lives when the model is sharded.

A model placed on a mesh (`penzai_lm.shard`) runs SPMD: its weights are
arguments of the programs with their shardings, and XLA partitions the
computation. The engine's own state must live on the same mesh, and the
decode carry must keep one sharding from call to call (a compiled program
takes its arguments in the shardings it was compiled for). A `Placement`
fixes it, read from the model (`penzai_lm.sharding.model_sharding`):

* model state (KV caches, capture buffers, patch state) by the weights'
  rules: head axes split like the weights' (``head_groups`` / ``heads``
  over the tensor-parallel mesh axis), ``batch`` over the mesh axes the
  weights do not use (data parallelism) when the batch bucket divides them,
  every other axis whole;
* everything else (tokens, per-row progress, sampler statistics, output
  buffers: small, and read by the host) replicated.

Prefill and decode constrain the carry they return to it, and a session's
state is put back on it between turns. Models on one device have no
placement (None), and their programs are unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from penzai import pz

from penzai_lm import sharding as sharding_lib


@dataclasses.dataclass(frozen=True)
class Placement:
  """Shardings of a prepared model's state on its mesh (static: part of the
  programs' cache keys through the `StateLayout`).

  Attributes:
    mesh: The model's mesh.
    leaves: One sharding per state leaf (`StateLayout.leaves`).
    packed: The same without size-1 dimensions (`StateLayout.pack`).
    weights: The sharding of each of the stateless model's arrays (None:
      not on the mesh). Programs are compiled for them; keying on them keeps
      models sharded differently from sharing a program.
  """

  mesh: jax.sharding.Mesh
  leaves: tuple[NamedSharding, ...]
  packed: tuple[NamedSharding, ...]
  weights: tuple[NamedSharding | None, ...] = ()

  @property
  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def put(self, leaves, which=None) -> list:
    """``leaves`` on their shardings (``which``: their indices among the
    state leaves; default all)."""
    which = range(len(self.leaves)) if which is None else which
    return [jax.device_put(x, self.leaves[i]) for x, i in zip(leaves, which)]

  def constrain(self, carry):
    """A `LoopState` in this placement (inside a program)."""
    model_state = carry.model_state
    if isinstance(model_state, list):  # Packed KV-cached state.
      model_state = [jax.lax.with_sharding_constraint(x, s)
                     for x, s in zip(model_state, self.packed)]
    else:  # The use_cache=False reference loop: replicated.
      model_state = jax.lax.with_sharding_constraint(model_state,
                                                     self.replicated)
    rest = jax.lax.with_sharding_constraint(
        dataclasses.replace(carry, model_state=None), self.replicated)
    return dataclasses.replace(rest, model_state=model_state)


def _packed(named: NamedSharding, shape) -> NamedSharding:
  spec = tuple(named.spec) + (None,) * len(shape)
  return NamedSharding(named.mesh, PartitionSpec(
      *(entry for entry, size in zip(spec, shape) if size != 1)))


def placement_of(model, state) -> Placement | None:
  """The placement of ``state`` (a list of ``pz.StateVariableValue``) for
  the stateless ``model``; None for a model on one device."""
  found = sharding_lib.model_sharding(model)
  if found is None:
    return None
  arrays = jax.tree_util.tree_leaves(state, is_leaf=pz.nx.is_namedarray)
  leaves = tuple(sharding_lib.state_sharding(x, found.mesh, found.rules)
                 for x in arrays)
  shapes = [np.shape(x.data_array if isinstance(x, pz.nx.NamedArrayBase)
                     else x) for x in arrays]
  weights = tuple(
      x.sharding if isinstance(getattr(x, "sharding", None), NamedSharding)
      else None for x in jax.tree_util.tree_leaves(model))
  return Placement(found.mesh, leaves, tuple(
      _packed(s, shape) for s, shape in zip(leaves, shapes)), weights)


def constrain(placement: Placement | None, carry):
  """``carry`` in ``placement`` (unchanged on one device)."""
  return carry if placement is None else placement.constrain(carry)
