"""Layers that penzai does not provide: RoPE, learned positions, soft-caps.

Axis conventions follow `penzai_lm.model.transformer`. The position layers
read token positions from the ``token_positions`` side input (an integer named
array with the ``seq`` axis and any batch axes; -1 marks padding).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.model.config import RopeScaling


def rope_inverse_frequencies(
    head_dim: int, base: float, scaling: RopeScaling | None = None
) -> np.ndarray:
  """Inverse frequencies of rotate-half RoPE, with optional Llama 3 scaling.

  Args:
    head_dim: Width of the rotated vectors (even).
    base: RoPE base (theta).
    scaling: Optional Llama 3 style scaling of low frequencies.

  Returns:
    A float32 array of shape ``(head_dim // 2,)``.
  """
  exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
  inv_freq = 1.0 / (base**exponents)
  if scaling is not None:
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    inv_freq = np.where(
        wavelen > low_wavelen,
        inv_freq / scaling.factor,
        np.where(wavelen < high_wavelen, inv_freq, interpolated),
    )
  return inv_freq.astype(np.float32)


@pz.pytree_dataclass
class ApplyRotaryEmbedding(pz.nn.Layer):
  """Rotary position embedding in the rotate-half (Hugging Face) layout.

  The two halves of the ``embedding_axis`` form the rotated pairs: element i is
  paired with element i + head_dim/2. The frequencies are data rather than
  configuration, so layers with different RoPE bases (Gemma 3's local and
  global layers) or scaled frequencies (Llama 3) share one structure, and a
  layer stack can carry a different frequency table per layer.

  Attributes:
    inverse_frequencies: Named array with one positional axis of size
      head_dim/2 (plus a stack axis while inside a layer stack).
    embedding_axis: Axis of the input holding the rotated vectors.
    positions_input_name: Side input with the token positions.
  """

  inverse_frequencies: pz.nx.NamedArray
  embedding_axis: str = dataclasses.field(
      default="projection", metadata={"pytree_node": False}
  )
  positions_input_name: str = dataclasses.field(
      default="token_positions", metadata={"pytree_node": False}
  )

  def __call__(self, x: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    positions = side_inputs[self.positions_input_name]

    def rotate(vector, position, inv_freq):
      angles = position.astype(jnp.float32) * inv_freq
      cos = jnp.cos(angles).astype(vector.dtype)
      sin = jnp.sin(angles).astype(vector.dtype)
      first, second = jnp.split(vector, 2)
      return jnp.concatenate(
          [first * cos - second * sin, second * cos + first * sin]
      )

    return pz.nx.nmap(rotate)(
        x.untag(self.embedding_axis), positions, self.inverse_frequencies
    ).tag(self.embedding_axis)

  @classmethod
  def from_config(
      cls, head_dim: int, base: float, scaling: RopeScaling | None = None
  ) -> ApplyRotaryEmbedding:
    """Builds a RoPE layer for vectors of width ``head_dim``."""
    return cls(
        inverse_frequencies=pz.nx.wrap(jax.device_put(
            rope_inverse_frequencies(head_dim, base, scaling)))
    )


@pz.pytree_dataclass
class AddLearnedPositionEmbeddings(pz.nn.Layer):
  """Adds a learned embedding of each token's position (GPT-2).

  Padding tokens (position -1) get the embedding of position 0; their outputs
  are never attended to.

  Attributes:
    table: Parameter with axes ``positions`` and ``embedding``.
    positions_input_name: Side input with the token positions.
  """

  table: pz.nn.ParameterLike[pz.nx.NamedArray]
  positions_input_name: str = dataclasses.field(
      default="token_positions", metadata={"pytree_node": False}
  )

  def __call__(self, x: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    positions = side_inputs[self.positions_input_name]
    positions = pz.nx.nmap(jnp.maximum)(positions, 0)
    return x + self.table.value[{"positions": positions}]

  @classmethod
  def from_config(
      cls,
      name: str,
      init_base_rng: jax.Array | None,
      max_positions: int,
      embedding_dim: int,
      dtype: jax.typing.DTypeLike = jnp.float32,
  ) -> AddLearnedPositionEmbeddings:
    """Builds the layer with a ``{name}.embeddings`` parameter."""
    return cls(
        table=pz.nn.make_parameter(
            f"{name}.embeddings",
            init_base_rng,
            pz.nn.variance_scaling_initializer,
            input_axes={},
            output_axes={"embedding": embedding_dim},
            parallel_axes={"positions": max_positions},
            convolution_spatial_axes={},
            dtype=dtype,
            scale=0.02,
            mode="fan_out",
            distribution="normal",
        )
    )


@pz.pytree_dataclass
class SoftCap(pz.nn.Layer):
  """Soft-caps every value: ``cap * tanh(x / cap)`` (Gemma 2's logit caps).

  Attributes:
    cap: The bound; outputs lie in (-cap, cap).
  """

  cap: float = dataclasses.field(metadata={"pytree_node": False})

  def __call__(self, x: pz.nx.NamedArray, **side_inputs) -> pz.nx.NamedArray:
    del side_inputs
    return pz.nx.nmap(jnp.tanh)(x / self.cap) * self.cap
