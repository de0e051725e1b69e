"""`run_with_cache`: one forward pass, with the activations at named points.

Capture layers are inserted right after the requested points' hook points
(so they record the value with any interventions applied) and write into
buffers allocated up front from the model's config, so the same
code runs on per-layer blocks and inside a layer stack's scan (where a
buffer has a ``blocks`` axis and each block writes its slice). Only the
requested points are kept: ask for a few names to keep memory bounded.

Prompts may be ragged: they are left-padded, the padding gets position -1
(no token attends to it), and `ActivationCache.row` returns one row's values
without it.

`run_with_cache` runs as a compiled program of an engine (see
`penzai_lm.generation.forward`; ``eager=True`` runs it op by op).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.interp import points as points_lib
from penzai_lm.model import TransformerLM
from penzai_lm.model import positions_from_padding
from penzai_lm.model.transformer import compiles
from penzai_lm.model.transformer import eager as eager_calls
from penzai_lm.model.build import head_axes
from penzai_lm.model.cache_attention import write_at


def _value_axes(config, point: str, seq: int) -> dict[str, int]:
  """Named axes of a point's value, besides the token axes."""
  common, query_only = head_axes(config)
  heads = {**common, **query_only}
  if point == "attn.pattern":
    return {**heads, "kv_seq": seq}
  if point == "attn.head_out":
    return {**heads, "projection": config.head_dim}
  if point == "mlp.neurons":
    return {"neurons": config.mlp_hidden_size}
  return {"embedding": config.hidden_size}


@pz.pytree_dataclass
class Capture(pz.nn.Layer):
  """Saves the value passing through into a preallocated buffer.

  A buffer as long as the call's ``seq`` is overwritten; a longer one is a
  per-slot record like a KV cache (generation captures): the call's tokens
  are written at its ``cache_end_index`` side input.
  """

  saved: pz.StateVariable

  def __call__(self, x, /, **side_inputs):
    buffer = self.saved.value
    x = x.astype(buffer.dtype)
    if x.named_shape["seq"] == buffer.named_shape["seq"]:
      self.saved.value = pz.nx.order_like(x, buffer)
    else:
      self.saved.value = write_at(buffer, x, "seq",
                                  side_inputs["cache_end_index"])
    return x


@dataclasses.dataclass(frozen=True)
class CaptureSpec:
  """Where one captured point's values end up.

  Attributes:
    name: The point's name.
    label: The label of the state variable holding them.
    layer: The block to take from a layer stack's per-layer buffer (which
      has a ``blocks`` axis), or None.
  """

  name: str
  label: str
  layer: int | None = None

  def take(self, value: pz.nx.NamedArray) -> pz.nx.NamedArray:
    return value if self.layer is None else value[{"blocks": self.layer}]


def insert_captures(model, names, token_shape: dict[str, int],
                    label_prefix: str = "capture"):
  """Inserts `Capture` layers with buffers of ``token_shape`` (the batch
  axes and ``seq``) right after the named points.

  Returns:
    ``(patched model, {name: (StateVariable, CaptureSpec)})``.
  """
  config = model.config
  parsed = [points_lib.parse_point(model, n) for n in names]
  patched, out = model, {}
  for point in dict.fromkeys(p.point for p in parsed):
    hook_point = points_lib.hook_points(model, point).get_sequence()[0]
    blocks = (hook_point.layer.named_shape["blocks"]
              if points_lib.is_stacked(hook_point) else 0)
    wanted = [p for p in parsed if p.point == point]
    if blocks or [p.name for p in wanted] == [point]:
      # One capture for all blocks (a stack) or a model-level point.
      metadata = {}
      if blocks:
        metadata = {"layerstack_axes": {
            "blocks": pz.nn.LayerStackVarBehavior.PER_LAYER}}
      var = pz.StateVariable(_buffer(config, point, token_shape, blocks,
                                     hook_point),
                             label=f"{label_prefix}/{point}",
                             metadata=metadata)
      patched = points_lib.hook_points(patched, point).insert_after(
          Capture(var))  # Every block of a stack (or the one point).
      for p in wanted:
        out[p.name] = (var, CaptureSpec(p.name, var.label,
                                        p.layer if blocks else None))
      continue
    for p in wanted:
      var = pz.StateVariable(_buffer(config, point, token_shape, 0,
                                     _hook_of(model, p)),
                             label=f"{label_prefix}/{p.name}")
      patched = points_lib.insert_at(patched, p.name, Capture(var),
                                     after_hook=True)
      out[p.name] = (var, CaptureSpec(p.name, var.label))
  return patched, out


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


def _token_batch(model, tokens) -> tuple[Any, Any, list[int]]:
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
  from penzai_lm.generation.prompts import normalize_prompts  # pylint: disable=g-import-not-at-top
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


def _hook_of(model, point: points_lib.Point):
  """The hook point of one block (or of the model) for a parsed point."""
  for h in points_lib.hook_points(model, point.point).get_sequence():
    if point.layer is None or h.layer is None or (
        not h.layer.named_shape and int(h.layer.data_array) == point.layer):
      return h
  return None


def _buffer(config, point, token_shape, stacked_blocks, hook_point=None):
  # Points added by a splice (penzai_lm.sae) say their own axes and dtype.
  own = getattr(hook_point, "value_axes", None)
  value_axes = (dict(own) if own else
                _value_axes(config, point, token_shape["seq"]))
  dtype = (getattr(hook_point, "value_dtype", None) if own
           else None) or config.activation_dtype
  axes = {**token_shape, **value_axes}
  if stacked_blocks:
    axes = {"blocks": stacked_blocks, **axes}
  return pz.nx.zeros(axes, dtype)


def run_with_cache(model, tokens, names=None, *, logits: bool = True,
                   eager: bool = False, engine=None,
                   **side_inputs) -> ActivationCache:
  """Runs ``model`` once and returns its logits and activations.

  Compiled like a top-level model call (`penzai_lm.generation.forward`):
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
  ids, padding, lengths = _token_batch(model, tokens)
  patched, captures = insert_captures(model, names, dict(ids.named_shape))
  if not eager and compiles(ids, side_inputs.get("token_positions"),
                            side_inputs):
    from penzai_lm.generation.engine import resolve_engine  # pylint: disable=g-import-not-at-top
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
