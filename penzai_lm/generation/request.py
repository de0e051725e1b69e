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
* Per-row options (one value, one per prompt or one per row) and seeds
  are expanded to rows by `row_options`.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Sequence
from typing import Any

import numpy as np
from penzai import pz

from penzai_lm import sampling
from penzai_lm.generation import shapes as shapes_lib
from penzai_lm.generation.prompts import is_int
from penzai_lm.generation.prompts import is_sequence
from penzai_lm.generation.prompts import normalize_prompts
from penzai_lm.generation.row_options import ban_padding_ids
from penzai_lm.generation.row_options import check_min_new_reachable
from penzai_lm.generation.row_options import expand_rows
from penzai_lm.generation.row_options import max_new_rows
from penzai_lm.generation.row_options import min_new_rows
from penzai_lm.generation.row_options import row_seeds
from penzai_lm.generation.row_options import token_lists
from penzai_lm.generation.state import Continuation
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model import memory
from penzai_lm.model import TransformerLM
from penzai_lm.model.points import parse_point
from penzai_lm.model.points import Point

DEFAULT_MAX_NEW_TOKENS = 128
# Rows (prompts x samples) of one request at most. The memory check
# (`_check_batch_early`) refuses batches whose caches cannot fit, but a small
# model fits a huge batch: this bound keeps an absurd num_samples (2**20 and
# up) from spending minutes and gigabytes on per-row seeds and settings.
MAX_ROWS = 1 << 16


@dataclasses.dataclass(frozen=True)
class Request:
  """A validated request, expanded to one entry per row.

  Attributes:
    prompts: One int32 array per prompt.
    num_samples: Samples per prompt.
    max_new_tokens: Tokens each row generates at most (forced ones
      included).
    min_new_tokens: Tokens each row generates before its stop tokens may be
      sampled (forced ones included).
    seeds: The u32 seed of each row.
    stop_tokens: Stop ids per row.
    forced_tokens: Tokens forced at the start of each row's output.
    logprobs_top_n: Top alternatives recorded per token (0: none).
    sampling: The sampling settings, one row per request row.
    prefill: The compile-time shapes (``prefill.decode`` for the loop).
    capture: The points whose values are recorded for every token, parsed
      (`penzai_lm.model.points.Point`).
  """

  prompts: tuple[np.ndarray, ...]
  num_samples: int
  max_new_tokens: tuple[int, ...]
  min_new_tokens: tuple[int, ...]
  seeds: tuple[int, ...]
  stop_tokens: tuple[tuple[int, ...], ...]
  forced_tokens: tuple[tuple[int, ...], ...]
  logprobs_top_n: int
  sampling: sampling.SamplingSettings
  prefill: shapes_lib.PrefillShape
  capture: tuple[Point, ...] = ()

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


def _check_option_names(values: dict[str, Any]) -> None:
  """Refuses a keyword that is neither `build_request`'s nor a sampling
  field's, naming the closest one."""
  for name in values:
    if name not in sampling.FIELD_NAMES:
      options = [p.name for p in inspect.signature(
          build_request).parameters.values() if p.kind == p.KEYWORD_ONLY
                 and p.name not in ("default_stop_tokens", "continuation")]
      known = (*options, *sampling.FIELD_NAMES)
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
    min_new_tokens: Any = 0,
    num_samples: Any = 1,
    seed: Any = None,
    stop_tokens: Any = None,
    forced_tokens: Any = None,
    logprobs_top_n: Any = 0,
    use_cache: Any = True,
    default_stop_tokens: Sequence[int] | None = None,
    tokenizer_vocab_size: int | None = None,
    continuation: Continuation | None = None,
    capture: Any = None,
    **sampling_values: Any,
) -> Request:
  """Validates a request for ``model`` (see `penzai_lm.generation.generate`).

  ``default_stop_tokens`` (default: ``model.config.eos_token_ids``) apply
  when ``stop_tokens`` is None; ``tokenizer_vocab_size`` (set by the text
  functions, from the tokenizer) bans the ids at and above it from sampling:
  a padded vocabulary's ids that have no text. Token-id generation leaves it
  None, so every id of the model may be sampled. ``continuation`` appends
  to a session's state.
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
  max_new = max_new_rows(max_new_tokens, n, num_samples)
  min_new = min_new_rows(min_new_tokens, n, num_samples, max_new)
  seeds = row_seeds(seed, n, num_samples)
  stops = token_lists("stop_tokens", stop_tokens, n, num_samples, vocab,
                      default_stop_tokens)
  forced = token_lists("forced_tokens", forced_tokens, n, num_samples, vocab)
  settings = ban_padding_ids(
      _sampling(sampling_values, seeds, n, num_samples, vocab),
      tokenizer_vocab_size, vocab)
  check_min_new_reachable(settings, stops, min_new)
  capture = _capture_points(model, capture)
  info = shapes_lib.RowsInfo(
      num_prompts=n, num_samples=num_samples,
      prompt_lengths=tuple(len(p) for p in rows), max_new_tokens=max_new,
      queue=max(len(f) for f in forced), stops=max(len(s) for s in stops),
      top_n=int(logprobs_top_n), capture=bool(capture))
  prefill = shapes_lib.plan(model, info, cached_model=cached,
                            use_cache=use_cache, continuation=continuation)
  return Request(
      prompts=tuple(rows), num_samples=num_samples, max_new_tokens=max_new,
      min_new_tokens=min_new, seeds=seeds, stop_tokens=stops,
      forced_tokens=forced,
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


def _capture_points(model, capture: Any) -> tuple[Point, ...]:
  """The parsed, de-duplicated points (`penzai_lm.model.hooks`)."""
  if capture is None:
    return ()
  names = [capture] if isinstance(capture, str) else capture
  if not isinstance(names, (list, tuple)) or not all(
      isinstance(n, str) for n in names):
    raise ValueError(
        "capture must be a point name or a list of them (e.g."
        f" ['blocks.3.resid_post']), got {capture!r}.")
  points = []
  for name in dict.fromkeys(names):
    try:
      points.append(parse_point(model, name))
    except ValueError as e:
      raise ValueError(f"capture: {e}") from None
  return tuple(points)
