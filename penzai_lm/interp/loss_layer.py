"""The next-token loss as a layer: per-token NLL recorded in the forward pass.

`insert_token_losses(model, tokens)` appends a `TokenLosses` layer after
the model's logits. It records, into a state variable, the negative
log-likelihood of each next token, ``-log softmax(logits[t])[tokens[t +
1]]`` in float32, and passes the logits through unchanged. The targets are
an array of the layer (an argument of a compiled program, like any patch
value), so new tokens of one shape reuse the program; a program that does
not return the logits (``run_with_cache(..., logits=False)``) returns only
the losses, never the ``(tokens, vocabulary)`` logits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz


@pz.pytree_dataclass
class TokenLosses(pz.nn.Layer):
  """Records the NLL of the next token at every position.

  Attributes:
    targets: The id each position predicts (the next token; any id at the
      last position, whose loss is meaningless), with the tokens' axes.
    saved: State variable that receives the float32 losses, with the
      tokens' axes.
  """

  targets: pz.nx.NamedArray
  saved: pz.StateVariable

  def __call__(self, logits, /, **side_inputs):
    del side_inputs
    scores = logits.astype(jnp.float32).untag("vocabulary")
    normalizer = pz.nx.nmap(jax.nn.logsumexp)(scores)
    picked = pz.nx.nmap(lambda row, t: row[t])(scores, self.targets)
    self.saved.value = pz.nx.order_like(normalizer - picked,
                                        self.saved.value)
    return logits


def next_token_targets(tokens: pz.nx.NamedArray) -> pz.nx.NamedArray:
  """``tokens`` shifted one step left along ``seq`` (0 at the end)."""
  shift = lambda row: jnp.concatenate([row[1:], jnp.zeros((1,), row.dtype)])
  return pz.nx.nmap(shift)(tokens.untag("seq")).tag("seq")


def insert_token_losses(model, tokens: pz.nx.NamedArray):
  """Appends a `TokenLosses` layer for ``tokens`` after ``model``'s logits.

  Args:
    model: An uncached `TransformerLM` whose body is a ``pz.nn.Sequential``.
    tokens: The named token ids the model will be called on.

  Returns:
    ``(patched model, the state variable that will hold the losses)``.
  """
  if not isinstance(model.body, pz.nn.Sequential):
    raise TypeError(
        "return_loss needs a TransformerLM whose body is a pz.nn.Sequential"
        f" (as built by penzai_lm); got {type(model.body).__name__}.")
  saved = pz.StateVariable(pz.nx.zeros(dict(tokens.named_shape),
                                       jnp.float32), label="token_losses")
  layer = TokenLosses(targets=next_token_targets(tokens), saved=saved)
  body = pz.nn.Sequential([*model.body.sublayers, layer])
  return dataclasses.replace(model, body=body), saved


def row_losses(losses: pz.nx.NamedArray, lengths: list[int]) -> list[Any]:
  """Each row's losses without padding: row ``r`` (left-padded to the
  ``seq`` axis, ``lengths[r]`` real tokens) gives ``lengths[r] - 1``
  values, the NLL of its tokens 1, 2, ... given those before. Rows are
  the batch axes' entries in row-major order of their names' order in
  ``losses.named_shape``. NumPy arrays, or JAX arrays inside a trace."""
  batch_axes = [a for a in losses.named_shape if a != "seq"]
  table = losses.unwrap(*batch_axes, "seq")
  if not isinstance(table, jax.core.Tracer):
    table = np.asarray(table, np.float32)
  table = table.reshape(-1, losses.named_shape["seq"])
  seq = table.shape[1]
  return [table[r, seq - n:seq - 1] for r, n in enumerate(lengths)]
