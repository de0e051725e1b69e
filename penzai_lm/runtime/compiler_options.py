"""XLA compile options for the runtime's programs.

`default_compiler_options` gives XLA's defaults, but for small models and
decoding on CPU: programs of models with at most `FEW_BLOCKS` transformer
blocks (prefill and decode) compile with XLA:CPU's older fusion emitters,
programs of models with at most `SMALL_MODEL` parameters take
`small_model_options` (both trade a little run time for compile time where
the compile is the wait), and decode programs on CPU keep XLA's own ops on
one thread. `docs/design.md` ("Compile options") has the measurements
behind them, rerun with `benchmarks/emitters_compile.py`,
`benchmarks/small_model_compile.py` and `benchmarks/decode_step_ops.py`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from penzai_lm.model.transformer import TransformerBlock


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
  """XLA's defaults, but for small models and for decoding on CPU.

  * A model of at most `SMALL_MODEL` parameters (toy and test models):
    `small_model_options` for every program. Its steps take a fraction of
    a millisecond either way; the compile is the wait.
  * A prefill or decode program of a model with at most `FEW_BLOCKS`
    blocks: XLA:CPU's older fusion emitters (they generate LLVM IR per
    fusion, faster per kernel than the newer emitters, which compile each
    distinct kernel once through MLIR and so win on deep models).
  * A decode program on CPU: no parallel tasks for XLA's own ops (its
    ``cpu-parallel-task-assigner`` pass left out). XLA:CPU splits loop
    fusions of a few KB into tasks for its thread pool, and waking the
    pool costs more than such an op; a decode step at a few rows is made
    of them (`docs/design.md` counts them). The products, which need the
    cores, run on the kernels' own threads, and XLA's dots are never split
    by the pass.
  * Anything else: no options (XLA's defaults, YNNPACK fusions included).

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
  options = {}
  if (program in ("prefill", "decode") and blocks is not None
      and blocks <= FEW_BLOCKS and _cpu_accepts(_EMITTERS, False)):
    options[_EMITTERS] = False
  if (program == "decode" and jax.default_backend() == "cpu"
      and _cpu_accepts(_DISABLE_PASSES, _PARALLEL_TASKS)):
    options[_DISABLE_PASSES] = _PARALLEL_TASKS
  return options


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
# XLA:CPU's pass that splits ops into parallel tasks (the
# ``outer_dimension_partitions`` of their backend configs), left out of
# decode programs.
_DISABLE_PASSES = "xla_disable_hlo_passes"
_PARALLEL_TASKS = "cpu-parallel-task-assigner"


@functools.cache
def _cpu_accepts(option: str, value: Any) -> bool:
  """Whether this jaxlib's XLA:CPU knows the compile option (older ones
  lack the emitter switch and refuse every program that names it). Asked
  only while CPU is the default backend."""
  try:
    jax.jit(_probe).lower(np.zeros((), np.float32)).compile({option: value})
  except RuntimeError:  # INVALID_ARGUMENT: No such compile option.
    return False
  return True


def _probe(x):
  """The program `_cpu_accepts` compiles (named: tests count compiles)."""
  return x + 1


def count_parameters(leaves) -> int:
  """Array elements of a model's leaves (its size, for compiler options)."""
  return sum(int(np.size(x)) for x in leaves if hasattr(x, "shape"))


def count_blocks(model) -> int:
  """Transformer blocks a model runs one after the other (a layer stack
  counts once: its scan compiles one block)."""
  return sum(isinstance(x, TransformerBlock) for x in jax.tree_util.tree_leaves(
      model, is_leaf=lambda x: isinstance(x, TransformerBlock)))
