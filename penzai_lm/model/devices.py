"""Where a model's arrays live, for choosing device-specific layers."""

from __future__ import annotations

import jax
import numpy as np


def devices_of(model) -> set[jax.Device] | None:
  """The devices holding ``model``'s arrays (numpy arrays count as the
  default device, where JAX will put them); None if it holds tracers (under
  a transformation, where arrays have no device)."""
  devices = set()
  for x in jax.tree_util.tree_leaves(model):
    if isinstance(x, jax.core.Tracer):
      return None
    if isinstance(x, jax.Array):
      devices |= x.sharding.device_set
    elif isinstance(x, np.ndarray):
      devices.add(jax.devices()[0])
  return devices
