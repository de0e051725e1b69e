"""Argument checks of `attribution_patching`: the scored points, the
clean/corrupted token pairs (stacked over a ``run`` axis, row 0 the clean
run, row 1 the corrupted run; ragged pairs left-padded as in
`run_with_cache`) and the noise corruption (`GaussianNoise`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.interp.patching_inputs import check_tokens_arg
from penzai_lm.interp.tracing import AddNoise
from penzai_lm.interp.tracing import GaussianNoise
from penzai_lm.interp.tracing import NOISE_AXIS
from penzai_lm.interp.weights import weights
from penzai_lm.model import positions_from_padding
from penzai_lm.model.hooks import BLOCK_POINTS

RUN_AXIS = "run"  # Row 0: the clean run, row 1: the corrupted run.
PER_POSITION = ("resid_pre", "resid_mid", "resid_post", "attn_out",
                "mlp_out")
POINTS = (*PER_POSITION, "attn.head_out", "mlp.neurons")
DEFAULT_POINTS = ("resid_pre", "attn_out", "mlp_out")


def check_points(names) -> tuple[str, ...]:
  """``names`` as a tuple of scored points.

  Raises:
    ValueError: for no names, a name that is not in `POINTS`, duplicates.
  """
  names = (names,) if isinstance(names, str) else tuple(names)
  if not names:
    raise ValueError("names is empty: give at least one point, e.g."
                     " names=['resid_pre'].")
  for name in names:
    if name in POINTS:
      continue
    if isinstance(name, str) and name.startswith("blocks."):
      hint = (" names a block; give the point alone (e.g. 'resid_pre'):"
              " every block is scored")
    elif name in BLOCK_POINTS:
      hint = " has no attribution score here (attention weights are not"
      hint += " patched as a whole)"
    else:
      hint = " is not a block point"
    raise ValueError(f"point {name!r}{hint}. Points: {', '.join(POINTS)}.")
  if len(set(names)) != len(names):
    raise ValueError(f"names has duplicates: {list(names)}.")
  return names


def pair_tokens(model, clean, corrupted):
  """(tokens over ``run``, token axes, positions or None, lengths).

  Raises:
    ValueError: for malformed tokens, pairs of different lengths, a ``run``
      axis in the tokens.
  """
  named = isinstance(clean, pz.nx.NamedArrayBase)
  rows = None
  if not named and len(clean) and np.ndim(clean[0]) == 1:
    rows = [list(map(int, r)) for r in clean], [
        list(map(int, r)) for r in corrupted]
    lengths = [len(r) for r in rows[0]]
    if len(rows[0]) != len(rows[1]) or lengths != [len(r) for r in rows[1]]:
      raise ValueError(
          f"clean prompts have lengths {lengths} but corrupted prompts"
          f" {[len(r) for r in rows[1]]}: pair i (clean[i], corrupted[i])"
          " must have one length (pairs may differ).")
    if len(set(lengths)) == 1:
      clean, corrupted, rows = rows[0], rows[1], None
  if rows is None:
    clean = check_tokens_arg(model, clean, "clean_tokens")
    corrupted = check_tokens_arg(model, corrupted, "corrupted_tokens")
    if dict(clean.named_shape) != dict(corrupted.named_shape):
      raise ValueError(
          f"clean_tokens has shape {dict(clean.named_shape)} but"
          f" corrupted_tokens has {dict(corrupted.named_shape)}; attribution"
          " compares runs of the same length.")
    if RUN_AXIS in clean.named_shape:
      raise ValueError(f"the tokens have a {RUN_AXIS!r} axis: that name is"
                       " the clean/corrupted axis here; rename it.")
    axes = tuple(clean.named_shape)
    tokens = pz.nx.stack([clean, corrupted.order_as(*axes)], RUN_AXIS)
    rows_n = int(np.prod([n for a, n in clean.named_shape.items()
                          if a != "seq"], dtype=int))
    return tokens, axes, None, (clean.named_shape["seq"],) * rows_n
  longest = max(lengths)
  ids = np.zeros((2, len(lengths), longest), np.int32)
  padding = np.ones((2, len(lengths), longest), bool)
  for run, prompts in enumerate(rows):
    for i, row in enumerate(prompts):
      ids[run, i, longest - len(row):] = row
      padding[run, i, longest - len(row):] = False
  tokens = pz.nx.wrap(jnp.asarray(ids)).tag(RUN_AXIS, "batch", "seq")
  check_tokens_arg(model, tokens[{RUN_AXIS: 0}], "clean_tokens")
  check_tokens_arg(model, tokens[{RUN_AXIS: 1}], "corrupted_tokens")
  positions = positions_from_padding(
      pz.nx.wrap(jnp.asarray(padding)).tag(RUN_AXIS, "batch", "seq"))
  return tokens, ("batch", "seq"), positions, tuple(lengths)




def noise_layer(model, corrupt: GaussianNoise, tokens: pz.nx.NamedArray,
                positions) -> AddNoise:
  """The layer (for ``embed``) adding ``corrupt``'s noise, a ``noise`` axis
  of samples, to the corrupted row of ``tokens`` (over ``run``).

  Raises:
    ValueError: for ragged prompts (noise positions would differ per row),
      tokens with a ``noise`` axis, noise positions outside the prompts.
  """
  if positions is not None:
    raise ValueError(
        "corrupt= needs prompts of one length (GaussianNoise.positions are"
        " positions of every row); run ragged prompts one length at a"
        " time.")
  if NOISE_AXIS in tokens.named_shape:
    raise ValueError(
        f"the tokens have a {NOISE_AXIS!r} axis: with corrupt= that name is"
        " the noise samples' axis; rename it.")
  noise = corrupt.noise(model, weights(model, "embed.W_E"),
                        tokens.named_shape["seq"])
  rows = pz.nx.wrap(jnp.asarray([False, True])).tag(RUN_AXIS)
  return AddNoise(noise=noise, rows=rows)
