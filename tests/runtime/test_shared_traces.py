"""Blocks of one structure are traced once per program (shared_traces.py).

Reads the traced program: every block is a call of `shared_block`, and
blocks of one structure call the same traced function. The outputs and the
new state equal those of the model without shared traces.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

from penzai_lm.generation import Engine
from penzai_lm.interp import insert_at
from penzai_lm.model import build_transformer
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.runtime.shared_traces import share_block_traces
from penzai_lm.runtime.shared_traces import SharedTrace
from penzai_lm.runtime.unstack import unstack_layers
from tests.generation.conftest import prompts
from tests.generation.conftest import tiny_model
from tests.model.configs import config


def _cached(model):
  return KVCachingTransformerLM.from_uncached(
      unstack_layers(model), cache_len=16, batch_axes={"batch": 2})


def _run(cached):
  """(traced program, logits, new state) of one 5-token call."""
  stateless, state = pz.unbind_state_vars(cached, freeze=True)
  tokens = pz.nx.wrap(jnp.asarray(prompts([5, 5], seed=3))).tag(
      "batch", "seq")
  call = lambda state, tokens: stateless.stateless_call(state, tokens)  # noqa: E731
  jaxpr = jax.make_jaxpr(call)(state, tokens)
  logits, new = jax.jit(call)(state, tokens)
  return jaxpr, logits, new


def _block_calls(jaxpr):
  return [e for e in jaxpr.jaxpr.eqns
          if e.params.get("name") == "shared_block"]


def _check_same_outputs(plain, shared):
  _, logits, new = _run(plain)
  _, shared_logits, shared_new = _run(shared)
  np.testing.assert_allclose(shared_logits.unwrap("batch", "seq", "vocabulary"),
                             logits.unwrap("batch", "seq", "vocabulary"),
                             rtol=1e-6, atol=1e-6)
  assert [s.label for s in shared_new] == [s.label for s in new]
  for a, b in zip(jax.tree_util.tree_leaves(shared_new),
                  jax.tree_util.tree_leaves(new)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stacked", [True, False])
def test_identical_blocks_share_one_trace(stacked):
  # Per-layer models label each block's parameters differently; the shared
  # trace labels them by position, so they share it too.
  plain = _cached(tiny_model("llama_gqa", stacked))
  shared = share_block_traces(plain)
  jaxpr, _, _ = _run(shared)
  calls = _block_calls(jaxpr)
  assert len(calls) == plain.config.num_layers
  assert len({id(e.params["jaxpr"]) for e in calls}) == 1
  _check_same_outputs(plain, shared)


def test_block_kinds_get_one_trace_each():
  # Gemma 3: sliding-window blocks and global ones differ in structure.
  plain = _cached(build_transformer(
      config("gemma3", False).replace(num_layers=4), seed=1))
  kinds = set(plain.config.resolved_layer_types)
  assert len(kinds) == 2
  shared = share_block_traces(plain)
  calls = _block_calls(_run(shared)[0])
  assert len(calls) == 4
  assert len({id(e.params["jaxpr"]) for e in calls}) == 2
  _check_same_outputs(plain, shared)


@pz.pytree_dataclass
class _AddOne(pz.nn.Layer):
  def __call__(self, x, **_):
    return x + 1.0


def test_a_patched_block_is_traced_on_its_own():
  model = insert_at(tiny_model("llama_gqa", False), "blocks.1.resid_post",
                    _AddOne())
  plain = _cached(model)
  shared = share_block_traces(plain)
  calls = _block_calls(_run(shared)[0])
  assert len({id(e.params["jaxpr"]) for e in calls}) == 2
  _check_same_outputs(plain, shared)


@pz.pytree_dataclass
class _Scale(pz.nn.Layer):
  factor: float  # A pytree leaf that is not an array.

  def __call__(self, x, **_):
    return x * self.factor if self.factor != 1.0 else x


def test_a_block_with_python_values_runs_as_it_is():
  model = insert_at(tiny_model("llama_gqa", False), "blocks.2.resid_post",
                    _Scale(2.0))
  plain = _cached(model)
  shared = share_block_traces(plain)
  calls = _block_calls(_run(shared)[0])
  assert len(calls) == plain.config.num_layers - 1
  _check_same_outputs(plain, shared)


def test_stacks_are_left_to_their_scan():
  model = tiny_model("llama_gqa", True)
  assert pz.select(model).at_instances_of(pz.nn.LayerStack).count() == 1
  assert not pz.select(share_block_traces(model)).at_instances_of(
      SharedTrace).count()


def test_engine_programs_match_the_scanned_model():
  # The engine's decode model shares traces; the scanned stack (not
  # unstacked) does not: same tokens, same log-probs.
  model = tiny_model("llama_gqa", True)
  ps = prompts([3, 6], seed=11)
  shared = Engine(program_store=None).generate(
      model, ps, max_new_tokens=8, temperature=0.0)
  scanned = Engine(program_store=None, unstack_layer_stacks=False).generate(
      model, ps, max_new_tokens=8, temperature=0.0)
  assert shared.tokens == scanned.tokens
  for a, b in zip(shared.logprobs, scanned.logprobs):
    np.testing.assert_allclose(a, b, atol=1e-5)
