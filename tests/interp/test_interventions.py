"""Interventions as data: per-row values, token rules that hold with the KV
cache, no recompiles, both layouts; checked against separate runs and
against one uncached forward pass over prompt + output."""

import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

import penzai_lm
from penzai_lm import generation
from penzai_lm import interp
from tests.model.configs import config

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
POINT = "blocks.1.resid_post"
GREEDY = dict(temperature=0.0, stop_tokens=[])


def _model(name="llama_gqa", stacked=True):
  return penzai_lm.build_transformer(config(name, stacked), seed=3)


def _vector(model, seed=0):
  rng = np.random.default_rng(seed)
  return rng.standard_normal(model.config.hidden_size).astype(np.float32)


def _np(x, like):
  return np.asarray(x.unwrap(*like.named_shape))


def _steer(model, strength, where="all", seed=0):
  return interp.insert_at(model, POINT, interp.AddVector.build(
      _vector(model, seed), strength=strength, where=where))


def test_per_row_strengths_equal_separate_runs_without_recompiling():
  model = _model()
  engine = generation.Engine()
  strengths = [0.0, 4.0, 8.0]  # 3 prompts: the loop runs a bucket of 4.
  batched = engine.generate(_steer(model, strengths), PROMPTS,
                            max_new_tokens=6, **GREEDY)
  for row, strength in enumerate(strengths):
    alone = engine.generate(_steer(model, strength), [PROMPTS[row]],
                            max_new_tokens=6, **GREEDY)
    assert alone.tokens[0] == batched.tokens[row], row
  assert len(set(map(tuple, batched.tokens))) == 3  # Steering did act.
  compiled = engine.compilations
  again = engine.generate(_steer(model, [1.0, -3.0, 5.0], seed=1), PROMPTS,
                          max_new_tokens=6, **GREEDY)
  assert engine.compilations == compiled  # New strengths and vector.
  assert again.tokens != batched.tokens
  # One value per prompt follows the prompt's samples; one per row too.
  samples = engine.generate(_steer(model, strengths), PROMPTS,
                            max_new_tokens=6, num_samples=2, **GREEDY)
  assert samples.tokens == [t for t in batched.tokens for _ in range(2)]
  per_row = engine.generate(
      _steer(model, [0.0, 0.0, 4.0, 4.0, 8.0, 8.0]), PROMPTS,
      max_new_tokens=6, num_samples=2, **GREEDY)
  assert per_row.tokens == samples.tokens


def test_per_row_values_of_the_wrong_size_are_an_error():
  model = _steer(_model(), [1.0, 2.0])
  with pytest.raises(ValueError, match=r"per-row values have 2 rows, but the"
                     r" request has 3 prompt\(s\): give 3 \(one per"
                     r" prompt\) or 6 \(one per row\)"):
    generation.generate(model, PROMPTS, num_samples=2)


@pytest.mark.parametrize("where", [
    "prompt", "generated", interp.TokenRule.steps(1, 3),
    interp.TokenRule.positions(2, 6)])
def test_token_rules_hold_with_the_kv_cache(where):
  """Generation (prompt prefilled, then one token per step, left-padded
  rows) gives the values of one uncached pass over prompt + output with
  the same rule; and the point itself moves by exactly strength * vector
  where the rule selects a token, not elsewhere."""
  model = _model(stacked=False)
  strength = 6.0
  steered = _steer(model, strength, where)
  names = [POINT, "final_norm"]
  result = generation.generate(steered, PROMPTS, max_new_tokens=5,
                               capture=names, **GREEDY)
  vector = _vector(model)
  for row, prompt in enumerate(PROMPTS):
    full = prompt + result.tokens[row]
    gen_start = pz.nx.wrap(jnp.asarray([len(prompt)])).tag("batch")
    want = interp.run_with_cache(steered, [full], names=names,
                                 generation_start=gen_start)
    plain = interp.run_with_cache(model, [full], names=[POINT])
    for name in names:
      got, expected = result.captures[name][row], want[name][{"batch": 0}]
      np.testing.assert_allclose(_np(got, expected), _np(expected, expected),
                                 atol=3e-5, rtol=1e-4, err_msg=name)
    moved = _np(result.captures[POINT][row], expected) - _np(
        plain[POINT][{"batch": 0}], expected)
    positions = np.arange(len(full))
    gen = positions - len(prompt)
    if isinstance(where, str):
      selected = gen < 0 if where == "prompt" else gen >= 0
    else:
      lo, hi = int(where.start.data_array), int(where.stop.data_array)
      offsets = gen if bool(where.from_generation.data_array) else positions
      selected = (offsets >= lo) & (offsets < hi)
    assert selected.any() and not selected.all()
    np.testing.assert_allclose(moved[selected], strength * np.broadcast_to(
        vector, moved[selected].shape), atol=1e-4)
    np.testing.assert_allclose(moved[~selected], 0.0, atol=1e-4)


def test_rules_are_data_per_row_and_equal_on_both_layouts():
  stacked = _model(stacked=True)
  engine = generation.Engine()
  rule_a = interp.TokenRule.steps([0, 2, 1], [2, 4, 3])  # Per row.
  rule_b = interp.TokenRule.positions([1, 0, 3], [5, 2, 4])
  outs = []
  for rule in (rule_a, rule_b):
    outs.append(engine.generate(_steer(stacked, [3.0, 5.0, 7.0], rule),
                                PROMPTS, max_new_tokens=6, **GREEDY))
  compiled = engine.compilations
  generated = interp.TokenRule.steps([0, 0, 0])  # Also per row.
  engine.generate(_steer(stacked, [3.0, 5.0, 7.0], generated), PROMPTS,
                  max_new_tokens=6, **GREEDY)
  assert engine.compilations == compiled == 2  # A rule is data.
  per_layer = generation.Engine(unstack_layer_stacks=False)
  for rule, out in zip((rule_a, rule_b), outs):
    other = per_layer.generate(_steer(stacked, [3.0, 5.0, 7.0], rule),
                               PROMPTS, max_new_tokens=6, **GREEDY)
    assert other.tokens == out.tokens


def test_patching_a_clean_generation_into_a_corrupted_one():
  """PatchValue indexes by position: the clean run's captured values at
  some positions replace the corrupted run's while it generates."""
  model = _model(stacked=False)
  clean_prompt, corrupt_prompt = [1, 2, 3, 4, 5], [1, 2, 9, 4, 5]
  point = "blocks.0.resid_post"
  clean = generation.generate(model, [clean_prompt], max_new_tokens=6,
                              capture=[point], **GREEDY)
  value = clean.captures[point][0]
  every = interp.insert_at(model, point, interp.PatchValue.build(value))
  patched = generation.generate(every, [corrupt_prompt], max_new_tokens=6,
                                **GREEDY)
  # Every position patched from block 0 on: the clean continuation.
  assert patched.tokens == clean.tokens
  some = interp.insert_at(model, point, interp.PatchValue.build(value, [2]))
  result = generation.generate(some, [corrupt_prompt], max_new_tokens=6,
                               capture=["final_norm"], **GREEDY)
  full = corrupt_prompt + result.tokens[0]
  want = interp.run_with_cache(some, [full], names=["final_norm"])
  got, expected = result.captures["final_norm"][0], want["final_norm"][
      {"batch": 0}]
  np.testing.assert_allclose(_np(got, expected), _np(expected, expected),
                             atol=3e-5)


def test_ablate_and_clamp_change_only_what_they_name():
  model = _model(stacked=False)
  ids = [PROMPTS[2]]
  base = interp.run_with_cache(model, ids, names=["blocks.0.mlp.neurons",
                                                  POINT])
  neurons = interp.insert_at(model, "blocks.0.mlp.neurons",
                             interp.Ablate.neurons(model.config, [1, 5]))
  got = interp.run_with_cache(neurons, ids, names=["blocks.0.mlp.neurons"])
  a = _np(got["blocks.0.mlp.neurons"], base["blocks.0.mlp.neurons"])
  b = _np(base["blocks.0.mlp.neurons"], base["blocks.0.mlp.neurons"])
  axis = list(base["blocks.0.mlp.neurons"].named_shape).index("neurons")
  assert (np.take(a, [1, 5], axis=axis) == 0).all()
  np.testing.assert_array_equal(np.delete(a, [1, 5], axis=axis),
                                np.delete(b, [1, 5], axis=axis))
  clamped = interp.insert_at(model, POINT, interp.Clamp.build(-0.1, 0.2,
                                                             where="prompt"))
  got = interp.run_with_cache(clamped, ids, names=[POINT])
  np.testing.assert_allclose(_np(got[POINT], base[POINT]),
                             np.clip(_np(base[POINT], base[POINT]), -0.1,
                                     0.2))


def test_bad_rules_and_values_are_errors():
  with pytest.raises(ValueError, match="where must be 'all', 'prompt'"):
    interp.AddVector.build(np.ones(32), where="prompts")
  with pytest.raises(ValueError, match="stop must be greater than start"):
    interp.TokenRule.steps(4, 2)
  with pytest.raises(ValueError, match="positions start must be >= 0"):
    interp.TokenRule.positions(-1)
  with pytest.raises(ValueError, match="strength must be finite"):
    interp.AddVector.build(np.ones(32), strength=[1.0, np.nan])
  with pytest.raises(ValueError, match="low must be <= high"):
    interp.Clamp.build(1.0, 0.0)
  with pytest.raises(ValueError, match=r"neurons must be a non-empty list"):
    interp.Ablate.neurons(_model().config, [48])


def test_per_row_heads_equal_one_run_per_row():
  model = _model(stacked=True)
  point = "blocks.1.attn.head_out"
  per_row = interp.insert_at(model, point, interp.ZeroHeads.build(
      model.config, [[0], [3], [1, 2]]))
  ids = [PROMPTS[2]] * 3
  tokens = pz.nx.wrap(jnp.asarray(ids)).tag("batch", "seq")
  batched = np.asarray(per_row(tokens).unwrap("batch", "seq", "vocabulary"))
  for row, heads in enumerate([[0], [3], [1, 2]]):
    alone = interp.insert_at(model, point,
                             interp.Ablate.heads(model.config, heads))
    logits = alone(pz.nx.wrap(jnp.asarray(ids[:1])).tag("batch", "seq"))
    np.testing.assert_allclose(
        batched[row], np.asarray(logits.unwrap("batch", "seq",
                                               "vocabulary"))[0], atol=1e-5)
  with pytest.raises(ValueError, match="heads is empty"):
    interp.ZeroHeads.build(model.config, [])
