"""Where `attribute`'s work goes when the model is on a mesh.

A model placed on a mesh (`penzai_lm.sharding.shard`, or
``load(..., mesh=)``) keeps its weights where they are: the model's own
rules split the forward and backward passes (tensor parallelism over
``model``). The targets of each backward batch are split over the mesh
axes of the rules' ``batch`` axis (data parallelism over ``data``): every
device pulls back its own targets' cotangents, and the batch's rows come
back to every process (`penzai_lm.runtime.host.to_host`). Everything else
(the prompt's source vectors) is replicated. Works the same with the mesh's
devices in one process or in several (``jax.distributed.initialize``): the
host code is the same in every process, so the graph is too.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np

from penzai_lm.sharding.shard import model_sharding


@dataclasses.dataclass(frozen=True)
class TargetPlacement:
  """How target batches and source arrays are placed on the model's mesh.

  Attributes:
    batch: Splits an array's first axis over the data-parallel mesh axes.
    replicated: A whole copy on every device.
    ways: Devices the first axis is split over (batches are a multiple).
  """

  batch: NamedSharding
  replicated: NamedSharding
  ways: int

  def split(self, array: np.ndarray) -> jax.Array:
    """``array`` (the same host value in every process) with its first
    axis split over the data-parallel axes."""
    return _global(array, self.batch)

  def replicate(self, array: np.ndarray) -> jax.Array:
    return _global(array, self.replicated)


def _global(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
  array = np.asarray(array)
  return jax.make_array_from_callback(array.shape, sharding,
                                      lambda index: array[index])


def target_placement(model) -> TargetPlacement | None:
  """The placement for ``model``'s mesh, or None for a model on one
  device."""
  found = model_sharding(model)
  if found is None:
    return None
  axes = found.rules.mesh_axes("batch")
  ways = int(np.prod([found.mesh.shape[a] for a in axes], dtype=np.int64))
  spec = PartitionSpec(axes if axes else None)
  return TargetPlacement(batch=NamedSharding(found.mesh, spec),
                         replicated=NamedSharding(found.mesh,
                                                  PartitionSpec()),
                         ways=ways)
