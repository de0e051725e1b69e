"""`run_with_cache`: one forward pass, with the activations at named points.

Capture layers (`penzai_lm.model.captures`) are inserted right after the
requested points' hook points, so they record the value with any
interventions applied, on either layout of the model. Only the requested
points are kept: ask for a few names to keep memory bounded.

Prompts may be ragged: they are left-padded, the padding gets position -1
(no token attends to it), and `ActivationCache.row` returns one row's values
without it. Lists of prompts run padded to a bucket of lengths
(`padded_length`: a power of two, at least 8, as `generate` pads prompts,
then multiples of 256 tokens), so batches of many lengths share a few
compiled programs; the cache's arrays are cut back to the longest prompt.

With ``return_loss=True`` the cache also holds each row's next-token
losses (see `penzai_lm.interp.loss_layer`).

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
from penzai_lm.generation.shapes import bucket
from penzai_lm.generation.shapes import MIN_PROMPT_BUCKET
from penzai_lm.interp.loss_layer import insert_token_losses
from penzai_lm.interp.loss_layer import row_losses
from penzai_lm.model import points as points_lib
from penzai_lm.model import positions_from_padding
from penzai_lm.model import TransformerLM
from penzai_lm.model.captures import insert_captures
from penzai_lm.model.transformer import compiles
from penzai_lm.model.transformer import eager as eager_calls


# Prompts longer than this are padded to a multiple of it (shorter ones to
# a power of two).
LONG_PROMPT_STEP = 256


@dataclasses.dataclass
class ActivationCache:
  """Logits and captured activations of one forward pass.

  Attributes:
    logits: ``(batch axes, seq, vocabulary)`` logits (left-padded rows),
      or None (``run_with_cache(..., logits=False)``).
    values: ``{point name: NamedArray}`` with the batch axes and ``seq``.
    lengths: Real tokens of each row (rows are left-padded to the longest).
    losses: With ``run_with_cache(..., return_loss=True)``, one float32
      array per row: ``losses[r][t]`` is the negative log-likelihood of the
      row's token ``t + 1`` given its tokens ``0..t`` (``lengths[r] - 1``
      values, no padding); else None.
  """

  logits: pz.nx.NamedArray | None
  values: dict[str, pz.nx.NamedArray]
  lengths: list[int]
  losses: list[np.ndarray] | None = None

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

  @property
  def loss(self) -> float | None:
    """The mean next-token loss over every predicted token of every row
    (as Hugging Face's ``labels=`` loss with padding ignored), or None
    without ``return_loss=True`` or predicted tokens."""
    if self.losses is None or not sum(map(len, self.losses)):
      return None
    return float(np.mean(np.concatenate(self.losses)))

  def row(self, r: int, name: str, batch_axis: str = "batch"):
    """Row ``r`` of a point's value, or of the logits (``name="logits"``),
    without the row's padding."""
    if name == "logits":
      if self.logits is None:
        raise KeyError(
            "the logits were not kept (run_with_cache(..., logits=False));"
            " run it with logits=True.")
      value = self.logits[{batch_axis: r}]
    else:
      value = self[name][{batch_axis: r}]
    pad = value.named_shape["seq"] - self.lengths[r]
    return value[{"seq": pz.slice[pad:]}]


def token_batch(model, tokens, *, bucketed: bool = False
                ) -> tuple[Any, Any, list[int]]:
  """(tokens NamedArray, padding mask or None, real lengths) from any of:
  a NamedArray with ``seq``, one list of ids, or a (ragged) list of
  lists. Lists are left-padded to the longest (``bucketed``: to
  `padded_length`); the mask is returned for every list input (ragged or
  not), so that one compiled program serves every batch of the same
  padded shape."""
  if isinstance(tokens, pz.nx.NamedArrayBase):
    seq = tokens.named_shape["seq"] if "seq" in tokens.named_shape else 0
    rows = int(np.prod([n for a, n in tokens.named_shape.items()
                        if a != "seq"], dtype=int))
    return tokens, None, [seq] * max(rows, 1)
  rows = normalize_prompts(tokens, model.config.vocab_size)
  longest = max(len(r) for r in rows)
  if bucketed:
    longest = padded_length(model.config, longest)
  ids = np.zeros((len(rows), longest), np.int32)
  padding = np.ones((len(rows), longest), bool)
  for i, row in enumerate(rows):
    ids[i, longest - len(row):] = row
    padding[i, longest - len(row):] = False
  named = pz.nx.wrap(jnp.asarray(ids)).tag("batch", "seq")
  mask = pz.nx.wrap(jnp.asarray(padding)).tag("batch", "seq")
  return named, mask, [len(r) for r in rows]


def padded_length(config, longest: int) -> int:
  """The length prompts of at most ``longest`` tokens are padded to.

  Up to `LONG_PROMPT_STEP` tokens, generation's prompt bucket (a power of
  two, at least 8); above, the next multiple of `LONG_PROMPT_STEP` (at
  most 25% more tokens, where a power of two could double the logits'
  memory). Never past the model's context
  (``config.max_position_embeddings``) nor below ``longest``.
  """
  if longest <= LONG_PROMPT_STEP:
    padded = bucket(longest, MIN_PROMPT_BUCKET)
  else:
    padded = -(-longest // LONG_PROMPT_STEP) * LONG_PROMPT_STEP
  return max(longest, min(padded, config.max_position_embeddings))


def check_context(config, lengths: list[int]) -> None:
  """Refuses a row longer than the model's context, as `generate` does."""
  limit = config.max_position_embeddings
  for r, length in enumerate(lengths):
    if length > limit:
      raise ValueError(
          f"prompt {r} has {length} tokens: more than the model's context"
          f" of {limit} tokens (config.max_position_embeddings). Shorten"
          f" the prompt or split it into windows of at most {limit}"
          " tokens.")


def capture_names(model, names) -> list[str]:
  """``names`` as a list without repeats (first occurrence kept); None:
  every point of the model."""
  if names is None:
    return points_lib.point_names(model)
  names = [names] if isinstance(names, str) else list(names)
  bad = [n for n in names if not isinstance(n, str)]
  if bad:
    raise TypeError(
        f"names must be point names (str), got {bad[0]!r}; see"
        " penzai_lm.interp.point_names(model).")
  return list(dict.fromkeys(names))


def _trim(value, seq: int):
  """The last ``seq`` entries of ``value``'s token axes (``seq``, and the
  keys' ``kv_seq`` of attention patterns)."""
  if value is None:
    return value
  cut = {axis: pz.slice[n - seq:] for axis, n in value.named_shape.items()
         if axis in ("seq", "kv_seq") and n != seq}
  if not cut:
    return value
  return value[cut].order_as(*value.named_shape)  # Slicing moves axes.


def run_with_cache(model, tokens, names=None, *, logits: bool = True,
                   return_loss: bool = False, eager: bool = False,
                   engine=None, **side_inputs) -> ActivationCache:
  """Runs ``model`` once and returns its logits and activations.

  Compiled like a top-level model call (`penzai_lm.runtime.forward`):
  one program per model structure, captured names and padded shape, kept
  by ``engine``'s program cache; new token ids and new patch values reuse
  it (the padding mask is an argument and positions are computed from it
  inside the program). Lists of prompts are left-padded to a bucket of
  lengths (`padded_length`: a power of two of at least 8 tokens, as
  `generate` pads prompts, up to 256, then a multiple of 256; never past
  the context), so ragged batches of many lengths compile one program per
  bucket and batch size; the returned arrays are cut back to the longest
  prompt. A ``pz.nx.NamedArray`` of tokens runs at its own shape.

  Args:
    model: An uncached `TransformerLM` (patched or not).
    tokens: A ``pz.nx.NamedArray`` of ids with a ``seq`` axis (and batch
      axes), one list of ids, or a list of (ragged) lists of ids.
    names: Point names to capture (`penzai_lm.model.hooks`); None captures
      every point (memory grows with layers x tokens x width: prefer a
      list). A name given twice is captured once.
    logits: Return the logits. With False the compiled program computes
      only what the captured points need: no output projection (for Gemma
      3's 262,144 ids and 1,100 tokens, 1.15 GB of float32 logits) and no
      block after the last captured point, like TransformerLens's
      ``stop_at_layer``; ``cache.logits`` is None.
    return_loss: Also compute each row's next-token losses in the same
      program (``cache.losses``, ``cache.loss``); with ``logits=False``
      the program returns the losses without the logits.
    eager: Run op by op instead (as inside ``penzai_lm.eager()``), e.g.
      to debug a patch. Inside a JAX trace (``jax.jit``, ``jax.grad``) the
      model is traced as part of it either way.
    engine: The `penzai_lm.Engine` whose program cache is used (default:
      the default engine).
    **side_inputs: Forwarded to the model (e.g. ``token_positions``).

  Returns:
    An `ActivationCache`.

  Raises:
    ValueError: for a point the model does not have, or a prompt longer
      than the model's context (``config.max_position_embeddings``), which
      `generate` refuses too.
    TypeError: for a model other than an uncached `TransformerLM`, or a
      non-bool ``logits`` / ``return_loss``.
  """
  if not isinstance(model, TransformerLM):
    raise TypeError(
        "run_with_cache needs the uncached TransformerLM (a cached model's"
        f" state would change); got {type(model).__name__}.")
  for flag, value in (("logits", logits), ("return_loss", return_loss)):
    if not isinstance(value, bool):
      raise TypeError(f"{flag} must be True or False, got {value!r}.")
  names = capture_names(model, names)
  ids, padding, lengths = token_batch(model, tokens, bucketed=True)
  check_context(model.config, lengths)
  patched, captures = insert_captures(model, names, dict(ids.named_shape))
  if return_loss:
    patched, loss_var = insert_token_losses(patched, ids)
  if not eager and compiles(ids, side_inputs.get("token_positions"),
                            side_inputs):
    out = resolve_engine(engine).forward(patched, ids, padding=padding,
                                         return_logits=logits, **side_inputs)
  else:
    if padding is not None and "token_positions" not in side_inputs:
      side_inputs["token_positions"] = positions_from_padding(padding)
    with eager_calls() if eager else contextlib.nullcontext():
      out = patched(ids, **side_inputs)
  seq = max(lengths) if padding is not None else ids.named_shape["seq"]
  values = {name: _trim(spec.take(var.value), seq)
            for name, (var, spec) in captures.items()}
  return ActivationCache(
      logits=_trim(out, seq) if logits else None, values=values,
      lengths=lengths,
      losses=row_losses(loss_var.value, lengths) if return_loss else None)
