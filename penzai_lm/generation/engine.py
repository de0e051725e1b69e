"""The generation engine: one compiled prefill, then a `while_loop`.

The data path of `generate(model, prompts, **options)`:

1. `request.build_request` validates everything once and returns a frozen
   `Request`: prompts, per-row limits and stop ids, seeds, the
   `SamplingSettings` and the bucketed `PrefillShape` / `DecodeShape`.
2. `Engine.prepare` makes the model ready (layer stacks unstacked for
   decoding and, where it pays, kept for prompts: `stacked_prefill.py`;
   cached mode for the shape, frozen, flattened: `prepare.py`), cached per
   model identity and shape.
3. A `Run` (`run.py`) calls the prefill program (`prefill.py`), then the
   decode program (`programs.py`) until every row has finished, in one call or in chunks
   when the host takes part (streaming, cancellation, stop strings, tools).

Everything that varies inside a bucket -- prompt ids and lengths, sampling
values, seeds, ``max_new_tokens``, stop ids, forced tokens -- is a traced
array, so one compiled program serves every such request; the weights are
arguments of the programs, never constants.

An `Engine` owns its prepared models in a bounded LRU cache and runs on a
`penzai_lm.runtime.Runtime`, which owns the compiled programs and their
compiler options; nothing is module-level state except the default engine
the plain functions use (`default_engine()`, on the default runtime that
top-level model calls use too). Make your own
engine to bound memory differently, to try compiler options, or to keep
programs apart::

    engine = Engine(max_programs=8)
    result = engine.generate(model, prompts, max_new_tokens=32)
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

import jax
from penzai import pz

from penzai_lm.generation import prepare as prepare_lib
from penzai_lm.generation import request as request_lib
from penzai_lm.generation import stacked_prefill
from penzai_lm.generation.results import GenerationResult
from penzai_lm.generation.run import check_run_controls
from penzai_lm.generation.run import Run
from penzai_lm.generation.stream import DEFAULT_CHUNK_SIZE
from penzai_lm.generation.stream import GenerationStream
from penzai_lm.runtime.collector import collector_paused
from penzai_lm.runtime.derived import alias_weights
from penzai_lm.runtime.derived import Derivable
from penzai_lm.runtime.derived import derivable_tree
from penzai_lm.runtime.derived import Lineage
from penzai_lm.runtime.derived import variant_key
from penzai_lm.runtime.identity_cache import IdentityCache
from penzai_lm.runtime.program_cache import Pending
from penzai_lm.runtime.program_store import ProgramStore
from penzai_lm.runtime.runtime import check_bound
from penzai_lm.runtime.runtime import CompilerOptions
from penzai_lm.runtime.runtime import default_runtime
from penzai_lm.runtime.runtime import Runtime
from penzai_lm.runtime.unstack import unstack_layers


def _derivable_unstack(model, leaves, values) -> Derivable:
  lineage = Lineage()
  unstacked = unstack_layers(model, lineage)
  made = derivable_tree(unstacked, leaves, values, lineage)
  return dataclasses.replace(made, value=alias_weights(unstacked, leaves,
                                                       values))


def _aliased(prepared: prepare_lib.PreparedModel, leaves,
             values) -> prepare_lib.PreparedModel:
  """``prepared`` holding aliases of the model's weights (`alias_weights`),
  not the weights themselves."""
  prepared = prepared.with_arrays(alias_weights(prepared.arrays(), leaves,
                                                values))
  if prepared.prefill is not None:
    prepared = dataclasses.replace(prepared, prefill=dataclasses.replace(
        prepared.prefill,
        state_args=alias_weights(prepared.prefill.state_args, leaves, values)))
  return dataclasses.replace(
      prepared, state_args=alias_weights(prepared.state_args, leaves, values))


class Engine:
  """Prepares models and runs generation on a `Runtime`'s programs.

  Attributes:
    runtime: The `penzai_lm.runtime.Runtime` that compiles and caches the
      programs ("prefill" and "decode" of `generate`, "forward" of
      `forward` and `run_with_cache`).
    programs: Its `ProgramCache` (``programs.compilations`` counts
      compilations).
    unstack_layer_stacks: Decode layer stacks as per-layer blocks (see
      `penzai_lm.runtime.unstack`); False decodes the stacks as they are
      (slow on CPU; for comparisons).
    prefill_over_stacks: Prefill fresh prompts on the model as the user
      stacked it (one block compiled and scanned), not on the per-layer
      blocks (`stacked_prefill.py`): True, False or "auto" (the default:
      where it costs no warm speed, `stacked_prefill.wanted`). A new
      prefill program compiles and first runs in a third of the time, but
      on XLA:CPU warm prefills of 16-bit float weights are slower;
      figures in `docs/cpu-speed.md`.
    prompt_attention: How prompts attend over the KV caches where a layer's
      attention chain is plain (`penzai_lm.model.prompt_attention`):
      "auto" (the default) runs them as cuDNN flash attention on a single
      GPU and as penzai's chain of layers elsewhere; "cudnn" and "xla" pick
      `jax.nn.dot_product_attention`'s implementation on any device (cuDNN:
      GPU only, bfloat16/float16 models); None always keeps penzai's chain.
  """

  def __init__(self, *, max_programs: int = 32, max_models: int = 4,
               compiler_options: CompilerOptions | None = None,
               unstack_layer_stacks: bool = True,
               program_store: ProgramStore | str | os.PathLike | None = "auto",
               prompt_attention: str | None = "auto",
               prefill_over_stacks: bool | str = "auto",
               runtime: Runtime | None = None):
    """Creates an engine.

    Args:
      max_programs: Compiled programs kept (least recently used evicted).
      max_models: Prepared models kept (each holds the arrays of one model
        in decode layout, per batch and cache bucket).
      compiler_options: ``fn(program_name, shape) -> dict`` of XLA options
        for programs compiled on CPU (see `Runtime`).
      unstack_layer_stacks: See the class attribute.
      program_store: A `ProgramStore`, a directory, None or "auto" (see
        `Runtime`).
      prompt_attention: See the class attribute.
      prefill_over_stacks: See the class attribute.
      runtime: Run on this runtime (e.g. `default_runtime()`, shared with
        top-level model calls) instead of a new one made from
        ``max_programs``, ``compiler_options`` and ``program_store``, which
        must then keep their defaults.

    Raises:
      ValueError / TypeError: for a bad argument, naming it.
    """
    check_bound("max_models", max_models)
    if prompt_attention not in prepare_lib.PROMPT_ATTENTION:
      raise ValueError(
          f"prompt_attention must be one of {prepare_lib.PROMPT_ATTENTION},"
          f" got {prompt_attention!r}.")
    if runtime is None:
      runtime = Runtime(max_programs=max_programs,
                        compiler_options=compiler_options,
                        program_store=program_store)
    elif not isinstance(runtime, Runtime):
      raise TypeError("runtime must be a penzai_lm.runtime.Runtime, got"
                      f" {type(runtime).__name__}.")
    elif (max_programs, compiler_options, program_store) != (32, None, "auto"):
      raise ValueError(
          "give either runtime= or max_programs / compiler_options /"
          " program_store (the runtime's own), not both.")
    self.runtime = runtime
    self.programs = runtime.programs
    self.prompt_attention = prompt_attention
    self.unstack_layer_stacks = bool(unstack_layer_stacks)
    if not (isinstance(prefill_over_stacks, bool)
            or prefill_over_stacks == "auto"):
      raise ValueError('prefill_over_stacks must be True, False or "auto",'
                       f" got {prefill_over_stacks!r}.")
    self.prefill_over_stacks = prefill_over_stacks
    self._prepared = IdentityCache(max_models)
    # Unstacked models are shared by every bucket of one model (one copy of
    # the weights in decode layout, not one per bucket).
    self._unstacked = IdentityCache(2)

  def program_store(self) -> ProgramStore | None:
    """The runtime's `ProgramStore` now (None: off)."""
    return self.runtime.program_store()

  @property
  def compilations(self) -> int:
    return self.runtime.compilations

  def program_count(self, name: str | None = None) -> int:
    """Compiled programs held ("prefill", "decode", "forward" or all)."""
    return self.runtime.program_count(name)

  def clear(self) -> None:
    """Drops every compiled program and prepared model."""
    self.runtime.clear()
    self._prepared.clear()
    self._unstacked.clear()

  # The data path.

  def start(self, model, prompts: Any, *, tool=None, continuation=None,
            **options) -> Run:
    """Validates a request and prepares (but does not start) a `Run`.

    ``continuation`` (a `state.Continuation`, used by `Session`) appends the
    prompt to a previous turn's state instead of starting from empty
    caches. Options as in `generate`.
    """
    if tool is not None and not (hasattr(tool, "respond")
                                 and hasattr(tool, "pause_token_id")):
      raise TypeError(
          "tool must provide pause_token_id and respond(tokens) (e.g."
          " penzai_lm.generation.CalculatorTool).")
    started = time.perf_counter()
    request = request_lib.build_request(model, prompts,
                                        continuation=continuation, **options)
    prepare_lib.check_prompt_attention(self.prompt_attention, model)
    key, index = self._prepare_key(model, request)
    prepared = first = None
    if continuation is None and not request_lib.is_cached_model(model):
      found = self._prepared.get(model, key, None)
      if found is not None:
        prepared = found.value
      elif self._over_stacks(model, request):
        # A model not prepared yet whose fresh prompt is prefilled over its
        # stacks: the prefill's program is traced and compiling before the
        # decode model is prepared (`Run.prefill`).
        first = self._prepare_stacked(model, request.decode, index)
    if first is not None:
      run = Run(self, lambda: self._prepare(model, request, key, index),
                request, tool=tool, prefill_first=first, started=started)
    else:
      if prepared is None:
        prepared = self._prepare(model, request, key, index)
      run = Run(self, prepared, request, tool=tool,
                continuation=continuation, started=started)
    run.timings.prepare_s = time.perf_counter() - started
    return run

  def generate(self, model, prompts: Any, *,
               cancel: threading.Event | None = None, chunk_size: int = 8,
               **options) -> GenerationResult:
    """`generate` on this engine."""
    check_run_controls(chunk_size, cancel)
    return self.start(model, prompts, **options).run_to_end(
        cancel=cancel, chunk_size=chunk_size)

  def stream(self, model, prompts: Any, *, chunk_size: int = 8,
             cancel: threading.Event | None = None, **options):
    """`stream` on this engine."""
    check_run_controls(chunk_size, cancel)
    return GenerationStream(self.start(model, prompts, **options),
                            chunk_size=chunk_size, cancel=cancel)

  def forward(self, model, tokens, **kwargs):
    """`Runtime.forward` on this engine's runtime."""
    return self.runtime.forward(model, tokens, **kwargs)

  def prepare(self, model, request) -> prepare_lib.PreparedModel:
    """The model ready for ``request``'s programs (cached).

    Cached per model structure, weights and shape: a patched variant of a
    prepared model (same weights, other patch values) gets the prepared
    model with only its patch's arrays replaced
    (`penzai_lm.runtime.derived`); nothing is unstacked again.
    """
    return self._prepare(model, request, *self._prepare_key(model, request))

  def _prepare(self, model, request, key, index) -> prepare_lib.PreparedModel:
    """`prepare`, given `_prepare_key`'s ``(key, index)``."""
    shape = request.decode

    @collector_paused()
    def make():
      _, leaves, values = variant_key(model)
      lineage = Lineage()
      decoded = None
      if self.unstack_layer_stacks and shape.use_cache:
        unstacked = self._unstacked.get(
            model, None, lambda: _derivable_unstack(model, leaves, values))
        if unstacked.recipes is not None:
          lineage.seed(jax.tree_util.tree_leaves(unstacked.value), leaves,
                       unstacked.recipes)
        decoded = unstacked.value
      if index is not None:
        decoded = prepare_lib.rows_to_batch(
            model if decoded is None else decoded, shape.batch_axis, index,
            lineage)
      prepared = prepare_lib.prepare_model(
          model, decoded=decoded, capture=request.capture,
          **self._prepare_options(model, shape))
      if self._over_stacks(model, request):
        # Fresh prompts run on the stacked model (its per-row values
        # gathered too), and the decode loop on the unstacked one.
        prepared = stacked_prefill.with_stacked_prefill(
            prepared, self._prepare_stacked(model, shape, index, lineage))
      recipes = lineage.recipes(prepared.arrays(), leaves, values)
      return Derivable(
          _aliased(prepared, leaves, values), recipes,
          leaves=lambda p: p.arrays(), rebuild=lambda p, new: p.with_arrays(
              new))

    return self._prepared.get_or_make(model, key, make)

  def _prepare_key(self, model, request):
    """``(key, index)``: what `prepare`'s cache keys a prepared model on
    besides the model, and the decode rows' per-row entries
    (`prepare_lib.row_index`)."""
    shape = request.decode
    index = prepare_lib.row_index(
        prepare_lib.per_row_size(model, shape.batch_axis),
        num_prompts=request.num_prompts, num_samples=request.num_samples,
        batch=shape.batch)
    key = (request_lib.is_cached_model(model), shape.use_cache,
           shape.batch_axis, shape.batch, shape.cache_len,
           self.unstack_layer_stacks, index, request.capture,
           self.prompt_attention)
    return key, index

  def _prepare_options(self, model, shape) -> dict:
    return dict(
        cached_model=request_lib.is_cached_model(model),
        use_cache=shape.use_cache,
        batch_axis=shape.batch_axis, batch=shape.batch,
        cache_len=shape.cache_len, prompt_attention=self.prompt_attention)

  def _over_stacks(self, model, request) -> bool:
    """Whether fresh prompts of ``request`` are prefilled on ``model``'s
    layer stacks (`stacked_prefill.wanted`)."""
    return bool(
        self.unstack_layer_stacks and request.decode.use_cache
        and not request.capture
        and pz.select(model).at_instances_of(pz.nn.LayerStack).count()
        and stacked_prefill.wanted(self.prefill_over_stacks, model))

  def _prepare_stacked(self, model, shape, index, lineage=None
                       ) -> prepare_lib.PreparedModel | None:
    """The model with its layer stacks, prepared to prefill prompts
    (`stacked_prefill.prefill_model`)."""
    with collector_paused():
      decoded = None if index is None else prepare_lib.rows_to_batch(
          model, shape.batch_axis, index, lineage)
      return stacked_prefill.prefill_model(prepare_lib.prepare_model(
          model, decoded=decoded, **self._prepare_options(model, shape)))

  def program(self, name: str, fn, static, args, **kwargs):
    """`Runtime.program` on this engine's runtime."""
    return self.runtime.program(name, fn, static, args, **kwargs)

  def lower(self, name: str, fn, static, args, **kwargs) -> Pending:
    """`Runtime.lower` on this engine's runtime."""
    return self.runtime.lower(name, fn, static, args, **kwargs)

  def lower_ahead(self, name: str, fn, static, args, **kwargs
                  ) -> Pending | None:
    """`Runtime.lower_ahead` on this engine's runtime."""
    return self.runtime.lower_ahead(name, fn, static, args, **kwargs)


_DEFAULT_ENGINE = Engine(runtime=default_runtime())


def default_engine() -> Engine:
  """The engine the module-level functions use."""
  return _DEFAULT_ENGINE


def resolve_engine(engine) -> Engine:
  """``engine``, or the default engine for None.

  Raises:
    TypeError: for anything but an `Engine` or None.
  """
  if engine is None:
    return _DEFAULT_ENGINE
  if not isinstance(engine, Engine):
    raise TypeError(
        "engine must be a penzai_lm.generation.Engine (or None for the"
        f" default one), got {type(engine).__name__}.")
  return engine


def clear_compiled_cache() -> None:
  """Drops the default engine's compiled programs and prepared models."""
  _DEFAULT_ENGINE.clear()


def generate(model, prompts: Any, *, engine: Engine | None = None,
             cancel: threading.Event | None = None, chunk_size: int = 8,
             **options) -> GenerationResult:
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
    engine: The `Engine` to run on (default: `default_engine()`).
    cancel: A ``threading.Event``; when set, generation stops at the next
      chunk boundary (``chunk_size`` steps) with finish reason
      ``"cancelled"``.
    chunk_size: Steps per compiled call when ``cancel`` is given.
    **options: The request:

      * ``max_new_tokens``: tokens generated per row at most (forced ones
        included); default 128.
      * ``min_new_tokens``: tokens generated per row before its stop tokens
        may be sampled (HF semantics; forced ones count); default 0.
      * sampling settings, each one value or a list per prompt / per row:
        ``temperature`` (0 = greedy), ``top_k``, ``top_p``, ``min_p``,
        ``typical_p``, ``epsilon_cutoff``, ``eta_cutoff``,
        ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
        ``logit_bias`` and ``banned_tokens`` (see
        `penzai_lm.sampling.SamplingSettings`).
      * ``seed``: int, list per prompt, or None for a fresh random seed
        (reported in ``result.seeds``). Sample ``j > 0`` of a prompt uses a
        seed derived from the prompt's seed.
      * ``stop_tokens``: ids that end a row (included in its output);
        default ``model.config.eos_token_ids``; ``[]`` disables. Per-row
        lists allowed.
      * ``num_samples``: samples per prompt: one prefill per prompt, then
        the cache is replicated to ``num_samples`` independent rows.
      * ``use_cache``: False recomputes the whole sequence each step with
        the uncached model (slow; a reference for the cached path).
      * ``logprobs_top_n``: record the top-n alternatives of every token
        (static: changing it compiles a new program).
      * ``forced_tokens``: tokens forced at the start of every row's output
        (or per prompt / per row lists); marked in ``result.forced``.
      * ``tool``: a tool such as `CalculatorTool`: rows pause on its end
        marker and the host injects its reply as forced tokens.

  Returns:
    A `GenerationResult`.

  Raises:
    ValueError / TypeError: for invalid requests, before anything runs.
  """
  return resolve_engine(engine).generate(
      model, prompts, cancel=cancel, chunk_size=chunk_size, **options)


def stream(model, prompts, *, engine: Engine | None = None,
           chunk_size: int = DEFAULT_CHUNK_SIZE,
           cancel: threading.Event | None = None,
           **options) -> GenerationStream:
  """Streams generated tokens; options as in `generate`.

  The request is validated here (errors raise immediately); the prefill runs
  on the first ``next()``.

  Args:
    model: As in `generate`.
    prompts: As in `generate`.
    engine: The `Engine` to run on (default: `default_engine()`).
    chunk_size: Decode steps per compiled call after the first token (the
      host sees tokens every ``chunk_size`` steps; 8 keeps the per-chunk host
      work to a few percent of the step time on a 135M model).
    cancel: Optional ``threading.Event`` that stops generation when set.
    **options: Any option of `generate`.

  Returns:
    A `GenerationStream` yielding `StreamEvent` objects.
  """
  return resolve_engine(engine).stream(
      model, prompts, chunk_size=chunk_size, cancel=cancel, **options)
