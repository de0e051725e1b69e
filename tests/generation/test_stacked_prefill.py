"""``Engine(prefill_over_stacks=...)``: prompts prefilled over the stacks.

The engine decodes on per-layer blocks (`penzai_lm.runtime.unstack`); this
setting runs a fresh prompt's prefill on the model as the user stacked it,
then splits its stacked caches into the decode model's per-layer ones
(`stacked_prefill.py`). The reference is an engine with the setting off
(its prefill runs per layer): every family, option and patch generates
the same tokens and log-probs both ways.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz
from penzai.toolshed.save_intermediates import SaveIntermediate

from penzai_lm import interp
from penzai_lm.generation import Engine
from penzai_lm.generation import Session
from penzai_lm.generation import stacked_prefill
from penzai_lm.kernels import ops
from penzai_lm.kernels import with_cpu_kernels
from penzai_lm.model import build_transformer
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.quantization import quantize
from penzai_lm.runtime.unstack import split_state
from penzai_lm.runtime.unstack import unstack_layers
from penzai_lm.runtime.unstack import unstacked_state_order
from tests.generation import conftest
from tests.generation.conftest import prompts
from tests.model.configs import CONFIGS

GREEDY = dict(max_new_tokens=6, temperature=0.0, stop_tokens=[])


def _stacked_engine():
  return Engine(prefill_over_stacks=True)


def _per_layer_engine():
  return Engine(prefill_over_stacks=False)


def _prefill_model(engine, model, rows, **options):
  """The model a run's prefill runs on (None: the decode model)."""
  return engine.start(model, rows, **options)._prepared.prefill  # pylint: disable=protected-access


def _same(a, b):
  assert a.tokens == b.tokens
  np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs),
                             atol=2e-5)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_family_prefills_over_its_stacks_as_per_layer(name):
  model = conftest.tiny_model(name, True)
  rows = prompts([5, 8], seed=60)
  engine = _stacked_engine()
  assert _prefill_model(engine, model, rows, **GREEDY) is not None
  stacked = engine.generate(model, rows, **GREEDY)
  per_layer = _per_layer_engine().generate(model, rows, **GREEDY)
  _same(stacked, per_layer)
  # Off where asked, and nothing to do for a model without stacks.
  assert _prefill_model(Engine(prefill_over_stacks=False), model, rows,
                        **GREEDY) is None
  assert _prefill_model(_stacked_engine(), unstack_layers(model), rows,
                        **GREEDY) is None


@pytest.mark.skipif(not ops.available(), reason="CPU kernels not built")
def test_prompts_on_int8_activations_prefill_over_the_stacks_as_per_layer():
  """Quantized layers with int8 activations: 2 x 16 prompt rows, on the
  AMX tiles where the CPU has them (`ops.int8_gemm_isa`), scanned or
  not."""
  model = conftest.tiny_model("llama_gqa", True)
  blocks32 = build_transformer(model.config.replace(
      hidden_size=64, head_dim=16, mlp_hidden_size=64), seed=7)
  rows = prompts([13, 16], seed=68)
  for fmt in ("q4_0", "q8_0"):
    x8 = with_cpu_kernels(quantize(blocks32, fmt), int8_activations=True)
    _same(_stacked_engine().generate(x8, rows, **GREEDY),
          _per_layer_engine().generate(x8, rows, **GREEDY))


def test_samples_and_per_row_values_prefill_over_the_stacks():
  model = conftest.tiny_model("llama_gqa", True)
  vector = np.linspace(-1.0, 1.0, model.config.hidden_size, dtype=np.float32)
  steer = interp.AddVector.build(vector, [0.0, 6.0])  # One per prompt.
  rows = prompts([4, 7], seed=61)
  options = dict(max_new_tokens=6, temperature=1.0, seed=[3, 4],
                 num_samples=2, stop_tokens=[])
  steered = interp.insert_at(model, "blocks.1.resid_post", steer)
  _same(_stacked_engine().generate(steered, rows, **options),
        _per_layer_engine().generate(steered, rows, **options))
  assert _prefill_model(_stacked_engine(), steered, rows,
                        **options) is not None


def test_patch_state_comes_out_of_the_stacked_prefill():
  """A patch with state inside the stack (one value per block) and one
  outside it: the decode loop starts from the prefill's values."""
  model = conftest.tiny_model("llama_gqa", True)

  def patched(base):
    base = (pz.select(base).at_instances_of(pz.nn.EmbeddingLookup)
            .insert_after(SaveIntermediate()))
    return interp.insert_at(base, "blocks.1.resid_post",
                            interp.AddVector.build(
                                np.ones(32, np.float32), 0.5))

  rows = prompts([5, 3], seed=62)
  stacked = _stacked_engine().generate(patched(model), rows, **GREEDY)
  per_layer = _per_layer_engine().generate(patched(model), rows, **GREEDY)
  _same(stacked, per_layer)
  (a,), (b,) = stacked.state.values(), per_layer.state.values()
  np.testing.assert_allclose(a.unwrap("batch", "seq", "embedding"),
                             b.unwrap("batch", "seq", "embedding"))


def test_session_turns_continue_from_a_stacked_prefill():
  model = conftest.tiny_model("gemma3", True)
  turns = [prompts([5], seed=63)[0], prompts([3], seed=64)[0]]
  replies = []
  for engine in (_stacked_engine(), _per_layer_engine()):
    session = Session(model, engine=engine)
    replies.append([session.generate(t, **GREEDY).tokens for t in turns])
  assert replies[0] == replies[1]


def test_one_prefill_program_per_bucket():
  model = conftest.tiny_model("gemma2", True)
  engine = _stacked_engine()
  engine.generate(model, prompts([4, 6], seed=65), **GREEDY)
  assert engine.compilations == 2
  engine.generate(model, prompts([7, 3], seed=66), **GREEDY)
  assert engine.compilations == 2


def test_captures_keep_the_per_layer_prefill():
  model = conftest.tiny_model("llama_gqa", True)
  rows = prompts([4], seed=67)
  options = dict(GREEDY, capture=["blocks.1.resid_post"])
  assert _prefill_model(_stacked_engine(), model, rows, **options) is None


def test_a_first_request_traces_the_prefill_before_preparing_the_decode_model(
    monkeypatch):
  """A model not prepared yet: its stacked prefill program is traced (and
  compiling) before the decode model is prepared; a prepared one keeps the
  order of a cached model."""
  model = conftest.tiny_model("llama_gqa", True)
  rows = prompts([5, 8], seed=70)
  engine = _stacked_engine()
  order = []
  lower, prepare = engine.lower, engine._prepare  # pylint: disable=protected-access
  monkeypatch.setattr(engine, "lower", lambda name, *a, **k: (
      order.append(name), lower(name, *a, **k))[1])
  monkeypatch.setattr(engine, "_prepare", lambda *a, **k: (
      order.append("prepare"), prepare(*a, **k))[1])
  first = engine.generate(model, rows, **GREEDY)
  assert order[:2] == ["prefill", "prepare"], order
  del order[:]
  again = engine.generate(model, rows, **GREEDY)
  assert order == ["prefill"]  # Found prepared; the program found compiled.
  assert engine.compilations == 2
  assert first.tokens == again.tokens
  _same(first, _per_layer_engine().generate(model, rows, **GREEDY))


def test_a_decode_model_the_stacked_prefill_does_not_fit_prefills_per_layer(
    monkeypatch):
  """Where the decode model's state turns out not to be what the stacked
  prefill traced before it hands over, the prompt runs per layer."""
  model = conftest.tiny_model("llama_gqa", True)
  rows = prompts([5, 8], seed=71)
  monkeypatch.setattr(stacked_prefill, "fits", lambda decode, prefill: False)
  engine = _stacked_engine()
  _same(engine.generate(model, rows, **GREEDY),
        _per_layer_engine().generate(model, rows, **GREEDY))
  assert _prefill_model(engine, model, rows, **GREEDY) is None


def test_fits_checks_the_handed_over_state_and_the_sampler():
  model = conftest.tiny_model("gemma3", True)
  engine = _stacked_engine()
  decode = engine.start(model, prompts([4], seed=72), **GREEDY)._prepared  # pylint: disable=protected-access
  prefill = decode.prefill
  assert prefill is not None and stacked_prefill.fits(decode, prefill)
  assert not stacked_prefill.fits(decode, None)
  assert not stacked_prefill.fits(decode, dataclasses.replace(
      prefill, cpu_sampler=not prefill.cpu_sampler))
  carried = prefill.unstacked_layout
  wider = [dataclasses.replace(s, shape=s.shape[:-1] + (s.shape[-1] + 1,))
           if s.shape else s for s in carried.leaves]
  assert not stacked_prefill.fits(decode, dataclasses.replace(
      prefill, unstacked_layout=dataclasses.replace(carried,
                                                    leaves=tuple(wider))))
  # Another axis order: the same shapes, another structure.
  values = carried.unflatten(np.zeros(s.shape, s.dtype) for s in carried.leaves)
  swapped = [jax.tree_util.tree_map(
      lambda x: x.order_as(*reversed(list(x.named_axes))), v,
      is_leaf=pz.nx.is_namedarray) if isinstance(
          v, pz.nx.NamedArrayBase) and len(v.named_axes) > 1 else v
             for v in values]
  assert jax.tree_util.tree_structure(swapped) != carried.treedef
  assert not stacked_prefill.fits(decode, dataclasses.replace(
      prefill, unstacked_layout=dataclasses.replace(
          carried, treedef=jax.tree_util.tree_structure(swapped))))


def test_the_setting_is_checked():
  for bad in ("yes", 1, None):
    with pytest.raises(ValueError, match="prefill_over_stacks must be True,"):
      Engine(prefill_over_stacks=bad)


@pytest.mark.skipif(not ops.available(), reason="CPU kernels not built: auto"
                    " keeps the per-layer prefill without the split kernel")
def test_auto_prefills_over_stacks_where_it_costs_no_warm_speed():
  """On for float32 and quantized weights, off for 16-bit floats
  (docs/cpu-speed.md) and for off-setting engines."""
  model = conftest.tiny_model("llama_gqa", True)
  rows = prompts([4], seed=69)
  assert _prefill_model(Engine(), model, rows, **GREEDY) is not None
  assert _prefill_model(Engine(prefill_over_stacks=False), model, rows,
                        **GREEDY) is None
  # Every contraction a multiple of the 32-value blocks.
  blocks32 = build_transformer(model.config.replace(
      hidden_size=64, head_dim=16, mlp_hidden_size=64), seed=7)
  for fmt in ("q8_0", "q4_0", "q4_1"):
    quantized = quantize(blocks32, fmt)
    assert _prefill_model(Engine(), quantized, rows, **GREEDY) is not None
    x8 = with_cpu_kernels(quantized, int8_activations=True)
    assert _prefill_model(Engine(), x8, rows, **GREEDY) is not None
  bf16 = build_transformer(model.config.replace(
      parameter_dtype=jnp.bfloat16), seed=7)
  assert _prefill_model(Engine(), bf16, rows, **GREEDY) is None
  assert _prefill_model(_stacked_engine(), bf16, rows, **GREEDY) is not None


@pytest.mark.parametrize("name", ["gemma3", "gemma2", "llama_gqa"])
def test_the_state_order_matches_an_unstacked_cached_model(name):
  """`unstacked_state_order` and `split_state` against `unstack_layers` of
  a stacked cached model whose caches hold distinct values."""
  model = conftest.tiny_model(name, True)
  cached = KVCachingTransformerLM.from_uncached(model, 8, {"batch": 2})
  _, variables = pz.unbind_state_vars(cached)
  key = iter(jax.random.split(jax.random.key(0), 64))
  for var in variables:
    var.value = jax.tree_util.tree_map(
        lambda x: x if not jnp.issubdtype(x.dtype, jnp.floating)
        else jax.random.normal(next(key), x.shape, x.dtype), var.value)
  order = unstacked_state_order(cached)
  got = split_state([v.freeze() for v in variables], order)
  want = [v.value for v in pz.unbind_state_vars(unstack_layers(cached))[1]]
  assert len(got) == len(want) > len(variables)
  for a, b in zip(got, want):
    for x, y in zip(jax.tree_util.tree_leaves(a, is_leaf=pz.nx.is_namedarray),
                    jax.tree_util.tree_leaves(b, is_leaf=pz.nx.is_namedarray)):
      if not isinstance(y, pz.nx.NamedArrayBase):  # The cache end index.
        np.testing.assert_array_equal(x, y)
        continue
      assert dict(x.named_shape) == dict(y.named_shape)
      axes = tuple(y.named_shape)
      np.testing.assert_array_equal(x.unwrap(*axes), y.unwrap(*axes))


def test_patched_variants_rederive_the_stacked_prefill_model():
  """A variant (same weights, other patch values) reuses the prepared
  model, the stacked prefill's arrays recomputed too."""
  model = conftest.tiny_model("llama_gqa", True)
  vector = np.linspace(-1.0, 1.0, 32, dtype=np.float32)
  rows = prompts([4, 6], seed=68)

  def steered(strength):
    return interp.insert_at(model, "blocks.1.resid_post",
                            interp.AddVector.build(vector, [0.0, strength]))

  engine = _stacked_engine()
  results = [engine.generate(steered(s), rows, **GREEDY) for s in (3., -9.)]
  assert engine._prepared.derived == 1  # pylint: disable=protected-access
  assert engine.compilations == 2
  for s, result in zip((3., -9.), results):
    _same(result, _per_layer_engine().generate(steered(s), rows, **GREEDY))
  assert results[0].tokens != results[1].tokens
