"""A first request compiles its decode program on another thread while the
prefill compiles and runs (ProgramCache.lower_ahead, Pending.start_compile),
and a new process compiles nothing else for it."""

import json
import pathlib
import subprocess
import sys
import threading

import jax
from jax import monitoring
import pytest
import transformers

from penzai_lm.generation import Engine
from tests.generation.conftest import prompts
from tests.loading.hf_models import save_perturbed
from tests.loading.synthetic_checkpoints import write_random_llama

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


@pytest.mark.parametrize("stacks", ["over stacks", "per layer"])
def test_decode_compiles_on_its_own_thread_once(model, stacks):
  # Over the layer stacks, the prefill compiles on a thread of its own while
  # this one prepares the decode model; per layer, here, beside the decode
  # program's compile.
  engine = Engine(program_store=None,
                  prefill_over_stacks=stacks == "over stacks")
  rows = prompts([4, 6], seed=41)
  result = {}
  threads = dict(_compile_threads(
      lambda: result.update(first=engine.generate(model, rows, **GREEDY))))
  assert threads["jit(decode_program)"] == "penzai_lm compile decode"
  assert threads["jit(prefill_program)"] == (
      "penzai_lm compile prefill" if stacks == "over stacks"
      else threading.current_thread().name)
  assert engine.compilations == 2  # The decode program was not made twice.
  again = engine.generate(model, rows, **GREEDY)
  assert engine.compilations == 2
  assert again.tokens == result["first"].tokens
  # The same tokens as recomputing the whole sequence without a cache.
  recomputed = engine.generate(model, rows, use_cache=False, **GREEDY)
  assert recomputed.tokens == again.tokens


@pytest.mark.parametrize("stacks", ["over stacks", "per layer"])
def test_a_streamed_first_request_compiles_decode_after_its_prefill(
    model, stacks):
  # The first tokens come from the prefill, which compiles on a thread of
  # its own. Per layer, this one traces the decode program meanwhile, and
  # XLA compiles it on its own thread, once, after the prefill has run.
  # Over the stacks, this one prepares the decode model meanwhile, and the
  # next chunk traces and compiles the decode program.
  engine = Engine(program_store=None,
                  prefill_over_stacks=stacks == "over stacks")
  rows = prompts([4, 6], seed=44)
  events = []
  threads = _compile_threads(lambda: events.extend(
      engine.stream(model, rows, chunk_size=2, **GREEDY)))
  assert dict(threads) == {
      "jit(prefill_program)": "penzai_lm compile prefill",
      "jit(decode_program)": ("penzai_lm compile decode" if stacks == "per layer"
                              else threading.current_thread().name)}
  assert engine.compilations == 2
  got = {}
  for e in events:
    got.setdefault(e.row, []).extend(e.tokens)
  assert [got[0], got[1]] == engine.generate(model, rows, **GREEDY).tokens
  assert engine.compilations == 2


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


def test_a_failed_streamed_prefill_leaves_no_decode_program_waiting(model):
  # The decode program was traced beside the prefill's failed compile and
  # never compiled: the next request compiles it rather than waiting for it.
  failing = threading.Event()
  failing.set()

  def options(name, shape):
    del shape
    return ({"xla_no_such_option_pzlm": True}
            if name == "prefill" and failing.is_set() else {})

  engine = Engine(program_store=None, compiler_options=options)
  if jax.default_backend() != "cpu":
    pytest.skip("compiler options apply to CPU programs only")
  rows = prompts([4, 6], seed=45)
  with pytest.raises(Exception, match="xla_no_such_option_pzlm"):
    list(engine.stream(model, rows, chunk_size=2, **GREEDY))
  failing.clear()
  events = []
  second = threading.Thread(target=lambda: events.extend(
      engine.stream(model, rows, chunk_size=2, **GREEDY)), daemon=True)
  second.start()
  second.join(timeout=300)
  assert not second.is_alive(), "the second request waited for a program"
  assert events and engine.compilations == 2


_FIRST_REQUEST = r"""
import json, sys
from jax import monitoring
names = []
monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **kw: names.append(kw.get("fun_name", ""))
    if event == "/jax/core/compile/backend_compile_duration" else None)
import penzai_lm
from penzai_lm.generation import Engine
model = penzai_lm.load_model(sys.argv[1])
Engine(program_store=None).generate(
    model, [[5, 6, 7, 8, 9], [10, 11]], max_new_tokens=3, temperature=0.7,
    top_p=0.9, seed=3, stop_tokens=[])
print(json.dumps(names))
"""


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_new_process_compiles_only_the_two_programs(family, tmp_path):
  # Eager jnp ops compile a program per shape and dtype on first use (empty
  # caches, norm epsilons, slices of the stacks: ~0.3 s of a SmolLM2 first
  # request); loading and preparing a model makes its arrays on the host.
  if jax.default_backend() != "cpu":
    pytest.skip("counts a CPU process's compilations")
  if family == "llama":
    path = write_random_llama(tmp_path / "m", dict(
        vocab_size=128, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
  else:
    path = tmp_path / "m"
    save_perturbed(transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        vocab_size=101, hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, sliding_window=5, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=16, rope_local_base_freq=1e4), path)
  out = subprocess.run(
      [sys.executable, "-c", _FIRST_REQUEST, str(path)], capture_output=True,
      text=True, timeout=600, check=False,
      cwd=pathlib.Path(__file__).resolve().parents[2])
  assert out.returncode == 0, out.stderr[-3000:]
  names = json.loads(out.stdout.strip().splitlines()[-1])
  # A model this small also has XLA asked which compile options it knows
  # (`runtime.compiler_options._cpu_accepts`, once a process).
  names = [n for n in names if n != "jit(_probe)"]
  assert sorted(names) == ["jit(decode_program)", "jit(prefill_program)"], (
      names)
