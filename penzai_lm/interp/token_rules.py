"""Which tokens an intervention applies to: a rule that holds with a KV cache.

A rule is data (integer and boolean arrays), so changing it -- or giving
each row its own -- does not recompile. It is evaluated per token from two
side inputs, never from a token's index in the current call (which is what
breaks hook-based tools once a KV cache feeds one token at a time):

* ``token_positions``: each token's position in its row (0 for the first
  real token; padding is -1 and never selected). Every penzai_lm model
  passes it.
* ``generation_start``: per row, the position of the first generated token
  (the prompt's length, plus a session's history). The generation engine
  passes it; a plain forward pass has none, and then every token counts as
  a prompt token.

==========================  =============================================
rule                        selects the tokens at positions ``p`` with
==========================  =============================================
``TokenRule.all()``         every real token (the default)
``TokenRule.prompt()``      ``p < generation_start``
``TokenRule.generated()``   ``p >= generation_start``
``TokenRule.positions(a, b)``  ``a <= p < b`` (absolute; ``b=a+1`` by
                            default)
``TokenRule.steps(a, b)``   generated tokens ``a <= p - generation_start
                            < b`` (step 0 is the first generated token)
==========================  =============================================

An intervention on a generated token changes what the model computes when
that token is fed, i.e. the distribution of the *next* token; the first
generated token is sampled from the last prompt token's logits, so steering
it needs the prompt (or at least its last position) selected.

Bounds may be per row: a named array with the batch axis, or a list given
to a constructor with ``batch_axis``. Bounds are stored as int32, clamped to
``[-2**30, 2**30]`` (positions stay far below 2**30), so a huge bound such
as ``steps(0, 2**40)`` means "no end" rather than wrapping around.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from penzai import pz

# An int32 bound beyond any position (positions stay far below 2**30).
_FAR = 1 << 30
NAMES = ("all", "prompt", "generated")


def _host_ints(value, what: str) -> np.ndarray:
  """A host bound as an int64 array clamped to ``[-_FAR, _FAR]``.

  Python ints of any size are clamped before numpy sees them (2**70 would
  not fit int64; 2**40 would wrap in int32).
  """
  def clamp(v):
    if isinstance(v, np.generic):
      v = v.item()
    if isinstance(v, int) and not isinstance(v, bool):
      return max(-_FAR, min(_FAR, v))
    return v
  if isinstance(value, np.ndarray) and value.dtype == object:
    value = value.tolist()
  if isinstance(value, (list, tuple)):
    value = [clamp(v) for v in value]
  elif not isinstance(value, np.ndarray):
    value = clamp(value)
  try:
    array = np.asarray(value)
  except (ValueError, TypeError):
    array = np.asarray(None)  # Reported below.
  if array.dtype == bool or not np.issubdtype(array.dtype, np.integer):
    raise ValueError(f"{what} must be an integer (or one per row), got"
                     f" {value!r}.")
  return np.clip(array, -_FAR, _FAR)


def _bound(value, batch_axis: str, what: str) -> pz.nx.NamedArray:
  if isinstance(value, pz.nx.NamedArrayBase):
    if not jnp.issubdtype(value.dtype, jnp.integer):
      raise ValueError(f"{what} must be integers, got {value.dtype}.")
    return pz.nx.nmap(jnp.clip)(value, -_FAR, _FAR).astype(jnp.int32)
  array = _host_ints(value, what)
  if array.ndim > 1:
    raise ValueError(f"{what} must be an integer or a list with one per row,"
                     f" got shape {array.shape}.")
  named = pz.nx.wrap(jnp.asarray(array, jnp.int32))
  return named.tag(batch_axis) if array.ndim else named


@pz.pytree_dataclass
class TokenRule(pz.Struct):
  """Selects tokens by position (see the module docstring).

  Attributes:
    start: First selected offset (int32 named array, scalar or per row).
    stop: End of the selected offsets (exclusive).
    from_generation: Whether offsets count from ``generation_start``
      (else from position 0).
  """

  start: pz.nx.NamedArray
  stop: pz.nx.NamedArray
  from_generation: pz.nx.NamedArray

  @classmethod
  def _make(cls, start, stop, from_generation: bool, batch_axis: str,
            what: str) -> TokenRule:
    start = _bound(start, batch_axis, f"{what} start")
    stop = _bound(stop, batch_axis, f"{what} stop")
    return cls(start=start, stop=stop,
               from_generation=pz.nx.wrap(jnp.asarray(from_generation)))

  @classmethod
  def all(cls) -> TokenRule:
    """Every real token."""
    return cls._make(0, _FAR, False, "batch", "all")

  @classmethod
  def prompt(cls) -> TokenRule:
    """Prompt tokens (and a session's history): before generation."""
    return cls._make(-_FAR, 0, True, "batch", "prompt")

  @classmethod
  def generated(cls) -> TokenRule:
    """Generated tokens (each when it is fed back)."""
    return cls._make(0, _FAR, True, "batch", "generated")

  @classmethod
  def positions(cls, start, stop=None, *, batch_axis: str = "batch"
                ) -> TokenRule:
    """Absolute positions ``start <= p < stop`` (``stop``: ``start + 1``).

    ``start``/``stop`` may be lists with one value per row.
    """
    _check_range(start, stop, "positions", minimum=0)
    if stop is None:
      stop = np.asarray(start) + 1
    return cls._make(start, stop, False, batch_axis, "positions")

  @classmethod
  def steps(cls, start, stop=None, *, batch_axis: str = "batch"
            ) -> TokenRule:
    """Generated tokens ``start <= step < stop`` (``stop``: no end)."""
    _check_range(start, stop, "steps", minimum=0)
    if stop is None:
      stop = np.full(np.shape(start), _FAR)
    return cls._make(start, stop, True, batch_axis, "steps")

  def mask(self, side_inputs: dict[str, Any]) -> pz.nx.NamedArray:
    """Bool named array over the tokens' axes: True where selected."""
    positions = side_inputs.get("token_positions")
    if positions is None:
      raise ValueError(
          "a token rule needs the 'token_positions' side input; call the"
          " model (TransformerLM or KVCachingTransformerLM), not a layer"
          " on its own.")
    gen = side_inputs.get("generation_start")
    if gen is None:
      gen = pz.nx.wrap(jnp.asarray(_FAR, jnp.int32))
    base = pz.nx.nmap(jnp.where)(self.from_generation, gen, 0)
    offset = positions - base
    return (positions >= 0) & (offset >= self.start) & (offset < self.stop)


def _check_range(start, stop, what: str, minimum: int) -> None:
  for name, value in (("start", start), ("stop", stop)):
    if value is None or isinstance(value, pz.nx.NamedArrayBase):
      continue
    array = _host_ints(value, f"{what} {name}")
    if (array < minimum).any():
      raise ValueError(f"{what} {name} must be >= {minimum}, got {value!r}.")
  if (stop is not None and not isinstance(start, pz.nx.NamedArrayBase)
      and not isinstance(stop, pz.nx.NamedArrayBase)
      and (np.asarray(stop) <= np.asarray(start)).any()):
    raise ValueError(f"{what}: stop must be greater than start, got"
                     f" [{start!r}, {stop!r}).")


def as_rule(where) -> TokenRule:
  """A `TokenRule` from a rule, ``"all"``, ``"prompt"`` or ``"generated"``.

  Raises:
    ValueError: for anything else.
  """
  if isinstance(where, TokenRule):
    return where
  if isinstance(where, str) and where in NAMES:
    return getattr(TokenRule, where)()
  raise ValueError(
      f"where must be 'all', 'prompt', 'generated' or a TokenRule (e.g."
      f" TokenRule.positions(3), TokenRule.steps(0, 8)), got {where!r}.")
