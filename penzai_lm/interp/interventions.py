"""Intervention layers: identity-shaped layers that change a point's value.

Insert them with `penzai_lm.interp.insert_at`::

    steered = insert_at(model, "blocks.6.resid_post",
                        AddVector.build(direction, strength=4.0))
    ablated = insert_at(model, "blocks.3.attn.head_out",
                        ZeroHeads.build(model.config, heads=[0, 5]))

Their values (vectors, strengths, masks) are arrays, i.e. arguments of the
compiled programs: changing them does not recompile. They apply to every
token of every row that passes the point; per-row values and position rules
inside the compiled generation loop come with the generation-time
interventions.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.model.hooks import heads_mask


@pz.pytree_dataclass
class AddVector(pz.nn.Layer):
  """Adds ``strength * vector`` to the value (steering).

  Attributes:
    vector: Named array over the value's feature axes (``embedding`` for the
      residual stream).
    strength: Scalar array.
  """

  vector: pz.nx.NamedArray
  strength: pz.nx.NamedArray

  @classmethod
  def build(cls, vector, strength: float = 1.0, axis: str = "embedding"
            ) -> AddVector:
    """From a 1-D array (or a named array) and a strength."""
    if not isinstance(vector, pz.nx.NamedArrayBase):
      vector = np.asarray(vector, np.float32)
      if vector.ndim != 1:
        raise ValueError(
            f"vector must be 1-D (one value per {axis!r} unit), got shape"
            f" {vector.shape}.")
      if not np.isfinite(vector).all():
        raise ValueError("vector has non-finite values.")
      vector = pz.nx.wrap(jnp.asarray(vector)).tag(axis)
    strength = float(strength)
    if not np.isfinite(strength):
      raise ValueError(f"strength must be finite, got {strength}.")
    return cls(vector=vector,
               strength=pz.nx.wrap(jnp.asarray(strength, jnp.float32)))

  def __call__(self, x, /, **_side_inputs):
    _check_axes(x, self.vector, "AddVector")
    return x + (self.strength * self.vector).astype(x.dtype)


@pz.pytree_dataclass
class ZeroHeads(pz.nn.Layer):
  """Zeroes some heads of a per-head value (``attn.head_out``,
  ``attn.pattern``).

  Attributes:
    mask: Bool named array over the query head axes, True = zeroed.
  """

  mask: pz.nx.NamedArray

  @classmethod
  def build(cls, config, heads) -> ZeroHeads:
    """Heads by index in Hugging Face order (see `head_coordinates`)."""
    heads = [heads] if isinstance(heads, int) else list(heads)
    if not heads:
      raise ValueError("heads is empty: name at least one head to zero.")
    return cls(mask=heads_mask(config, heads))

  def __call__(self, x, /, **_side_inputs):
    _check_axes(x, self.mask, "ZeroHeads")
    return x * (~self.mask).astype(x.dtype)


def _check_axes(x, data, what: str) -> None:
  missing = set(data.named_shape) - set(x.named_shape)
  if missing:
    raise ValueError(
        f"{what} works on axes {sorted(data.named_shape)} but the value at"
        f" this point has axes {sorted(x.named_shape)}; insert it at a point"
        " that has them (see penzai_lm.model.hooks).")


@pz.pytree_dataclass
class PatchValue(pz.nn.Layer):
  """Replaces the value at some token positions with a given one
  (activation patching: the value from another run).

  Attributes:
    value: The replacement, with the point's axes (a ``seq`` axis as long
      as the patched run's; batch axes optional).
    where: Bool named array over ``seq`` (and optionally batch axes): True
      where the value is replaced.
  """

  value: pz.nx.NamedArray
  where: pz.nx.NamedArray

  @classmethod
  def build(cls, value: pz.nx.NamedArray, positions) -> PatchValue:
    """Patches ``value`` in at the listed ``seq`` positions."""
    seq = value.named_shape.get("seq")
    if seq is None:
      raise ValueError("value needs a 'seq' axis (one entry per token).")
    positions = [positions] if isinstance(positions, int) else list(positions)
    bad = [p for p in positions if not 0 <= p < seq]
    if bad:
      raise ValueError(
          f"positions {bad} are outside the value's {seq} tokens.")
    where = np.zeros((seq,), bool)
    where[positions] = True
    return cls(value=value, where=pz.nx.wrap(jnp.asarray(where)).tag("seq"))

  def __call__(self, x, /, **_side_inputs):
    _check_axes(x, self.value, "PatchValue")
    if x.named_shape["seq"] != self.value.named_shape["seq"]:
      raise ValueError(
          f"PatchValue holds {self.value.named_shape['seq']} tokens but the"
          f" run has {x.named_shape['seq']}; patch runs of the same length.")
    return pz.nx.nmap(jnp.where)(self.where, self.value.astype(x.dtype), x)
