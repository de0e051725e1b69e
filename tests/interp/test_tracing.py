"""Causal tracing: patching_sweep with a Gaussian-noise corruption of the
embeddings (several samples) and restoring windows of blocks, against a
plain loop over runs built from two hand-written layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

import penzai_lm
from penzai_lm import interp
from tests.model.configs import config

PROMPT = [5, 9, 14, 3, 7, 11]
SUBJECT = (1, 2)


@pz.pytree_dataclass
class _Add(pz.nn.Layer):
  delta: pz.nx.NamedArray

  def __call__(self, x, /, **_):
    return x + self.delta


@pz.pytree_dataclass
class _Replace(pz.nn.Layer):
  value: pz.nx.NamedArray
  mask: pz.nx.NamedArray

  def __call__(self, x, /, **_):
    return pz.nx.nmap(jnp.where)(self.mask, self.value, x)


def _prob(model, answer) -> float:
  tokens = pz.nx.wrap(jnp.asarray(PROMPT, jnp.int32)).tag("seq")
  logits = np.asarray(model(tokens).unwrap("seq", "vocabulary"))[-1]
  return float(jax.nn.softmax(logits)[answer])


def _loop(model, noise, point, layer, position, window, clean, answer):
  """The metric of one cell, run by run (one run per noise sample)."""
  n = model.config.num_layers
  blocks = range(max(0, layer - window // 2),
                 min(n, layer + (window - 1) // 2 + 1))
  probs = []
  for sample in noise:
    patched = interp.insert_at(model, "embed", _Add(
        pz.nx.wrap(sample).tag("seq", "embedding")))
    mask = pz.nx.wrap(jnp.arange(len(PROMPT)) == position).tag("seq")
    for b in blocks:
      patched = interp.insert_at(patched, f"blocks.{b}.{point}", _Replace(
          clean[f"blocks.{b}.{point}"], mask), after_hook=False)
    probs.append(_prob(patched, answer))
  return float(np.mean(probs))


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("point, window", [("resid_pre", 1), ("mlp_out", 2)])
def test_noise_corrupted_sweep_equals_a_loop_of_runs(stacked, point, window):
  model = penzai_lm.build_transformer(config("llama_gqa", stacked), seed=3)
  corrupt = interp.GaussianNoise(positions=SUBJECT, samples=3, seed=1)
  result = interp.patching_sweep(model, PROMPT, corrupt=corrupt, point=point,
                                 window=window, positions=[1, 2, 5])
  answer = int(np.argmax(np.asarray(model(pz.nx.wrap(jnp.asarray(
      PROMPT, jnp.int32)).tag("seq")).unwrap("seq", "vocabulary"))[-1]))
  noise = np.asarray(corrupt.noise(model, interp.weights(model, "embed.W_E"),
                                   len(PROMPT)).unwrap("noise", "seq",
                                                       "embedding"))
  assert (noise[:, [0, 3, 4, 5]] == 0).all() and (noise[:, 1:3] != 0).all()
  clean = interp.run_with_cache(
      model, PROMPT, names=[f"blocks.{b}.{point}" for b in range(3)])
  clean = {n: clean[n][{"batch": 0}] for n in clean.values}
  assert result.clean_metric == pytest.approx(_prob(model, answer), abs=1e-5)
  corrupted = np.mean([_prob(interp.insert_at(model, "embed", _Add(
      pz.nx.wrap(s).tag("seq", "embedding"))), answer) for s in noise])
  assert result.corrupted_metric == pytest.approx(corrupted, abs=1e-5)
  assert result.corrupted_metric < result.clean_metric
  for i, layer in enumerate(result.layers):
    for j, position in enumerate(result.positions):
      want = _loop(model, noise, point, layer, position, window, clean,
                   answer)
      assert result.values[i, j] == pytest.approx(want, abs=1e-5), (
          layer, position)


def test_tracing_inputs_are_checked():
  model = penzai_lm.build_transformer(config("llama_gqa", True), seed=3)
  with pytest.raises(ValueError, match="corrupted_tokens .* or corrupt="):
    interp.patching_sweep(model, PROMPT)
  with pytest.raises(ValueError, match="outside the prompt's 6 tokens"):
    interp.patching_sweep(model, PROMPT,
                          corrupt=interp.GaussianNoise(positions=[9]))
  with pytest.raises(ValueError, match="window must be an int >= 1"):
    interp.patching_sweep(model, PROMPT, window=0,
                          corrupt=interp.GaussianNoise(positions=[1]))
  for bad in (dict(positions=[]), dict(positions=[1], scale=-1.0),
              dict(positions=[1], scale=float("nan")),
              dict(positions=[1], samples=0)):
    with pytest.raises(ValueError, match="GaussianNoise"):
      interp.GaussianNoise(**bad)


def test_metric_fields_outside_the_model_are_refused_before_running():
  model = penzai_lm.build_transformer(config("llama_gqa", True), seed=3)
  for metric, message in ((interp.LogitDiff(10**6, 1), "LogitDiff.answer"),
                          (interp.LogitDiff(1, 2, position=6),
                           "LogitDiff.position"),
                          (interp.AnswerProb(97), "AnswerProb.answer")):
    with pytest.raises(ValueError, match=message):
      interp.patching_sweep(model, PROMPT, PROMPT[::-1], metric=metric)
