"""A generation request, validated once at the boundary.

`build_request(model, prompts, **options)` checks every argument a user can
get wrong, expands per-prompt values to rows, draws seeds, builds the
`SamplingSettings` and plans the bucketed shapes; the frozen `Request` it
returns is all the engine reads. Errors are ``ValueError`` (``TypeError`` for
an argument of the wrong kind) and say what is wrong and how to fix it;
nothing runs or compiles before they are raised.

Conventions:

* A request has ``num_prompts`` prompts and ``num_samples`` samples per
  prompt, so ``num_rows = num_prompts * num_samples`` rows. Rows are
  prompt-major: row ``r`` is sample ``r % num_samples`` of prompt
  ``r // num_samples``.
* A per-row option is either one value (used for every row), a list with
  one value per prompt (each value is used for all samples of its prompt),
  or a list with one value per row.
* Seeds: ``seed=None`` draws a fresh random seed per prompt (reported in the
  result). Sample 0 of a prompt uses the prompt's seed as is; sample ``j >
  0`` uses ``derive_seed(seed, j)``, so every sample is drawn independently
  from its first token on and ``num_samples=1`` reproduces sample 0.
"""

from __future__ import annotations

import dataclasses
import difflib
import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np
from penzai import pz

from penzai_lm import sampling
from penzai_lm.generation import shapes as shapes_lib
from penzai_lm.generation.prompts import is_int
from penzai_lm.generation.prompts import is_sequence
from penzai_lm.generation.prompts import normalize_prompts
from penzai_lm.generation.prompts import token_list
from penzai_lm.generation.state import Continuation
from penzai_lm.interp.points import parse_point
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model import TransformerLM
from penzai_lm.model import memory

DEFAULT_MAX_NEW_TOKENS = 128
# Rows (prompts x samples) of one request at most. The memory check
# (`_check_batch_early`) refuses batches whose caches cannot fit, but a small
# model fits a huge batch: this bound keeps an absurd num_samples (2**20 and
# up) from spending minutes and gigabytes on per-row seeds and settings.
MAX_ROWS = 1 << 16


def derive_seed(seed: int, sample: int) -> int:
  """Seed of sample ``sample`` (> 0) of a prompt whose seed is ``seed``."""
  return int(np.random.SeedSequence([int(seed), int(sample)]).generate_state(
      1, np.uint32)[0])


def expand_rows(name: str, value: Any, num_prompts: int, num_samples: int,
                is_row_value=lambda v: not is_sequence(v)) -> list[Any]:
  """Expands a per-row option to one value per row (see module docstring)."""
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


@dataclasses.dataclass(frozen=True)
class Request:
  """A validated request, expanded to one entry per row.

  Attributes:
    prompts: One int32 array per prompt.
    num_samples: Samples per prompt.
    max_new_tokens: Tokens each row generates at most (forced ones
      included).
    seeds: The u32 seed of each row.
    stop_tokens: Stop ids per row.
    forced_tokens: Tokens forced at the start of each row's output.
    logprobs_top_n: Top alternatives recorded per token (0: none).
    sampling: The sampling settings, one row per request row.
    prefill: The compile-time shapes (``prefill.decode`` for the loop).
    capture: Point names whose values are recorded for every token.
  """

  prompts: tuple[np.ndarray, ...]
  num_samples: int
  max_new_tokens: tuple[int, ...]
  seeds: tuple[int, ...]
  stop_tokens: tuple[tuple[int, ...], ...]
  forced_tokens: tuple[tuple[int, ...], ...]
  logprobs_top_n: int
  sampling: sampling.SamplingSettings
  prefill: shapes_lib.PrefillShape
  capture: tuple[str, ...] = ()

  @property
  def decode(self) -> shapes_lib.DecodeShape:
    return self.prefill.decode

  @property
  def num_prompts(self) -> int:
    return len(self.prompts)

  @property
  def num_rows(self) -> int:
    return len(self.prompts) * self.num_samples

  def prompt_of_row(self, row: int) -> np.ndarray:
    return self.prompts[row // self.num_samples]

  @property
  def row_prompt_lengths(self) -> list[int]:
    return [len(self.prompt_of_row(r)) for r in range(self.num_rows)]


def is_cached_model(model) -> bool:
  """True for a `KVCachingTransformerLM`, False for a `TransformerLM`."""
  if isinstance(model, KVCachingTransformerLM):
    return True
  if isinstance(model, TransformerLM):
    return False
  raise TypeError(
      "model must be a penzai_lm TransformerLM (e.g. from build_transformer"
      " or a checkpoint loader) or a KVCachingTransformerLM, got"
      f" {type(model).__name__}.")


def _max_new(value: Any, n: int, num_samples: int) -> tuple[int, ...]:
  rows = expand_rows("max_new_tokens", value, n, num_samples)
  for r, v in enumerate(rows):
    if not is_int(v) or int(v) < 1:
      where = f" for row {r}" if len(set(map(repr, rows))) > 1 else ""
      raise ValueError(
          "max_new_tokens must be a positive integer (at least one new"
          f" token), got {v!r}{where}.")
  return tuple(int(v) for v in rows)


def _sampling(values: dict[str, Any], seeds, n: int, num_samples: int,
              vocab: int) -> sampling.SamplingSettings:
  """The request's `SamplingSettings` (one row per request row)."""
  rows = {}
  for field in sampling.FIELDS:
    value = values.get(field.name)
    if value is None:
      continue  # Off (the field's neutral value).
    if field.kind == "token_bias" and not (
        field.is_row_value(value) or (is_sequence(value) and all(
            field.is_row_value(v) for v in value))):
      raise ValueError(
          "logit_bias must be a dict {token_id: bias} for every row or a"
          f" list of such dicts (per prompt or per row), got {value!r}.")
    if field.kind == "token_set" and value is not None and not is_sequence(
        value):
      raise ValueError(
          f"{field.name} must be a list of token ids (for every row) or a"
          f" list of such lists, got {value!r}.")
    rows[field.name] = expand_rows(field.name, value, n, num_samples,
                                   field.is_row_value)
  try:
    return sampling.SamplingSettings.make(
        n * num_samples, vocab, seed=list(seeds), always_dense=True,
        top_k_cap=sampling.top_k_cap_for(rows.get("top_k", 0), vocab),
        **rows)
  except ValueError as e:
    hint = ""
    if num_samples > 1:
      hint = (f" (rows are prompt-major: row r is sample r % {num_samples}"
              f" of prompt r // {num_samples})")
    raise ValueError(f"{e}{hint}") from None


_OPTIONS = ("max_new_tokens", "num_samples", "seed", "stop_tokens",
            "forced_tokens", "logprobs_top_n", "use_cache", "capture")


def _check_option_names(values: dict[str, Any]) -> None:
  for name in values:
    if name not in sampling.FIELD_NAMES:
      known = (*_OPTIONS, *sampling.FIELD_NAMES)
      close = difflib.get_close_matches(name, known, n=1)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
      raise TypeError(
          f"unknown generation option {name!r}{hint}; the options are"
          f" {', '.join(known)}.")


def build_request(
    model,
    prompts: Any,
    *,
    max_new_tokens: Any = DEFAULT_MAX_NEW_TOKENS,
    num_samples: Any = 1,
    seed: Any = None,
    stop_tokens: Any = None,
    forced_tokens: Any = None,
    logprobs_top_n: Any = 0,
    use_cache: Any = True,
    default_stop_tokens: Sequence[int] | None = None,
    continuation: Continuation | None = None,
    capture: Any = None,
    **sampling_values: Any,
) -> Request:
  """Validates a request for ``model`` (see `penzai_lm.generation.generate`).

  ``default_stop_tokens`` (default: ``model.config.eos_token_ids``) apply
  when ``stop_tokens`` is None; ``continuation`` appends to a session's
  state.
  """
  cached = is_cached_model(model)
  _check_option_names(sampling_values)
  if not isinstance(use_cache, bool):
    raise ValueError(f"use_cache must be True or False, got {use_cache!r}.")
  config = model.config
  vocab = config.vocab_size
  batch_axis = None
  if cached and len(model.batch_axes) == 1:
    batch_axis = next(iter(model.batch_axes))
  if not is_int(num_samples) or num_samples < 1:
    raise ValueError(
        f"num_samples must be a positive integer, got {num_samples!r}.")
  _check_batch_early(model, cached, prompts, int(num_samples))
  rows = normalize_prompts(prompts, vocab, batch_axis)
  if len(rows) * int(num_samples) > MAX_ROWS:
    raise ValueError(
        f"num_samples={num_samples!r} with {len(rows)} prompt(s) asks for"
        f" {len(rows) * int(num_samples)} rows; a request has at most"
        f" {MAX_ROWS} rows. Lower num_samples or split the request.")
  if not is_int(logprobs_top_n) or not 0 <= logprobs_top_n <= vocab:
    raise ValueError(
        f"logprobs_top_n must be an integer in [0, {vocab}], got"
        f" {logprobs_top_n!r}.")
  n, num_samples = len(rows), int(num_samples)
  if default_stop_tokens is None:
    default_stop_tokens = config.eos_token_ids
  max_new = _max_new(max_new_tokens, n, num_samples)
  seeds = row_seeds(seed, n, num_samples)
  stops = token_lists("stop_tokens", stop_tokens, n, num_samples, vocab,
                      default_stop_tokens)
  forced = token_lists("forced_tokens", forced_tokens, n, num_samples, vocab)
  settings = _sampling(sampling_values, seeds, n, num_samples, vocab)
  capture = _capture_names(model, capture)
  info = shapes_lib.RowsInfo(
      num_prompts=n, num_samples=num_samples,
      prompt_lengths=tuple(len(p) for p in rows), max_new_tokens=max_new,
      queue=max(len(f) for f in forced), stops=max(len(s) for s in stops),
      top_n=int(logprobs_top_n), capture=bool(capture))
  prefill = shapes_lib.plan(model, info, cached_model=cached,
                            use_cache=use_cache, continuation=continuation)
  return Request(
      prompts=tuple(rows), num_samples=num_samples, max_new_tokens=max_new,
      seeds=seeds, stop_tokens=stops, forced_tokens=forced,
      logprobs_top_n=int(logprobs_top_n), sampling=settings, prefill=prefill,
      capture=capture)


def _batch_hint(prompts: Any) -> tuple[int, int]:
  """(prompts, tokens of a prompt at least), read off shapes only."""
  if isinstance(prompts, pz.nx.NamedArrayBase):
    sizes = dict(prompts.named_shape)
    length = sizes.pop("seq", 1)
    return (next(iter(sizes.values())) if len(sizes) == 1 else 1), length
  shape = getattr(prompts, "shape", None)
  if isinstance(shape, tuple) and len(shape) == 2:
    return shape
  if is_sequence(prompts) and len(prompts) and is_sequence(prompts[0]):
    return len(prompts), 1
  return 1, 1


def _check_batch_early(model, cached: bool, prompts: Any,
                       num_samples: int) -> None:
  """Refuses a batch that cannot fit before anything is built per row.

  Planning checks the exact shapes, but only after per-row lists are
  built: for 2**31 rows (a large ``num_samples``, or a broadcast array of
  prompts) that alone would take minutes and all memory.
  """
  n, length = (int(x) for x in _batch_hint(prompts))
  if cached:
    if len(model.batch_axes) == 1:
      shapes_lib.check_cached_batch(model, n, num_samples)
    return
  rows = n * num_samples
  slots = shapes_lib.bucket(length, shapes_lib.MIN_PROMPT_BUCKET)
  memory.check_fits(
      f"generate() with {memory.format_count(n)} prompt(s) x"
      f" {memory.format_count(num_samples)} sample(s): at least "
      + memory.describe_cache(model.config, rows, slots)
      + ", with its output and sampling buffers,",
      memory.request_bytes(model.config, rows, slots),
      "Lower the batch (prompts x num_samples).")


def _capture_names(model, capture: Any) -> tuple[str, ...]:
  """Validated, de-duplicated point names (`penzai_lm.model.hooks`)."""
  if capture is None:
    return ()
  names = [capture] if isinstance(capture, str) else capture
  if not isinstance(names, (list, tuple)) or not all(
      isinstance(n, str) for n in names):
    raise ValueError(
        "capture must be a point name or a list of them (e.g."
        f" ['blocks.3.resid_post']), got {capture!r}.")
  for name in names:
    try:
      parse_point(model, name)
    except ValueError as e:
      raise ValueError(f"capture: {e}") from None
  return tuple(dict.fromkeys(names))
