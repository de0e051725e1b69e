"""Training an SAE on a tiny random model: it learns, the figures are the
right ones, a seed fixes the result, the step compiles once, and bad
settings are clear errors.

The model is `tests.model.configs`'s "llama_gqa" (hidden size 32); a TopK
SAE of 128 features trains for 150 steps of 256 tokens (seconds).
"""

import math

import jax
from jax import monitoring
import numpy as np
import pytest

import penzai_lm
from penzai_lm import interp
from penzai_lm import sae as sae_lib
from penzai_lm.sae.activations import PointActivations
from penzai_lm.sae.activations import ShuffleBuffer
from penzai_lm.model.transformer import TransformerBlock
from tests.model.configs import config
from tests.sae.random_saes import random_sae

POINT = "blocks.1.resid_post"
K = 8
SETTINGS = dict(expansion_factor=4, k=K, batch_tokens=256, steps=150,
                context_length=32, model_batch=8, buffer_tokens=2048,
                learning_rate=3e-3, log_every=10, eval_windows=8,
                dead_feature_window=40)


@pytest.fixture(scope="module")
def model():
  return penzai_lm.build_transformer(config("llama_gqa"), seed=3)


def _tokens(seed=0, n=12_000):
  return np.random.default_rng(seed).integers(0, 97, n)


def _traces(run) -> dict[str, int]:
  """Function name -> times traced for compilation while ``run()`` runs
  (a retrace is what a recompile starts with; the persistent compilation
  cache of the test session could hide the backend compile itself)."""
  counts = {}

  def listener(event, seconds, **kw):
    del seconds
    if event == "/jax/core/compile/jaxpr_trace_duration":
      name = kw.get("fun_name", "")
      counts[name] = counts.get(name, 0) + 1

  monitoring.register_event_duration_secs_listener(listener)
  try:
    run()
  finally:
    monitoring.unregister_event_duration_listener(listener)
  return counts


@pytest.fixture(scope="module")
def trained(model, tmp_path_factory):
  out = {}
  directory = tmp_path_factory.mktemp("sae") / "topk"

  def run():
    out["sae"], out["report"] = sae_lib.train_sae(
        model, POINT, _tokens(), sae_lib.TrainConfig(**SETTINGS),
        save_to=directory, progress=False)

  out["traces"] = _traces(run)
  return out


def test_topk_sae_learns(trained):
  report = trained["report"]
  first, last = report.history[0], report.final
  assert report.steps == 150 and report.tokens == 150 * 256
  assert len(report.history) == 15 and last.step == 150
  assert first.explained_variance < 0.5
  assert last.explained_variance > max(0.65, first.explained_variance + 0.3)
  for entry in report.history:
    assert 0.9 * K <= entry.l0 <= K  # relu(top-k) may zero a few.
    assert 0.0 <= entry.dead_fraction <= 1.0
    assert math.isfinite(entry.loss) and entry.loss >= entry.mse
  assert any(e.aux_loss > 0 for e in report.history) == any(
      e.dead_fraction > 0 for e in report.history)
  evaluation = report.evaluation
  assert evaluation.tokens == 8 * 31  # Held-out windows minus position 0.
  assert 0.9 * K <= evaluation.l0 <= K
  assert evaluation.explained_variance > 0.6
  assert 0.0 <= evaluation.dead_fraction < 0.5
  for value in (evaluation.ce_clean, evaluation.ce_spliced,
                evaluation.ce_zero_ablated, evaluation.ce_recovered):
    assert math.isfinite(value)
  sae = trained["sae"]
  assert sae.config.hook_point == POINT and sae.config.k == K
  assert sae.config.num_features == 4 * 32
  np.testing.assert_allclose(
      np.linalg.norm(np.asarray(sae.flat()["w_dec"]), axis=1), 1.0,
      rtol=1e-5)


def test_saved_in_saelens_format(trained):
  report = trained["report"]
  assert (report.saved_to / "cfg.json").exists()
  loaded = sae_lib.load_sae(report.saved_to)
  assert loaded.config.activation == "topk" and loaded.config.k == K
  assert loaded.config.hook_point == POINT
  for name, value in trained["sae"].flat().items():
    np.testing.assert_array_equal(np.asarray(loaded.flat()[name]),
                                  np.asarray(value), err_msg=name)


def test_step_compiles_once_and_a_seed_fixes_the_result(model, trained):
  assert trained["traces"].get("train_step") == 1
  out = {}

  def again():
    out["same"] = sae_lib.train_sae(
        model, POINT, _tokens(), sae_lib.TrainConfig(**SETTINGS),
        progress=False)[0]
    # Another seed, length and coefficients: new values, same programs.
    other = dict(SETTINGS, seed=1, steps=40, learning_rate=1e-3,
                 aux_k_coefficient=0.5, eval_windows=0)
    out["other"] = sae_lib.train_sae(model, POINT, _tokens(),
                                     sae_lib.TrainConfig(**other),
                                     progress=False)[0]

  traces = _traces(again)
  assert "train_step" not in traces and "_values_at" not in traces, traces
  first = trained["sae"].flat()
  for name, value in out["same"].flat().items():
    np.testing.assert_array_equal(np.asarray(value), np.asarray(first[name]),
                                  err_msg=name)
  assert not np.allclose(out["other"].flat()["w_dec"], first["w_dec"])


def test_ce_figures_equal_a_replace_splice(model, trained):
  """With no position skipped, the spliced cross-entropy is the one of
  `splice(..., mode="replace")`, the clean one the model's own."""
  sae = trained["sae"]
  windows = _tokens(5, 8 * 32).reshape(8, 32)  # The fixture's shapes.
  metrics = sae_lib.evaluate_sae(model, sae, windows, skip_positions=0)

  def ce(m):
    logits = interp.run_with_cache(m, windows.tolist(), names=[]).logits
    logp = jax.nn.log_softmax(np.asarray(
        logits.unwrap("batch", "seq", "vocabulary"), np.float64), -1)
    return -np.take_along_axis(np.asarray(logp)[:, :-1],
                               windows[:, 1:, None], -1).mean()

  spliced = sae_lib.splice(model, sae, mode="replace")
  np.testing.assert_allclose(metrics.ce_clean, ce(model), rtol=1e-5)
  np.testing.assert_allclose(metrics.ce_spliced, ce(spliced), rtol=1e-5)
  assert metrics.ce_spliced != metrics.ce_clean
  assert metrics.tokens == 8 * 32
  recovered = (metrics.ce_zero_ablated - metrics.ce_spliced) / (
      metrics.ce_zero_ablated - metrics.ce_clean)
  np.testing.assert_allclose(metrics.ce_recovered, recovered)


@pytest.mark.parametrize("activation,extra", [
    ("relu", dict(l1_coefficient=1.0)),
    ("jumprelu", dict(l0_coefficient=0.2, resample_every=50,
                      dead_feature_window=20)),
])
def test_relu_and_jumprelu_learn_sparse_codes(model, activation, extra):
  """On precomputed activations: the reconstruction improves and the
  sparsity penalty lowers L0 from its start."""
  reader = PointActivations(model, POINT, skip_positions=1)
  windows = _tokens(1, 64 * 32).reshape(64, 32)
  acts = np.concatenate([np.asarray(reader(windows[i:i + 8]))
                         for i in range(0, 64, 8)])
  cfg = sae_lib.TrainConfig(**dict(SETTINGS, activation=activation,
                                   steps=200, log_every=20, **extra))
  sae, report = sae_lib.train_sae_on_activations(acts, cfg, hook_point=POINT,
                                                 progress=False)
  first, last = report.history[0], report.final
  assert last.explained_variance > max(0.7, first.explained_variance + 0.3)
  assert last.l0 < 0.6 * first.l0
  assert sae.config.activation == activation and sae.config.hook_point == POINT
  if activation == "jumprelu":
    threshold = np.asarray(sae.flat()["threshold"])
    assert threshold.std() > 0  # Learned per feature.
    assert [step for step, _ in report.resampled] == [50, 100, 150, 200]


def test_shuffle_buffer_hands_out_each_activation_once_mixed():
  chunks = [np.full((100, 1), i, np.float32) + np.arange(100)[:, None] / 1e3
            for i in range(10)]
  batches = list(ShuffleBuffer(capacity=300, batch=64, seed=0).batches(
      iter(chunks)))
  assert all(b.shape == (64, 1) for b in batches)
  values = np.concatenate(batches).ravel()
  assert len(np.unique(values)) == len(values) == 64 * (1000 // 64)
  assert len(np.unique(np.floor(batches[0].ravel()))) > 1  # Mixed chunks.


@pytest.mark.parametrize("kwargs,match", [
    (dict(activation="gelu"), "activation must be one of"),
    (dict(k=0), "k must be an int > 0"),
    (dict(learning_rate=-1.0), "learning_rate must be a finite number > 0"),
    (dict(batch_tokens=1.5), "batch_tokens must be an int > 0"),
    (dict(l1_coefficient=float("nan")), "l1_coefficient"),
    (dict(steps=None), "exactly one of steps= or total_tokens="),
    (dict(total_tokens=1000), "exactly one of steps= or total_tokens="),
    (dict(skip_positions=32), "skip_positions"),
    (dict(warmup_steps=100, decay_steps=100), "exceed the 150 training"),
    (dict(adam_beta2=1.0), "adam_beta2 must be in"),
    (dict(normalize_activations="layer_norm"), "normalize_activations"),
    (dict(b_dec_init="median"), "b_dec_init"),
    (dict(jumprelu_sparsity_loss="quadratic"), "jumprelu_sparsity_loss"),
    (dict(resample_every=0), "resample_every must be an int > 0"),
    (dict(use_bias=True), "unexpected keyword"),
])
def test_bad_settings_are_clear_errors(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    sae_lib.TrainConfig(**dict(SETTINGS, **kwargs))


def test_bad_inputs_are_clear_errors(model):
  cfg = sae_lib.TrainConfig(**SETTINGS)
  with pytest.raises(ValueError, match="exceeds the 8 features"):
    sae_lib.train_sae(model, POINT, _tokens(),
                      sae_lib.TrainConfig(**dict(SETTINGS, num_features=8,
                                                 k=9)), progress=False)
  with pytest.raises(ValueError, match="attn.pattern grows"):
    sae_lib.train_sae(model, "blocks.1.attn.pattern", _tokens(), cfg,
                      progress=False)
  with pytest.raises(ValueError, match="leaves none to train on"):
    sae_lib.train_sae(model, POINT, _tokens(n=200), cfg, progress=False)
  with pytest.raises(ValueError, match="integer ids"):
    sae_lib.train_sae(model, POINT, np.ones(5000) * 0.5, cfg, progress=False)
  with pytest.raises(TypeError, match="must be a TrainConfig"):
    sae_lib.train_sae(model, POINT, _tokens(), dict(SETTINGS),
                      progress=False)


def test_outlier_activations_are_dropped_and_left_alone(model, trained):
  """Activations far longer than the median (attention sinks) are not
  trained on; evaluation leaves tokens above the limit alone and does not
  count them."""
  reader = PointActivations(model, POINT, skip_positions=1)
  acts = np.asarray(reader(_tokens(2, 8 * 32).reshape(8, 32)))
  acts = np.concatenate([acts] * 4)
  acts[::97] *= 100.0
  cfg = sae_lib.TrainConfig(**dict(SETTINGS, steps=5))
  _, report = sae_lib.train_sae_on_activations(acts, cfg, progress=False)
  assert report.dropped_tokens == len(acts[::97])
  median = np.median(np.linalg.norm(acts, axis=-1))
  assert report.norm_limit == pytest.approx(10 * median, rel=0.05)
  windows = _tokens(5, 8 * 32).reshape(8, 32)
  values = np.asarray(reader(windows))
  limit = float(np.median(np.linalg.norm(values, axis=-1)))
  metrics = sae_lib.evaluate_sae(model, trained["sae"], windows,
                                 max_norm=limit)
  assert metrics.tokens == (np.linalg.norm(values, axis=-1) <= limit).sum()
  with pytest.raises(ValueError, match="no token of these windows"):
    sae_lib.evaluate_sae(model, trained["sae"], windows, max_norm=0.0)


def test_an_iterable_of_batches_is_read_once(model):
  """Batches from an iterable: the first eval_windows windows are held
  out, training stops when it ends (fewer steps than asked)."""
  windows = _tokens(3, 48 * 32).reshape(48, 32)
  source = (windows[i:i + 4] for i in range(0, 48, 4))
  cfg = sae_lib.TrainConfig(**dict(SETTINGS, steps=100, buffer_tokens=512))
  _, report = sae_lib.train_sae(model, POINT, source, cfg, progress=False)
  trained_tokens = (48 - 8) // 8 * 8 * 31  # Whole forward groups of 8.
  assert report.steps == trained_tokens // 256 < 100
  assert report.history[-1].step == report.steps
  assert report.evaluation.tokens == 8 * 31


def test_reading_and_evaluating_trace_each_block_structure_once(monkeypatch):
  """`PointActivations` and `evaluate_sae` run per-block layers; blocks of
  one structure are traced once per program, not once each (SmolLM2's 30
  blocks: 2.7 s of tracing per program)."""
  model = penzai_lm.build_transformer(
      config("llama_gqa").replace(num_layers=6), seed=4)
  traced = []
  real = TransformerBlock.__call__

  def counting(self, *args, **kwargs):
    traced.append(self)
    return real(self, *args, **kwargs)

  monkeypatch.setattr(TransformerBlock, "__call__", counting)
  windows = _tokens(7, 2 * 16).reshape(2, 16)
  values = PointActivations(model, POINT)(windows)
  assert values.shape == (2 * 16, 32)
  # Block 1 holds the capture; blocks 0, 2-5 share one trace (or none,
  # where an earlier test traced that structure and shape already).
  assert len(traced) <= 2, len(traced)
  traced.clear()
  sae_lib.evaluate_sae(model, random_sae("topk", d_in=32, d_sae=64), windows,
                       point=POINT, rows=2)
  # Three programs (clean, spliced, zero-ablated), two structures at most
  # in each: 18 block traces without sharing.
  assert len(traced) <= 6, len(traced)
