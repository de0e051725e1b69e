"""Models come with frozen weights: plain JAX transformations take them.

Regression for issue 9: ``jax.jit(f)(model)`` failed with JAX's own error
about penzai's `Parameter` until the user found `pz.freeze_params` in the
source. (Loaded checkpoints: tests/interp/test_hf_parity.py jits and
differentiates the real models as `penzai_lm.load` returns them.)
"""

import jax
import numpy as np
import pytest
from penzai import pz

from penzai_lm.model import build_transformer
from tests.model.configs import config
from tests.model.conftest import random_tokens


def _logits(model, tokens):
  return model(tokens).unwrap("batch", "seq", "vocabulary")


def test_jit_and_grad_take_the_model_as_is():
  model = build_transformer(config("llama_gqa", True), seed=1)
  assert pz.select(model).at_instances_of(pz.Parameter).count() == 0
  assert pz.select(model).at_instances_of(pz.ParameterValue).count() > 0
  tokens = pz.nx.wrap(random_tokens((1, 6))).tag("batch", "seq")
  jitted = jax.jit(_logits)(model, tokens)
  np.testing.assert_allclose(jitted, _logits(model, tokens), atol=1e-5)

  def loss(m):
    return _logits(m, tokens)[0, -1, 3]

  # allow_int: the model also holds integer data (e.g. attention windows).
  grads = jax.jit(jax.grad(loss, allow_int=True))(model)
  norms = [float(np.abs(p.value.unwrap(*p.value.named_shape)).max())
           for p in pz.select(grads).at_instances_of(
               pz.ParameterValue).get_sequence()]
  assert max(norms) > 0


def test_mutable_parameters_on_request():
  model = build_transformer(config("llama_gqa", True), seed=1, freeze=False)
  assert pz.select(model).at_instances_of(pz.ParameterValue).count() == 0
  assert pz.select(model).at_instances_of(pz.Parameter).count() > 0
  frozen = build_transformer(config("llama_gqa", True), seed=1)
  tokens = pz.nx.wrap(random_tokens((1, 6))).tag("batch", "seq")
  np.testing.assert_array_equal(
      _logits(pz.freeze_params(model), tokens), _logits(frozen, tokens))


def test_freeze_must_be_a_bool():
  with pytest.raises(TypeError, match="freeze must be True or False"):
    build_transformer(config("llama_gqa", True), seed=1, freeze="yes")
