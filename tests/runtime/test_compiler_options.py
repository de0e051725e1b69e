"""Compiler options: XLA's defaults but for small models and CPU decode
programs, chosen per program and model size."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from penzai_lm import interp
from penzai_lm.generation import Engine
from penzai_lm.runtime import compiler_options
from penzai_lm.runtime import runtime as runtime_lib
from penzai_lm.runtime.compiler_options import default_compiler_options
from penzai_lm.runtime.compiler_options import small_model_options
from tests.generation import conftest
from tests.generation.conftest import prompts

GREEDY = dict(max_new_tokens=3, temperature=0.0, stop_tokens=[])


# What a decode program on CPU compiles with beside the other options.
SERIAL = {"xla_disable_hlo_passes": "cpu-parallel-task-assigner"}


def _decode_extra(program: str) -> dict:
  """What a decode program adds on CPU (`SERIAL`)."""
  cpu = jax.default_backend() == "cpu"
  return SERIAL if cpu and program == "decode" else {}


def test_few_block_models_compile_with_the_older_fusion_emitters():
  older = {"xla_cpu_use_fusion_emitters": False}
  large = compiler_options.SMALL_MODEL + 1
  for program in ("prefill", "decode"):
    extra = _decode_extra(program)
    assert default_compiler_options(program, None, blocks=3) == older | extra
    assert default_compiler_options(program, None, blocks=3,
                                    parameters=large) == older | extra
    assert default_compiler_options(program, None, blocks=4) == extra
    assert default_compiler_options(program, None) == extra
  assert default_compiler_options("forward", None, blocks=1) == {}


def test_decode_programs_keep_xla_ops_on_one_thread():
  """On CPU a decode program's own ops are not split into parallel tasks
  (`SERIAL`); the option does that in this jaxlib: an op that XLA
  splits by default is not split under it (the pass has a name that a
  jaxlib upgrade could change, making the option a silent no-op)."""
  if jax.default_backend() != "cpu":
    pytest.skip("XLA:CPU's pass")
  large = compiler_options.SMALL_MODEL + 1
  assert default_compiler_options(
      "decode", None, blocks=30, parameters=large) == SERIAL
  for program in ("prefill", "forward"):
    assert default_compiler_options(
        program, None, blocks=30, parameters=large) == {}
  lowered = jax.jit(lambda x: jnp.tanh(x) * 2 + x).lower(
      np.zeros((8, 1 << 14), np.float32))
  partitions = "outer_dimension_partitions"
  if len(os.sched_getaffinity(0)) >= 2:  # XLA splits for 2 threads or more
    assert partitions in lowered.compile().as_text()
  assert partitions not in lowered.compile(SERIAL).as_text()


def test_small_models_compile_at_llvm_o0():
  if jax.default_backend() != "cpu":
    pytest.skip("XLA:CPU's options")
  small = small_model_options()
  assert small == {"xla_cpu_use_fusion_emitters": False,
                   "xla_backend_optimization_level": 0,
                   "xla_llvm_disable_expensive_passes": True}
  for program in ("prefill", "decode", "forward"):
    for blocks in (None, 1, 30):
      assert default_compiler_options(
          program, None, blocks=blocks,
          parameters=compiler_options.SMALL_MODEL) == small
    assert default_compiler_options(
        program, None, blocks=30,
        parameters=compiler_options.SMALL_MODEL + 1) == _decode_extra(program)


def test_programs_are_compiled_for_the_models_size(model, monkeypatch):
  """The engine counts the model's parameters (array elements) for every
  program: generation's and a top-level call's (the cached model's arrays
  add a few elements)."""
  asked = []

  def spy(program, shape, **kwargs):
    asked.append((program, kwargs["parameters"]))
    return default_compiler_options(program, shape, **kwargs)

  monkeypatch.setattr(runtime_lib, "default_compiler_options", spy)
  engine = Engine()
  engine.generate(model, prompts([4]), **GREEDY)
  interp.run_with_cache(model, prompts([5])[0], names=[], engine=engine)
  size = sum(x.size for x in jax.tree_util.tree_leaves(model))
  assert 10_000 < size <= compiler_options.SMALL_MODEL
  assert [name for name, _ in asked] == ["prefill", "decode", "forward"]
  assert all(size <= n <= size * 1.01 for _, n in asked), (asked, size)


@pytest.mark.parametrize("over_stacks", [True, False])
def test_a_prefill_over_the_stacks_is_compiled_for_one_block(over_stacks,
                                                             monkeypatch):
  """A prefill over the layer stack compiles one block (its scan's body),
  so it gets the options of a few-block program; the decode program runs
  every layer's block (SmolLM2: the prefill compiled in 0.9 -> 0.6 s)."""
  asked = []

  def spy(program, shape, **kwargs):
    asked.append((program, kwargs["blocks"]))
    return default_compiler_options(program, shape, **kwargs)

  monkeypatch.setattr(runtime_lib, "default_compiler_options", spy)
  model = conftest.tiny_model("llama_gqa", stacked=True)
  Engine(prefill_over_stacks=over_stacks).generate(model, prompts([4]),
                                                   **GREEDY)
  assert asked == [("prefill", 1 if over_stacks else 3), ("decode", 3)]
