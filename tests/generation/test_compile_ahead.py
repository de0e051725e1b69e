"""A first request compiles its decode program on another thread while the
prefill compiles and runs (ProgramCache.compile_ahead)."""

import threading

import jax
from jax import monitoring
import pytest

from penzai_lm.generation import Engine
from tests.generation.conftest import prompts

GREEDY = dict(max_new_tokens=3, temperature=0.0, stop_tokens=[])


def _compile_threads(run) -> list[tuple[str, str]]:
  """``(program name, thread)`` of each program XLA compiled while ``run()``
  runs. A list: with a program store both programs are named "jit(call)",
  and a dict kept whichever finished last (a small model's decode program
  now compiles before the prefill's, so its thread was overwritten)."""
  threads = []

  def listener(event, seconds, **kw):
    del seconds
    name = kw.get("fun_name", "")
    if event == "/jax/core/compile/backend_compile_duration" and (
        "program" in name or name == "jit(call)"):
      threads.append((name, threading.current_thread().name))

  monitoring.register_event_duration_secs_listener(listener)
  try:
    run()
  finally:
    monitoring.unregister_event_duration_listener(listener)
  return threads


def test_decode_compiles_on_its_own_thread_once(model):
  engine = Engine(program_store=None)
  rows = prompts([4, 6], seed=41)
  result = {}
  threads = dict(_compile_threads(
      lambda: result.update(first=engine.generate(model, rows, **GREEDY))))
  assert threads["jit(decode_program)"] == "penzai_lm compile decode"
  assert threads["jit(prefill_program)"] == threading.current_thread().name
  assert engine.compilations == 2  # The decode program was not made twice.
  again = engine.generate(model, rows, **GREEDY)
  assert engine.compilations == 2
  assert again.tokens == result["first"].tokens
  # The same tokens as recomputing the whole sequence without a cache.
  recomputed = engine.generate(model, rows, use_cache=False, **GREEDY)
  assert recomputed.tokens == again.tokens


def test_with_a_program_store(model, tmp_path):
  engine = Engine(program_store=tmp_path)
  rows = prompts([3], seed=42)
  threads = _compile_threads(lambda: engine.generate(model, rows, **GREEDY))
  assert "penzai_lm compile decode" in [thread for _, thread in threads]
  assert engine.compilations == 2
  assert engine.program_store().stats.saved == 2


def test_a_failed_background_compile_is_raised_by_the_decode_call(model):
  # XLA refuses the unknown option on the background thread; the decode
  # call compiles again and raises XLA's error instead of hanging.
  def options(name, shape):
    del shape
    return {"xla_no_such_option_pzlm": True} if name == "decode" else {}

  engine = Engine(program_store=None, compiler_options=options)
  if jax.default_backend() != "cpu":
    pytest.skip("compiler options apply to CPU programs only")
  with pytest.raises(Exception, match="xla_no_such_option_pzlm"):
    engine.generate(model, prompts([4], seed=43), **GREEDY)
  assert engine.compilations == 1  # The prefill.
