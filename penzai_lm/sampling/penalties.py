"""Repetition, presence and frequency penalties and the state they need.

Array conventions:
  * ``logits``: float32 ``(batch, vocab)``.
  * ``SamplerState.counts``: int32 ``(batch, vocab)``, how many times each
    token has been *generated* so far (prompt tokens are not counted).
  * ``SamplerState.seen``: bool ``(batch, vocab)``, True for tokens that occur
    in the prompt or in the generated output.
  * Per-row penalty values are float32 ``(batch,)`` (see ``SamplingSettings``).

Semantics:
  * repetition penalty (HF / CTRL): for every ``seen`` token, a logit ``l``
    becomes ``l / penalty`` if ``l > 0`` else ``l * penalty``.
  * presence / frequency penalties (OpenAI): over *generated* tokens only,
    ``l -= presence * (count > 0) + frequency * count``.
  The repetition penalty is applied first, then presence and frequency.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from penzai_lm.sampling.settings import SamplingSettings


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerState:
  """Per-row token statistics used by the penalties.

  Attributes:
    counts: int32 (batch, vocab); occurrences of each token in the generated
      output.
    seen: bool (batch, vocab); token occurs in the prompt or the output.
  """

  counts: jax.Array
  seen: jax.Array


def init_sampler_state(
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array | None = None,
    *,
    vocab_size: int,
) -> SamplerState:
  """Builds the state from (padded) prompts.

  Args:
    prompt_tokens: int (batch, prompt_len) token ids, padded arbitrarily.
    prompt_mask: bool (batch, prompt_len); True marks real prompt tokens.
      ``None`` means every position is real. Ids outside [0, vocab) are
      ignored.
    vocab_size: Static vocabulary size.

  Returns:
    A state with zero counts and ``seen`` set for the prompt tokens.
  """
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  if prompt_tokens.ndim != 2:
    raise ValueError("prompt_tokens must have shape (batch, prompt_len), got "
                     f"shape {prompt_tokens.shape}; add a batch axis with "
                     "tokens[None] for a single prompt.")
  batch = prompt_tokens.shape[0]
  if prompt_mask is None:
    prompt_mask = jnp.ones(prompt_tokens.shape, bool)
  elif jnp.shape(prompt_mask) != prompt_tokens.shape:
    raise ValueError(f"prompt_mask has shape {jnp.shape(prompt_mask)} but "
                     f"prompt_tokens has shape {prompt_tokens.shape}; they "
                     "must match.")
  # Padding and out-of-range ids are routed to index `vocab_size` and dropped.
  valid = (jnp.asarray(prompt_mask, bool) & (prompt_tokens >= 0)
           & (prompt_tokens < vocab_size))
  ids = jnp.where(valid, prompt_tokens, vocab_size)
  rows = jnp.arange(batch)[:, None]
  seen = jnp.zeros((batch, vocab_size), bool).at[rows, ids].set(
      True, mode="drop")
  return SamplerState(counts=jnp.zeros((batch, vocab_size), jnp.int32),
                      seen=seen)


def update_sampler_state(
    state: SamplerState,
    tokens: jax.Array,
    active: jax.Array | None = None,
) -> SamplerState:
  """Records one generated token per row.

  Args:
    state: The current state.
    tokens: int (batch,) tokens just generated.
    active: Optional bool (batch,); rows where it is False (e.g. finished
      sequences) are left unchanged.

  Returns:
    The updated state.
  """
  batch, vocab = state.counts.shape
  tokens = jnp.asarray(tokens, jnp.int32)
  if tokens.shape != (batch,):
    raise ValueError(f"tokens must have shape ({batch},), one per row, got "
                     f"{tokens.shape}.")
  if active is None:
    active = jnp.ones((batch,), bool)
  ids = jnp.where(active, tokens, vocab)  # Inactive rows: dropped update.
  rows = jnp.arange(batch)
  return SamplerState(
      counts=state.counts.at[rows, ids].add(1, mode="drop"),
      seen=state.seen.at[rows, ids].set(True, mode="drop"),
  )


def penalize(
    logits: jax.Array,
    counts: jax.Array,
    seen: jax.Array,
    repetition_penalty: jax.Array,
    presence_penalty: jax.Array,
    frequency_penalty: jax.Array,
) -> jax.Array:
  """Applies the three penalties unconditionally (see module docstring).

  Args:
    logits: f32 (batch, vocab).
    counts: int32 (batch, vocab) generated-token counts.
    seen: bool (batch, vocab) prompt-or-generated mask.
    repetition_penalty: f32 (batch,).
    presence_penalty: f32 (batch,).
    frequency_penalty: f32 (batch,).

  Returns:
    The penalised logits, f32 (batch, vocab).
  """
  rep = repetition_penalty[:, None]
  repeated = jnp.where(logits > 0, logits / rep, logits * rep)
  logits = jnp.where(seen, repeated, logits)
  return (logits
          - presence_penalty[:, None] * (counts > 0).astype(logits.dtype)
          - frequency_penalty[:, None] * counts.astype(logits.dtype))


def any_active(settings: SamplingSettings) -> jax.Array:
  """bool scalar: some row has a non-neutral penalty."""
  return jnp.any((settings.repetition_penalty != 1)
                 | (settings.presence_penalty != 0)
                 | (settings.frequency_penalty != 0))


def apply_penalties(
    logits: jax.Array,
    settings: SamplingSettings,
    state: SamplerState,
) -> jax.Array:
  """Applies the penalties, skipping all work if every row has them off.

  Args:
    logits: f32 (batch, vocab).
    settings: The sampling settings.
    state: Token statistics (see :func:`init_sampler_state`).

  Returns:
    The penalised logits, f32 (batch, vocab).
  """
  if state.counts.shape != logits.shape or state.seen.shape != logits.shape:
    raise ValueError(f"sampler state has shape {state.counts.shape} but the "
                     f"logits have shape {logits.shape}; build it with "
                     "init_sampler_state(..., vocab_size=logits.shape[-1]).")
  return jax.lax.cond(
      any_active(settings),
      lambda x: penalize(x, state.counts, state.seen,
                         settings.repetition_penalty,
                         settings.presence_penalty,
                         settings.frequency_penalty),
      lambda x: x,
      logits)
