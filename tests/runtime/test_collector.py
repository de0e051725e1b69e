"""The cyclic collector is paused while programs are traced and models are
prepared, and left as it was found."""

import gc

import jax.numpy as jnp
import numpy as np
import pytest

from penzai_lm.generation import Engine
from penzai_lm.generation import prepare as prepare_lib
from penzai_lm.runtime.collector import collector_paused
from penzai_lm.runtime.program_cache import ProgramCache
from tests.generation.conftest import prompts


@pytest.fixture(autouse=True)
def enabled_collector():
  """Every test starts with the collector enabled, and leaves it so."""
  gc.enable()
  yield
  gc.enable()


def test_a_pause_disables_the_collector_and_enables_it_again():
  with collector_paused():
    assert not gc.isenabled()
  assert gc.isenabled()


def test_a_collector_the_user_disabled_stays_disabled():
  gc.disable()
  with collector_paused():
    assert not gc.isenabled()
  assert not gc.isenabled()


def test_nested_pauses_enable_it_at_the_outermost_end():
  with collector_paused():
    with collector_paused():
      pass
    assert not gc.isenabled()
  assert gc.isenabled()


def test_an_error_inside_a_pause_enables_it_again():
  with pytest.raises(ValueError, match="inside"):
    with collector_paused():
      raise ValueError("raised inside the pause")
  assert gc.isenabled()


def test_explicit_collections_still_run_inside_a_pause():
  # Only the automatic collections are paused: gc.collect() still frees
  # cycles.
  with collector_paused():
    cycle = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1


def test_tracing_a_program_runs_with_the_collector_paused():
  seen = []

  def program(static, x):
    del static
    seen.append(gc.isenabled())
    return x * 2

  cache = ProgramCache(4)
  compiled, _ = cache.lower("double", program, None,
                            (np.ones(3, np.float32),), dict).compile()
  assert seen == [False]
  assert gc.isenabled()
  np.testing.assert_array_equal(compiled(jnp.ones(3)), np.full(3, 2.0))


@pytest.mark.parametrize("over_stacks", [True, False])
def test_a_first_request_prepares_its_models_with_the_collector_paused(
    model, monkeypatch, over_stacks):
  seen = []
  prepare_model = prepare_lib.prepare_model

  def recording(*args, **kwargs):
    seen.append(gc.isenabled())
    return prepare_model(*args, **kwargs)

  monkeypatch.setattr(prepare_lib, "prepare_model", recording)
  engine = Engine(prefill_over_stacks=over_stacks)
  engine.generate(model, prompts([3, 5]), max_new_tokens=2, temperature=0.0)
  # Over the stacks: the stacked prefill's model, then the decode model's
  # (and its stacked prefill model); else the decode model alone.
  assert seen and not any(seen), seen
  assert gc.isenabled()
