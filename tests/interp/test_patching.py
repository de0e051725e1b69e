"""patching_sweep: one batched run equals a loop of single patched runs, on
both layouts, in chunks with one compilation; and against transformers."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

import penzai_lm
from penzai_lm import interp
from penzai_lm.runtime.unstack import unstack_layers
from tests import real_models
from tests.model.configs import config

CLEAN = [5, 6, 7, 8, 9, 10]
CORRUPT = [5, 6, 70, 8, 9, 11]  # Differs at positions 2 and 5.
# The logit difference of the runs' top predictions at the last token (23
# clean, 89 corrupted): what the default metric picks.
METRIC = interp.LogitDiff(23, 89)
TOL = 1e-5


@functools.cache
def _models():
  """The same weights as a layer stack and as per-layer blocks."""
  stacked = penzai_lm.build_transformer(config("llama_gqa", True), seed=3)
  return {"stacked": stacked, "unstacked": unstack_layers(stacked)}


@jax.jit
def _jit_logits(model, tokens):
  return model(tokens)


def _logits(model, ids):
  tokens = pz.nx.wrap(jnp.asarray([ids], jnp.int32)).tag("batch", "seq")
  return _jit_logits(pz.freeze_params(model), tokens)


SWEEPS = {  # name: (point, layers, positions)
    "resid_pre": ("resid_pre", None, None),
    "head_out": ("attn.head_out", [0, 2], [2, (3, 5)]),
}


@functools.cache
def _sweep(layout, which):
  point, layers, positions = SWEEPS[which]
  return interp.patching_sweep(_models()[layout], CLEAN, CORRUPT,
                               point=point, layers=layers,
                               positions=positions, metric=METRIC)


# Per-layer blocks compile a program per patched block: the loop checks one
# (the layout test compares the others with the stack's).
@pytest.mark.parametrize("layout, which, rows", [
    ("stacked", "resid_pre", None), ("unstacked", "resid_pre", [1]),
    ("stacked", "head_out", None)])
def test_sweep_equals_single_patched_runs(layout, which, rows):
  model = _models()[layout]
  result = _sweep(layout, which)
  point = SWEEPS[which][0]
  assert result.point == point
  assert result.values.shape == (len(result.layers), len(result.positions))
  rows = range(len(result.layers)) if rows is None else rows
  names = [f"blocks.{result.layers[i]}.{point}" for i in rows]
  # One prompt without a batch axis, as the sweep captures it (the same
  # shapes: eager operations compiled once).
  tokens = pz.nx.wrap(jnp.asarray(CLEAN, jnp.int32)).tag("seq")
  cache = interp.run_with_cache(model, tokens, names=names)
  for i, name in zip(rows, names):
    expected = []
    for p in result.positions:
      patched = interp.insert_at(
          model, name, interp.PatchValue.build(
              cache[name], list(np.atleast_1d(p))))
      expected.append(float(METRIC(_logits(patched, CORRUPT))))
    np.testing.assert_allclose(result.values[i], expected, atol=TOL,
                               rtol=TOL, err_msg=name)
  np.testing.assert_allclose(result.clean_metric,
                             float(METRIC(_logits(model, CLEAN))), atol=TOL)
  np.testing.assert_allclose(result.corrupted_metric,
                             float(METRIC(_logits(model, CORRUPT))), atol=TOL)
  # The sweep measures something: patching the corrupted tokens changes it.
  assert np.abs(result.values - result.corrupted_metric).max() > 1e-3


def test_layouts_give_equal_sweeps():
  for which in SWEEPS:
    a, b = _sweep("stacked", which), _sweep("unstacked", which)
    assert (a.layers, a.positions) == (b.layers, b.positions)
    np.testing.assert_allclose(a.values, b.values, atol=TOL, rtol=TOL)
    np.testing.assert_allclose(a.normalized, b.normalized, atol=1e-4)


def test_resid_pre_sweep_semantics():
  result = _sweep("stacked", "resid_pre")
  assert result.layers == (0, 1, 2) and result.positions == tuple(range(6))
  # Positions before the first corrupted token hold the same values in both
  # runs: patching them changes nothing.
  np.testing.assert_allclose(result.normalized[:, :2], 0.0, atol=1e-4)
  # Block 0's input is the token embeddings: only the positions of the
  # corrupted tokens differ there.
  np.testing.assert_allclose(result.normalized[0, [0, 1, 3, 4]], 0.0,
                             atol=1e-4)
  assert abs(result.normalized[0, 2]) > 1e-2
  assert result.value(0, 2) == result.values[0, 2]
  with pytest.raises(KeyError, match="not swept"):
    result.value(0, (1, 2))


@pytest.mark.parametrize("layout", ["stacked", "unstacked"])
def test_patching_whole_resid_pre_restores_the_clean_run(layout):
  model = _models()[layout]
  clean_logits = _logits(model, CLEAN).unwrap("batch", "seq", "vocabulary")[0]

  def distance(logits):  # Max |logit - clean logit| over every token.
    return jnp.abs(logits.unwrap("seq", "vocabulary") - clean_logits).max()

  result = interp.patching_sweep(model, CLEAN, CORRUPT, positions="all",
                                 metric=distance)
  assert result.positions == (tuple(range(6)),)
  assert result.corrupted_metric > 0.1
  assert result.clean_metric < TOL
  np.testing.assert_allclose(result.values, 0.0, atol=TOL)
  np.testing.assert_allclose(result.normalized, 1.0, atol=1e-4)


def test_one_compilation_for_every_chunk():
  model = _models()["stacked"]
  traces = []

  def metric(logits):  # Runs once per trace of a compiled program.
    traces.append(dict(logits.named_shape))
    return METRIC(logits)

  chunked = interp.patching_sweep(model, CLEAN, CORRUPT, metric=metric,
                                  batch_size=3)
  # 3 x 6 patched runs and the 2 baselines: 7 chunks of 3 rows (the last
  # padded), and one trace for all of them.
  assert len(traces) == 1, traces
  assert traces[0] == {"seq": 6, "vocabulary": 97}
  np.testing.assert_allclose(chunked.values, _sweep("stacked",
                                                    "resid_pre").values,
                             atol=TOL, rtol=TOL)
  # Other layers and positions, same chunk size: no new trace.
  again = interp.patching_sweep(model, CLEAN, CORRUPT, metric=metric,
                                layers=[2, 0], positions=[5, 2, 3],
                                batch_size=3)
  assert len(traces) == 1, traces
  full = _sweep("stacked", "resid_pre").values
  np.testing.assert_allclose(again.values, full[[2, 0]][:, [5, 2, 3]],
                             atol=TOL, rtol=TOL)


def test_default_metric_and_batches_of_prompts():
  model = _models()["stacked"]
  last = lambda ids: _logits(model, ids).unwrap(  # noqa: E731
      "batch", "seq", "vocabulary")[0, -1]
  assert (int(np.argmax(last(CLEAN))), int(np.argmax(last(CORRUPT)))) == (
      METRIC.answer, METRIC.wrong)
  default = interp.patching_sweep(model, CLEAN, CORRUPT)
  full = _sweep("stacked", "resid_pre")
  np.testing.assert_array_equal(default.values, full.values)
  assert default.clean_metric > 0 > default.corrupted_metric
  # A batch of two prompts (the same one twice): the metric is the mean.
  batch = interp.patching_sweep(model, [CLEAN, CLEAN], [CORRUPT, CORRUPT],
                                layers=[0, 2], positions=[2, 5],
                                metric=METRIC)
  np.testing.assert_allclose(batch.values, full.values[[0, 2]][:, [2, 5]],
                             atol=TOL, rtol=TOL)


@pytest.mark.parametrize("kwargs, message", [
    (dict(corrupted_tokens=CORRUPT[:-1]),
     r"clean_tokens has shape \{'seq': 6\} but corrupted_tokens has"
     r" \{'seq': 5\}"),
    (dict(corrupted_tokens=[5, 6, 97, 8, 9, 10]), "contains id 97"),
    (dict(clean_tokens=[[1, 2], [3]]), "equally long lists"),
    (dict(point="resid_pots"), "did you mean 'resid_post'"),
    (dict(point="embed"), "not inside a block"),
    (dict(point="blocks.1.resid_pre"), r"choose blocks with layers=\[...\]"),
    (dict(layers=[0, 3]), r"layers \[3\] do not exist: the model has 3"
     r" blocks \(0 to 2\)"),
    (dict(layers=[-1]), r"layers \[-1\] do not exist"),
    (dict(layers=[]), "layers is empty"),
    (dict(layers=[1, 1]), "duplicates"),
    (dict(positions=[0, 6]), r"positions \[6\] are outside the prompts' 6"
     " tokens"),
    (dict(positions="last"), "give None"),
    (dict(positions=[()]), "non-empty tuple"),
    (dict(metric=3), "metric must be callable"),
    (dict(metric=lambda logits: logits[{"seq": -1}]),
     "must return a scalar per run"),
    (dict(batch_size=0), "batch_size must be a positive int"),
    (dict(clean_tokens=[CLEAN, CLEAN], corrupted_tokens=[CORRUPT, CORRUPT],
          metric=None),
     "pass metric="),
])
def test_bad_inputs_are_errors(kwargs, message):
  args = dict(clean_tokens=CLEAN, corrupted_tokens=CORRUPT, metric=METRIC)
  args.update(kwargs)
  with pytest.raises(ValueError, match=message):
    interp.patching_sweep(_models()["stacked"], args.pop("clean_tokens"),
                          args.pop("corrupted_tokens"), **args)


def test_bad_models_and_results():
  cached = penzai_lm.KVCachingTransformerLM.from_uncached(
      _models()["stacked"], 8, {"batch": 1})
  with pytest.raises(ValueError, match="needs an uncached TransformerLM"):
    interp.patching_sweep(cached, CLEAN, CORRUPT, metric=METRIC)
  same = interp.PatchingResult(
      values=np.zeros((1, 1)), layers=(0,), positions=(0,),
      point="resid_pre", clean_metric=1.0, corrupted_metric=1.0)
  with pytest.raises(ValueError, match="normalised score is undefined"):
    same.normalized  # pylint: disable=pointless-statement
  with pytest.raises(ValueError, match="LogitDiff.answer must be an int"):
    interp.LogitDiff(1.5, 2)


# ------------------------------------------------- against transformers

HF_CLEAN = "The Eiffel Tower is in the city of"
HF_CORRUPT = "The Colosseum is in the city of"  # 9 tokens each (SmolLM2).
HF_CELLS = dict(layers=[3, 6], positions=[3, 8])


@pytest.mark.slow
def test_sweep_matches_transformers():
  torch = pytest.importorskip("torch")
  name = "smollm2-135m-instruct"
  model, tokenizer = real_models.ours(name)
  threads = torch.get_num_threads()
  torch.set_num_threads(1)  # See test_hf_parity.py.
  try:
    hf = real_models.theirs(name)
    clean, corrupt = tokenizer.encode(HF_CLEAN), tokenizer.encode(HF_CORRUPT)
    assert len(clean) == len(corrupt) == 9, (clean, corrupt)
    paris, rome = tokenizer.encode(" Paris"), tokenizer.encode(" Rome")
    assert len(paris) == len(rome) == 1
    metric = interp.LogitDiff(paris[0], rome[0])
    result = interp.patching_sweep(model, clean, corrupt, metric=metric,
                                   **HF_CELLS)

    def hf_logits(ids, layer=None, pos=None):
      """HF logits (seq, vocabulary), with resid_pre of ``layer`` at
      ``pos`` taken from the clean run."""
      saved = {}

      def hidden(args, kwargs):
        return args[0] if args else kwargs["hidden_states"]

      def keep(_module, args, kwargs):
        saved["clean"] = hidden(args, kwargs).detach().clone()

      def patch(_module, args, kwargs):
        hs = hidden(args, kwargs).clone()
        hs[:, pos] = saved["clean"][:, pos]
        if args:
          return (hs,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hs}

      with contextlib.ExitStack() as stack:
        if layer is not None:
          block = hf.model.layers[layer]
          handle = block.register_forward_pre_hook(keep, with_kwargs=True)
          with torch.no_grad():
            hf(torch.tensor([clean]))
          handle.remove()
          stack.callback(block.register_forward_pre_hook(
              patch, with_kwargs=True).remove)
        with torch.no_grad():
          return hf(torch.tensor([ids])).logits[0].numpy()

    def theirs(logits):
      return float(logits[-1, paris[0]] - logits[-1, rome[0]])

    assert abs(result.clean_metric - theirs(hf_logits(clean))) < 1e-3
    assert abs(result.corrupted_metric - theirs(hf_logits(corrupt))) < 1e-3
    assert result.clean_metric - result.corrupted_metric > 1.0
    for i, layer in enumerate(result.layers):
      for j, pos in enumerate(result.positions):
        reference = hf_logits(corrupt, layer, pos)
        diff = abs(result.values[i, j] - theirs(reference))
        print(f"cell ({layer}, {pos}): metric {result.values[i, j]:.4f},"
              f" |diff| vs transformers {diff:.2e}")
        assert diff < 1e-3, (layer, pos, diff)
        if (layer, pos) == (6, 3):
          # Whole logits of one cell: a one-cell sweep whose metric is the
          # distance to transformers' patched logits.
          ref = jnp.asarray(reference)
          cell = interp.patching_sweep(
              model, clean, corrupt, layers=[layer], positions=[pos],
              metric=lambda l: jnp.abs(  # pylint: disable=cell-var-from-loop
                  l.unwrap("seq", "vocabulary") - ref).max())
          print(f"cell ({layer}, {pos}): max |logit diff| vs"
                f" transformers {cell.values[0, 0]:.2e}")
          assert cell.values[0, 0] < 1e-3, cell.values
    # At these early and middle blocks the subject's last token (3) carries
    # much of the answer; the last token (8) not yet.
    assert (result.normalized[:, 0] > 0.25).all(), result
    assert (np.abs(result.normalized[:, 1]) < 0.1).all(), result
  finally:
    torch.set_num_threads(threads)
