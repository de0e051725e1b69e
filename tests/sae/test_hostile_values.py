"""Hostile values for the autoencoder tools are clear errors raised before
anything runs (or, for a diverging run, at the step that diverged): a
learning rate that blows the weights up, token ids outside the vocabulary,
activations holding NaN or inf, non-finite weights, dictionaries too large
for memory, bad edit values and feature ids, and splicing an autoencoder's
own features."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

import penzai_lm
from penzai_lm import generation
from penzai_lm import interp
from penzai_lm import sae as sae_lib
from penzai_lm.model.memory import InsufficientMemoryError
from tests.model.configs import config

POINT = "blocks.1.resid_post"
FEATURES = f"{POINT}.sae.features"
TINY = dict(expansion_factor=2, k=4, batch_tokens=64, steps=6,
            context_length=16, model_batch=4, buffer_tokens=256,
            log_every=3, eval_windows=0)


@pytest.fixture(scope="module")
def model():
  return penzai_lm.build_transformer(config("llama_gqa", False), seed=3)


def _activations(rows=512, width=32, seed=0):
  return np.random.default_rng(seed).standard_normal(
      (rows, width)).astype(np.float32)


def _sae(model, activation="relu", width=64):
  hidden = model.config.hidden_size
  cfg = sae_lib.SAEConfig(
      activation=activation, num_features=width,
      input_axes=(("embedding", hidden),),
      output_axes=(("embedding", hidden),), hook_point=POINT,
      k=4 if activation == "topk" else None)
  return sae_lib.SparseAutoencoder.random(cfg, 0)


# -- training --------------------------------------------------------------


def test_a_diverging_run_stops_at_its_step_with_a_hint():
  config_ = sae_lib.TrainConfig(**{**TINY, "learning_rate": 1e30})
  with pytest.raises(FloatingPointError,
                     match=r"diverged at step [1-6]: .*NaN or inf with"
                     r" learning_rate=1e\+30. Lower"):
    sae_lib.train_sae_on_activations(_activations(), config_,
                                     progress=False)
  # The same run at a sane rate ends with finite weights.
  sae, report = sae_lib.train_sae_on_activations(
      _activations(), sae_lib.TrainConfig(**TINY), progress=False)
  assert report.steps == 6
  assert all(np.isfinite(v).all() for v in sae.flat().values())


@pytest.mark.parametrize("bad", [97, -1, 2**40])
def test_train_sae_refuses_token_ids_outside_the_vocabulary(model, bad):
  tokens = np.random.default_rng(0).integers(0, 97, 2048)
  tokens[700] = bad
  config_ = sae_lib.TrainConfig(**TINY)
  with pytest.raises(ValueError, match=rf"token id {bad}, outside the"
                     r" model's vocabulary \[0, 97\)"):
    sae_lib.train_sae(model, POINT, tokens, config_, progress=False)
  batches = [tokens[:1024].reshape(-1, 16), tokens[1024:].reshape(-1, 16)]
  with pytest.raises(ValueError, match=rf"token batch 0 contains token id"
                     rf" {bad}"):
    sae_lib.train_sae(model, POINT, iter(batches), config_, progress=False)
  with pytest.raises(ValueError, match=rf"eval_tokens contains token id"
                     rf" {bad}"):
    sae_lib.train_sae(model, POINT, np.zeros(2048, np.int64), config_,
                      eval_tokens=tokens[:1024].reshape(-1, 16),
                      progress=False)
  with pytest.raises(ValueError, match=rf"tokens contains token id {bad}"):
    sae_lib.evaluate_sae(model, _sae(model), tokens[:1024].reshape(-1, 16))


def test_all_infinite_activations_are_refused():
  acts = np.full((512, 32), np.inf, np.float32)
  with pytest.raises(ValueError, match="512 of 512 rows hold NaN or inf"):
    sae_lib.train_sae_on_activations(acts, sae_lib.TrainConfig(**TINY),
                                     progress=False)


def test_zero_activations_cannot_be_scaled_to_an_expected_norm():
  acts = np.zeros((512, 32), np.float32)
  config = sae_lib.TrainConfig(
      **{**TINY, "normalize_activations": "expected_average_only_in"})
  with pytest.raises(ValueError, match="mean norm 0.0: they cannot be scaled"):
    sae_lib.train_sae_on_activations(acts, config, progress=False)


def test_some_nan_rows_are_counted_not_silently_dropped():
  acts = _activations()
  acts[::7] = np.nan
  with pytest.raises(ValueError,
                     match=r"74 of 512 rows hold NaN or inf values \(the"
                     r" first: row 0\)"):
    sae_lib.train_sae_on_activations(acts, sae_lib.TrainConfig(**TINY),
                                     progress=False)
  # The same through an iterable of chunks: the chunk is named.
  chunks = [acts[:256][1::7], acts[256:]]
  with pytest.raises(ValueError, match=r"chunk 1: 37 of 256 rows"):
    sae_lib.train_sae_on_activations(iter(chunks),
                                     sae_lib.TrainConfig(**TINY),
                                     progress=False)


def test_num_features_too_large_for_memory_is_refused_before_allocating():
  config_ = sae_lib.TrainConfig(**{**TINY, "num_features": 10**12})
  with pytest.raises(InsufficientMemoryError, match="1,000,000,000,000"
                     " features.*num_features"):
    sae_lib.train_sae_on_activations(_activations(), config_,
                                     progress=False)
  cfg = sae_lib.SAEConfig(num_features=10**12,
                          input_axes=(("embedding", 32),),
                          output_axes=(("embedding", 32),))
  with pytest.raises(InsufficientMemoryError, match="num_features"):
    sae_lib.SparseAutoencoder.random(cfg)


def test_from_arrays_refuses_non_finite_weights():
  sae = sae_lib.SparseAutoencoder.random(sae_lib.SAEConfig(
      num_features=8, input_axes=(("embedding", 4),),
      output_axes=(("embedding", 4),)))
  flat = {k: np.array(v) for k, v in sae.flat().items()}
  with pytest.raises(ValueError, match=r"from_arrays: w_enc holds 32 NaN"
                     r" and 0 infinite value\(s\) of 32"):
    sae_lib.SparseAutoencoder.from_arrays(
        sae.config, **{**flat, "w_enc": np.full((4, 8), np.nan)})
  flat["b_dec"][2] = -np.inf
  with pytest.raises(ValueError, match="b_dec holds 0 NaN and 1 infinite"):
    sae_lib.SparseAutoencoder.from_arrays(sae.config, **flat)


# -- edits -----------------------------------------------------------------


def _nan(batch=None):
  value = pz.nx.wrap(jnp.full((2,) if batch else (), jnp.nan))
  return value.tag(batch) if batch else value


def test_one_finiteness_rule_for_every_edit(model):
  """A NaN value is refused when the edit is built, whether given as a
  number, a list or a named array (which went through unchecked, to NaN
  logits)."""
  sae = _sae(model)
  hidden = model.config.hidden_size
  with pytest.raises(ValueError, match="offset must be finite"):
    sae_lib.FeatureEdit.clamp(sae, [3], _nan())
  with pytest.raises(ValueError, match="scale must be finite"):
    sae_lib.FeatureEdit.scaled(sae, [3], _nan("batch"))
  with pytest.raises(ValueError, match=r"offset must be finite: it holds 1"):
    sae_lib.FeatureEdit.add(sae, [3], [1.0, np.inf])
  with pytest.raises(ValueError, match="strength must be finite"):
    interp.AddVector.build(np.ones(hidden), _nan())
  with pytest.raises(ValueError, match="vector must be finite"):
    interp.AddVector.build(
        pz.nx.wrap(jnp.full((hidden,), jnp.nan)).tag("embedding"))
  with pytest.raises(ValueError, match="mean must be finite"):
    interp.Ablate.heads(model.config, [0], mean=_nan())
  with pytest.raises(ValueError, match=r"high must not be NaN \(\+-inf is"):
    interp.Clamp.build(-np.inf, _nan())
  interp.Clamp.build(-np.inf, np.inf)  # Infinite bounds stay legitimate.
  # What the build-time check cannot see (a value built directly, or
  # traced) meets the engine's: NaN logits end the row, for a clamp as for
  # an AddVector.
  spliced = sae_lib.splice(model, sae)
  clamp = jax.jit(lambda v: sae_lib.FeatureEdit.clamp(sae, [3], v))(
      jnp.float32(jnp.nan))
  add = interp.AddVector(
      vector=pz.nx.wrap(jnp.ones((model.config.hidden_size,))).tag(
          "embedding"), strength=_nan(), where=interp.TokenRule.all())
  options = dict(max_new_tokens=3, temperature=0.0, stop_tokens=[])
  for patched in (interp.insert_at(spliced, FEATURES, clamp),
                  interp.insert_at(model, POINT, add)):
    result = generation.generate(patched, [[1, 2, 3]], **options)
    assert result.finish_reasons == ["non_finite"]


@pytest.mark.parametrize("value", ["abc", None, [[1.0], [2.0, 3.0]],
                                   object()])
def test_edit_values_that_are_not_numbers_are_type_errors(model, value):
  sae = _sae(model)
  with pytest.raises(TypeError, match="offset must be a number or a list of"
                     " numbers"):
    sae_lib.FeatureEdit.clamp(sae, [3], value)
  with pytest.raises(TypeError, match="strength must be a number"):
    interp.AddVector.build(np.ones(model.config.hidden_size), value)


def test_feature_ids_are_checked_before_the_mask_is_allocated(model):
  sae = _sae(model)
  with pytest.raises(ValueError, match=r"feature 1000000000000 does not"
                     r" exist: the autoencoder has 64 features"):
    sae_lib.FeatureEdit.clamp(sae, [10**12], 1.0)
  # A width given as a number is checked against memory before the mask.
  with pytest.raises(InsufficientMemoryError, match="FeatureEdit mask of 1"
                     " x 1,000,000,000,000,000,000 features"):
    sae_lib.FeatureEdit.clamp(10**18, [3], 1.0)


# -- splicing and feature attribution ---------------------------------------


def test_splicing_at_an_autoencoders_own_point_is_refused(model):
  sae = _sae(model)
  spliced = sae_lib.splice(model, sae)
  with pytest.raises(ValueError, match=r"point 'blocks.1.resid_post.sae."
                     r"features' is already spliced: it is a point of the"
                     r" autoencoder spliced at 'blocks.1.resid_post'"):
    sae_lib.splice(spliced, sae, FEATURES)
  with pytest.raises(ValueError, match=r"output_point 'blocks.1.resid_post"
                     r".sae.error' is already spliced"):
    sae_lib.splice(spliced, sae, POINT, name="other",
                   output_point=f"{POINT}.sae.error")
  # An autoencoder over the features axis itself is refused when built.
  width = sae.config.num_features
  with pytest.raises(ValueError, match=r"input_axes .* use 'features', the"
                     r" dictionary's own axis"):
    sae_lib.SAEConfig(num_features=8, input_axes=(("features", width),),
                      output_axes=(("features", width),))


@pytest.fixture(scope="module")
def attribution(model):
  sae = _sae(model)
  return sae_lib.feature_attribution(sae_lib.splice(model, sae), [1, 2, 3],
                                     FEATURES, interp.LogitDiff(5, 6))


@pytest.mark.parametrize("n", [0, -1, 2.5, True, "3"])
def test_top_refuses_a_count_below_one_or_not_an_int(attribution, n):
  with pytest.raises(ValueError, match=r"n must be an int >= 1"):
    attribution.top(n)


def test_top_refuses_a_row_that_does_not_exist(attribution):
  assert len(attribution.top(3, row=0)) == 3
  for row in (5, 1, -1):
    with pytest.raises(ValueError, match=rf"row {row} does not exist: the"
                       r" attribution has 1 row\(s\) \(0-0\)"):
      attribution.top(3, row=row)


def test_feature_attribution_checks_its_metric(model):
  spliced = sae_lib.splice(model, _sae(model))
  with pytest.raises(ValueError, match=r"LogitDiff.answer=1000000 is outside"
                     r" the model's vocabulary \[0, 97\)"):
    sae_lib.feature_attribution(spliced, [1, 2, 3], FEATURES,
                                interp.LogitDiff(10**6, 6))
  with pytest.raises(ValueError, match=r"<lambda>: its value is nan"):
    sae_lib.feature_attribution(spliced, [1, 2, 3], FEATURES,
                                lambda logits: jnp.float32(jnp.nan))
  with pytest.raises(TypeError, match=r"must return a scalar number"):
    sae_lib.feature_attribution(spliced, [1, 2, 3], FEATURES,
                                lambda logits: "abc")
