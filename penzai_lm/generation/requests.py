"""Validation and normalisation of generation requests (token level).

Everything here runs on the host, before anything is compiled, and raises a
``ValueError`` (``TypeError`` for arguments of the wrong kind) that says what
is wrong and how to fix it. Nothing is mutated.

Conventions:

* A request has ``num_prompts`` prompts and ``num_samples`` samples per
  prompt, so ``num_rows = num_prompts * num_samples`` rows. Rows are
  prompt-major: row ``r`` is sample ``r % num_samples`` of prompt
  ``r // num_samples``.
* A per-row setting is either one value (used for every row), a list with one
  value per prompt (each value is used for all samples of its prompt), or a
  list with one value per row.
* Seeds: ``seed=None`` draws a fresh random seed per prompt (reported in the
  result). Sample 0 of a prompt uses the prompt's seed as is; sample ``j > 0``
  uses ``derive_seed(seed, j)``, so every sample is drawn independently from
  its first token on and ``num_samples=1`` reproduces sample 0.
"""

from __future__ import annotations

import dataclasses
import numbers
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from penzai import pz

from penzai_lm.sampling import DEFAULT_TOP_K_CAP

# Sampling settings forwarded to `SamplingSettings.make`, with neutral values.
SAMPLING_DEFAULTS = dict(
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    repetition_penalty=1.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
)


def _is_int(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_sequence(value: Any) -> bool:
  if isinstance(value, (np.ndarray, jax.Array)):
    return value.ndim > 0
  return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def next_power_of_two(n: int) -> int:
  """Smallest power of two >= n (n >= 1)."""
  return 1 << max(0, int(n) - 1).bit_length()


def derive_seed(seed: int, sample: int) -> int:
  """Seed of sample ``sample`` (> 0) of a prompt whose seed is ``seed``."""
  return int(np.random.SeedSequence([int(seed), int(sample)]).generate_state(
      1, np.uint32)[0])


# Prompts.


def normalize_prompts(
    prompts: Any, vocab_size: int, batch_axis: str | None = None
) -> list[np.ndarray]:
  """Turns the accepted prompt forms into a list of int32 id arrays.

  Accepted forms: one prompt as a list of ints (or a 1-D array); a list of
  such lists (ragged is fine); a 2-D array (rows); a ``pz.nx.NamedArray``
  with a ``seq`` axis and at most one batch axis.

  Args:
    prompts: The prompts.
    vocab_size: Ids must lie in ``[0, vocab_size)``.
    batch_axis: If given, the only batch axis name a NamedArray may use.

  Returns:
    One int32 array per prompt.

  Raises:
    ValueError / TypeError: with a description of the problem.
  """
  if isinstance(prompts, pz.nx.NamedArrayBase):
    rows = _named_prompts(prompts, batch_axis)
  elif isinstance(prompts, (np.ndarray, jax.Array)):
    array = np.asarray(prompts)
    if array.ndim == 1:
      rows = [array]
    elif array.ndim == 2:
      rows = list(array)
    else:
      raise ValueError(
          f"prompts as an array must be 1-D (one prompt) or 2-D (one row per"
          f" prompt); got shape {array.shape}.")
  elif isinstance(prompts, str):
    raise TypeError(
        "generate() takes token ids, not text; encode the prompt with a"
        " tokenizer or use penzai_lm.generation.generate_text(model,"
        " tokenizer, text).")
  elif _is_sequence(prompts):
    items = list(prompts)
    if not items:
      raise ValueError("prompts is empty: pass at least one prompt.")
    if all(_is_int(i) or (isinstance(i, np.generic) and _is_int(i.item()))
           for i in items):
      rows = [np.asarray([int(i) for i in items])]
    elif all(_is_sequence(i) for i in items):
      rows = [np.asarray(i) for i in items]
    elif any(isinstance(i, str) for i in items):
      raise TypeError(
          "generate() takes token ids, not text; use generate_text(model,"
          " tokenizer, prompts) for strings.")
    else:
      raise ValueError(
          "prompts must be a list of token ids (one prompt) or a list of"
          " lists of token ids (a batch); got a list that mixes ids and"
          " other values.")
  else:
    raise TypeError(
        "prompts must be a list of token ids, a list of such lists, a numpy"
        " array or a pz.nx.NamedArray with a 'seq' axis; got"
        f" {type(prompts).__name__}.")

  out = []
  for i, row in enumerate(rows):
    row = np.asarray(row)
    if row.ndim != 1:
      raise ValueError(
          f"prompt {i} must be a flat list of token ids, got shape"
          f" {row.shape}.")
    if row.size == 0:
      raise ValueError(
          f"prompt {i} is empty; every prompt needs at least one token (e.g."
          " the BOS token).")
    if row.dtype == object or not (np.issubdtype(row.dtype, np.integer)):
      raise ValueError(
          f"prompt {i} must contain integer token ids, got dtype"
          f" {row.dtype}.")
    low, high = int(row.min()), int(row.max())
    if low < 0 or high >= vocab_size:
      bad = low if low < 0 else high
      raise ValueError(
          f"prompt {i} contains token id {bad}, outside the model's"
          f" vocabulary [0, {vocab_size}).")
    out.append(row.astype(np.int32))
  return out


def _named_prompts(prompts, batch_axis):
  if prompts.positional_shape:
    raise ValueError(
        f"the prompt NamedArray has positional axes {prompts.positional_shape};"
        " tag every axis, e.g. pz.nx.wrap(ids).tag('batch', 'seq').")
  names = list(prompts.named_shape)
  if "seq" not in names:
    raise ValueError(
        f"the prompt NamedArray has axes {dict(prompts.named_shape)} but needs"
        " a 'seq' axis (and at most one batch axis).")
  others = [n for n in names if n != "seq"]
  if len(others) > 1:
    raise ValueError(
        f"the prompt NamedArray has axes {dict(prompts.named_shape)}: only"
        " 'seq' and one batch axis are allowed.")
  if others and batch_axis is not None and others[0] != batch_axis:
    raise ValueError(
        f"the prompt NamedArray's batch axis is {others[0]!r}, but the cached"
        f" model's batch axis is {batch_axis!r}; rename it with"
        f" .untag({others[0]!r}).tag({batch_axis!r}).")
  if not np.issubdtype(prompts.dtype, np.integer):
    raise ValueError(
        f"the prompt NamedArray must hold integer ids, got {prompts.dtype}.")
  if others:
    return list(np.asarray(prompts.unwrap(others[0], "seq")))
  return [np.asarray(prompts.unwrap("seq"))]


# Per-row values.


def expand_rows(
    name: str, value: Any, num_prompts: int, num_samples: int,
    is_scalar=lambda v: not _is_sequence(v),
) -> list[Any]:
  """Expands a per-row setting to one value per row (see module docstring)."""
  rows = num_prompts * num_samples
  if is_scalar(value):
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


def token_list(name: str, ids: Any, vocab_size: int) -> tuple[int, ...]:
  out = []
  for token in ids:
    if isinstance(token, np.generic):
      token = token.item()
    if not _is_int(token):
      raise ValueError(f"{name}: token ids must be integers, got {token!r}.")
    if not 0 <= token < vocab_size:
      raise ValueError(
          f"{name}: token id {token} is outside the vocabulary"
          f" [0, {vocab_size}).")
    out.append(int(token))
  return tuple(out)


def _is_flat_ids(value: Any) -> bool:
  """A flat list of ids (a 'scalar' for per-row id-list settings)."""
  if value is None:
    return True
  if not _is_sequence(value):
    return False
  items = list(value)
  return not items or not any(_is_sequence(i) for i in items)


def token_lists(
    name: str, value: Any, num_prompts: int, num_samples: int,
    vocab_size: int, default: Sequence[int] = (),
) -> list[tuple[int, ...]]:
  """A per-row list of token ids: one flat list for all rows, or a list of
  lists (per prompt or per row); None gives ``default``."""
  if value is None:
    value = list(default)
  if not _is_sequence(value):
    raise ValueError(
        f"{name} must be a list of token ids (for every row) or a list of"
        f" such lists (per prompt or per row), got {value!r}.")
  items = list(value)
  if items and any(_is_sequence(i) for i in items) and not all(
      _is_sequence(i) for i in items):
    raise ValueError(
        f"{name} mixes token ids and lists; pass one list of ids for every"
        " row or one list per prompt/row.")
  rows = expand_rows(name, items, num_prompts, num_samples, _is_flat_ids)
  return [token_list(f"{name}[{r}]", ids, vocab_size)
          for r, ids in enumerate(rows)]


def _seeds(seed: Any, num_prompts: int, num_samples: int) -> list[int]:
  """Per-row u32 seeds (see module docstring)."""
  if seed is None or _is_int(seed):
    per_prompt = [seed] * num_prompts
  elif _is_sequence(seed):
    values = list(seed)
    if len(values) == num_prompts * num_samples and num_samples > 1:
      return [_check_seed(v, r, draw=True) for r, v in enumerate(values)]
    if len(values) != num_prompts:
      raise ValueError(
          f"seed has {len(values)} values but the request has {num_prompts}"
          " prompt(s); pass one int (or None), or one per prompt.")
    per_prompt = values
  else:
    raise ValueError(f"seed must be an int, None or a list, got {seed!r}.")
  seeds = []
  for p, value in enumerate(per_prompt):
    base = _check_seed(value, p, draw=True)
    seeds.extend(base if j == 0 else derive_seed(base, j)
                 for j in range(num_samples))
  return seeds


def _check_seed(value, index, draw):
  if value is None and draw:
    return secrets.randbits(32)
  if isinstance(value, np.generic):
    value = value.item()
  if not _is_int(value) or not 0 <= value < 2**32:
    raise ValueError(
        f"seed[{index}] = {value!r} is invalid: seeds must be integers in"
        " [0, 2**32) or None (random).")
  return int(value)


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
  """A validated request, expanded to one entry per row.

  Attributes:
    prompts: One int32 array per prompt.
    num_samples: Samples per prompt.
    max_new_tokens: int (rows,), tokens to generate at most per row (forced
      tokens included).
    sampling: Sampling values (`SAMPLING_DEFAULTS` names), one list entry per
      row; plus ``logit_bias`` and ``banned_tokens`` per row.
    seeds: u32 seed per row.
    stop_tokens: Stop ids per row.
    forced_tokens: Tokens forced at the start of each row's output.
    logprobs_top_n: Number of top alternatives recorded per token (0: none).
    top_k_cap: Static number of top-k candidates of the sampler.
  """

  prompts: list[np.ndarray]
  num_samples: int
  max_new_tokens: np.ndarray
  sampling: dict[str, list[Any]]
  seeds: list[int]
  stop_tokens: list[tuple[int, ...]]
  forced_tokens: list[tuple[int, ...]]
  logprobs_top_n: int
  top_k_cap: int

  @property
  def num_prompts(self) -> int:
    return len(self.prompts)

  @property
  def num_rows(self) -> int:
    return len(self.prompts) * self.num_samples

  def prompt_of_row(self, row: int) -> int:
    return row // self.num_samples

  @property
  def row_prompt_lengths(self) -> list[int]:
    return [len(self.prompts[self.prompt_of_row(r)])
            for r in range(self.num_rows)]


def build_request(
    prompts: Any,
    *,
    vocab_size: int,
    default_stop_tokens: Sequence[int],
    max_new_tokens: Any,
    num_samples: Any,
    seed: Any,
    stop_tokens: Any,
    forced_tokens: Any,
    logprobs_top_n: Any,
    logit_bias: Any,
    banned_tokens: Any,
    batch_axis: str | None = None,
    **sampling: Any,
) -> GenerationRequest:
  """Validates and expands a request (see `penzai_lm.generation.generate`)."""
  unknown = set(sampling) - set(SAMPLING_DEFAULTS)
  if unknown:
    raise TypeError(f"unknown generation settings: {sorted(unknown)}.")
  rows = normalize_prompts(prompts, vocab_size, batch_axis)
  if not _is_int(num_samples) or num_samples < 1:
    raise ValueError(
        f"num_samples must be a positive integer, got {num_samples!r}.")
  n = len(rows)

  max_new = expand_rows("max_new_tokens", max_new_tokens, n, num_samples)
  for r, value in enumerate(max_new):
    if isinstance(value, np.generic):
      value = value.item()
    if not _is_int(value) or value < 1:
      raise ValueError(
          f"max_new_tokens must be a positive integer (at least one new"
          f" token), got {value!r}" + (f" for row {r}." if len(set(
              map(repr, max_new))) > 1 else "."))
  max_new = np.asarray([int(v) for v in max_new], np.int32)

  if not _is_int(logprobs_top_n) or not 0 <= logprobs_top_n <= vocab_size:
    raise ValueError(
        f"logprobs_top_n must be an integer in [0, {vocab_size}], got"
        f" {logprobs_top_n!r}.")

  values = {}
  for name, default in SAMPLING_DEFAULTS.items():
    value = sampling.get(name, default)
    if value is None:
      value = default
    values[name] = expand_rows(name, value, n, num_samples)
  for name, value in (("logit_bias", logit_bias),
                      ("banned_tokens", banned_tokens)):
    is_scalar = ((lambda v: v is None or isinstance(v, Mapping))
                 if name == "logit_bias" else _is_flat_ids)
    if name == "logit_bias" and not (value is None or isinstance(
        value, Mapping) or (_is_sequence(value) and all(
            isinstance(v, Mapping) or v is None for v in value))):
      raise ValueError(
          "logit_bias must be a dict {token_id: bias} for every row or a list"
          f" of such dicts (per prompt or per row), got {value!r}.")
    if name == "banned_tokens" and value is not None and not _is_sequence(
        value):
      raise ValueError(
          "banned_tokens must be a list of token ids (for every row) or a"
          f" list of such lists, got {value!r}.")
    values[name] = expand_rows(name, value, n, num_samples, is_scalar)

  top_ks = [v for v in values["top_k"] if _is_int(v)]
  top_k_cap = DEFAULT_TOP_K_CAP
  if top_ks and max(top_ks) > top_k_cap:
    top_k_cap = next_power_of_two(min(max(top_ks), vocab_size))

  return GenerationRequest(
      prompts=rows,
      num_samples=int(num_samples),
      max_new_tokens=max_new,
      sampling=values,
      seeds=_seeds(seed, n, num_samples),
      stop_tokens=token_lists("stop_tokens", stop_tokens, n, num_samples,
                              vocab_size, default_stop_tokens),
      forced_tokens=token_lists("forced_tokens", forced_tokens, n,
                                num_samples, vocab_size),
      logprobs_top_n=int(logprobs_top_n),
      top_k_cap=top_k_cap,
  )
