"""The static shapes a request compiles for: one for prefill, one for decode.

A request becomes a fixed-shape batch: ``B`` decode rows (the request's rows
plus padding rows up to a power of two), prompts left-padded to a bucket of
``P`` tokens (a power of two, at least 8) and a KV cache of ``C`` slots (a
power of two holding ``P - 1 + max(max_new_tokens)`` tokens). Everything
else that varies between requests is a traced array, so these two frozen
values (parts of the program cache keys) are all that decides whether a
request compiles. The decode shape does not depend on the prompt bucket
(output buffers are sized by the cache), so prompts of any length share one
decode program per cache bucket and batch size.
"""

from __future__ import annotations

import dataclasses

import jax

from penzai_lm.generation.state import Continuation
from penzai_lm.model import memory

MIN_PROMPT_BUCKET = 8
MIN_QUEUE = 16
MIN_STOP_WIDTH = 8


def next_power_of_two(n: int) -> int:
  """Smallest power of two >= n (n >= 1)."""
  return 1 << max(0, int(n) - 1).bit_length()


def bucket(n: int, minimum: int = 1) -> int:
  return max(minimum, next_power_of_two(n))


@dataclasses.dataclass(frozen=True)
class DecodeShape:
  """Compile-time shapes of the decode loop.

  Attributes:
    use_cache: Cached decoding (else full recomputation every step).
    batch_axis: Name of the model's batch axis.
    batch: Decode rows ``B``.
    cache_len: Cache slots ``C`` (the token buffer without a cache); also
      the length of the per-row output buffers.
    queue_len: Forced-token queue length per row and call.
    stop_width: Stop ids per row.
    top_n: Top alternatives recorded per token.
    vocab: Vocabulary size.
    capture: Whether activations are captured: a finished row feeds its
      last token once more (its activations are recorded; its output is
      not), for which the cache has one more slot.
    cpu_sampler: Whether the CPU kernel is asked to pick tokens
      (``sample_next(kernel=True)``, which runs the JAX sampler instead
      while the kernel lacks a sampling setting); set from the prepared
      model.
  """

  use_cache: bool
  batch_axis: str
  batch: int
  cache_len: int
  queue_len: int
  stop_width: int
  top_n: int
  vocab: int
  capture: bool = False
  cpu_sampler: bool = False


@dataclasses.dataclass(frozen=True)
class PrefillShape:
  """Compile-time shapes of the prefill (which builds the decode carry).

  Attributes:
    decode: The decode loop it prepares.
    batch: Prefill rows (``decode.batch`` unless samples are replicated).
    prompt_len: Prompt bucket ``P``.
    gather: Whether decode rows are gathered from prefill rows
      (``num_samples > 1``: one prefill per prompt).
    continued: Whether it appends to a previous state (a `Continuation`)
      instead of starting from empty caches.
    emits_first: Whether the prefill writes the last prompt column too and
      picks every row's first token (cached decoding without captures): the
      first token then needs no decode call, and a new process has it
      before its decode program finished compiling.
  """

  decode: DecodeShape
  batch: int
  prompt_len: int
  gather: bool
  continued: bool = False
  emits_first: bool = False


@dataclasses.dataclass(frozen=True)
class RowsInfo:
  """What planning needs to know of a validated request."""

  num_prompts: int
  num_samples: int
  prompt_lengths: tuple[int, ...]  # Per prompt.
  max_new_tokens: tuple[int, ...]  # Per row.
  queue: int  # Longest forced-token list.
  stops: int  # Most stop ids of a row.
  top_n: int
  capture: bool = False  # Captures need the last token fed too.

  @property
  def num_rows(self) -> int:
    return self.num_prompts * self.num_samples


def _check_context(rows: RowsInfo, limit: int, history: int) -> None:
  for r, n_new in enumerate(rows.max_new_tokens):
    prompt = r // rows.num_samples
    length = rows.prompt_lengths[prompt]
    if history + length + n_new <= limit:
      continue
    if history:
      raise ValueError(
          f"the session holds {history} cached tokens; {length} more and"
          f" max_new_tokens={n_new} exceed the model's context of"
          f" {limit} tokens (config.max_position_embeddings). Start a new"
          " session (reset()) or lower max_new_tokens.")
    raise ValueError(
        f"prompt {prompt} has {length} tokens and max_new_tokens is {n_new}:"
        f" {length + n_new} tokens exceed the model's context of {limit}"
        " tokens (config.max_position_embeddings). Shorten the prompt or"
        " lower max_new_tokens.")


def check_cached_batch(model, num_prompts: int, num_samples: int) -> None:
  """Refuses more rows than a `KVCachingTransformerLM` (one batch axis)
  was built for."""
  (axis, batch), = model.batch_axes.items()
  rows = num_prompts * num_samples
  if batch < rows:
    raise ValueError(
        f"the cached model was built for {batch} row(s) but the request"
        f" needs {rows} ({num_prompts} prompt(s) x {num_samples} sample(s));"
        " rebuild it with KVCachingTransformerLM.from_uncached(model,"
        f" cache_len, {{{axis!r}: {rows}}}) or pass the uncached model.")


def _cached_model_shapes(model, rows: RowsInfo, gather: bool):
  """(axis, batch, prefill batch, prompt_len, cache_len) for a given
  `KVCachingTransformerLM` (its batch and cache size are fixed)."""
  if model.per_row_end:
    raise ValueError(
        "generate() runs cached models with one end index for the batch;"
        " this one has one per row (per_row_end=True, for stepping rows"
        " yourself). Pass the uncached model, or build the cached one with"
        " per_row_end=False.")
  end = model.cache_end_index.value
  if isinstance(end, jax.core.Tracer):
    raise ValueError("generate() cannot be called inside jax.jit.")
  if int(end) != 0:
    raise ValueError(
        f"this KVCachingTransformerLM already holds {int(end)} tokens;"
        " generate() starts from an empty cache. Build a fresh one with"
        " KVCachingTransformerLM.from_uncached(model, cache_len, batch_axes).")
  if len(model.batch_axes) != 1:
    raise ValueError(
        f"the cached model has batch axes {model.batch_axes}; generate()"
        " supports exactly one batch axis.")
  (axis, batch), = model.batch_axes.items()
  check_cached_batch(model, rows.num_prompts, rows.num_samples)
  cache_len = model.cache_len
  longest = max(rows.prompt_lengths)
  if longest > cache_len:
    raise ValueError(
        f"the longest prompt has {longest} tokens but the cached model's"
        f" cache holds only {cache_len}; rebuild it with a larger"
        " cache_len or pass the uncached model (sized automatically).")
  prompt_len = min(bucket(longest, MIN_PROMPT_BUCKET), cache_len)
  prefill = min(bucket(rows.num_prompts), batch) if gather else batch
  return axis, batch, prefill, prompt_len, cache_len


def plan(model, rows: RowsInfo, *, cached_model: bool, use_cache: bool,
         continuation: Continuation | None = None) -> PrefillShape:
  """Chooses the bucketed shapes of a request.

  Args:
    model: The model (uncached `TransformerLM` or `KVCachingTransformerLM`).
    rows: The validated request's sizes.
    cached_model: Whether ``model`` is a `KVCachingTransformerLM`.
    use_cache: Cached decoding.
    continuation: The state a session turn appends to, if any.

  Returns:
    The prefill shape (whose ``decode`` is the decode shape).

  Raises:
    ValueError: if the request does not fit the model, or its buffers do
      not fit in the available memory (`memory.InsufficientMemoryError`).
  """
  config = model.config
  max_cache = config.max_cache_len  # None: no limit but the context.
  _check_context(rows, config.max_position_embeddings,
                 continuation.positions if continuation else 0)
  gather = rows.num_samples > 1
  longest = max(rows.prompt_lengths)
  # Slots a row fills after its prompt (with captures, its last token too).
  max_new = max(rows.max_new_tokens) + rows.capture
  if continuation is not None:
    if cached_model or rows.num_rows != 1 or not use_cache:
      raise ValueError(
          "a continuation needs the uncached TransformerLM, one row and"
          " use_cache=True.")
    axis, batch, prefill = "batch", 1, 1
    prompt_len = bucket(longest, MIN_PROMPT_BUCKET)
    cache_len = max(continuation.cache_len, bucket(
        continuation.start_slot + prompt_len - 1 + max_new))
    if max_cache is not None and cache_len > max_cache:
      cache_len = max_cache  # A state never holds more.
      if continuation.start_slot + prompt_len > cache_len:
        raise ValueError(
            f"the conversation fills this model's {max_cache} cache slots"
            " (its learned positions end there); start a new session"
            " (reset()).")
  elif cached_model:
    if not use_cache:
      raise ValueError(
          "use_cache=False needs the uncached TransformerLM; pass the model"
          " you built the KVCachingTransformerLM from.")
    axis, batch, prefill, prompt_len, cache_len = _cached_model_shapes(
        model, rows, gather)
  else:
    axis = "batch"
    batch = bucket(rows.num_rows)
    prefill = bucket(rows.num_prompts) if gather else batch
    prompt_len = bucket(longest, MIN_PROMPT_BUCKET)
    cache_len = bucket(prompt_len + max_new - 1)
    if max_cache is not None and cache_len > max_cache:
      cache_len = max_cache
      if prompt_len + max_new - 1 > cache_len:
        prompt_len = longest
  decode = DecodeShape(
      use_cache=use_cache,
      batch_axis=axis,
      batch=batch,
      cache_len=cache_len,
      queue_len=bucket(rows.queue, MIN_QUEUE),
      stop_width=bucket(rows.stops, MIN_STOP_WIDTH),
      top_n=rows.top_n,
      vocab=config.vocab_size,
      capture=rows.capture,
  )
  check_memory(config, decode, rows, cached_model=cached_model,
               continuation=continuation)
  return PrefillShape(decode=decode, batch=prefill, prompt_len=prompt_len,
                      gather=gather, continued=continuation is not None,
                      emits_first=use_cache and not rows.capture)


def check_memory(config, decode: DecodeShape, rows: RowsInfo, *,
                 cached_model: bool = False,
                 continuation: Continuation | None = None) -> None:
  """Refuses a request whose buffers cannot fit in the available memory.

  Raises:
    memory.InsufficientMemoryError: naming the request and the limit.
  """
  B, C = decode.batch, decode.cache_len
  if decode.use_cache:
    what = memory.describe_cache(config, B, C)
  else:
    what = f"a token buffer of {memory.format_count(C)} slots x {B} rows"
  who = "a Session turn" if continuation is not None else "generate()"
  what = (f"{who} with {rows.num_prompts} prompt(s) x"
          f" {memory.format_count(rows.num_samples)} sample(s) and"
          f" max_new_tokens up to {max(rows.max_new_tokens)}: {what}, with"
          " its output and sampling buffers,")
  if continuation is not None:
    hint = ("Lower max_new_tokens or start a new session (reset()) with a"
            " smaller min_cache_len.")
  elif cached_model:
    hint = ("Rebuild the KVCachingTransformerLM with a smaller cache_len or"
            " batch.")
  else:
    hint = ("Lower max_new_tokens, shorten the prompts, or lower the batch"
            " (prompts x num_samples).")
  memory.check_fits(what, memory.request_bytes(
      config, B, C, top_n=decode.top_n, kv_cache=decode.use_cache), hint)
