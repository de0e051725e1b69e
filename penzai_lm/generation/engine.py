"""The compiled generation engine: one prefill call, then a `while_loop`.

`generate(model, prompts, **settings)` validates a request
(`penzai_lm.generation.requests`), plans its bucketed shapes
(`penzai_lm.generation.plan`), prepares the model (`...prepare`: unstacked,
cached mode, frozen, flattened) and drives a `Run` (`...run`) through the two
compiled programs (`...programs`: prefill and the decode loop), which are
compiled once per plan and cached (`...program_cache`).

Everything that varies inside a bucket -- prompt ids and lengths, sampling
values, seeds, ``max_new_tokens``, stop ids, forced tokens -- is a traced
array, so one compiled program serves every such request; the weights are
arguments of the programs, never constants. Decode programs do not depend on
the prompt bucket (output buffers are sized by the cache), so prompts of
different lengths share one decode program per cache bucket and batch size.
"""

from __future__ import annotations

import threading
from typing import Any

from penzai_lm.generation import plan as plan_lib
from penzai_lm.generation import prepare
from penzai_lm.generation import requests as requests_lib
from penzai_lm.generation import run as run_lib
from penzai_lm.generation.program_cache import PROGRAMS as _PROGRAMS
from penzai_lm.generation.program_cache import cache_size as _cache_size  # noqa: F401  (tests)
from penzai_lm.generation.results import GenerationResult
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model import TransformerLM

DEFAULT_MAX_NEW_TOKENS = 128
unstack_layers = prepare.unstack_layers


def clear_compiled_cache() -> None:
  """Drops every compiled program and prepared model (rebuilt on demand)."""
  _PROGRAMS.clear()
  prepare.clear_caches()


def start_run(model, prompts, *, max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
              temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
              repetition_penalty=1.0, presence_penalty=0.0,
              frequency_penalty=0.0, logit_bias=None, banned_tokens=None,
              seed=None, stop_tokens=None, num_samples=1, use_cache=True,
              logprobs_top_n=0, forced_tokens=None, tool=None,
              default_stop_tokens=None, continuation=None) -> run_lib.Run:
  """Validates a request and prepares (but does not start) a `Run`.

  ``continuation`` (a `plan.Continuation`, used by `Session`) appends the
  prompt to a previous run's state instead of starting from empty caches.
  """
  kind = plan_lib.model_kind(model)
  if not isinstance(use_cache, bool):
    raise ValueError(f"use_cache must be True or False, got {use_cache!r}.")
  if default_stop_tokens is None:
    default_stop_tokens = model.config.eos_token_ids
  batch_axis = None
  if kind == "cached" and len(model.batch_axes) == 1:
    batch_axis = next(iter(model.batch_axes))
  if tool is not None and not hasattr(tool, "respond"):
    raise TypeError(
        "tool must provide pause_token_id and respond(tokens) (e.g."
        " penzai_lm.generation.CalculatorTool).")
  request = requests_lib.build_request(
      prompts,
      vocab_size=model.config.vocab_size,
      default_stop_tokens=default_stop_tokens,
      max_new_tokens=max_new_tokens,
      num_samples=num_samples,
      seed=seed,
      stop_tokens=stop_tokens,
      forced_tokens=forced_tokens,
      logprobs_top_n=logprobs_top_n,
      logit_bias=logit_bias,
      banned_tokens=banned_tokens,
      batch_axis=batch_axis,
      temperature=temperature,
      top_k=top_k,
      top_p=top_p,
      min_p=min_p,
      repetition_penalty=repetition_penalty,
      presence_penalty=presence_penalty,
      frequency_penalty=frequency_penalty,
  )
  return run_lib.Run(model, request, use_cache=use_cache, tool=tool,
                     continuation=continuation)


def generate(
    model: TransformerLM | KVCachingTransformerLM,
    prompts: Any,
    *,
    max_new_tokens: int | list[int] = DEFAULT_MAX_NEW_TOKENS,
    temperature: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    top_p: float | list[float] = 1.0,
    min_p: float | list[float] = 0.0,
    repetition_penalty: float | list[float] = 1.0,
    presence_penalty: float | list[float] = 0.0,
    frequency_penalty: float | list[float] = 0.0,
    logit_bias: dict[int, float] | list[dict[int, float]] | None = None,
    banned_tokens: list[int] | list[list[int]] | None = None,
    seed: int | list[int] | None = None,
    stop_tokens: list[int] | list[list[int]] | None = None,
    num_samples: int = 1,
    use_cache: bool = True,
    logprobs_top_n: int = 0,
    forced_tokens: list[int] | list[list[int]] | None = None,
    tool: Any = None,
    cancel: threading.Event | None = None,
    chunk_size: int = 8,
) -> GenerationResult:
  """Generates tokens for one prompt or a batch, in compiled JAX.

  Token level: knows nothing about text (see `generate_text` for that).

  Args:
    model: An uncached `TransformerLM` (converted to cached mode with a cache
      sized for the request) or a `KVCachingTransformerLM` with an empty
      cache, one batch axis of at least ``num_rows`` rows; its cache size is
      then fixed, and rows that reach it end with ``"cache_full"``.
    prompts: One prompt (a list of ids or a 1-D array), a ragged list of
      prompts, a 2-D array, or a ``pz.nx.NamedArray`` with a ``seq`` axis and
      at most one batch axis. Prompts are taken whole (no padding is guessed).
    max_new_tokens: Maximum tokens generated per row (forced ones included).
    temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
      frequency_penalty, logit_bias, banned_tokens: Sampling settings (see
      `penzai_lm.sampling.SamplingSettings`); each may be one value or a list
      per prompt / per row. ``temperature=0`` is greedy.
    seed: Int, list per prompt, or None for a fresh random seed (reported in
      ``result.seeds``). Sample ``j > 0`` of a prompt uses a seed derived
      from the prompt's seed.
    stop_tokens: Ids that end a row (included in its output); default
      ``model.config.eos_token_ids``; ``[]`` disables. Per-row lists allowed.
    num_samples: Samples per prompt: one prefill per prompt, then the cache
      is replicated to ``num_samples`` independent rows.
    use_cache: False recomputes the whole sequence each step with the
      uncached model (slow; a reference for the cached path).
    logprobs_top_n: Record the top-n alternatives of every token (static:
      changing it compiles a new program).
    forced_tokens: Tokens forced at the start of every row's output (or per
      prompt / per row lists); marked in ``result.forced``.
    tool: A tool such as `CalculatorTool`: rows pause on its end marker and
      the host injects its reply as forced tokens.
    cancel: A ``threading.Event``; when set, generation stops at the next
      chunk boundary (``chunk_size`` steps) with finish reason
      ``"cancelled"``.
    chunk_size: Steps per compiled call when ``cancel`` is given.

  Returns:
    A `GenerationResult`.

  Raises:
    ValueError / TypeError: for invalid requests, before anything runs.
  """
  run = start_run(
      model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
      top_k=top_k, top_p=top_p, min_p=min_p,
      repetition_penalty=repetition_penalty,
      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
      logit_bias=logit_bias, banned_tokens=banned_tokens, seed=seed,
      stop_tokens=stop_tokens, num_samples=num_samples, use_cache=use_cache,
      logprobs_top_n=logprobs_top_n, forced_tokens=forced_tokens, tool=tool)
  return run_to_end(run, cancel=cancel, chunk_size=chunk_size)


def run_to_end(run: run_lib.Run, *, cancel: threading.Event | None = None,
               chunk_size: int = 8) -> GenerationResult:
  """Prefills and decodes a run until every row has finished.

  The first decode call runs one step (so the time to first token is
  measured), the rest one call to the end, or chunks of ``chunk_size``
  steps between which ``cancel`` is checked.
  """
  _check_chunk_size(chunk_size)
  if cancel is not None and cancel.is_set():
    run.cancel()
    return run.result()
  run.prefill()
  run.decode(1)
  while not run.finished:
    if cancel is not None:
      if cancel.is_set():
        run.cancel()
        break
      run.decode(chunk_size)
    else:
      run.decode(None)
  return run.result()


def _check_chunk_size(chunk_size) -> None:
  if (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
      or chunk_size < 1):
    raise ValueError(
        f"chunk_size must be a positive integer, got {chunk_size!r}.")
