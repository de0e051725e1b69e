"""The static plan of a request: the bucketed shapes its programs compile for.

A request becomes a fixed-shape batch: ``B`` decode rows (the request's rows
plus padding rows up to a power of two), prompts left-padded to a bucket of
``P`` tokens (a power of two, at least 8) and a KV cache of ``C`` slots (a
power of two holding ``P - 1 + max(max_new_tokens)`` tokens). Everything else
that varies between requests is a traced array, so a `Plan` (part of the
program cache key) is all that decides whether a request compiles.
"""

from __future__ import annotations

import dataclasses

import jax

from penzai_lm.generation import requests as requests_lib
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model import TransformerLM

MIN_PROMPT_BUCKET = 8
MIN_QUEUE = 16
MIN_STOP_WIDTH = 8


@dataclasses.dataclass(frozen=True)
class Plan:
  """Compile-time shapes of a request (part of the program cache key).

  Attributes:
    use_cache: Cached decoding (else full recomputation).
    batch_axis: Name of the batch axis.
    batch: Decode rows ``B``.
    prefill_batch: Prefill rows (``B`` unless rows are replicated).
    prompt_len: Prompt bucket ``P``.
    cache_len: Cache slots ``C`` (token buffer length without a cache).
    out_len: Length of the per-row output buffers (``C``).
    queue_len: Forced-token queue length per row and call.
    stop_width: Stop ids per row.
    top_n: Top alternatives recorded per token.
    vocab: Vocabulary size.
    gather: Whether decode rows are gathered from prefill rows.
    continued: Whether the prefill continues a previous run's state (see
      `Continuation`) instead of starting from empty caches.
  """

  use_cache: bool
  batch_axis: str
  batch: int
  prefill_batch: int
  prompt_len: int
  cache_len: int
  out_len: int
  queue_len: int
  stop_width: int
  top_n: int
  vocab: int
  gather: bool
  continued: bool = False


@dataclasses.dataclass(frozen=True)
class Continuation:
  """The device state a run continues from (a `Session`'s previous turn).

  Attributes:
    state: Leaves of the cached model's state after the previous run (the
      caches, positions and any patch state), on device; None for an empty
      cache of at least ``cache_len`` slots (a session's first call).
    start_slot: Cache slot where the new tokens go. Slots from here on are
      discarded (tokens the previous run generated past what it kept).
    positions: Real tokens already in the cache (the next token position).
    cache_len: Cache slots of ``state``; the new run may grow the cache.
  """

  state: list | None
  start_slot: int
  positions: int
  cache_len: int


def bucket(n: int, minimum: int = 1) -> int:
  return max(minimum, requests_lib.next_power_of_two(n))


def model_kind(model):
  if isinstance(model, KVCachingTransformerLM):
    return "cached"
  if isinstance(model, TransformerLM):
    return "uncached"
  raise TypeError(
      "model must be a penzai_lm TransformerLM (e.g. from build_transformer"
      " or a checkpoint loader) or a KVCachingTransformerLM, got"
      f" {type(model).__name__}.")


def _empty_cache_check(model: KVCachingTransformerLM) -> None:
  end = model.cache_end_index.value
  if isinstance(end, jax.core.Tracer):
    raise ValueError("generate() cannot be called inside jax.jit.")
  if int(end) != 0:
    raise ValueError(
        f"this KVCachingTransformerLM already holds {int(end)} tokens;"
        " generate() starts from an empty cache. Build a fresh one with"
        " KVCachingTransformerLM.from_uncached(model, cache_len, batch_axes).")


def _check_context(request, limit: int, history: int) -> None:
  for r, n_new in enumerate(request.max_new_tokens):
    length = len(request.prompts[request.prompt_of_row(r)])
    if history + length + int(n_new) <= limit:
      continue
    if history:
      raise ValueError(
          f"the session holds {history} cached tokens; {length} more and"
          f" max_new_tokens={int(n_new)} exceed the model's context of"
          f" {limit} tokens (config.max_position_embeddings). Start a new"
          " session (reset()) or lower max_new_tokens.")
    raise ValueError(
        f"prompt {request.prompt_of_row(r)} has {length} tokens and"
        f" max_new_tokens is {int(n_new)}: {length + int(n_new)} tokens"
        f" exceed the model's context of {limit} tokens"
        " (config.max_position_embeddings). Shorten the prompt or lower"
        " max_new_tokens.")


def _plan_continuation(model, request, use_cache: bool,
                       continuation: Continuation):
  """(prompt_len, cache_len) of a run that appends to a previous state."""
  if model_kind(model) != "uncached" or request.num_rows != 1 or not use_cache:
    raise ValueError(
        "a continuation needs the uncached TransformerLM, one row and"
        " use_cache=True.")
  prompt_len = bucket(len(request.prompts[0]), MIN_PROMPT_BUCKET)
  needed = continuation.start_slot + prompt_len - 1 + int(
      request.max_new_tokens.max())
  cache_len = max(continuation.cache_len, bucket(needed))
  limit = model.config.max_position_embeddings
  if model.config.family == "gpt2" and cache_len > limit:
    cache_len = limit  # A state never holds more (from_uncached refuses).
    if continuation.start_slot + prompt_len > cache_len:
      raise ValueError(
          f"the conversation fills this GPT-2 model's {limit} cache slots;"
          " start a new session (reset()).")
  return prompt_len, cache_len


def plan_request(model, request: requests_lib.GenerationRequest,
                 use_cache: bool,
                 continuation: Continuation | None = None) -> Plan:
  """Chooses the bucket shapes of a request.

  Raises:
    ValueError: if the request does not fit the model.
  """
  kind = model_kind(model)
  config = model.config
  rows = request.num_rows
  lengths = [len(p) for p in request.prompts]
  longest = max(lengths)
  max_new = int(request.max_new_tokens.max())
  limit = config.max_position_embeddings
  _check_context(request, limit,
                 continuation.positions if continuation else 0)
  gather = request.num_samples > 1

  if continuation is not None:
    axis, batch, prefill_batch = "batch", 1, 1
    prompt_len, cache_len = _plan_continuation(
        model, request, use_cache, continuation)
  elif kind == "cached":
    if not use_cache:
      raise ValueError(
          "use_cache=False needs the uncached TransformerLM; pass the model"
          " you built the KVCachingTransformerLM from.")
    _empty_cache_check(model)
    if len(model.batch_axes) != 1:
      raise ValueError(
          f"the cached model has batch axes {model.batch_axes}; generate()"
          " supports exactly one batch axis.")
    (axis, batch), = model.batch_axes.items()
    if batch < rows:
      raise ValueError(
          f"the cached model was built for {batch} row(s) but the request"
          f" needs {rows} ({request.num_prompts} prompt(s) x"
          f" {request.num_samples} sample(s)); rebuild it with"
          f" KVCachingTransformerLM.from_uncached(model, cache_len,"
          f" {{{axis!r}: {rows}}}) or pass the uncached model.")
    cache_len = model.cache_len
    if longest > cache_len:
      raise ValueError(
          f"the longest prompt has {longest} tokens but the cached model's"
          f" cache holds only {cache_len}; rebuild it with a larger"
          " cache_len or pass the uncached model (sized automatically).")
    prompt_len = min(bucket(longest, MIN_PROMPT_BUCKET), cache_len)
    prefill_batch = min(bucket(request.num_prompts), batch) if gather else batch
  else:
    axis = "batch"
    batch = bucket(rows)
    prefill_batch = bucket(request.num_prompts) if gather else batch
    prompt_len = bucket(longest, MIN_PROMPT_BUCKET)
    cache_len = bucket(prompt_len + max_new - 1)
    if config.family == "gpt2" and cache_len > limit:
      # GPT-2's cache may not exceed its learned positions.
      cache_len = limit
      if prompt_len + max_new - 1 > cache_len:
        prompt_len = longest

  # Rows can generate at most cache_len - prompt_len + 1 tokens; sizing the
  # output buffers by the cache alone keeps the decode program independent
  # of the prompt bucket (prompts of any length share it).
  out_len = cache_len
  queue = max(len(f) for f in request.forced_tokens)
  stops = max(len(s) for s in request.stop_tokens)
  plan = Plan(
      use_cache=use_cache,
      batch_axis=axis,
      batch=batch,
      prefill_batch=prefill_batch,
      prompt_len=prompt_len,
      cache_len=cache_len,
      out_len=out_len,
      queue_len=bucket(queue, MIN_QUEUE),
      stop_width=bucket(stops, MIN_STOP_WIDTH),
      top_n=request.logprobs_top_n,
      vocab=config.vocab_size,
      gather=gather,
      continued=continuation is not None,
  )
  return plan
