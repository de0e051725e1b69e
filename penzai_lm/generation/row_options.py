"""Per-row request options: one value, one per prompt or one per row.

Conventions (see `request`): rows are prompt-major, row ``r`` is sample
``r % num_samples`` of prompt ``r // num_samples``.

* A per-row option is either one value (used for every row), a list with
  one value per prompt (each value is used for all samples of its prompt),
  or a list with one value per row. Lists, tuples, numpy arrays and
  concrete ``jax.Array`` values are all accepted (a 0-d array is one
  value): JAX arrays are read onto the host first
  (`penzai_lm.sampling.row_values.host_value`; a traced value is refused).
* Seeds: ``seed=None`` draws a fresh random seed per prompt (reported in the
  result). Sample 0 of a prompt uses the prompt's seed as is; sample ``j >
  0`` uses ``derive_seed(seed, j)``, so every sample is drawn independently
  from its first token on and ``num_samples=1`` reproduces sample 0.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from penzai_lm.generation.prompts import is_int
from penzai_lm.generation.prompts import is_sequence
from penzai_lm.generation.prompts import token_list
from penzai_lm.sampling.row_values import host_value


def derive_seed(seed: int, sample: int) -> int:
  """Seed of sample ``sample`` (> 0) of a prompt whose seed is ``seed``."""
  return int(np.random.SeedSequence([int(seed), int(sample)]).generate_state(
      1, np.uint32)[0])


def expand_rows(name: str, value: Any, num_prompts: int, num_samples: int,
                is_row_value=lambda v: not is_sequence(v)) -> list[Any]:
  """Expands a per-row option to one value per row (see module docstring)."""
  value = host_value(name, value)
  rows = num_prompts * num_samples
  if is_row_value(value):
    return [value] * rows
  values = list(value)
  if len(values) == rows:
    return values
  if len(values) == num_prompts:
    return [v for v in values for _ in range(num_samples)]
  expected = f"{num_prompts}" if num_samples == 1 else (
      f"{num_prompts} (one per prompt) or {rows} (one per row)")
  raise ValueError(
      f"{name} has {len(values)} values but the request has {num_prompts}"
      f" prompt(s) x {num_samples} sample(s); pass one value for every row or"
      f" a list of length {expected}.")


def _is_flat_ids(value: Any) -> bool:
  """One row's list of ids (None or a flat list)."""
  return value is None or (is_sequence(value) and not any(
      is_sequence(i) for i in value))


def token_lists(name: str, value: Any, num_prompts: int, num_samples: int,
                vocab_size: int, default: Sequence[int] = ()
                ) -> tuple[tuple[int, ...], ...]:
  """A per-row list of token ids: one flat list for all rows, or a list of
  lists (per prompt or per row); None gives ``default``."""
  value = host_value(name, value)
  if value is None:
    value = list(default)
  if not is_sequence(value):
    raise ValueError(
        f"{name} must be a list of token ids (for every row) or a list of"
        f" such lists (per prompt or per row), got {value!r}.")
  items = list(value)
  if items and any(is_sequence(i) for i in items) and not all(
      is_sequence(i) for i in items):
    raise ValueError(
        f"{name} mixes token ids and lists; pass one list of ids for every"
        " row or one list per prompt/row.")
  rows = expand_rows(name, items, num_prompts, num_samples, _is_flat_ids)
  return tuple(token_list(f"{name}[{r}]", ids, vocab_size)
               for r, ids in enumerate(rows))


def _check_seed(value: Any, index: int) -> int:
  if value is None:
    return secrets.randbits(32)
  if not is_int(value) or not 0 <= int(value) < 2**32:
    raise ValueError(
        f"seed[{index}] = {value!r} is invalid: seeds must be integers in"
        " [0, 2**32) or None (random).")
  return int(value)


def row_seeds(seed: Any, num_prompts: int, num_samples: int
              ) -> tuple[int, ...]:
  """Per-row u32 seeds (see module docstring)."""
  seed = host_value("seed", seed)
  if seed is None or is_int(seed):
    per_prompt = [seed] * num_prompts
  elif is_sequence(seed):
    values = list(seed)
    if len(values) == num_prompts * num_samples and num_samples > 1:
      return tuple(_check_seed(v, r) for r, v in enumerate(values))
    if len(values) != num_prompts:
      raise ValueError(
          f"seed has {len(values)} values but the request has {num_prompts}"
          " prompt(s); pass one int (or None), or one per prompt.")
    per_prompt = values
  else:
    raise ValueError(f"seed must be an int, None or a list, got {seed!r}.")
  seeds = []
  for p, value in enumerate(per_prompt):
    base = _check_seed(value, p)
    seeds.extend(base if j == 0 else derive_seed(base, j)
                 for j in range(num_samples))
  return tuple(seeds)


def max_new_rows(value: Any, n: int, num_samples: int) -> tuple[int, ...]:
  """``max_new_tokens`` per row (positive)."""
  rows = expand_rows("max_new_tokens", value, n, num_samples)
  for r, v in enumerate(rows):
    if not is_int(v) or int(v) < 1:
      where = f" for row {r}" if len(set(map(repr, rows))) > 1 else ""
      raise ValueError(
          "max_new_tokens must be a positive integer (at least one new"
          f" token), got {v!r}{where}.")
  return tuple(int(v) for v in rows)


def min_new_rows(value: Any, n: int, num_samples: int,
                 max_new: tuple[int, ...]) -> tuple[int, ...]:
  """``min_new_tokens`` per row, in ``[0, max_new_tokens]``."""
  rows = expand_rows("min_new_tokens", value, n, num_samples)
  for r, (v, most) in enumerate(zip(rows, max_new)):
    if not is_int(v) or not 0 <= int(v) <= most:
      raise ValueError(
          f"min_new_tokens must be an integer in [0, max_new_tokens={most}]"
          f" (stop tokens are not sampled before it), got {v!r} for row"
          f" {r}.")
  return tuple(int(v) for v in rows)


def check_min_new_reachable(settings, stops, min_new) -> None:
  """A row that bans every token but its stop ids cannot wait for
  min_new_tokens."""
  if not any(min_new) or settings.banned_tokens is None:
    return
  banned = np.asarray(settings.banned_tokens)
  for r, (ids, least) in enumerate(zip(stops, min_new)):
    if least and ids:
      allowed = ~banned[r]
      allowed[list(ids)] = False
      if not allowed.any():
        raise ValueError(
            f"row {r} bans every token but its stop tokens, so it cannot"
            f" generate min_new_tokens={least} tokens; ban fewer tokens.")


def ban_padding_ids(settings, tokenizer_vocab_size: Any, vocab_size: int):
  """``settings`` with ids ``>= tokenizer_vocab_size`` banned in every row.

  Models ship padded vocabularies (Qwen2.5: 151936 rows for 151665 tokens,
  Phi-3: 32064 for 32011): the padding ids have logits but no text, so a
  sampled one could not be decoded. The ban is data in the settings' dense
  mask, so it compiles nothing new.
  """
  if tokenizer_vocab_size is None:
    return settings
  if not is_int(tokenizer_vocab_size) or not (
      0 < tokenizer_vocab_size <= vocab_size):
    raise ValueError(
        f"tokenizer_vocab_size must be an integer in [1, {vocab_size}] (the"
        f" model's vocabulary), got {tokenizer_vocab_size!r}.")
  if tokenizer_vocab_size == vocab_size:
    return settings
  banned = np.array(settings.banned_tokens)  # A copy: the ban is added.
  banned[:, int(tokenizer_vocab_size):] = True
  for r in range(banned.shape[0]):
    if banned[r].all():
      raise ValueError(
          f"banned_tokens[{r}] bans every token of the tokenizer (ids"
          f" >= {tokenizer_vocab_size} are the model's vocabulary padding and"
          " are never sampled); at least one token must stay allowed.")
  return dataclasses.replace(settings, banned_tokens=jnp.asarray(banned))
