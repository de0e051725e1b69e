"""The generation engine: one compiled prefill, then a `while_loop`.

The data path of `generate(model, prompts, **options)`:

1. `request.build_request` validates everything once and returns a frozen
   `Request`: prompts, per-row limits and stop ids, seeds, the
   `SamplingSettings` and the bucketed `PrefillShape` / `DecodeShape`.
2. `Engine.prepare` makes the model ready (layer stacks unstacked, cached
   mode for the shape, frozen, flattened; `prepare.py`), cached per model
   identity and shape.
3. A `Run` (`run.py`) calls the prefill program, then the decode program
   (`programs.py`) until every row has finished, in one call or in chunks
   when the host takes part (streaming, cancellation, stop strings, tools).

Everything that varies inside a bucket -- prompt ids and lengths, sampling
values, seeds, ``max_new_tokens``, stop ids, forced tokens -- is a traced
array, so one compiled program serves every such request; the weights are
arguments of the programs, never constants.

An `Engine` owns its compiled programs and prepared models in bounded LRU
caches and its compiler options; nothing is module-level state except the
default engine the plain functions use (`default_engine()`). Make your own
engine to bound memory differently, to try compiler options, or to keep
programs apart::

    engine = Engine(max_programs=8)
    result = engine.generate(model, prompts, max_new_tokens=32)
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from penzai_lm.generation import prepare as prepare_lib
from penzai_lm.generation import request as request_lib
from penzai_lm.generation.caches import IdentityCache
from penzai_lm.generation.caches import Pending
from penzai_lm.generation.caches import ProgramCache
from penzai_lm.generation.program_store import auto_directory
from penzai_lm.generation.program_store import ProgramStore
from penzai_lm.generation.results import GenerationResult
from penzai_lm.generation.run import Run
from penzai_lm.generation.variants import alias_weights
from penzai_lm.generation.variants import Derivable
from penzai_lm.generation.variants import derivable_tree
from penzai_lm.generation.variants import Lineage
from penzai_lm.generation.variants import variant_key
from penzai_lm.model.transformer import check_tokens
from penzai_lm.model.transformer import compiles
from penzai_lm.model.transformer import positions_from_padding

CompilerOptions = Callable[[str, Any], dict[str, Any]]


# Prefill and decode programs of models with at most this many transformer
# blocks are compiled with XLA:CPU's older fusion emitters (see
# `default_compiler_options`).
FEW_BLOCKS = 3

# Programs of models with at most this many parameters are compiled with
# `small_model_options` (see `default_compiler_options`).
SMALL_MODEL = 1_000_000


def default_compiler_options(program: str, shape, *,
                             blocks: int | None = None,
                             parameters: int | None = None
                             ) -> dict[str, Any]:
  """XLA's defaults, but for small models.

  Fusion emitters: XLA:CPU's newer fusion emitters compile each distinct
  kernel through MLIR (~15 ms of code generation each) and share identical
  kernels, so the blocks of a deep model cost little; the older emitters
  generate LLVM IR directly, faster per kernel, but once per fusion. A
  program of a model with at most `FEW_BLOCKS` blocks has few kernels of
  its blocks, so it compiles faster with the older ones. With the JAX
  sampler (~110 distinct kernels) in the decode program (one fresh
  process each, SmolLM2-shaped blocks, first generate's XLA seconds, new
  -> old emitters): 1 block 4.9 -> 3.0 s, 2 blocks 5.5 -> 3.3 s, 4 blocks
  5.6 -> 4.9 s, 8 blocks 5.0 -> 7.4 s (the 30-block decode program alone:
  4.6 -> 7.5-8.6 s). With the CPU sampling kernel (one call), medians of
  3 (`benchmarks/emitters_compile.py`), compile+trace new -> old: 1 block
  1.61 -> 0.99 s, 2 blocks 1.68 -> 1.33 s, 3 blocks 1.75 -> 1.27 s, 4
  blocks 1.71 -> 1.52 s; decode 321 -> 291, 215 -> 219, 207 -> 184 and
  194 -> 211 tok/s.

  Small models: the programs of a model of at most `SMALL_MODEL`
  parameters (toy and test models: a grokking transformer has 0.3 M) take
  `small_model_options`: the older emitters at any depth, at LLVM -O0
  without its expensive passes. Their steps take a fraction of a
  millisecond either way; the compile is the wait, and every new patch
  structure, batch or cache bucket is a new one. Medians of 3 fresh
  processes (`benchmarks/small_model_compile.py`; first generate's XLA
  seconds at batch 1 and then 8, and decode tok/s at batch 1, as a larger
  model is compiled -> small options): 34 k parameters, 3 blocks: 3.8 ->
  1.5 s and 6.7 -> 1.6 s, 7,600 -> 5,800 tok/s; 80 k, 8 blocks: 5.8 ->
  2.3 s and 5.2 -> 2.4 s; 0.29 M: 2.8 -> 1.2 s and 7.6 -> 1.2 s, 5,500 ->
  4,600 tok/s. Past the bound the slower code starts to count: with
  SmolLM2's vocabulary on 1.6 M parameters, the sampler decoded 2,700 ->
  1,100 tok/s (batch 8: 820 -> 160).

  Measured (`benchmarks/compiler_options.py`, SmolLM2-135M fp32, greedy):
  turning XLA's YNNPACK fusions off for decode programs on CPU (our earlier
  default) changed nothing at batch 1 (0.93-1.10x at 64-2048 cache slots)
  and was 1.3-4x slower at batch 2-8 at every cache size (batch 2, 64
  slots: 6.5 against 24.5 tok/s; batch 8, 2048 slots: 21.8 against 29.2),
  so that 2 and 4 rows decoded slower in total than one.

  Args:
    program: "prefill", "decode" or "forward".
    shape: The program's shape (unused).
    blocks: The transformer blocks the program runs one after the other (a
      layer stack counts once: its scan compiles one block), if known.
    parameters: The model's parameters (array elements), if known.
  """
  del shape
  if parameters is not None and parameters <= SMALL_MODEL:
    return small_model_options()
  if (program in ("prefill", "decode") and blocks is not None
      and blocks <= FEW_BLOCKS and _cpu_accepts(_EMITTERS, False)):
    return {_EMITTERS: False}
  return {}


def small_model_options() -> dict[str, Any]:
  """XLA:CPU's options for the programs of small models (see
  `default_compiler_options`), e.g. for ``jax.jit(..., compiler_options=)``;
  those this jaxlib lacks are left out, and none off CPU."""
  options = {}
  if jax.default_backend() != "cpu":
    return options
  if _cpu_accepts(_EMITTERS, False):
    options[_EMITTERS] = False
  if _cpu_accepts(_OPT_LEVEL, 0):
    options.update({_OPT_LEVEL: 0, "xla_llvm_disable_expensive_passes": True})
  return options


_EMITTERS = "xla_cpu_use_fusion_emitters"
_OPT_LEVEL = "xla_backend_optimization_level"


@functools.cache
def _cpu_accepts(option: str, value: Any) -> bool:
  """Whether this jaxlib's XLA:CPU knows the compile option (older ones
  lack the emitter switch and refuse every program that names it). Asked
  only while CPU is the default backend."""
  try:
    jax.jit(lambda x: x + 1).lower(
        np.zeros((), np.float32)).compile({option: value})
  except RuntimeError:  # INVALID_ARGUMENT: No such compile option.
    return False
  return True


def _derivable_unstack(model, leaves, values) -> Derivable:
  lineage = Lineage()
  unstacked = prepare_lib.unstack_layers(model, lineage)
  made = derivable_tree(unstacked, leaves, values, lineage)
  return dataclasses.replace(made, value=alias_weights(unstacked, leaves,
                                                       values))


class Engine:
  """Compiles, caches and runs generation programs.

  Attributes:
    programs: The `ProgramCache` (``programs.compilations`` counts
      compilations): "prefill" and "decode" programs of `generate`, and
      "forward" programs of top-level model calls and `run_with_cache`
      (`forward`).
    unstack_layer_stacks: Decode layer stacks as per-layer blocks (see
      `penzai_lm.generation.prepare`); False decodes the stacks as they are
      (slow on CPU; for comparisons).
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
               prompt_attention: str | None = "auto"):
    """Creates an engine.

    Args:
      max_programs: Compiled programs kept (least recently used evicted).
      max_models: Prepared models kept (each holds the arrays of one model
        in decode layout, per batch and cache bucket).
      compiler_options: ``fn(program_name, shape) -> dict`` of XLA options
        for programs compiled on CPU ("prefill" with a `PrefillShape`,
        "decode" with a `DecodeShape`, "forward" with the tokens' named
        shape), asked once per compilation; default
        `default_compiler_options`.
      unstack_layer_stacks: See the class attribute.
      program_store: Where compiled programs' exported forms are kept, so
        that a new process skips tracing them (`ProgramStore`): a store, a
        directory, None (off), or "auto": ``penzai_lm_programs`` inside
        JAX's persistent compilation cache directory while one is set
        (``jax_compilation_cache_dir``; the CLI sets one).
      prompt_attention: See the class attribute.
    """
    for name, value in (("max_programs", max_programs),
                        ("max_models", max_models)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    if compiler_options is not None and not callable(compiler_options):
      raise TypeError(
          "compiler_options must be a function (program name, shape) ->"
          f" dict, got {type(compiler_options).__name__}.")
    if prompt_attention not in prepare_lib.PROMPT_ATTENTION:
      raise ValueError(
          f"prompt_attention must be one of {prepare_lib.PROMPT_ATTENTION},"
          f" got {prompt_attention!r}.")
    self.prompt_attention = prompt_attention
    if isinstance(program_store, (str, os.PathLike)) and (
        program_store != "auto"):
      program_store = ProgramStore(program_store)
    elif program_store is not None and program_store != "auto" and (
        not isinstance(program_store, ProgramStore)):
      raise TypeError(
          "program_store must be a ProgramStore, a directory, None or"
          f' "auto", got {type(program_store).__name__}.')
    self._program_store = program_store
    self._auto_store: ProgramStore | None = None
    self.programs = ProgramCache(max_programs, store=self.program_store)
    self.unstack_layer_stacks = bool(unstack_layer_stacks)
    self._compiler_options = compiler_options
    self._prepared = IdentityCache(max_models)
    # Unstacked models are shared by every bucket of one model (one copy of
    # the weights in decode layout, not one per bucket).
    self._unstacked = IdentityCache(2)

  def program_store(self) -> ProgramStore | None:
    """The `ProgramStore` programs are compiled through now (None: off)."""
    if self._program_store != "auto":
      return self._program_store
    directory = jax.config.jax_compilation_cache_dir
    if not directory or "://" in str(directory):
      return None  # No cache, or a remote one (gs://...).
    if self._auto_store is None or self._auto_store.directory != (
        auto_directory(directory)):
      self._auto_store = ProgramStore(auto_directory(directory))
    return self._auto_store

  @property
  def compilations(self) -> int:
    return self.programs.compilations

  def program_count(self, name: str | None = None) -> int:
    """Compiled programs held ("prefill", "decode" or all)."""
    return len(self.programs.items(name))

  def clear(self) -> None:
    """Drops every compiled program and prepared model."""
    self.programs.clear()
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
    run = Run(self, self.prepare(model, request), request, tool=tool,
              continuation=continuation, started=started)
    run.timings.prepare_s = time.perf_counter() - started
    return run

  def generate(self, model, prompts: Any, *,
               cancel: threading.Event | None = None, chunk_size: int = 8,
               **options) -> GenerationResult:
    """`generate` on this engine."""
    return self.start(model, prompts, **options).run_to_end(
        cancel=cancel, chunk_size=chunk_size)

  def stream(self, model, prompts: Any, *, chunk_size: int = 8,
             cancel: threading.Event | None = None, **options):
    """`stream` on this engine."""
    from penzai_lm.generation.stream import GenerationStream  # pylint: disable=g-import-not-at-top
    return GenerationStream(self.start(model, prompts, **options),
                            chunk_size=chunk_size, cancel=cancel)

  def forward(self, model, tokens, *, token_positions=None, padding=None,
              return_logits: bool = True, **side_inputs):
    """``model(tokens, ...)`` as a compiled program of this engine (a
    top-level model call uses the default engine's;
    `penzai_lm.generation.forward`).

    Args:
      model: An uncached `TransformerLM` on concrete arrays.
      tokens: Named token ids with a ``seq`` axis.
      token_positions: As in `TransformerLM.__call__`.
      padding: A named mask of padding tokens (True), from which the
        positions are computed inside the program when ``token_positions``
        is None.
      return_logits: With False the program returns None instead of the
        logits, so XLA leaves out whatever only they need (the output
        projection, the blocks after the last state variable written);
        state variables (captures) still get their values.
      **side_inputs: Forwarded to the model.
    """
    from penzai_lm.generation.forward import compiled_forward  # pylint: disable=g-import-not-at-top
    check_tokens(tokens, model.config.vocab_size)
    if compiles(tokens, token_positions, side_inputs):
      logits = compiled_forward(model, tokens, engine=self,
                                token_positions=token_positions,
                                padding=padding,
                                return_logits=return_logits, **side_inputs)
      if logits is not NotImplemented:
        return logits
    # Traced, eager, or an unhashable non-array side input: the plain call.
    if token_positions is None and padding is not None:
      token_positions = positions_from_padding(padding)
    logits = model(tokens, token_positions=token_positions, **side_inputs)
    return logits if return_logits else None

  def prepare(self, model, request) -> prepare_lib.PreparedModel:
    """The model ready for ``request``'s programs (cached).

    Cached per model structure, weights and shape: a patched variant of a
    prepared model (same weights, other patch values) gets the prepared
    model with only its patch's arrays replaced
    (`penzai_lm.generation.variants`); nothing is unstacked again.
    """
    cached = request_lib.is_cached_model(model)
    shape = request.decode
    index = prepare_lib.row_index(
        prepare_lib.per_row_size(model, shape.batch_axis),
        num_prompts=request.num_prompts, num_samples=request.num_samples,
        batch=shape.batch)

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
          model, cached_model=cached, use_cache=shape.use_cache,
          batch_axis=shape.batch_axis, batch=shape.batch,
          cache_len=shape.cache_len, decoded=decoded,
          capture=request.capture, prompt_attention=self.prompt_attention)
      recipes = lineage.recipes(prepared.model_leaves, leaves, values)
      prepared = dataclasses.replace(
          prepared,
          model_leaves=alias_weights(prepared.model_leaves, leaves, values),
          state_args=alias_weights(prepared.state_args, leaves, values))
      return Derivable(
          prepared, recipes, leaves=lambda p: p.model_leaves,
          rebuild=lambda p, new: dataclasses.replace(p, model_leaves=new))

    return self._prepared.get_or_make(
        model, (cached, shape.use_cache, shape.batch_axis, shape.batch,
                shape.cache_len, self.unstack_layer_stacks, index,
                request.capture, self.prompt_attention), make)

  def program(self, name: str, fn, static, args, *, shape, donate=(),
              blocks: int | None = None, parameters: int | None = None):
    """``(compiled program, compile seconds)`` for ``fn`` (cached).
    ``blocks`` and ``parameters``: the model's transformer blocks and
    parameters, for the default compiler options."""
    return self.lower(name, fn, static, args, shape=shape, donate=donate,
                      blocks=blocks, parameters=parameters).compile()

  def lower(self, name: str, fn, static, args, *, shape, donate=(),
            blocks: int | None = None, parameters: int | None = None
            ) -> Pending:
    """``fn``'s program traced (or cached): see `ProgramCache.lower`."""
    return self.programs.lower(
        name, fn, static, args,
        self._options_for(name, shape, blocks, parameters), donate)

  def compile_ahead(self, name: str, fn, static, args, *, shape, donate=(),
                    blocks: int | None = None,
                    parameters: int | None = None) -> float:
    """Traces ``fn``'s program and compiles it in the background (see
    `ProgramCache.compile_ahead`); returns the seconds spent tracing."""
    return self.programs.compile_ahead(
        name, fn, static, args,
        self._options_for(name, shape, blocks, parameters), donate)

  def _options_for(self, name: str, shape, blocks: int | None,
                   parameters: int | None):
    def options():
      if jax.default_backend() != "cpu":
        return {}
      if self._compiler_options is not None:
        return self._compiler_options(name, shape)
      return default_compiler_options(name, shape, blocks=blocks,
                                      parameters=parameters)
    return options


_DEFAULT_ENGINE = Engine()


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
