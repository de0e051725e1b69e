"""Intervention layers: identity-shaped layers that change a point's value.

Insert them with `penzai_lm.interp.insert_at`::

    steered = insert_at(model, "blocks.6.resid_post",
                        AddVector.build(direction, strength=[0, 4, 8]))
    ablated = insert_at(model, "blocks.3.attn.head_out",
                        Ablate.heads(model.config, heads=[0, 5]))

`insert_at` checks their arrays against the point before the model runs
(`penzai_lm.model.points.check_fits`): a vector of the wrong size, or one
over axes the point's value lacks, is an error naming the point and the
expected size.

Every builder refuses NaN and inf in the values it is given, in any form
(numbers, lists, numpy, jax or named arrays; `check_finite`: the one rule
for interventions and feature edits); a value traced inside ``jax.jit``
cannot be read then, and NaN or +inf logits end a generated row with
finish reason ``"non_finite"``.

Interventions are data, not graph: their values (vectors, strengths, masks,
patched activations, which tokens) are arrays, i.e. arguments of the
compiled programs, so changing them does not recompile.

* **Which tokens**: every intervention has a ``where`` `TokenRule` (all
  tokens, prompt only, generated only, absolute positions or a step range),
  evaluated from each token's position, so it holds with a KV cache.
* **Per row**: any value may carry the batch axis (``batch``), one entry per
  prompt (or per row with ``num_samples``); a list of strengths does that.
  In `generate` such values follow their rows whatever the internal batch
  bucket (3 prompts run as 4 rows) or ``num_samples`` (see
  `penzai_lm.generation.prepare.rows_to_batch`). Called directly, the
  model's batch axis must match them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.interp.token_rules import as_rule
from penzai_lm.interp.token_rules import TokenRule
from penzai_lm.model.hooks import heads_mask
from penzai_lm.model.points import Intervention


def check_finite(value, what: str, *, allow_inf: bool = False) -> None:
  """The finiteness rule of every intervention's and edit's values: NaN
  (and, unless ``allow_inf``, +-inf) is refused when the value is built.

  ``value`` may be a number, a list, a numpy or jax array or a named
  array. A value traced inside ``jax.jit`` cannot be read here; if it
  turns the logits NaN or +inf, `penzai_lm.generation.generate` ends the
  row with finish reason ``"non_finite"``.

  Raises:
    ValueError: naming ``what`` and counting the bad entries.
  """
  if isinstance(value, pz.nx.NamedArrayBase):
    value = value.data_array
  if isinstance(value, jax.core.Tracer):
    return
  try:
    array = np.asarray(value)
  except (TypeError, ValueError):
    return  # Not numbers: the builder's type check says so.
  if not np.issubdtype(array.dtype, np.inexact):
    return
  bad = np.isnan(array) if allow_inf else ~np.isfinite(array)
  if not bad.any():
    return
  if allow_inf:
    raise ValueError(f"{what} must not be NaN (+-inf is allowed): it holds"
                     f" {int(bad.sum())} NaN value(s) of {array.size}.")
  raise ValueError(f"{what} must be finite: it holds {int(bad.sum())} NaN"
                   f" or inf value(s) of {array.size}.")


def as_float_array(value, what: str) -> np.ndarray | jax.Array:
  """``value`` as a float32 array (a jax array, traced or not, stays one);
  a TypeError naming ``what`` for anything that is not numbers (a string,
  None, objects)."""
  if isinstance(value, jax.Array):
    if value.dtype == bool or not jnp.issubdtype(value.dtype, jnp.number):
      raise TypeError(f"{what} must be numbers, got dtype {value.dtype}.")
    return value.astype(jnp.float32)
  try:
    array = np.asarray(value)
  except (TypeError, ValueError) as e:  # Ragged lists.
    raise TypeError(f"{what} must be a number or a list of numbers, got"
                    f" {value!r}.") from e
  if array.dtype == bool or not (np.issubdtype(array.dtype, np.integer) or
                                 np.issubdtype(array.dtype, np.floating)):
    raise TypeError(f"{what} must be a number or a list of numbers, got"
                    f" {value!r}.")
  return array.astype(np.float32)


def _check_axes(x, data, what: str) -> None:
  missing = set(data.named_shape) - set(x.named_shape)
  if missing:
    raise ValueError(
        f"{what} works on axes {sorted(data.named_shape)} but the value at"
        f" this point has axes {sorted(x.named_shape)}; insert it at a point"
        " that has them (see penzai_lm.model.hooks).")


def _select(rule: TokenRule, side_inputs, new, old):
  """``new`` at the tokens ``rule`` selects, ``old`` elsewhere."""
  mask = rule.mask(side_inputs)
  return pz.nx.order_like(pz.nx.nmap(jnp.where)(mask, new, old), old)


def _per_row(value, batch_axis: str, what: str) -> pz.nx.NamedArray:
  """A float scalar, or a list (one per row) tagged with ``batch_axis``."""
  check_finite(value, what)
  if isinstance(value, pz.nx.NamedArrayBase):
    return value.astype(jnp.float32)
  array = as_float_array(value, what)
  if array.ndim > 1:
    raise ValueError(f"{what} must be a number or a list with one per row,"
                     f" got shape {array.shape}.")
  named = pz.nx.wrap(jnp.asarray(array))
  return named.tag(batch_axis) if array.ndim else named


def _heads(config, heads, batch_axis: str) -> pz.nx.NamedArray:
  """A heads mask from head indices, or from one list of them per row (a
  row's list may be empty: nothing zeroed in that row)."""
  if isinstance(heads, int):
    heads = [heads]
  heads = list(heads)
  if not heads:
    raise ValueError(
        "heads is empty: name at least one head, or give one list per row"
        " (a row's list may be empty: no head zeroed in that row).")
  if all(isinstance(h, (list, tuple)) for h in heads):
    return pz.nx.stack([heads_mask(config, list(h)) for h in heads],
                       batch_axis)
  return heads_mask(config, heads)


def _feature_vector(vector, axis: str, what: str) -> pz.nx.NamedArray:
  check_finite(vector, what)
  if isinstance(vector, pz.nx.NamedArrayBase):
    return vector
  vector = as_float_array(vector, what)
  if vector.ndim != 1:
    raise ValueError(
        f"{what} must be 1-D (one value per {axis!r} unit), got shape"
        f" {vector.shape}; for one per row pass a named array with the"
        " batch axis.")
  return pz.nx.wrap(jnp.asarray(vector)).tag(axis)


@pz.pytree_dataclass
class AddVector(Intervention):
  """Adds ``strength * vector`` to the value (steering).

  Attributes:
    vector: Named array over the value's feature axes (``embedding`` for the
      residual stream), optionally per row.
    strength: Float named array: a scalar or one per row.
    where: Which tokens.
  """

  vector: pz.nx.NamedArray
  strength: pz.nx.NamedArray
  where: TokenRule

  @classmethod
  def build(cls, vector, strength=1.0, *, where="all", axis: str = "embedding",
            batch_axis: str = "batch") -> AddVector:
    """From a 1-D array (or a named array), a strength (or a list with one
    per row) and a token rule (``"all"``, ``"prompt"``, ``"generated"`` or
    a `TokenRule`)."""
    return cls(vector=_feature_vector(vector, axis, "vector"),
               strength=_per_row(strength, batch_axis, "strength"),
               where=as_rule(where))

  def __call__(self, x, /, **side_inputs):
    _check_axes(x, self.vector, "AddVector")
    steered = x + (self.strength * self.vector).astype(x.dtype)
    return _select(self.where, side_inputs, steered, x)


@pz.pytree_dataclass
class Ablate(Intervention):
  """Replaces some units of the value (heads, neurons, residual dimensions)
  by zero or by given values (mean ablation).

  Attributes:
    mask: Bool named array over the units' axes (optionally per row): True
      = replaced.
    value: Replacement (float named array broadcastable to the value, e.g.
      a mean over a dataset), or a scalar 0.
    where: Which tokens.
  """

  mask: pz.nx.NamedArray
  value: pz.nx.NamedArray
  where: TokenRule

  @classmethod
  def heads(cls, config, heads, *, mean=None, where="all",
            batch_axis: str = "batch") -> Ablate:
    """Heads by index in Hugging Face order (see `head_coordinates`), at
    ``attn.head_out`` or ``attn.pattern``: a list, or one list per row
    (``[[0], [5, 6], [3]]``); ``mean``: a named array of replacement
    values (e.g. the heads' mean output), else zeros."""
    return cls._make(_heads(config, heads, batch_axis), mean, where)

  @classmethod
  def neurons(cls, config, neurons, *, mean=None, where="all") -> Ablate:
    """MLP neurons by index, at ``mlp.neurons``."""
    neurons = [neurons] if isinstance(neurons, int) else list(neurons)
    size = config.mlp_hidden_size
    bad = [n for n in neurons if not 0 <= int(n) < size]
    if not neurons or bad:
      raise ValueError(
          f"neurons must be a non-empty list of indices in [0, {size}),"
          f" got {neurons!r}.")
    mask = np.zeros((size,), bool)
    mask[neurons] = True
    return cls._make(pz.nx.wrap(jnp.asarray(mask)).tag("neurons"), mean,
                     where)

  @classmethod
  def _make(cls, mask, mean, where) -> Ablate:
    if mean is None:
      value = pz.nx.wrap(jnp.zeros((), jnp.float32))
    elif isinstance(mean, pz.nx.NamedArrayBase):
      check_finite(mean, "mean")
      value = mean
    else:
      raise ValueError(
          "mean must be a named array with the value's axes (e.g. from"
          " run_with_cache, averaged over tokens), got"
          f" {type(mean).__name__}.")
    return cls(mask=mask, value=value, where=as_rule(where))

  def __call__(self, x, /, **side_inputs):
    _check_axes(x, self.mask, "Ablate")
    new = pz.nx.nmap(jnp.where)(self.mask, self.value.astype(x.dtype), x)
    return _select(self.where, side_inputs, new, x)


@pz.pytree_dataclass
class ZeroHeads(Intervention):
  """Zeroes some heads of a per-head value (``attn.head_out``,
  ``attn.pattern``); `Ablate.heads` also mean-ablates.

  Attributes:
    mask: Bool named array over the query head axes, True = zeroed.
    where: Which tokens.
  """

  mask: pz.nx.NamedArray
  where: TokenRule

  @classmethod
  def build(cls, config, heads, *, where="all", batch_axis: str = "batch"
            ) -> ZeroHeads:
    """Heads by index in Hugging Face order (see `head_coordinates`): a
    list, or one list per row."""
    return cls(mask=_heads(config, heads, batch_axis), where=as_rule(where))

  def __call__(self, x, /, **side_inputs):
    _check_axes(x, self.mask, "ZeroHeads")
    return _select(self.where, side_inputs,
                   x * (~self.mask).astype(x.dtype), x)


@pz.pytree_dataclass
class Clamp(Intervention):
  """Clips the value to ``[low, high]`` (e.g. clamp a feature or neuron).

  Attributes:
    low: Lower bound (named array broadcastable to the value; -inf: none).
    high: Upper bound (+inf: none).
    where: Which tokens.
  """

  low: pz.nx.NamedArray
  high: pz.nx.NamedArray
  where: TokenRule

  @classmethod
  def build(cls, low=-np.inf, high=np.inf, *, where="all",
            batch_axis: str = "batch") -> Clamp:
    """Scalars, lists (one per row) or named arrays over feature axes."""
    bounds = []
    for name, value in (("low", low), ("high", high)):
      check_finite(value, name, allow_inf=True)
      if isinstance(value, pz.nx.NamedArrayBase):
        bounds.append(value.astype(jnp.float32))
        continue
      array = as_float_array(value, name)
      if array.ndim > 1:
        raise ValueError(f"{name} must be a number or one per row, got"
                         f" {value!r}.")
      named = pz.nx.wrap(jnp.asarray(array))
      bounds.append(named.tag(batch_axis) if array.ndim else named)
    if not isinstance(low, pz.nx.NamedArrayBase) and not isinstance(
        high, pz.nx.NamedArrayBase) and (np.asarray(low) > np.asarray(
            high)).any():
      raise ValueError(f"low must be <= high, got [{low!r}, {high!r}].")
    return cls(low=bounds[0], high=bounds[1], where=as_rule(where))

  def __call__(self, x, /, **side_inputs):
    clipped = pz.nx.nmap(jnp.clip)(x, self.low.astype(x.dtype),
                                   self.high.astype(x.dtype))
    return _select(self.where, side_inputs, clipped, x)


@pz.pytree_dataclass
class PatchValue(Intervention):
  """Replaces the value at some token positions with the value from
  another run (activation patching).

  The patched value is indexed by token *position* (the run's
  ``token_positions``), not by index in the current call, so it patches the
  right tokens in a left-padded batch and with a KV cache (where the prompt
  arrives in one call and each generated token in its own).

  Attributes:
    value: The replacement, with the point's axes and ``seq`` = positions
      0, 1, ... (e.g. `ActivationCache.row` of another run, or captures of
      another generation); batch axes optional (per row).
    patched: Bool named array over ``seq`` (and optionally batch axes):
      which positions of ``value`` are patched in.
    where: Which tokens (combined with ``patched``).
  """

  value: pz.nx.NamedArray
  patched: pz.nx.NamedArray
  where: TokenRule

  @classmethod
  def build(cls, value: pz.nx.NamedArray, positions=None, *, where="all"
            ) -> PatchValue:
    """Patches ``value`` in at the listed positions (None: all of them)."""
    if not isinstance(value, pz.nx.NamedArrayBase):
      raise ValueError(
          "value must be a named array with a 'seq' axis (e.g. from"
          f" run_with_cache), got {type(value).__name__}.")
    check_finite(value, "value")
    seq = value.named_shape.get("seq")
    if seq is None:
      raise ValueError("value needs a 'seq' axis (one entry per token).")
    if positions is None:
      positions = range(seq)
    positions = [positions] if isinstance(positions, int) else list(positions)
    bad = [p for p in positions if not 0 <= p < seq]
    if bad:
      raise ValueError(
          f"positions {bad} are outside the value's {seq} tokens.")
    patched = np.zeros((seq,), bool)
    patched[positions] = True
    return cls(value=value, patched=pz.nx.wrap(jnp.asarray(patched)).tag(
        "seq"), where=as_rule(where))

  def __call__(self, x, /, **side_inputs):
    _check_axes(x, self.value, "PatchValue")
    positions = side_inputs["token_positions"]
    n = self.value.named_shape["seq"]
    index = pz.nx.nmap(jnp.clip)(positions, 0, n - 1)
    take = pz.nx.nmap(lambda table, i: table[i])
    value = take(self.value.untag("seq"), index)
    ok = take(self.patched.untag("seq"), index) & (positions < n)
    new = pz.nx.nmap(jnp.where)(ok, value.astype(x.dtype), x)
    return _select(self.where, side_inputs, new, x)
