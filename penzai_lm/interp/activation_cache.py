"""`run_with_cache`: one forward pass, with the activations at named points.

Capture layers (`penzai_lm.model.captures`) are inserted right after the
requested points' hook points, so they record the value with any
interventions applied, on either layout of the model. Only the requested
points are kept: ask for a few names to keep memory bounded.

Prompts may be ragged: they are left-padded, the padding gets position -1
(no token attends to it), and `ActivationCache.row` returns one row's values
without it.

`run_with_cache` runs as a compiled program of an engine (see
`penzai_lm.runtime.forward`; ``eager=True`` runs it op by op).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.generation.engine import resolve_engine
from penzai_lm.generation.prompts import normalize_prompts
from penzai_lm.model import points as points_lib
from penzai_lm.model import positions_from_padding
from penzai_lm.model import TransformerLM
from penzai_lm.model.captures import insert_captures
from penzai_lm.model.transformer import compiles
from penzai_lm.model.transformer import eager as eager_calls


@dataclasses.dataclass
class ActivationCache:
  """Logits and captured activations of one forward pass.

  Attributes:
    logits: ``(batch axes, seq, vocabulary)`` logits (left-padded rows),
      or None (``run_with_cache(..., logits=False)``).
    values: ``{point name: NamedArray}`` with the batch axes and ``seq``.
    lengths: Real tokens of each row (rows are left-padded to the longest).
  """

  logits: pz.nx.NamedArray | None
  values: dict[str, pz.nx.NamedArray]
  lengths: list[int]

  def __getitem__(self, name: str) -> pz.nx.NamedArray:
    if name not in self.values:
      raise KeyError(
          f"{name!r} was not captured; captured: {sorted(self.values)}."
          " Pass it in run_with_cache(..., names=[...]).")
    return self.values[name]

  def __contains__(self, name: str) -> bool:
    return name in self.values

  def keys(self):
    return self.values.keys()

  def row(self, r: int, name: str, batch_axis: str = "batch"):
    """Row ``r`` of a point's value, without the row's padding."""
    value = self[name][{batch_axis: r}]
    pad = value.named_shape["seq"] - self.lengths[r]
    return value[{"seq": pz.slice[pad:]}]


def token_batch(model, tokens) -> tuple[Any, Any, list[int]]:
  """(tokens NamedArray, padding mask or None, real lengths) from any of:
  a NamedArray with ``seq``, one list of ids, or a (ragged) list of
  lists. Lists are left-padded to the longest; the mask is returned for
  every list input (ragged or not), so that one compiled program serves
  every batch of the same padded shape."""
  if isinstance(tokens, pz.nx.NamedArrayBase):
    seq = tokens.named_shape["seq"] if "seq" in tokens.named_shape else 0
    rows = int(np.prod([n for a, n in tokens.named_shape.items()
                        if a != "seq"], dtype=int))
    return tokens, None, [seq] * max(rows, 1)
  rows = normalize_prompts(tokens, model.config.vocab_size)
  longest = max(len(r) for r in rows)
  ids = np.zeros((len(rows), longest), np.int32)
  padding = np.ones((len(rows), longest), bool)
  for i, row in enumerate(rows):
    ids[i, longest - len(row):] = row
    padding[i, longest - len(row):] = False
  named = pz.nx.wrap(jnp.asarray(ids)).tag("batch", "seq")
  mask = pz.nx.wrap(jnp.asarray(padding)).tag("batch", "seq")
  return named, mask, [len(r) for r in rows]


def run_with_cache(model, tokens, names=None, *, logits: bool = True,
                   eager: bool = False, engine=None,
                   **side_inputs) -> ActivationCache:
  """Runs ``model`` once and returns its logits and activations.

  Compiled like a top-level model call (`penzai_lm.runtime.forward`):
  one program per model structure, captured names and padded shape, kept
  by ``engine``'s program cache; ragged prompts of one padded shape, new
  token ids and new patch values reuse it (the padding mask is an
  argument and positions are computed from it inside the program).

  Args:
    model: An uncached `TransformerLM` (patched or not).
    tokens: A ``pz.nx.NamedArray`` of ids with a ``seq`` axis (and batch
      axes), one list of ids, or a list of (ragged) lists of ids.
    names: Point names to capture (`penzai_lm.model.hooks`); None captures
      every point (memory grows with layers x tokens x width: prefer a
      list).
    logits: Return the logits. With False the compiled program computes
      only what the captured points need: no output projection (for Gemma
      3's 262,144 ids and 1,100 tokens, 1.15 GB of float32 logits) and no
      block after the last captured point, like TransformerLens's
      ``stop_at_layer``; ``cache.logits`` is None.
    eager: Run op by op instead (as inside ``penzai_lm.eager()``), e.g.
      to debug a patch. Inside a JAX trace (``jax.jit``, ``jax.grad``) the
      model is traced as part of it either way.
    engine: The `penzai_lm.Engine` whose program cache is used (default:
      the default engine).
    **side_inputs: Forwarded to the model (e.g. ``token_positions``).

  Returns:
    An `ActivationCache`.

  Raises:
    ValueError: for a point the model does not have.
  """
  if not isinstance(model, TransformerLM):
    raise TypeError(
        "run_with_cache needs the uncached TransformerLM (a cached model's"
        f" state would change); got {type(model).__name__}.")
  if not isinstance(logits, bool):
    raise TypeError(f"logits must be True or False, got {logits!r}.")
  names = points_lib.point_names(model) if names is None else (
      [names] if isinstance(names, str) else list(names))
  ids, padding, lengths = token_batch(model, tokens)
  patched, captures = insert_captures(model, names, dict(ids.named_shape))
  if not eager and compiles(ids, side_inputs.get("token_positions"),
                            side_inputs):
    out = resolve_engine(engine).forward(patched, ids, padding=padding,
                                         return_logits=logits, **side_inputs)
  else:
    if padding is not None and "token_positions" not in side_inputs:
      side_inputs["token_positions"] = positions_from_padding(padding)
    with eager_calls() if eager else contextlib.nullcontext():
      out = patched(ids, **side_inputs)
  values = {name: spec.take(var.value)
            for name, (var, spec) in captures.items()}
  return ActivationCache(logits=out if logits else None, values=values,
                         lengths=lengths)
