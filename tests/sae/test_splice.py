"""Autoencoders spliced into models: the error term leaves every logit as it
was (bit for bit op by op, to float rounding compiled), features are recorded while generating (dense and top-k)
and edited per row without recompiling, transcoders replace what they
predict, and bad requests are clear errors."""

import numpy as np
import pytest
from penzai import pz

import penzai_lm
from penzai_lm import generation
from penzai_lm import interp
from penzai_lm import sae as sae_lib
from penzai_lm.runtime.unstack import unstack_layers
from tests.model.configs import config

POINT = "blocks.1.resid_post"
FEATURES = f"{POINT}.sae.features"
PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8]]
GREEDY = dict(temperature=0.0, stop_tokens=[])


def _model(name="llama_gqa", stacked=True):
  return penzai_lm.build_transformer(config(name, stacked), seed=3)


def _sae(model, activation="jumprelu", width=4, seed=0, **kw):
  hidden = model.config.hidden_size
  cfg = sae_lib.SAEConfig(
      activation=activation, num_features=width * hidden,
      input_axes=(("embedding", hidden),),
      output_axes=(("embedding", hidden),), hook_point=POINT,
      k=8 if activation == "topk" else None, **kw)
  base = sae_lib.SparseAutoencoder.random(cfg, seed)
  rng = np.random.default_rng(seed)
  noisy = {k: np.asarray(v) + 0.05 * rng.standard_normal(v.shape)
           for k, v in base.flat().items()}
  return sae_lib.SparseAutoencoder.from_arrays(cfg, **noisy)


def _np(x, *axes):
  return np.asarray(x.unwrap(*axes))


def _logits(cache):
  return _np(cache.logits, "batch", "seq", "vocabulary")


@pytest.mark.parametrize("name", ["llama_gqa", "gemma3", "gpt2"])
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("activation", ["relu", "jumprelu", "topk"])
def test_error_term_keeps_every_logit(name, stacked, activation):
  model = _model(name, stacked)
  spliced = sae_lib.splice(model, _sae(model, activation))
  assert not pz.select(spliced).at_instances_of(pz.nn.LayerStack).count()
  plain = interp.run_with_cache(unstack_layers(model), PROMPTS, names=[POINT],
                               eager=True)
  cached = interp.run_with_cache(spliced, PROMPTS, names=[POINT, FEATURES],
                                 eager=True)
  np.testing.assert_array_equal(_logits(cached), _logits(plain))
  np.testing.assert_array_equal(_np(cached[POINT], "batch", "seq", "embedding"),
                                _np(plain[POINT], "batch", "seq", "embedding"))
  # Compiled, XLA may fuse what follows the point differently (gemma3's
  # logits move by up to 7e-7): equal to float rounding.
  compiled = interp.run_with_cache(spliced, PROMPTS, names=[FEATURES])
  np.testing.assert_allclose(_logits(compiled), _logits(plain), rtol=1e-5,
                             atol=3e-6)
  features = _np(cached[FEATURES], "batch", "seq", "features")
  assert (features > 0).any() and (features == 0).any()  # Sparse, not dead.


@pytest.mark.parametrize("name", ["llama_gqa", "gemma3"])
def test_a_spliced_stack_equals_the_stack_to_float_rounding(name):
  """What README and splice's docstring promise for a layer stack: the
  splice unstacks it, and the stack's own compiled scan rounds differently,
  so its logits are equal to float rounding, not bit for bit."""
  model = _model(name, stacked=True)
  stacked = interp.run_with_cache(model, PROMPTS, names=[POINT])
  spliced = interp.run_with_cache(sae_lib.splice(model, _sae(model)), PROMPTS,
                                  names=[POINT])
  np.testing.assert_allclose(_logits(spliced), _logits(stacked), rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_allclose(
      _np(spliced[POINT], "batch", "seq", "embedding"),
      _np(stacked[POINT], "batch", "seq", "embedding"), rtol=1e-5, atol=1e-5)


def test_features_equal_the_autoencoder_on_the_captured_value():
  model = _model()
  sae = _sae(model)
  cached = interp.run_with_cache(sae_lib.splice(model, sae), PROMPTS,
                                 names=[POINT, FEATURES, f"{POINT}.sae.error"])
  x = cached[POINT]
  want = sae.encode(x)
  np.testing.assert_allclose(
      _np(cached[FEATURES], "batch", "seq", "features"),
      _np(want, "batch", "seq", "features"), rtol=1e-6, atol=1e-6)
  error = _np(cached[f"{POINT}.sae.error"], "batch", "seq", "embedding")
  np.testing.assert_allclose(
      error, _np(x - sae.forward(x), "batch", "seq", "embedding"),
      rtol=1e-5, atol=1e-5)


def test_generation_captures_dense_and_top_k_features():
  """Features recorded while generating equal one uncached pass over
  prompt + output; the sparse capture holds the largest ones."""
  model = _model(stacked=False)
  spliced = sae_lib.splice(model, _sae(model), top_k=5)
  names = [FEATURES, f"{POINT}.sae.top_ids", f"{POINT}.sae.top_values"]
  result = generation.generate(spliced, PROMPTS, max_new_tokens=5,
                               capture=names, **GREEDY)
  for row, prompt in enumerate(PROMPTS):
    tokens = prompt + result.tokens[row]
    dense = _np(result.captures[FEATURES][row], "seq", "features")
    assert dense.shape[0] == len(tokens)
    again = interp.run_with_cache(spliced, [tokens], names=[FEATURES])
    np.testing.assert_allclose(
        dense, _np(again[FEATURES], "batch", "seq", "features")[0],
        rtol=1e-5, atol=1e-5)
    ids = _np(result.captures[names[1]][row], "seq", "top_k")
    values = _np(result.captures[names[2]][row], "seq", "top_k")
    assert ids.dtype == np.int32
    np.testing.assert_allclose(np.take_along_axis(dense, ids, 1), values)
    np.testing.assert_allclose(np.sort(dense, 1)[:, ::-1][:, :5], values,
                               rtol=1e-6)


def test_clamping_a_feature_adds_its_decoder_direction():
  """At the point itself, clamping feature j to v moves the value by
  (v - f_j) * w_dec[j] at the selected tokens, nowhere else."""
  model = _model(stacked=False)
  sae = _sae(model)
  spliced = sae_lib.splice(model, sae)
  base = interp.run_with_cache(spliced, PROMPTS, names=[POINT, FEATURES])
  j = 7
  edit = sae_lib.FeatureEdit.clamp(sae, [j], 3.0,
                                   where=interp.TokenRule.positions(1, 3))
  steered = interp.insert_at(spliced, FEATURES, edit)
  after = interp.run_with_cache(steered, PROMPTS, names=[POINT, FEATURES])
  f = _np(base[FEATURES], "batch", "seq", "features")[..., j]
  direction = _np(sae.direction(j), "embedding")
  moved = (_np(after[POINT], "batch", "seq", "embedding")
           - _np(base[POINT], "batch", "seq", "embedding"))
  positions = np.array([[0, 1, 2, 3, 4], [-1, -1, 0, 1, 2]])
  selected = (positions >= 1) & (positions < 3)
  want = np.where(selected[..., None],
                  (3.0 - f)[..., None] * direction, 0.0)
  np.testing.assert_allclose(moved, want, atol=2e-5)
  edited = _np(after[FEATURES], "batch", "seq", "features")[..., j]
  np.testing.assert_array_equal(edited[selected], 3.0)


def test_per_row_feature_edits_equal_separate_runs_without_recompiling():
  model = _model(stacked=False)
  sae = _sae(model)
  spliced = sae_lib.splice(model, sae)
  engine = generation.Engine()
  prompts = PROMPTS + [[9, 10]]

  def steer(values, feature=3):
    return interp.insert_at(spliced, FEATURES,
                            sae_lib.FeatureEdit.clamp(sae, [feature], values))

  values = [0.0, 20.0, -20.0]
  batched = engine.generate(steer(values), prompts, max_new_tokens=6,
                            **GREEDY)
  for row, value in enumerate(values):
    alone = engine.generate(steer(value), [prompts[row]], max_new_tokens=6,
                            **GREEDY)
    assert alone.tokens[0] == batched.tokens[row]
  compiled = engine.compilations
  engine.generate(steer([1.0, 2.0, 3.0], feature=11), prompts,
                  max_new_tokens=6, **GREEDY)
  assert engine.compilations == compiled

  def per_row(features, values):  # One list of features per row.
    return interp.insert_at(spliced, FEATURES, sae_lib.FeatureEdit.clamp(
        sae, features, values))

  first = engine.generate(per_row([[1, 2], [5], [9]], [20.0] * 3), prompts,
                          max_new_tokens=6, **GREEDY)
  compiled = engine.compilations  # A mask per row is another structure.
  second = engine.generate(per_row([[3], [4, 6, 8], [0]], [-20.0, 20.0, 9.0]),
                           prompts, max_new_tokens=6, **GREEDY)
  assert engine.compilations == compiled
  assert first.tokens != second.tokens


def test_transcoder_replaces_the_mlp_and_keeps_it_with_the_error_term():
  model = _model("gemma3", stacked=False)
  hidden = model.config.hidden_size
  cfg = sae_lib.SAEConfig(
      activation="relu", num_features=64,
      input_axes=(("embedding", hidden),),
      output_axes=(("embedding", hidden),),
      hook_point="blocks.2.mlp_in", output_point="blocks.2.mlp_out")
  transcoder = sae_lib.SparseAutoencoder.random(cfg, 2, skip=True)
  flat = {k: np.asarray(v) + 0.1 * np.random.default_rng(5).standard_normal(
      v.shape) for k, v in transcoder.flat().items()}
  transcoder = sae_lib.SparseAutoencoder.from_arrays(cfg, **flat)
  names = ["blocks.2.mlp_in", "blocks.2.mlp_out"]
  plain = interp.run_with_cache(model, PROMPTS, names=names)
  kept = interp.run_with_cache(sae_lib.splice(model, transcoder), PROMPTS,
                               names=names)
  np.testing.assert_array_equal(_logits(kept), _logits(plain))
  replaced = interp.run_with_cache(
      sae_lib.splice(model, transcoder, mode="replace"), PROMPTS,
      names=[*names, "blocks.2.mlp_in.transcoder.features"])
  want = transcoder.forward(replaced["blocks.2.mlp_in"])
  np.testing.assert_allclose(
      _np(replaced["blocks.2.mlp_out"], "batch", "seq", "embedding"),
      _np(want, "batch", "seq", "embedding"), rtol=1e-5, atol=1e-5)
  # Reading the branch input (resid_mid) wraps the whole MLP branch.
  branch = interp.run_with_cache(
      sae_lib.splice(model, transcoder, "blocks.2.resid_mid",
                     mode="replace"), PROMPTS,
      names=["blocks.2.resid_mid", "blocks.2.mlp_out"])
  want = transcoder.forward(branch["blocks.2.resid_mid"])
  np.testing.assert_allclose(
      _np(branch["blocks.2.mlp_out"], "batch", "seq", "embedding"),
      _np(want, "batch", "seq", "embedding"), rtol=1e-5, atol=1e-5)


def test_feature_attribution_matches_finite_differences():
  model = _model(stacked=False)
  sae = _sae(model, "relu")
  spliced = sae_lib.splice(model, sae)
  metric = interp.LogitDiff(answer=5, wrong=9)
  result = sae_lib.feature_attribution(spliced, PROMPTS, FEATURES, metric)
  assert result.gradients.shape == (2, 5, sae.config.num_features)
  cached = interp.run_with_cache(spliced, PROMPTS, names=[FEATURES])
  for r, n in enumerate(cached.lengths):  # Padding values are unspecified.
    np.testing.assert_allclose(
        result.activations[r, -n:], _np(cached.row(r, FEATURES), "seq",
                                        "features"), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(result.metric, metric(cached.logits), rtol=1e-5)
  # Adding eps to feature j at position p moves the metric by ~eps * grad.
  eps = 1e-2
  for row, (feature, position) in enumerate([(4, 3), (17, 1)]):
    prompt = [PROMPTS[row]]
    single = sae_lib.feature_attribution(spliced, prompt, FEATURES, metric)
    bumped = interp.insert_at(spliced, FEATURES, sae_lib.FeatureEdit.add(
        sae, [feature], eps, where=interp.TokenRule.positions(
            position, position + 1)))
    moved = (metric(interp.run_with_cache(bumped, prompt, names=[]).logits)
             - single.metric)
    grad = single.gradients[0, position, feature]
    assert abs(grad) > 1e-4
    np.testing.assert_allclose(moved / eps, grad, rtol=2e-2, atol=1e-4)
  top = result.top(3, row=1)
  assert len(top) == 3 and all(0 <= t < 3 for t, _, _ in top)


def test_errors_name_what_is_wrong():
  model = _model()
  sae = _sae(model)
  with pytest.raises(ValueError, match=r"spliced in \(penzai_lm.sae.splice\)"):
    interp.run_with_cache(model, PROMPTS, names=[FEATURES])
  with pytest.raises(ValueError, match="the model has 3 blocks"):
    sae_lib.splice(model, sae, "blocks.3.resid_post")
  with pytest.raises(ValueError, match=r"do not match the value at"
                     r" 'blocks.1.mlp.neurons'"):
    sae_lib.splice(model, sae, "blocks.1.mlp.neurons")
  spliced = sae_lib.splice(model, sae)
  with pytest.raises(ValueError, match="already spliced in"):
    sae_lib.splice(spliced, sae)
  assert "blocks.1.resid_post.extra.features" in interp.run_with_cache(
      sae_lib.splice(spliced, sae, name="extra"), PROMPTS,
      names=["blocks.1.resid_post.extra.features"])
  with pytest.raises(ValueError, match="feature 999 does not exist"):
    sae_lib.FeatureEdit.clamp(sae, [999], 1.0)
  with pytest.raises(ValueError, match="finite"):
    sae_lib.FeatureEdit.clamp(sae, [1], float("nan"))
  with pytest.raises(ValueError, match="has axis 'features'.*insert it at a"):
    interp.insert_at(spliced, POINT, sae_lib.FeatureEdit.clamp(sae, [1], 1.0))
  with pytest.raises(ValueError, match="features point"):
    sae_lib.feature_attribution(spliced, PROMPTS, POINT,
                                interp.LogitDiff(1, 2))
  with pytest.raises(ValueError, match="w_dec has shape"):
    sae_lib.SparseAutoencoder.from_arrays(
        sae.config, **{**sae.flat(), "w_dec": np.zeros((3, 3))})
  with pytest.raises(ValueError, match="1 <= k <= num_features"):
    sae_lib.SAEConfig(activation="topk", num_features=8,
                      input_axes=(("embedding", 4),),
                      output_axes=(("embedding", 4),))
