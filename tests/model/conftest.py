import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

from penzai_lm.model import build_transformer
from penzai_lm.runtime.compiler_options import small_model_options
from tests.model.configs import CONFIGS
from tests.model.configs import config

jax.config.update("jax_enable_x64", False)


@functools.cache
def _model(name, stacked):
  return perturbed_model(config(name, stacked))


def perturbed_model(cfg, seed=7):
  """A random model of ``cfg`` whose every parameter is perturbed."""
  model = build_transformer(cfg, seed=seed, freeze=False)
  # Random init leaves norm scales at 1 and biases at 0; perturb them so the
  # tests see every parameter.
  def perturb(param):
    shape = param.value.named_shape
    rng = np.random.default_rng(sum(map(ord, param.label)))
    noise = pz.nx.wrap(
        rng.standard_normal(tuple(shape.values())).astype(np.float32)
    ).tag(*shape.keys())
    return pz.Parameter(value=param.value + 0.1 * noise, label=param.label)

  unbound, params = pz.unbind_params(model)
  return pz.bind_variables(unbound, [perturb(p) for p in params])


@pytest.fixture(params=sorted(CONFIGS))
def family(request):
  return request.param


@pytest.fixture(params=[True, False], ids=["stacked", "unstacked"])
def stacked(request):
  return request.param


@pytest.fixture
def model(family, stacked):
  return _model(family, stacked)


def random_tokens(shape, vocab=97, seed=0):
  return np.random.RandomState(seed).randint(1, vocab, size=shape).astype(np.int32)


# The test models are small: compiled as the engine compiles their programs
# (`small_model_options`, LLVM -O0; tests/model/test_kv_cache.py: these two
# functions compiled in 72 s of its 146 s).
_jit_small = functools.partial(jax.jit, compiler_options=small_model_options())


@_jit_small
def _uncached_logits(model, tokens, token_positions):
  return model(tokens, token_positions=token_positions)


def uncached_logits(model, tokens, *axes, token_positions=None):
  """Logits of the uncached model (jitted) as a numpy array over ``axes``."""
  named = pz.nx.wrap(jnp.asarray(tokens, jnp.int32)).tag(*axes)
  out = _uncached_logits(pz.freeze_params(model), named, token_positions)
  return np.asarray(out.unwrap(*axes, "vocabulary"))


@_jit_small
def _cached_step(stateless, state, tokens):
  return stateless.stateless_call(state, tokens)


def run_cached(cached, tokens, prefill):
  """Feeds ``tokens`` (batch, seq) to a cached model: a prefill, then 1 by 1.

  Runs the functional form under jit (the stateful form is tested on its own)
  and returns (logits over (batch, seq, vocabulary), final state).
  """
  stateless, state = pz.unbind_state_vars(pz.freeze_params(cached), freeze=True)
  chunks = [tokens[:, :prefill]]
  chunks += [tokens[:, t : t + 1] for t in range(prefill, tokens.shape[1])]
  outs = []
  for chunk in chunks:
    named = pz.nx.wrap(jnp.asarray(chunk, jnp.int32)).tag("batch", "seq")
    out, state = _cached_step(stateless, state, named)
    outs.append(np.asarray(out.unwrap("batch", "seq", "vocabulary")))
  return np.concatenate(outs, 1), {s.label: s.value for s in state}
