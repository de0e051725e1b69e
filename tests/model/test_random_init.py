"""Random weights: numpy's on the host, or `jax.random`'s on the device
with the same distributions (for big benchmark shapes)."""

import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

from penzai_lm.model import build_transformer
from tests.model.configs import config


def _values(model) -> dict[str, np.ndarray]:
  return {p.label: np.asarray(p.value.unwrap(*p.value.named_shape), np.float32)
          for p in pz.select(model).at_instances_of(
              pz.ParameterValue).get_sequence()}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_device_draws_follow_the_host_distributions(dtype):
  cfg = config("qwen2_bias", True).replace(
      hidden_size=256, mlp_hidden_size=512, parameter_dtype=dtype)
  host = build_transformer(cfg, seed=3)
  device = build_transformer(cfg, seed=3, on_device=True)
  assert (pz.select(device).at_instances_of(pz.ParameterValue).count()
          == pz.select(host).at_instances_of(pz.ParameterValue).count())
  hv, dv = _values(host), _values(device)
  assert hv.keys() == dv.keys()
  for label, h in hv.items():
    d = dv[label]
    assert d.shape == h.shape and d.dtype == h.dtype, label
    if label.endswith("/scale.weights") or label.endswith(".bias"):
      np.testing.assert_array_equal(d, h)  # ones and zeros
    else:
      assert not np.array_equal(d, h), label
      # The same spread (large weights: within a few percent).
      assert abs(d.std() / h.std() - 1) < 0.1, label
  for p in pz.select(device).at_instances_of(pz.ParameterValue).get_sequence():
    assert p.value.dtype == dtype
  # Deterministic per seed.
  again = _values(build_transformer(cfg, seed=3, on_device=True))
  assert all(np.array_equal(again[k], v) for k, v in dv.items())


def test_on_device_must_be_a_bool():
  with pytest.raises(TypeError, match="on_device must be True or False"):
    build_transformer(config("llama_gqa", True), seed=1, on_device=1)
