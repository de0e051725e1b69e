"""`FeatureEdit`: clamp, scale or add to an autoencoder's features.

Insert it at a splice's features point::

    steered = insert_at(spliced, "blocks.6.resid_post.sae.features",
                        FeatureEdit.clamp(sae, [1234], value=[0, 4, 8]))

With the error term kept (the splice's default), the model then sees its own
value plus ``(f_edited - f) @ w_dec``: clamping feature ``j`` to ``v`` adds
``(v - f_j)`` times its decoder row, i.e. steering along that feature.

Values follow the rule of every intervention: NaN or inf is refused when
the edit is built (`penzai_lm.interp.interventions.check_finite`), and NaN
or +inf logits from a value traced past that check end a generated row
with finish reason ``"non_finite"``.

Every value is data (a mask over ``features``, a scale and an offset, each
a scalar or one per row), so new features, strengths or rows never
recompile; ``where`` (a `penzai_lm.interp.TokenRule`) picks the tokens, and
holds with the KV cache.

The edit is ``f -> f * scale + offset`` on the masked features:
clamp to ``v`` is ``scale=0, offset=v``; scaling by ``s`` is
``scale=s, offset=0``; adding ``a`` is ``scale=1, offset=a``.

An edit built from ids also keeps them (``ids``, padded with -1 to at least
`MIN_IDS`, a power of two: a new count up to that width does not
recompile). A splice whose features are only edited, not recorded, then
computes just the edited features and their decoder rows
(`penzai_lm.sae.splice`): steering costs about what an `AddVector` does,
not a dense encode and decode of the whole dictionary.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.interp.interventions import as_float_array
from penzai_lm.interp.interventions import check_finite
from penzai_lm.interp.token_rules import as_rule
from penzai_lm.interp.token_rules import TokenRule
from penzai_lm.model import memory
from penzai_lm.model.points import Intervention
from penzai_lm.sae.autoencoder import FEATURES
from penzai_lm.sae.autoencoder import SparseAutoencoder

# The axis of an edit's feature ids (its sparse form).
EDITED = "edited"
# Fewest id slots an edit keeps: 1 to 8 features share one program.
MIN_IDS = 8


def take_features(table: pz.nx.NamedArray, ids: pz.nx.NamedArray
                  ) -> pz.nx.NamedArray:
  """``table``'s entries at feature ``ids`` (its ``features`` axis becomes
  ``edited``)."""
  return pz.nx.nmap(lambda t, i: jnp.take(t, i, axis=0))(
      table.untag(FEATURES), ids.untag(EDITED)).tag(EDITED)


def _width(sae_or_width) -> int:
  if isinstance(sae_or_width, SparseAutoencoder):
    return sae_or_width.config.num_features
  if isinstance(sae_or_width, int) and not isinstance(sae_or_width, bool) \
      and sae_or_width > 0:
    return sae_or_width
  raise TypeError("pass the SparseAutoencoder (or its number of features),"
                  f" got {type(sae_or_width).__name__}.")


def _mask(width: int, features, batch_axis: str
          ) -> tuple[pz.nx.NamedArray, pz.nx.NamedArray]:
  """A bool mask over ``features`` and the ids padded with -1 over
  ``edited``: from ids, or one list of ids per row (every id checked
  against ``width`` before anything is allocated)."""
  if isinstance(features, (int, np.integer)):
    features = [int(features)]
  features = list(features)
  per_row = bool(features) and all(
      isinstance(f, (list, tuple, np.ndarray)) for f in features)
  rows = [list(f) for f in features] if per_row else [features]
  for ids in rows:
    if not ids:
      raise ValueError("features is empty: name at least one feature"
                       + (" per row." if per_row else "."))
    for f in ids:
      if isinstance(f, bool) or not isinstance(f, (int, np.integer)) or not (
          0 <= f < width):
        raise ValueError(f"feature {f!r} does not exist: the autoencoder has"
                         f" {width} features (0-{width - 1}).")
  memory.check_fits(f"a FeatureEdit mask of {len(rows)} x {width:,}"
                    " features", len(rows) * width,
                    "Pass the SparseAutoencoder (or its true width).")
  mask = np.zeros((len(rows), width), bool)
  for r, ids in enumerate(rows):
    mask[r, np.asarray(ids, np.int64)] = True
  count = max(int(row.sum()) for row in mask)
  slots = max(MIN_IDS, 1 << (count - 1).bit_length())
  ids = np.full((len(rows), slots), -1, np.int32)
  for r, row in enumerate(mask):
    chosen = np.flatnonzero(row)
    ids[r, :chosen.size] = chosen
  named = pz.nx.wrap(jnp.asarray(mask)).tag(batch_axis, FEATURES)
  named_ids = pz.nx.wrap(jnp.asarray(ids)).tag(batch_axis, EDITED)
  if per_row:
    return named, named_ids
  return named[{batch_axis: 0}], named_ids[{batch_axis: 0}]


def _values(value, batch_axis: str, what: str) -> pz.nx.NamedArray:
  """A finite scalar, one per row (a list), or a named array (the rule of
  every intervention: `penzai_lm.interp.interventions.check_finite`)."""
  check_finite(value, what)
  if isinstance(value, pz.nx.NamedArrayBase):
    return value.astype(jnp.float32)
  array = as_float_array(value, what)
  if array.ndim > 1:
    raise ValueError(f"{what} must be a finite number or a list with one per"
                     f" row, got {value!r}.")
  named = pz.nx.wrap(jnp.asarray(array))
  return named.tag(batch_axis) if array.ndim else named


@pz.pytree_dataclass
class FeatureEdit(Intervention):
  """``f -> f * scale + offset`` on the features ``mask`` selects, at the
  tokens ``where`` selects (see the module docstring).

  Attributes:
    mask: Bool named array over ``features`` (optionally per row).
    scale: Float named array: a scalar or one per row.
    offset: Float named array: a scalar or one per row.
    where: Which tokens.
    ids: The features ``mask`` selects, as int32 ids over ``edited``
      padded with -1 (optionally per row), or None (then a splice always
      computes every feature).
  """

  mask: pz.nx.NamedArray
  scale: pz.nx.NamedArray
  offset: pz.nx.NamedArray
  where: TokenRule
  ids: pz.nx.NamedArray | None = None

  @classmethod
  def build(cls, sae, features, *, scale=1.0, offset=0.0, where="all",
            batch_axis: str = "batch") -> FeatureEdit:
    """The general form: ``features`` (ids, or one list per row), ``scale``
    and ``offset`` (numbers, or lists with one per row)."""
    mask, ids = _mask(_width(sae), features, batch_axis)
    return cls(mask=mask, scale=_values(scale, batch_axis, "scale"),
               offset=_values(offset, batch_axis, "offset"),
               where=as_rule(where), ids=ids)

  @classmethod
  def clamp(cls, sae, features, value, *, where="all",
            batch_axis: str = "batch") -> FeatureEdit:
    """Sets the features to ``value`` (0 ablates them)."""
    return cls.build(sae, features, scale=0.0, offset=value, where=where,
                     batch_axis=batch_axis)

  @classmethod
  def scaled(cls, sae, features, factor, *, where="all",
             batch_axis: str = "batch") -> FeatureEdit:
    """Multiplies the features by ``factor``."""
    return cls.build(sae, features, scale=factor, where=where,
                     batch_axis=batch_axis)

  @classmethod
  def add(cls, sae, features, amount, *, where="all",
          batch_axis: str = "batch") -> FeatureEdit:
    """Adds ``amount`` to the features."""
    return cls.build(sae, features, offset=amount, where=where,
                     batch_axis=batch_axis)

  def __call__(self, f, /, **side_inputs):
    if FEATURES not in f.named_shape:
      raise ValueError(
          "FeatureEdit works on an autoencoder's features: insert it at a"
          " 'blocks.{i}.P.sae.features' point (penzai_lm.sae.splice).")
    if f.named_shape[FEATURES] != self.mask.named_shape[FEATURES]:
      raise ValueError(
          f"this FeatureEdit was built for {self.mask.named_shape[FEATURES]}"
          f" features, but the point has {f.named_shape[FEATURES]}.")
    return self._apply(f, self.mask, side_inputs)

  def on_ids(self, f: pz.nx.NamedArray, ids: pz.nx.NamedArray,
             **side_inputs) -> pz.nx.NamedArray:
    """The edit on some features only: ``f`` holds the activations of the
    features ``ids`` names (both over ``edited``, ids in range)."""
    return self._apply(f, take_features(self.mask, ids), side_inputs)

  def _apply(self, f, selected, side_inputs):
    edited = f * self.scale.astype(f.dtype) + self.offset.astype(f.dtype)
    new = pz.nx.nmap(jnp.where)(selected, edited, f)
    mask = self.where.mask(side_inputs)
    return pz.nx.order_like(pz.nx.nmap(jnp.where)(mask, new, f), f)
