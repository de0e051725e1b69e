"""Top-level model calls run as compiled programs of the engine (issue 28):
equal to the eager call, compiled once per structure and shape, state
written back, eager on request and traced as usual inside JAX
transformations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

import penzai_lm
from penzai_lm import interp
from penzai_lm.generation import default_engine
from penzai_lm.generation import Engine
from tests.generation import conftest


def _tokens(rows, seed=0, length=5):
  ids = np.random.default_rng(seed).integers(1, conftest.VOCAB,
                                             (rows, length))
  return pz.nx.wrap(jnp.asarray(ids, jnp.int32)).tag("batch", "seq")


def _values(logits):
  return np.asarray(logits.unwrap("batch", "seq", "vocabulary"))


def _steered(model, strength):
  vector = np.linspace(-1.0, 1.0, model.config.hidden_size, dtype=np.float32)
  return interp.insert_at(model, "blocks.1.resid_post",
                          interp.AddVector.build(vector, strength))


@pytest.mark.parametrize("stacked", [True, False])
def test_a_call_compiles_once_per_shape_and_equals_the_eager_call(stacked):
  model = conftest.tiny_model("llama_gqa", stacked)
  engine = default_engine()
  tokens = _tokens(2, seed=1)
  with penzai_lm.eager():
    before = engine.compilations
    expected = _values(model(tokens))
    assert engine.compilations == before  # Eager: nothing compiled.
  got = _values(model(tokens))
  np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
  compiled = engine.compilations
  for seed in (2, 3):  # New ids, same shape: the same program.
    model(_tokens(2, seed=seed))
  positions = pz.nx.wrap(jnp.asarray([[0, 1, 2, 3, 4], [-1, 0, 1, 2, 3]])
                         ).tag("batch", "seq")
  model(tokens, token_positions=positions)  # Positions: one more program.
  assert engine.compilations == compiled + 1
  model(_tokens(3, seed=4))  # A new shape: one more.
  assert engine.compilations == compiled + 2


def test_patched_models_with_new_values_reuse_the_program():
  model = conftest.tiny_model("llama_gqa", True)
  tokens = _tokens(2, seed=5)
  engine = Engine()
  first = _values(engine.forward(_steered(model, 1.0), tokens))
  assert engine.compilations == 1
  outs = [_values(engine.forward(_steered(model, s), tokens))
          for s in (2.0, -3.0)]
  assert engine.compilations == 1
  with penzai_lm.eager():
    eager = _values(_steered(model, -3.0)(tokens))
  np.testing.assert_allclose(outs[1], eager, atol=1e-5, rtol=1e-5)
  assert not np.allclose(first, outs[0])


def test_an_engine_of_its_own_keeps_its_programs():
  model = conftest.tiny_model("llama_gqa", True)
  engine = Engine(max_programs=1)
  before = default_engine().compilations
  engine.forward(model, _tokens(1, seed=6))
  engine.forward(model, _tokens(2, seed=6))  # Evicts the first.
  engine.forward(model, _tokens(1, seed=7))
  assert engine.compilations == 3 and engine.program_count("forward") == 1
  assert default_engine().compilations == before


def test_state_variables_hold_their_new_values():
  model = conftest.patched_model()  # A recorder counts the tokens it saw.
  recorder = pz.select(model).at_instances_of(conftest.CallRecorder).get()
  start = int(recorder.seen.value)
  model(_tokens(2, seed=8, length=6))
  model(_tokens(2, seed=9, length=6))
  assert int(recorder.seen.value) == start + 12
  with penzai_lm.eager():
    model(_tokens(2, seed=9, length=6))
  assert int(recorder.seen.value) == start + 18


def test_calls_inside_jax_transformations_are_traced_as_usual():
  model = conftest.tiny_model("llama_gqa", True)
  tokens = _tokens(2, seed=10)
  expected = _values(model(tokens))
  engine = default_engine()
  before = engine.compilations
  jitted = jax.jit(lambda m, t: m(t))(model, tokens)
  closed = jax.jit(lambda: model(tokens))()  # Concrete inputs, in a trace.
  np.testing.assert_allclose(_values(jitted), expected, atol=1e-5)
  np.testing.assert_allclose(_values(closed), expected, atol=1e-5)

  def loss(strength):
    steered = _steered(model, pz.nx.wrap(jnp.asarray(strength, jnp.float32)))
    return steered(tokens).data_array.sum()

  grad = jax.grad(loss)(1.0)

  def body(carry, ids):
    return carry, model(pz.nx.wrap(ids).tag("batch", "seq")).data_array

  ids = tokens.unwrap("batch", "seq")
  _, scanned = jax.lax.scan(body, 0, jnp.stack([ids, ids]))
  np.testing.assert_allclose(np.asarray(scanned[1]), expected, atol=1e-5)
  assert engine.compilations == before  # All traced by the caller.
  step = 1e-2  # Top-level calls: compiled.
  numeric = (loss(1.0 + step) - loss(1.0 - step)) / (2 * step)
  np.testing.assert_allclose(grad, numeric, rtol=2e-2)


def test_eager_is_a_context_manager_and_a_decorator():
  model = conftest.tiny_model("llama_gqa", True)
  engine = Engine()

  @penzai_lm.eager()
  def run():
    return engine.forward(model, _tokens(1, seed=11))

  run()
  assert engine.compilations == 0
  with penzai_lm.eager():
    with penzai_lm.eager(False):
      engine.forward(model, _tokens(1, seed=11))
  assert engine.compilations == 1


def test_invalid_tokens_are_refused_before_compiling():
  model = conftest.tiny_model("llama_gqa", True)
  engine = default_engine()
  before = engine.compilations
  bad = pz.nx.wrap(jnp.asarray([[1, conftest.VOCAB]])).tag("batch", "seq")
  with pytest.raises(ValueError, match="outside the vocabulary"):
    model(bad)
  assert engine.compilations == before
