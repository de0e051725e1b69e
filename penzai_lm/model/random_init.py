"""Random parameters for a model built with parameter slots.

Values come from numpy (one generator per parameter, seeded by the model seed
and the parameter label), which avoids compiling an initialisation program:
norm scales start at 1, biases at 0, token embeddings at N(0, 1/hidden),
position embeddings at N(0, 0.02^2) and other weights at N(0, 1/fan_in).
With ``on_device=True`` the same distributions are drawn by `jax.random` on
the default device, in the parameters' dtype (other values), for models
too large to draw on the host in reasonable time.
"""

from __future__ import annotations

import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz


def _input_axes_by_label(model) -> dict[str, tuple[str, ...]]:
  linears = pz.select(model).at_instances_of(pz.nn.Linear).get_sequence()
  return {
      layer.weights.label: tuple(layer.in_axis_names)
      for layer in linears
      if isinstance(layer.weights, pz.ParameterSlot)
  }


def random_parameters(
    build_with_rng, slot_model, seed: int, *, on_device: bool = False
) -> list[pz.Parameter]:
  """Random parameters for every slot of ``slot_model``.

  Args:
    build_with_rng: Function of a PRNG key returning the same model with
      initialised parameters; only traced for shapes, never run.
    slot_model: The model with parameter slots.
    seed: Integer seed.
    on_device: Draw with `jax.random` on the default device instead of
      numpy on the host.

  Returns:
    Parameters to bind to ``slot_model``.
  """
  shapes = jax.eval_shape(
      lambda: pz.unbind_params(build_with_rng(jax.random.key(0)), freeze=True)[1]
  )
  input_axes = _input_axes_by_label(slot_model)
  parameters = []
  for value in shapes:
    label, named = value.label, value.value
    # Layer-stack axis first, as loaders lay it out: each block's slice of a
    # stacked weight is then contiguous.
    shape = dict(
        sorted(named.named_shape.items(), key=lambda item: item[0] != "blocks")
    )
    sizes = tuple(shape.values())
    if label.endswith("/scale.weights"):
      mean, std = 1.0, 0.0
    elif label.endswith(".bias"):
      mean, std = 0.0, 0.0
    elif label.endswith(".embeddings"):
      # Like penzai's EmbeddingTable init (fan-out variance scaling).
      mean, std = 0.0, 0.02 if "position" in label else shape["embedding"] ** -0.5
    else:
      fan_in = math.prod(shape[a] for a in input_axes.get(label, ()) if a in shape)
      mean, std = 0.0, 1 / math.sqrt(max(fan_in, 1))
    stream = [seed, zlib.crc32(label.encode())]
    if on_device:
      array = _draw(jax.random.fold_in(jax.random.key(stream[0]), stream[1]),
                    sizes, jnp.dtype(named.dtype), mean, std)
    else:
      data = (np.full(sizes, mean) if std == 0 else
              np.random.default_rng(stream).standard_normal(sizes) * std)
      array = jnp.asarray(data.astype(np.float32)).astype(named.dtype)
    parameters.append(
        pz.Parameter(value=pz.nx.wrap(array).tag(*shape.keys()), label=label)
    )
  return parameters


@functools.partial(jax.jit, static_argnums=(1, 2))
def _draw(key, sizes, dtype, mean, std):
  # Drawn in the parameter's dtype: no float32 copy of the largest weight.
  return (jax.random.normal(key, sizes, dtype) * std + mean).astype(dtype)
