"""ScannedLayerStack against penzai's own LayerStack."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import penzai.nn.layer_stack as penzai_layer_stack
import pytest
from penzai import pz

from penzai_lm.model import build_transformer
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model.scanned_stack import ScannedLayerStack
from tests.model.conftest import _model
from tests.model.conftest import random_tokens
from tests.model.conftest import run_cached
from tests.model.configs import config

LAYERS, FEATURES = 4, 3
PER_LAYER = {"layers": pz.nn.LayerStackVarBehavior.PER_LAYER}
SHARED = {"layers": pz.nn.LayerStackVarBehavior.SHARED}

# `penzai.nn.layer_stack.jax` as seen by the block while a stack calls it.
_JAX_SEEN = []


@pz.pytree_dataclass
class _Block(pz.nn.Layer):
  """One block: a weight, a per-layer accumulator, a shared running value."""

  weight: Any
  per_layer: Any
  shared: Any

  def __call__(self, x, /, *, scale):
    _JAX_SEEN.append(penzai_layer_stack.jax)
    y = pz.nx.nmap(jnp.tanh)(x * self.weight.value * scale
                             + self.per_layer.value)
    self.per_layer.value = self.per_layer.value + y
    self.shared.value = 0.5 * self.shared.value + pz.nx.nmap(jnp.mean)(
        y.untag("batch"))
    return y


def _named(data, *axes):
  return pz.nx.wrap(jnp.asarray(data, jnp.float32)).tag(*axes)


def _stack(cls, **kwargs):
  """A stack of 4 blocks with fresh state variables (same values each time)."""
  rng = np.random.default_rng(0)
  block = _Block(
      weight=pz.Parameter(
          value=_named(rng.normal(size=(LAYERS, FEATURES)), "layers", "f"),
          label="weight"),
      per_layer=pz.StateVariable(
          value=_named(rng.normal(size=(LAYERS, FEATURES)), "layers", "f"),
          label="per_layer", metadata={"layerstack_axes": PER_LAYER}),
      shared=pz.StateVariable(
          value=_named(rng.normal(size=(FEATURES,)), "f"),
          label="shared", metadata={"layerstack_axes": SHARED}),
  )
  return cls(stacked_sublayers=block, stack_axis="layers",
             stack_axis_size=LAYERS, **kwargs)


def _call(stack, jit):
  """Output and updated state values of one call on a fixed input."""
  x = _named(np.linspace(-1.0, 1.0, 2 * FEATURES).reshape(2, FEATURES),
             "batch", "f")
  stateless, state = pz.unbind_state_vars(pz.freeze_params(stack),
                                          freeze=True)
  if jit:
    call = jax.jit(lambda s, st, x: s.stateless_call(st, x, scale=2.0))
    out, new_state = call(stateless, state, x)
  else:
    out = stack(x, scale=2.0)
    new_state = pz.unbind_state_vars(stack, freeze=True)[1]
  values = {s.label: np.asarray(s.value.unwrap(*sorted(s.value.named_shape)))
            for s in new_state}
  return np.asarray(out.unwrap("batch", "f")), values


@pytest.mark.parametrize("unroll", [1, 2, LAYERS])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_matches_penzai_layer_stack(jit, unroll):
  expected_out, expected_state = _call(_stack(pz.nn.LayerStack), jit)
  out, state = _call(_stack(ScannedLayerStack, unroll=unroll), jit)
  np.testing.assert_allclose(out, expected_out, rtol=1e-6, atol=1e-6)
  assert state.keys() == expected_state.keys() == {"per_layer", "shared"}
  for label, value in expected_state.items():
    np.testing.assert_allclose(state[label], value, rtol=1e-6, atol=1e-6)
  # The call really updated both variables (the comparison is not vacuous).
  for initial in pz.unbind_state_vars(_stack(pz.nn.LayerStack))[1]:
    before = initial.value.unwrap(*sorted(initial.value.named_shape))
    assert not np.allclose(np.asarray(before), state[initial.label])


def _lowered_text(stack):
  stateless, state = pz.unbind_state_vars(pz.freeze_params(stack),
                                          freeze=True)
  x = _named(np.ones((2, FEATURES)), "batch", "f")
  fn = jax.jit(lambda s, st, x: s.stateless_call(st, x, scale=2.0))
  return fn.lower(stateless, state, x).as_text()


def test_unroll_1_compiles_a_loop():
  assert "while" in _lowered_text(_stack(ScannedLayerStack, unroll=1))
  assert "while" not in _lowered_text(_stack(pz.nn.LayerStack))
  assert "while" not in _lowered_text(_stack(ScannedLayerStack, unroll=LAYERS))


def test_penzai_module_is_not_patched():
  _JAX_SEEN.clear()
  _call(_stack(ScannedLayerStack), jit=False)
  _call(_stack(ScannedLayerStack), jit=True)
  assert _JAX_SEEN and all(seen is jax for seen in _JAX_SEEN)
  assert penzai_layer_stack.jax is jax


def test_is_a_layer_stack():
  stack = _stack(ScannedLayerStack)
  assert pz.select(stack).at_instances_of(pz.nn.LayerStack).count() == 1
  paths = pz.select(stack).at_instances_of(pz.StateVariable).selected_by_path
  for path in paths:
    assert penzai_layer_stack.layerstack_axes_from_keypath(path) == {
        "layers": LAYERS}


def test_errors_match_penzai():
  for cls in (pz.nn.LayerStack, ScannedLayerStack):
    stack = _stack(cls)
    no_metadata = (
        pz.select(stack).at_instances_of(pz.StateVariable)
        .where(lambda v: v.label == "shared")
        .apply(lambda v: pz.StateVariable(value=v.value, label=v.label)))
    with pytest.raises(ValueError, match="layerstack_axes"):
      _call(no_metadata, jit=False)


def test_cached_transformer_matches_penzai_layer_stack():
  """A stacked model in cached mode (per-layer KV caches, shared positions):
  the same logits and caches with penzai's LayerStack in its place."""
  model = _model("llama_gqa", True)
  as_penzai = (
      pz.select(model).at_instances_of(ScannedLayerStack)
      .apply(lambda s: pz.nn.LayerStack(
          stacked_sublayers=s.stacked_sublayers, stack_axis=s.stack_axis,
          stack_axis_size=s.stack_axis_size)))
  assert pz.select(model).at_instances_of(ScannedLayerStack).count() == 1
  assert pz.select(as_penzai).at_instances_of(ScannedLayerStack).count() == 0
  tokens = random_tokens((2, 7))
  got, got_state = run_cached(
      KVCachingTransformerLM.from_uncached(model, 8, {"batch": 2}), tokens, 5)
  expected, expected_state = run_cached(
      KVCachingTransformerLM.from_uncached(as_penzai, 8, {"batch": 2}),
      tokens, 5)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  assert got_state.keys() == expected_state.keys()
  for label, value in expected_state.items():
    leaves = jax.tree_util.tree_leaves(value)
    for a, b in zip(jax.tree_util.tree_leaves(got_state[label]), leaves):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_bfloat16_weights_are_not_widened_before_the_loop():
  """XLA:CPU widened a scanned bfloat16 stack to float32 before the loop
  (a second copy of every weight); their bits travel instead, and the
  output is the same as without the scan."""
  cfg = config("llama_gqa", True).replace(parameter_dtype=jnp.bfloat16)
  model = build_transformer(cfg, seed=3)
  stacked_shapes = {
      ",".join(map(str, x.data_array.shape))
      for x in pz.select(model).at_instances_of(pz.nx.NamedArray).get_sequence()
      if "blocks" in x.named_shape and x.dtype == jnp.bfloat16}
  assert stacked_shapes
  tokens = pz.nx.wrap(jnp.asarray(random_tokens((1, 6)))).tag("batch", "seq")
  fn = jax.jit(lambda m, t: m(t).unwrap("batch", "seq", "vocabulary"))
  hlo = fn.lower(model, tokens).compile().as_text()
  assert not [s for s in stacked_shapes if f"f32[{s}]" in hlo]
  unrolled = pz.select(model).at_instances_of(ScannedLayerStack).apply(
      lambda s: dataclasses.replace(s, unroll=s.stack_axis_size))
  np.testing.assert_allclose(
      np.asarray(fn(model, tokens), np.float32),
      np.asarray(fn(unrolled, tokens), np.float32), rtol=1e-2, atol=1e-2)
