"""run_with_cache runs as a compiled program of the engine (issue 28): the
same values as op by op, one program per padded shape whatever the rows'
lengths, new values of a patch reuse it, and inside a JAX trace it is traced
as usual."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

import penzai_lm
from penzai_lm import interp
from penzai_lm.generation import Engine
from penzai_lm.runtime.unstack import unstack_layers
from tests.model.configs import config

NAMES = ["embed", "blocks.1.resid_post", "blocks.0.attn.pattern",
         "blocks.1.mlp.neurons"]


def _model(stacked=True):
  model = penzai_lm.build_transformer(config("llama_gqa", True), seed=3)
  return model if stacked else unstack_layers(model)


def _np(x):
  return np.asarray(x.unwrap(*sorted(x.named_shape)))


def _assert_same(a, b):
  for name in a.keys():
    np.testing.assert_allclose(_np(a[name]), _np(b[name]), rtol=1e-5,
                               atol=1e-5, err_msg=name)
  np.testing.assert_allclose(_np(a.logits), _np(b.logits), rtol=1e-5,
                             atol=1e-5)


def _steer(model, strength):
  vector = np.linspace(-1, 1, model.config.hidden_size, dtype=np.float32)
  return interp.insert_at(model, "blocks.0.resid_post",
                          interp.AddVector.build(vector, strength))


@pytest.mark.parametrize("stacked", [True, False])
def test_compiled_equals_eager_on_ragged_rows(stacked):
  model = _model(stacked)
  engine = Engine()
  ids = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
  got = interp.run_with_cache(model, ids, names=NAMES, engine=engine)
  assert engine.compilations == 1
  want = interp.run_with_cache(model, ids, names=NAMES, eager=True,
                               engine=engine)
  assert engine.compilations == 1
  _assert_same(got, want)
  assert got.lengths == [6, 3]
  # Padding is masked: a row's values are those of the row alone.
  alone = interp.run_with_cache(model, [ids[1]], names=NAMES, engine=engine)
  np.testing.assert_allclose(_np(got.row(1, "blocks.1.resid_post")),
                             _np(alone.row(0, "blocks.1.resid_post")),
                             rtol=1e-5, atol=1e-5)


def test_one_program_per_padded_shape_and_patch_structure():
  model = _model()
  engine = Engine()
  for ids in ([[1, 2, 3, 4], [5, 6]], [[1, 2], [3, 4, 5, 6]],
              [[9, 8, 7, 6], [5, 4, 3, 2]], [[1], [2, 3, 4, 5]]):
    interp.run_with_cache(model, ids, names=NAMES, engine=engine)
  assert engine.compilations == 1
  for strength in (1.0, 4.0, -2.0):  # New patch values: the same program.
    cache = interp.run_with_cache(_steer(model, strength), [[1, 2], [3]],
                                  names=NAMES, engine=engine)
  assert engine.compilations == 2
  want = interp.run_with_cache(_steer(model, -2.0), [[1, 2], [3]],
                               names=NAMES, eager=True)
  _assert_same(cache, want)


def test_traced_inside_jax_transformations():
  model = _model()
  engine = Engine()
  tokens = pz.nx.wrap(jnp.asarray([[1, 2, 3, 4]])).tag("batch", "seq")
  want = interp.run_with_cache(model, tokens, names=NAMES, engine=engine)

  def resid(m):
    cache = interp.run_with_cache(m, tokens, names=NAMES, engine=engine)
    return cache["blocks.1.resid_post"].data_array

  got = jax.jit(resid)(model)
  assert engine.compilations == 1  # The top-level call only.
  np.testing.assert_allclose(
      np.asarray(got), np.asarray(want["blocks.1.resid_post"].data_array),
      rtol=1e-5, atol=1e-5)


def test_eager_context_runs_op_by_op():
  model = _model()
  engine = Engine()
  with penzai_lm.eager():
    interp.run_with_cache(model, [[1, 2, 3]], names=NAMES, engine=engine)
  assert engine.compilations == 0


def _flops(engine) -> list[float]:
  return [float(p.cost_analysis()["flops"])
          for _, p in engine.programs.items("forward")]


@pytest.mark.parametrize("stacked", [True, False])
def test_without_logits_only_what_the_captures_need_runs(stacked):
  """``logits=False``: the same captured values, no logits, and a program
  without the output projection (and, per-layer, without the blocks after
  the last captured point)."""
  model, engine = _model(stacked), Engine()
  prompts = [[1, 2, 3, 4], [5, 6]]
  point = "blocks.0.resid_post"
  full = interp.run_with_cache(model, prompts, names=[point], engine=engine)
  lean = interp.run_with_cache(model, prompts, names=[point], engine=engine,
                               logits=False)
  assert lean.logits is None and full.logits is not None
  np.testing.assert_array_equal(_np(lean[point]), _np(full[point]))
  with_logits, without = _flops(engine)
  assert without < with_logits
  if not stacked:  # A later point needs more of the model.
    interp.run_with_cache(model, prompts, names=["blocks.1.resid_post"],
                          engine=engine, logits=False)
    assert _flops(engine)[2] > without
  eager = interp.run_with_cache(model, prompts, names=[point], logits=False,
                                eager=True)
  assert eager.logits is None
  np.testing.assert_allclose(_np(eager[point]), _np(full[point]), rtol=1e-5,
                             atol=1e-5)
  with pytest.raises(TypeError, match="logits must be True or False"):
    interp.run_with_cache(model, prompts, names=[point], logits="no")
