"""attribution_patching: against patching_sweep where the first-order
estimate must hold, against autograd on transformers' model of the same
weights (forward hooks, retain_grad), on both layouts, ragged pairs, one
compilation."""

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
CORRUPT = [5, 6, 70, 8, 9, 11]  # Differs at positions 2 and 5.
METRIC = interp.LogitDiff(23, 89)
ALL = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out",
       "attn.head_out", "mlp.neurons")


@functools.cache
def _models():
  stacked = penzai_lm.build_transformer(config("llama_gqa", True), seed=3)
  return {"stacked": stacked, "unstacked": unstack_layers(stacked)}


@functools.cache
def _result(layout, names=ALL):
  return interp.attribution_patching(_models()[layout], CLEAN, CORRUPT,
                                     METRIC, names=names)


def test_layouts_agree_and_scores_add_up():
  a, b = _result("stacked"), _result("unstacked")
  assert (a.clean_metric, a.corrupted_metric) == pytest.approx(
      (b.clean_metric, b.corrupted_metric), abs=1e-5)
  shapes = {n: a.values(n).shape for n in ALL}
  assert shapes == {**{n: (3, 6) for n in ALL}, "attn.head_out": (3, 6, 4),
                    "mlp.neurons": (3, 6, 48)}
  for name in ALL:
    np.testing.assert_allclose(a.values(name), b.values(name), atol=1e-5,
                               err_msg=name)
  v = a.values
  # Positions before the first corrupted token have equal values in both
  # runs: nothing to patch, score 0 (up to rounding: XLA may round rows
  # of one batch differently, ~1e-11 here).
  for name in ALL:
    np.testing.assert_allclose(v(name)[:, :2], 0.0, atol=1e-8, err_msg=name)
  # Block 0's input differs only at the corrupted tokens.
  assert not v("resid_pre")[0, [3, 4]].any()
  assert np.abs(v("resid_pre")[0, [2, 5]]).min() > 1e-3
  # The same value and gradient under two names.
  np.testing.assert_allclose(v("resid_pre")[1:], v("resid_post")[:-1],
                             atol=1e-6)
  # attn_out is a linear map of the heads' outputs, mlp_out of the neurons
  # (no biases, no post norms here): their scores are the sums.
  np.testing.assert_allclose(v("attn.head_out").sum(-1), v("attn_out"),
                             atol=1e-5)
  np.testing.assert_allclose(v("mlp.neurons").sum(-1), v("mlp_out"),
                             atol=1e-5)


def _with_nearby_corruption(model, eps):
  """``model`` with the embeddings of the corrupted tokens (70, 11) set to
  the clean ones' (7, 10) plus ``eps`` times a fixed direction: every
  activation of the corrupted run is then within O(eps) of the clean
  run's, where the first-order estimate must hold."""
  tables = pz.select(model).at_instances_of(pz.nn.EmbeddingTable)
  table = tables.get()
  data = table.embeddings.value.unwrap("vocabulary", "embedding")
  noise = np.random.default_rng(0).standard_normal((2, data.shape[1]))
  scale = float(jnp.std(data))
  for (clean, corrupt), n in zip([(7, 70), (10, 11)], noise):
    data = data.at[corrupt].set(data[clean] + eps * scale * n)
  value = pz.nx.wrap(data).tag("vocabulary", "embedding")
  return tables.at(lambda t: t.embeddings.value).set(value)


def test_first_order_estimate_of_patching_sweep():
  """Near the clean run, attribution equals patching_sweep's change to
  first order: the error shrinks as eps**2 (relative to the change: as
  eps). Far from it (the tokens as they are) it is only an estimate."""
  errors = {}
  for eps in (0.04, 0.02):
    model = _with_nearby_corruption(_models()["stacked"], eps)
    attribution = interp.attribution_patching(
        model, CLEAN, CORRUPT, METRIC, names=["resid_pre", "attn.head_out"])
    for point, name in (("resid_pre", "resid_pre"),
                        ("attn.head_out", "attn.head_out")):
      sweep = interp.patching_sweep(model, CLEAN, CORRUPT, point=point,
                                    metric=METRIC)
      change = sweep.values - sweep.corrupted_metric
      estimate = attribution.values(name)
      if name == "attn.head_out":  # The sweep patches every head at once.
        estimate = estimate.sum(-1)
      assert sweep.corrupted_metric == pytest.approx(
          attribution.corrupted_metric, abs=1e-5)
      err = np.abs(estimate - change).max()
      errors[eps, point] = err / np.abs(change).max()
      print(f"eps {eps} {point}: max |change| {np.abs(change).max():.3e},"
            f" max |estimate - change| {err:.3e}, corr"
            f" {np.corrcoef(estimate.ravel(), change.ravel())[0, 1]:.5f}")
  for point in ("resid_pre", "attn.head_out"):
    assert errors[0.04, point] < 0.1, errors
    ratio = errors[0.02, point] / errors[0.04, point]
    assert 0.3 < ratio < 0.7, (point, ratio)  # Linear in eps.
  as_sweep = attribution.as_patching_result("resid_pre")
  np.testing.assert_allclose(as_sweep.values - as_sweep.corrupted_metric,
                             attribution.values("resid_pre"), atol=1e-7)


def test_ragged_pairs_equal_each_pair_alone():
  model = _models()["stacked"]
  clean = [CLEAN, [3, 4, 5, 6]]
  corrupt = [CORRUPT, [3, 40, 5, 6]]
  both = interp.attribution_patching(model, clean, corrupt, METRIC,
                                     names=["resid_pre", "mlp.neurons"])
  assert both.lengths == (6, 4)
  metrics = []
  for r in range(2):
    alone = interp.attribution_patching(model, clean[r], corrupt[r], METRIC,
                                        names=["resid_pre", "mlp.neurons"])
    metrics.append((alone.clean_metric, alone.corrupted_metric))
    for name in ("resid_pre", "mlp.neurons"):
      # The metric is a mean over the rows: each row's gradient is half.
      np.testing.assert_allclose(2 * both.row(name, r), alone.values(name),
                                 atol=1e-5, err_msg=name)
  np.testing.assert_allclose(
      (both.clean_metric, both.corrupted_metric), np.mean(metrics, axis=0),
      atol=1e-5)
  assert not both["resid_pre"][{"batch": 1, "seq": pz.slice[:2]}].data_array.any()
  with pytest.raises(ValueError, match="the prompts are ragged"):
    both.values("resid_pre")


def test_one_compilation_for_new_prompts_of_the_same_shape():
  model = _models()["stacked"]
  traces = []

  def metric(logits):
    traces.append(dict(logits.named_shape))
    return METRIC(logits)

  first = interp.attribution_patching(model, CLEAN, CORRUPT, metric,
                                      names=["resid_pre"])
  again = interp.attribution_patching(model, CORRUPT, CLEAN, metric,
                                      names=["resid_pre"])
  # Two runs' metrics in one trace of one program; swapped roles flip the
  # metrics, and the program is reused.
  assert traces == [{"seq": 6, "vocabulary": 97}] * 2, traces
  assert again.clean_metric == pytest.approx(first.corrupted_metric,
                                             abs=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(names=["attn.pattern"]), "'attn.pattern' has no attribution"),
    (dict(names=["blocks.1.resid_pre"]), "names a block"),
    (dict(names=["resid_pots"]), "'resid_pots' is not a block point"),
    (dict(names=[]), "names is empty"),
    (dict(corrupted_tokens=CORRUPT[:-1]), "corrupted_tokens has"),
    (dict(clean_tokens=[CLEAN, [1, 2]], corrupted_tokens=[CORRUPT, [1]]),
     r"pair i \(clean\[i\], corrupted\[i\]\) must have one length"),
    (dict(metric=3), "metric must be callable"),
])
def test_bad_inputs_are_errors(kwargs, message):
  args = dict(clean_tokens=CLEAN, corrupted_tokens=CORRUPT, metric=METRIC)
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    interp.attribution_patching(_models()["stacked"], args.pop("clean_tokens"),
                                args.pop("corrupted_tokens"), **args)


# ------------------------------------------------ against transformers


def test_scores_equal_torch_autograd_on_the_same_weights(tmp_path):
  """The same quantity by hand in torch: hooks keep each point's clean
  value and the corrupted run's tensor (retain_grad), backward of the
  metric, (clean - corrupted) . grad."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from penzai_lm.loading import load_model  # pylint: disable=g-import-not-at-top
  from tests.loading.hf_models import save_perturbed  # pylint: disable=g-import-not-at-top
  hf_config = transformers.LlamaConfig(
      vocab_size=101, hidden_size=32, intermediate_size=40,
      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=64)
  hf = save_perturbed(transformers.LlamaForCausalLM, hf_config, tmp_path)
  model = load_model(tmp_path)
  clean, corrupt = [3, 17, 29, 41, 8, 60, 12], [3, 17, 29, 90, 8, 61, 12]
  metric = interp.LogitDiff(answer=44, wrong=7)
  ours = interp.attribution_patching(model, clean, corrupt, metric,
                                     names=ALL)

  def run(ids, keep_grad):
    saved = {}

    def keep(name, tensor):
      if keep_grad:
        tensor.retain_grad()
      saved[name] = tensor

    handles = []
    for i, layer in enumerate(hf.model.layers):
      def hooks(i=i, layer=layer):
        yield layer.register_forward_pre_hook(
            lambda m, a, k: keep(("resid_pre", i), a[0] if a else
                                 k["hidden_states"]), with_kwargs=True)
        yield layer.post_attention_layernorm.register_forward_pre_hook(
            lambda m, a: keep(("resid_mid", i), a[0]))
        yield layer.self_attn.register_forward_hook(
            lambda m, a, o: keep(("attn_out", i), o[0]))
        yield layer.self_attn.o_proj.register_forward_pre_hook(
            lambda m, a: keep(("attn.head_out", i), a[0]))
        yield layer.mlp.register_forward_hook(
            lambda m, a, o: keep(("mlp_out", i), o))
        yield layer.mlp.down_proj.register_forward_pre_hook(
            lambda m, a: keep(("mlp.neurons", i), a[0]))
        yield layer.register_forward_hook(
            lambda m, a, o: keep(("resid_post", i),
                                 o[0] if isinstance(o, tuple) else o))
      handles.extend(hooks())
    try:
      with torch.set_grad_enabled(keep_grad):
        logits = hf(torch.tensor([ids])).logits[0]
        value = logits[-1, metric.answer] - logits[-1, metric.wrong]
        if keep_grad:
          value.backward()
    finally:
      for h in handles:
        h.remove()
    return float(value.detach()), saved

  clean_metric, clean_acts = run(clean, False)
  corrupted_metric, acts = run(corrupt, True)
  assert ours.clean_metric == pytest.approx(clean_metric, abs=1e-4)
  assert ours.corrupted_metric == pytest.approx(corrupted_metric, abs=1e-4)
  for name in ALL:
    theirs = []
    for i in range(3):
      delta = (clean_acts[name, i] - acts[name, i]).detach()[0]
      grad = acts[name, i].grad[0]
      if name == "attn.head_out":  # Per head: (seq, heads, head_dim).
        delta, grad = (t.reshape(len(clean), 4, 8) for t in (delta, grad))
      if name == "mlp.neurons":
        theirs.append((delta * grad).numpy())
      else:
        theirs.append((delta * grad).sum(-1).numpy())
    theirs = np.stack(theirs)
    got = ours.values(name)
    scale = np.abs(theirs).max()
    assert scale > 1e-3, name
    np.testing.assert_allclose(got, theirs, atol=1e-4 * max(1.0, scale),
                               err_msg=name)
