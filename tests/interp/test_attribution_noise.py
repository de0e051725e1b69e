"""attribution_patching with corrupt=GaussianNoise (causal tracing's
corruption): against a hand-built computation (each noise sample added at
``embed`` by a layer of its own, jax.grad of the metric with respect to an
added zero at each point, times clean - noised, averaged over samples),
against torch autograd on transformers' model of the same weights, and
clear errors for bad inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

import penzai_lm
from penzai_lm import interp
from penzai_lm.runtime.unstack import unstack_layers
from tests.model.configs import config

CLEAN = [5, 6, 7, 8, 9, 10]
CORRUPT = [5, 6, 70, 8, 9, 11]
METRIC = interp.LogitDiff(23, 89)
NOISE = interp.GaussianNoise(positions=(1, 2), samples=3, seed=4)
NAMES = ("resid_pre", "attn_out", "mlp_out")


@pz.pytree_dataclass
class _Add(pz.nn.Layer):
  delta: pz.nx.NamedArray

  def __call__(self, x, /, **_):
    return x + self.delta.astype(x.dtype)


@functools.cache
def _stacked():
  return penzai_lm.build_transformer(config("llama_gqa", True), seed=3)


def _tokens(ids):
  return pz.nx.wrap(jnp.asarray(ids, jnp.int32)).tag("seq")


def _metric(model, ids, metric):
  return metric(model(_tokens(ids)))


def _by_hand(model, clean_ids, noised_ids, noise, metric, names):
  """``{point: (blocks, seq)}``: per sample, the noised run's gradient of
  the metric at each point (an added zero) times clean - noised, summed
  over ``embedding``; then averaged over samples. Also the mean metric."""
  n = model.config.num_layers
  where = [f"blocks.{l}.{p}" for p in names for l in range(n)]
  clean = interp.run_with_cache(model, _tokens(clean_ids), names=where)
  scores, metrics = [], []
  for sample in noise.unwrap("noise", "seq", "embedding"):
    noised = interp.insert_at(model, "embed", _Add(
        pz.nx.wrap(jnp.asarray(sample)).tag("seq", "embedding")))
    acts = interp.run_with_cache(noised, _tokens(noised_ids), names=where)

    def f(deltas, noised=noised):
      m = noised
      for name, d in zip(where, deltas):
        m = interp.insert_at(m, name, _Add(d), after_hook=False)
      return _metric(pz.freeze_params(m), noised_ids, metric)

    zeros = [pz.nx.zeros(dict(acts[w].named_shape)) for w in where]
    value, grads = jax.value_and_grad(f)(zeros)
    metrics.append(float(value))
    scores.append({w: np.asarray(
        ((clean[w] - acts[w]) * g).unwrap("seq", "embedding")).sum(-1)
                   for w, g in zip(where, grads)})
  return {p: np.mean([[s[f"blocks.{l}.{p}"] for l in range(n)]
                      for s in scores], axis=0) for p in names
          }, float(np.mean(metrics))


@pytest.mark.parametrize("corrupted", [None, CORRUPT])
def test_equals_per_sample_gradients_averaged(corrupted):
  model = _stacked()
  ours = interp.attribution_patching(model, CLEAN, corrupted, METRIC,
                                     names=NAMES, corrupt=NOISE)
  noise = NOISE.noise(model, interp.weights(model, "embed.W_E"), len(CLEAN))
  want, noised_metric = _by_hand(
      unstack_layers(model), CLEAN, corrupted or CLEAN, noise, METRIC, NAMES)
  assert ours.clean_metric == pytest.approx(
      float(_metric(model, CLEAN, METRIC)), abs=1e-5)
  assert ours.corrupted_metric == pytest.approx(noised_metric, abs=1e-5)
  for name in NAMES:
    scale = np.abs(want[name]).max()
    assert scale > 1e-3, name
    np.testing.assert_allclose(ours.values(name), want[name],
                               atol=1e-5 * max(1.0, scale), err_msg=name)
  # Block 0's input differs only where noise (or a token change) is.
  untouched = [p for p in range(len(CLEAN))
               if p not in NOISE.positions and CLEAN[p] == (corrupted or
                                                           CLEAN)[p]]
  assert not ours.values("resid_pre")[0, untouched].any()
  # Averaging: one sample's attribution differs from the mean.
  one = interp.attribution_patching(
      model, CLEAN, corrupted, METRIC, names=NAMES,
      corrupt=interp.GaussianNoise(positions=(1, 2), samples=1, seed=4))
  assert not np.allclose(one.values("resid_pre"), ours.values("resid_pre"))


def test_default_metric_is_the_clean_answers_probability():
  model = _stacked()
  ours = interp.attribution_patching(model, CLEAN, corrupt=NOISE,
                                     names="resid_pre")
  logits = model(_tokens(CLEAN)).unwrap("seq", "vocabulary")[-1]
  probs = jax.nn.softmax(logits)
  assert ours.clean_metric == pytest.approx(float(probs.max()), abs=1e-6)


@pytest.mark.parametrize("kwargs, message", [
    (dict(corrupt=None), "give corrupted_tokens .* or corrupt="),
    (dict(corrupt=3), "corrupt must be a GaussianNoise"),
    (dict(corrupt=interp.GaussianNoise(positions=(2, 9))),
     r"positions \[9\] are outside the prompt's 6 tokens"),
    (dict(clean_tokens=[CLEAN, [1, 2]]), "corrupt= needs prompts of one"),
    (dict(clean_tokens=pz.nx.wrap(jnp.asarray([CLEAN])).tag("noise", "seq")),
     "'noise' axis"),
])
def test_bad_inputs_are_errors(kwargs, message):
  args = dict(clean_tokens=CLEAN, corrupt=NOISE, metric=METRIC)
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    interp.attribution_patching(_stacked(), args.pop("clean_tokens"), **args)


def test_equals_torch_autograd_with_noised_embeddings(tmp_path):
  """Per sample, a forward hook adds the noise to transformers' token
  embeddings; hooks keep resid_pre and mlp_out (retain_grad); backward of
  the metric; (clean - noised) . grad, averaged over samples."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from penzai_lm.loading import load_model  # pylint: disable=g-import-not-at-top
  from tests.loading.hf_models import save_perturbed  # pylint: disable=g-import-not-at-top
  hf_config = transformers.LlamaConfig(
      vocab_size=101, hidden_size=32, intermediate_size=40,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=64)
  hf = save_perturbed(transformers.LlamaForCausalLM, hf_config, tmp_path)
  model = load_model(tmp_path)
  clean = [3, 17, 29, 41, 8, 60, 12]
  metric = interp.LogitDiff(answer=44, wrong=7)
  corrupt = interp.GaussianNoise(positions=(2, 3), samples=2, seed=1)
  ours = interp.attribution_patching(model, clean, metric=metric,
                                     names=("resid_pre", "mlp_out"),
                                     corrupt=corrupt)
  noise = np.asarray(corrupt.noise(
      model, interp.weights(model, "embed.W_E"), len(clean)).unwrap(
          "noise", "seq", "embedding"))

  def run(sample):
    saved, handles = {}, []

    def keep(name, tensor):
      if sample is not None:
        tensor.retain_grad()
      saved[name] = tensor

    for i, layer in enumerate(hf.model.layers):
      handles.append(layer.register_forward_pre_hook(
          lambda m, a, k, i=i: keep(("resid_pre", i), a[0] if a else
                                    k["hidden_states"]), with_kwargs=True))
      handles.append(layer.mlp.register_forward_hook(
          lambda m, a, o, i=i: keep(("mlp_out", i), o)))
    if sample is not None:
      handles.append(hf.model.embed_tokens.register_forward_hook(
          lambda m, a, o: o + torch.tensor(sample)[None]))
    try:
      with torch.set_grad_enabled(sample is not None):
        logits = hf(torch.tensor([clean])).logits[0]
        value = logits[-1, metric.answer] - logits[-1, metric.wrong]
        if sample is not None:
          value.backward()
    finally:
      for h in handles:
        h.remove()
    return float(value.detach()), saved

  clean_metric, clean_acts = run(None)
  runs = [run(s) for s in noise]
  assert ours.clean_metric == pytest.approx(clean_metric, abs=1e-4)
  assert ours.corrupted_metric == pytest.approx(
      np.mean([m for m, _ in runs]), abs=1e-4)
  for name in ("resid_pre", "mlp_out"):
    theirs = np.mean([[
        ((clean_acts[name, i] - acts[name, i]).detach()[0]
         * acts[name, i].grad[0]).sum(-1).numpy() for i in range(2)]
                      for _, acts in runs], axis=0)
    scale = np.abs(theirs).max()
    assert scale > 1e-3, name
    np.testing.assert_allclose(ours.values(name), theirs,
                               atol=1e-4 * max(1.0, scale), err_msg=name)
