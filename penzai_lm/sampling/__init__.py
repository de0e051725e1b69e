"""Batched, per-row next-token sampling for compiled generation loops.

Array conventions: logits are float32 ``(batch, vocab)``; every per-row
setting, seed, step, token and log-probability is a ``(batch,)`` array; the
penalty state holds ``(batch, vocab)`` arrays. All sampling code is pure
``jnp``, takes every setting as a traced value (changing values never
recompiles) and is meant to run once per token inside ``jax.lax.while_loop``.

Filter order (HF ``generate()``): penalties (repetition, presence,
frequency) -> logit bias -> banned tokens -> temperature -> top-k -> top-p ->
min-p -> typical -> epsilon -> eta -> XTC (llama.cpp's, last) -> sample.
Temperature 0 is greedy.

Typical use::

  settings = SamplingSettings.make(batch, vocab, temperature=0.7, top_p=0.9,
                                   seed=[1, 2, 3, 4])
  state = init_sampler_state(prompt_tokens, prompt_mask, vocab_size=vocab)
  # inside the decode loop:
  token, logprob = sample_next(logits, settings, state, step)
  state = update_sampler_state(state, token, active=~done)
"""

from penzai_lm.sampling.filters import MIN_TEMPERATURE
from penzai_lm.sampling.penalties import apply_penalties
from penzai_lm.sampling.penalties import init_sampler_state
from penzai_lm.sampling.penalties import penalize
from penzai_lm.sampling.penalties import SamplerState
from penzai_lm.sampling.penalties import update_sampler_state
from penzai_lm.sampling.row_values import host_value
from penzai_lm.sampling.sample import row_keys
from penzai_lm.sampling.sample import sample_next
from penzai_lm.sampling.sample import top_logprobs
from penzai_lm.sampling.settings import DEFAULT_TOP_K_CAP
from penzai_lm.sampling.settings import FIELD_NAMES
from penzai_lm.sampling.settings import FIELDS
from penzai_lm.sampling.settings import kernel_implements_all
from penzai_lm.sampling.settings import SamplingField
from penzai_lm.sampling.settings import SamplingSettings
from penzai_lm.sampling.settings import top_k_cap_for

__all__ = [
    "DEFAULT_TOP_K_CAP",
    "FIELDS",
    "FIELD_NAMES",
    "MIN_TEMPERATURE",
    "SamplerState",
    "SamplingField",
    "SamplingSettings",
    "apply_penalties",
    "host_value",
    "init_sampler_state",
    "kernel_implements_all",
    "penalize",
    "row_keys",
    "sample_next",
    "top_k_cap_for",
    "top_logprobs",
    "update_sampler_state",
]
