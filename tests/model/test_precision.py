"""float32 means float32: every matrix product of a float32 model asks for
full precision (JAX's default computes float32 matmuls in TF32 on recent
NVIDIA GPUs), unless the config opts into a faster one.

On CPU XLA computes float32 either way; the request is visible in the
lowered program, which is what these tests read. (The engine's programs run
the same cached and uncached calls.)
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from penzai import pz

import penzai_lm
from penzai_lm import interp
from penzai_lm.model import KVCachingTransformerLM
from tests.model.configs import config


def _precisions(fn, *args) -> set[str]:
  text = jax.jit(fn).lower(*args).as_text()
  dots = [line for line in text.splitlines() if "dot_general" in line]
  assert dots
  return {p for line in dots
          for p in re.findall(r"precision = \[(\w+), \w+\]", line)
          } | ({"DEFAULT"} if any("precision" not in l for l in dots) else set())


def _model(precision=None):
  cfg = config("llama_gqa", True)
  if precision is not None:
    cfg = dataclasses.replace(cfg, matmul_precision=precision)
  return penzai_lm.build_transformer(cfg, seed=1)


TOKENS = pz.nx.wrap(jnp.ones((1, 4), jnp.int32)).tag("batch", "seq")


@pytest.mark.parametrize("precision,expected", [
    (None, "HIGHEST"), ("tensorfloat32", "HIGH"), ("bfloat16", "DEFAULT")])
def test_every_product_of_the_forward_pass_asks_for_it(precision, expected):
  model = _model(precision)
  assert _precisions(lambda m, t: m(t), model, TOKENS) == {expected}
  cached = KVCachingTransformerLM.from_uncached(
      model, cache_len=8, batch_axes={"batch": 1})
  stateless, state = pz.unbind_state_vars(cached, freeze=True)

  def step(s, st, t):
    return s.stateless_call(st, t)[0]

  assert _precisions(step, stateless, state, TOKENS) == {expected}
  resid = pz.nx.wrap(jnp.ones((1, 4, 32))).tag("batch", "seq", "embedding")
  assert _precisions(interp.unembed, model, resid) == {expected}
  assert _precisions(interp.logits_from_embeddings, model, resid) == {
      expected}


def test_unknown_precision_is_an_error():
  with pytest.raises(ValueError, match="Unknown matmul_precision 'fp32'"):
    _model("fp32")
