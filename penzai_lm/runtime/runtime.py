"""`Runtime`: compiles, caches and runs programs.

A runtime owns a bounded `ProgramCache` of compiled programs, the optional
on-disk `ProgramStore` it compiles through, and the XLA compile options of
its programs (`compiler_options.default_compiler_options` unless given).
Programs are asked for by name ("prefill", "decode" and "forward" today),
a static key and example arguments: `program` compiles (or finds) one,
`lower` traces it and leaves the compile for later, and `lower_ahead`
traces one for XLA to compile in the background (`Pending.start_compile`).

`forward` runs a model call as one compiled program (`forward.py`). The
default runtime (`default_runtime()`) serves top-level model calls
(`TransformerLM.__call__` reaches it through `penzai_lm.model.dispatch`)
and the default `penzai_lm.Engine`.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import jax

from penzai_lm.model import dispatch
from penzai_lm.model.transformer import check_tokens
from penzai_lm.model.transformer import compiles
from penzai_lm.model.transformer import positions_from_padding
from penzai_lm.runtime import forward as forward_lib
from penzai_lm.runtime.compiler_options import default_compiler_options
from penzai_lm.runtime.program_cache import Pending
from penzai_lm.runtime.program_cache import ProgramCache
from penzai_lm.runtime.program_store import auto_directory
from penzai_lm.runtime.program_store import ProgramStore

CompilerOptions = Callable[[str, Any], dict[str, Any]]


def check_bound(name: str, value) -> None:
  """Refuses a cache bound that is not a positive integer, naming it."""
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{name} must be a positive integer, got {value!r}.")


class Runtime:
  """Compiles and caches programs.

  Attributes:
    programs: The `ProgramCache` (``programs.compilations`` counts
      compilations).
  """

  def __init__(self, *, max_programs: int = 32,
               compiler_options: CompilerOptions | None = None,
               program_store: ProgramStore | str | os.PathLike | None = "auto"):
    """Creates a runtime.

    Args:
      max_programs: Compiled programs kept (least recently used evicted).
      compiler_options: ``fn(program_name, shape) -> dict`` of XLA options
        for programs compiled on CPU ("prefill" with a `PrefillShape`,
        "decode" with a `DecodeShape`, "forward" with the tokens' named
        shape), asked once per compilation; default
        `default_compiler_options`.
      program_store: Where compiled programs' exported forms are kept, so
        that a new process skips tracing them (`ProgramStore`): a store, a
        directory, None (off), or "auto": ``penzai_lm_programs`` inside
        JAX's persistent compilation cache directory while one is set
        (``jax_compilation_cache_dir``; the CLI sets one).

    Raises:
      ValueError / TypeError: for a bad argument, naming it.
    """
    check_bound("max_programs", max_programs)
    if compiler_options is not None and not callable(compiler_options):
      raise TypeError(
          "compiler_options must be a function (program name, shape) ->"
          f" dict, got {type(compiler_options).__name__}.")
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
    self._compiler_options = compiler_options
    self.programs = ProgramCache(max_programs, store=self.program_store)

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
    """Compiled programs held ("prefill", "decode", "forward" or all)."""
    return len(self.programs.items(name))

  def clear(self) -> None:
    """Drops every compiled program."""
    self.programs.clear()

  def forward(self, model, tokens, *, token_positions=None, padding=None,
              return_logits: bool = True, **side_inputs):
    """``model(tokens, ...)`` as a compiled program of this runtime (a
    top-level model call uses the default runtime's; `forward.py`).

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
    check_tokens(tokens, model.config.vocab_size)
    if compiles(tokens, token_positions, side_inputs):
      logits = forward_lib.compiled_forward(
          self, model, tokens, token_positions=token_positions,
          padding=padding, return_logits=return_logits, **side_inputs)
      if logits is not NotImplemented:
        return logits
    # Traced, eager, or an unhashable non-array side input: the plain call.
    if token_positions is None and padding is not None:
      token_positions = positions_from_padding(padding)
    logits = model(tokens, token_positions=token_positions, **side_inputs)
    return logits if return_logits else None

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

  def lower_ahead(self, name: str, fn, static, args, *, shape, donate=(),
                  blocks: int | None = None, parameters: int | None = None
                  ) -> Pending | None:
    """``fn``'s program traced for a compile on another thread, or None if
    it is cached or being made: see `ProgramCache.lower_ahead`."""
    return self.programs.lower_ahead(
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


_DEFAULT_RUNTIME = Runtime()
dispatch.use_compiled_forward(
    lambda model, tokens, **kwargs: forward_lib.compiled_forward(
        _DEFAULT_RUNTIME, model, tokens, **kwargs))


def default_runtime() -> Runtime:
  """The runtime of top-level model calls and of the default engine."""
  return _DEFAULT_RUNTIME
