"""The uncached `TransformerLM`.

Axis-name conventions, shared by every layer in penzai_lm:

* ``batch`` (or any other user-chosen batch axes): independent sequences.
* ``seq``: the token axis of the input; in attention, the query tokens.
* ``kv_seq``: the key/value token axis of an attention matrix (a renamed copy
  of ``seq``, or the cache slots in cached mode).
* ``embedding``: the residual stream.
* ``heads`` (multi-head), ``query_heads`` (multi-query), or ``head_groups`` +
  ``query_heads`` (grouped-query): attention heads. Keys and values carry only
  ``heads`` / ``head_groups``.
* ``projection``: the per-head query/key/value vectors.
* ``neurons``: the MLP hidden layer.
* ``vocabulary``: token ids of the output logits.
* ``blocks``: the layer axis of a layer stack.
* ``positions``: the learned position table (``position_embedding="learned"``).

Side inputs: ``token_positions`` gives the position of each token (integer
named array over ``seq`` and the batch axes); -1 marks padding, which no
token attends to. The cached mode adds ``kv_token_positions`` (over the cache
slots) and ``cache_end_index``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.model import dispatch
from penzai_lm.model.config import TransformerConfig
from penzai_lm.model.tracing import top_level


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # pytype: disable=wrong-keyword-args
class TransformerBlock(pz.nn.Sequential):
  """One transformer block: an attention residual then an MLP residual."""

  def treescope_color(self):
    color = "oklch(0.785 0.103 186.9 / 1.0)"
    return color, f"color-mix(in oklab, {color} 25%, white)"


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # pytype: disable=wrong-keyword-args
class TransformerFeedForward(pz.nn.Sequential):
  """The MLP of a transformer block."""


def check_tokens(tokens, vocab_size: int, what: str = "tokens") -> None:
  """Validates a token array: a named integer array with a ``seq`` axis.

  Token ids are range-checked when their values are known (outside jit).

  Raises:
    ValueError: with a description of what is wrong.
  """
  if not isinstance(tokens, pz.nx.NamedArrayBase):
    raise ValueError(
        f"{what} must be a pz.nx.NamedArray with a 'seq' axis, got"
        f" {type(tokens).__name__}. Wrap ids with"
        " pz.nx.wrap(ids).tag('batch', 'seq')."
    )
  if tokens.positional_shape:
    raise ValueError(
        f"{what} has positional axes {tokens.positional_shape}; tag every axis"
        " (e.g. .tag('batch', 'seq'))."
    )
  if "seq" not in tokens.named_shape:
    raise ValueError(
        f"{what} has axes {dict(tokens.named_shape)} but needs a 'seq' axis."
    )
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{what} must have an integer dtype, got {tokens.dtype}.")
  data = tokens.data_array
  if not isinstance(data, jax.core.Tracer) and data.size:
    # numpy, not jnp: under a jit that closes over concrete tokens, jnp
    # would turn them into tracers and int() would fail.
    host = np.asarray(data)
    low, high = int(host.min()), int(host.max())
    if low < 0 or high >= vocab_size:
      bad = low if low < 0 else high
      raise ValueError(
          f"{what} contains id {bad}, outside the vocabulary [0,"
          f" {vocab_size})."
      )


@pz.pytree_dataclass
class TransformerLM(pz.nn.Layer):
  """A decoder-only language model built from `pz.nn` layers.

  Build one with `penzai_lm.build_transformer` (random or with parameter
  slots) or load a checkpoint with `penzai_lm.load`. Convert it to cached
  sampling mode with `KVCachingTransformerLM.from_uncached`.

  Attributes:
    body: The layers, from embedding lookup to output logits. Patch it with
      ``pz.select``.
    config: The architecture.
  """

  body: pz.nn.Layer
  config: TransformerConfig = dataclasses.field(
      metadata={"pytree_node": False}
  )

  def __call__(
      self,
      tokens: pz.nx.NamedArray,
      *,
      token_positions: pz.nx.NamedArray | None = None,
      **side_inputs,
  ) -> pz.nx.NamedArray:
    """Computes logits for every token.

    A call on concrete arrays outside any JAX trace runs as one compiled
    program, cached by the default `penzai_lm.Engine` per model structure
    and shapes (new token or patch values reuse it); inside
    ``penzai_lm.eager()`` it runs op by op, and inside ``jax.jit``,
    ``jax.grad`` and the like it is traced as part of the caller's
    program. See `penzai_lm.runtime.forward` (reached through
    `penzai_lm.model.dispatch`).

    Args:
      tokens: Integer named array with a ``seq`` axis and any batch axes.
      token_positions: Position of each token, same axes as ``tokens``; -1
        marks padding. Defaults to 0, 1, 2, ... along ``seq``. For left-padded
        batches use `positions_from_padding`.
      **side_inputs: Extra side inputs forwarded to the body (for patches).

    Returns:
      Logits with the axes of ``tokens`` plus ``vocabulary``.
    """
    check_tokens(tokens, self.config.vocab_size)
    seq_len = tokens.named_shape["seq"]
    limit = self.config.max_cache_len
    if limit is not None and seq_len > limit:
      raise ValueError(
          f"The sequence has {seq_len} tokens but this model has only"
          f" {limit} learned positions (config.max_cache_len)."
      )
    if compiles(tokens, token_positions, side_inputs):
      logits = dispatch.compiled_forward(
          self, tokens, token_positions=token_positions, **side_inputs)
      if logits is not NotImplemented:
        return logits
    if token_positions is None:
      token_positions = pz.nx.arange("seq", seq_len)
    with jax.default_matmul_precision(self.config.matmul_precision):
      return self.body(tokens, token_positions=token_positions,
                       **side_inputs)


_EAGER = contextvars.ContextVar("penzai_lm_eager", default=False)

@contextlib.contextmanager
def eager(enabled: bool = True):
  """Runs `TransformerLM` calls op by op (no compiled program) inside.

  Top-level calls of a model (and `penzai_lm.interp.run_with_cache`) are
  compiled by default (`penzai_lm.runtime.forward`); use this to debug a
  layer (breakpoints, prints on every call) or to compare::

      with penzai_lm.eager():
        logits = model(tokens)

  Also a decorator (``@penzai_lm.eager()``). Per thread (a context
  variable); ``eager(False)`` turns compilation back on inside.
  """
  token = _EAGER.set(bool(enabled))
  try:
    yield
  finally:
    _EAGER.reset(token)


def compiles(tokens, token_positions, side_inputs) -> bool:
  """Whether a model call with these inputs runs as a compiled program: at
  the top level (no JAX trace is active, jit is enabled, no input is a
  tracer) and outside `eager`."""
  if _EAGER.get() or jax.config.jax_disable_jit or not top_level():
    return False
  return not any(isinstance(x, jax.core.Tracer) for x in
                 jax.tree_util.tree_leaves((tokens, token_positions,
                                            side_inputs)))


def leading_padding(tokens: pz.nx.NamedArray, pad_id: int) -> pz.nx.NamedArray:
  """Marks the left padding of each row: the run of ``pad_id`` at its start.

  A ``pad_id`` token after the first real token is a real token.
  """
  is_pad = (tokens == pad_id).untag("seq")
  return pz.nx.nmap(jnp.cumprod)(is_pad.astype(jnp.int32)).tag("seq") == 1


def positions_from_padding(is_padding: pz.nx.NamedArray) -> pz.nx.NamedArray:
  """Token positions for a padded batch.

  Args:
    is_padding: Boolean array with a ``seq`` axis; True for padding.

  Returns:
    Positions counting real tokens from 0, and -1 at padding.
  """
  real = ~is_padding
  count = pz.nx.nmap(jnp.cumsum)(real.untag("seq"), dtype=jnp.int32).tag("seq")
  return pz.nx.nmap(jnp.where)(real, count - 1, -1)
