"""Engine: bounded program and model caches, compiler options, no module
state."""

import gc

import jax
import numpy as np
import pytest

import penzai_lm
from penzai_lm import interp
from penzai_lm.generation import default_engine
from penzai_lm.generation import Engine
from penzai_lm.generation import generate
from penzai_lm.generation.shapes import DecodeShape
from penzai_lm.generation.shapes import PrefillShape
from tests.generation import conftest
from tests.generation.conftest import prompts

GREEDY = dict(max_new_tokens=3, temperature=0.0, stop_tokens=[])


def test_engine_runs_apart_from_the_default_one(model):
  engine = Engine()
  before = default_engine().compilations
  rows = prompts([4, 6], seed=40)
  mine = engine.generate(model, rows, **GREEDY)
  assert engine.compilations == 2  # One prefill, one decode program.
  # The timed parts are disjoint (the decode program, traced while the
  # prefill's was compiling, was counted twice).
  t = mine.timings
  assert t.compile_s > 0
  assert t.prepare_s + t.compile_s + t.prefill_s + t.decode_s <= t.total_s
  assert default_engine().compilations == before
  assert generate(model, rows, engine=engine, **GREEDY).tokens == mine.tokens
  assert engine.compilations == 2  # Reused.
  assert penzai_lm.generate(model, rows, **GREEDY).tokens == mine.tokens


def test_program_cache_is_bounded_least_recently_used(model):
  engine = Engine(max_programs=2)
  engine.generate(model, prompts([4]), **GREEDY)  # Batch bucket 1.
  engine.generate(model, prompts([4, 4]), **GREEDY)  # Batch bucket 2.
  assert engine.program_count() == 2
  assert engine.program_count("decode") == 1
  assert engine.compilations == 4
  engine.generate(model, prompts([4, 4]), **GREEDY)  # Still held.
  assert engine.compilations == 4
  engine.clear()
  assert engine.program_count() == 0


def test_prepared_models_are_bounded_and_do_not_keep_models_alive():
  engine = Engine(max_models=1)
  first = conftest.tiny_model("llama_gqa", False)
  engine.generate(first, prompts([4]), **GREEDY)
  engine.generate(first, prompts([4, 4]), **GREEDY)
  assert len(engine._prepared) == 1  # pylint: disable=protected-access
  model = penzai_lm.build_transformer(first.config, seed=11)
  engine.generate(model, prompts([4]), **GREEDY)
  del model
  gc.collect()
  engine.generate(first, prompts([4]), **GREEDY)
  assert len(engine._prepared) == 1  # pylint: disable=protected-access


@pytest.mark.parametrize("stacked", [True, False])
def test_a_dropped_model_frees_its_weights(stacked):
  """The engine's caches hold what they made from a model (its unstacked
  and prepared forms) but not the model: once the user drops it (and its
  patched variants), no array holds its weights' memory any more."""
  engine = Engine()
  config = conftest.tiny_model("llama_gqa", stacked).config
  model = penzai_lm.build_transformer(config, seed=23)
  buffers = {x.unsafe_buffer_pointer()
             for x in jax.tree_util.tree_leaves(model)
             if isinstance(x, jax.Array)}
  engine.generate(model, prompts([4]), **GREEDY)
  for strength in (2.0, 4.0):  # Variants reuse the prepared weights.
    engine.generate(_steered(model, strength), prompts([4]), **GREEDY)
  assert engine._prepared.derived >= 1  # pylint: disable=protected-access
  del model
  gc.collect()
  live = {x.unsafe_buffer_pointer() for x in jax.live_arrays()
          if not x.is_deleted()}
  assert not buffers & live
  assert len(engine._prepared) == 0  # pylint: disable=protected-access


def test_compiler_options_are_chosen_per_program_and_shape(model):
  seen = []

  def options(name, shape):
    seen.append((name, type(shape)))
    return {}

  engine = Engine(compiler_options=options)
  engine.generate(model, prompts([4]), **GREEDY)
  if jax.default_backend() == "cpu":
    assert seen == [("prefill", PrefillShape), ("decode", DecodeShape)]


def test_both_fusion_emitters_generate_the_same(model):
  """The tiny model's programs take the older emitters at LLVM -O0 by
  default (a small model); XLA's defaults (the newer emitters at -O2) must
  produce the same tokens and log-probs."""
  settings = dict(max_new_tokens=5, temperature=0.8, top_p=0.9, seed=3)
  rows = prompts([4, 7], seed=41)
  older = Engine().generate(model, rows, **settings)
  newer = Engine(compiler_options=lambda name, shape: {}).generate(
      model, rows, **settings)
  assert older.tokens == newer.tokens
  np.testing.assert_allclose(np.array(older.logprobs),
                             np.array(newer.logprobs), atol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_programs=0), "max_programs must be a positive integer"),
    (dict(max_models=1.5), "max_models must be a positive integer"),
    (dict(compiler_options={"decode": {}}), "compiler_options must be a"),
])
def test_engine_arguments_are_checked(kwargs, message):
  with pytest.raises((ValueError, TypeError), match=message):
    Engine(**kwargs)


# --- Patched variants reuse the prepared model (issue 28) ------------------


def _steered(model, strength, per_row=False):
  vector = np.linspace(-1.0, 1.0, model.config.hidden_size, dtype=np.float32)
  strengths = [0.0, strength] if per_row else strength
  return interp.insert_at(model, "blocks.1.resid_post",
                          interp.AddVector.build(vector, strengths))


def _weights(engine, model, rows):
  """The prepared model's arrays (a run's, before it starts)."""
  return engine.start(model, rows, **GREEDY)._prepared.model_leaves  # pylint: disable=protected-access


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("per_row", [False, True])
def test_patched_variants_reuse_the_prepared_model(stacked, per_row):
  """A new patched model object with other values and the same weights is
  not prepared (unstacked, converted) again: the prepared model of the
  first is reused with the patch's arrays replaced, and it generates what
  a fresh engine does."""
  model = conftest.tiny_model("llama_gqa", stacked)
  rows = prompts([4, 6], seed=41)
  engine = Engine()
  results = [engine.generate(_steered(model, s, per_row), rows, **GREEDY)
             for s in (2.0, 8.0, -8.0)]
  assert engine._prepared.made == 1  # pylint: disable=protected-access
  assert engine._prepared.derived == 2  # pylint: disable=protected-access
  assert engine.compilations == 2
  for s, result in zip((2.0, 8.0, -8.0), results):
    fresh = Engine().generate(_steered(model, s, per_row), rows, **GREEDY)
    assert result.tokens == fresh.tokens
  assert len({str(r.tokens) for r in results}) > 1  # The values matter.
  first = _weights(engine, _steered(model, 3.0, per_row), rows)
  second = _weights(engine, _steered(model, 5.0, per_row), rows)
  assert engine._prepared.made == 1  # pylint: disable=protected-access
  # Weights (every array larger than a steering vector) are the same
  # buffers; the steering values are new arrays.
  width = model.config.hidden_size
  assert all(a is b for a, b in zip(first, second) if a.size > width)
  assert not all(a is b for a, b in zip(first, second))


def test_variants_in_a_new_bucket_reuse_the_unstacked_weights():
  model = conftest.tiny_model("llama_gqa", True)
  engine = Engine()
  engine.generate(_steered(model, 2.0), prompts([4]), **GREEDY)
  engine.generate(_steered(model, 4.0), prompts([4, 4]), **GREEDY)
  assert engine._prepared.made == 2  # pylint: disable=protected-access
  assert engine._unstacked.made == 1  # pylint: disable=protected-access
  assert engine._unstacked.derived == 1  # pylint: disable=protected-access


def test_new_weights_or_structure_are_prepared_anew():
  model = conftest.tiny_model("llama_gqa", True)
  rows = prompts([4])
  engine = Engine()
  engine.generate(_steered(model, 2.0), rows, **GREEDY)
  other = penzai_lm.build_transformer(model.config, seed=12)
  engine.generate(_steered(other, 2.0), rows, **GREEDY)  # Other weights.
  engine.generate(model, rows, **GREEDY)  # Another structure.
  assert engine._prepared.made == 3  # pylint: disable=protected-access
  assert engine._prepared.derived == 0  # pylint: disable=protected-access


def test_prepare_time_is_reported():
  model = conftest.tiny_model("llama_gqa", True)
  engine = Engine()
  first = engine.generate(_steered(model, 2.0), prompts([4]), **GREEDY)
  t = first.timings
  assert 0 < t.prepare_s < t.total_s
