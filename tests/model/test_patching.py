"""Patches made to the uncached model survive conversion to cached mode."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model import build_transformer
from penzai_lm.model.transformer import TransformerBlock
from tests.model.configs import config
from tests.model.conftest import _model
from tests.model.conftest import random_tokens
from tests.model.conftest import run_cached
from tests.model.conftest import uncached_logits


@pz.pytree_dataclass
class ZeroHead(pz.nn.Layer):
  """Zeroes one head of the per-head attention output."""

  axis: str = dataclasses.field(metadata={"pytree_node": False})
  index: int = dataclasses.field(metadata={"pytree_node": False})

  def __call__(self, x, **_):
    keep = pz.nx.arange(self.axis, x.named_shape[self.axis]) != self.index
    return x * keep.astype(x.dtype)


@pz.pytree_dataclass
class CountCalls(pz.nn.Layer):
  """Identity layer with its own state: counts the tokens it has seen."""

  seen: pz.StateVariable

  def __call__(self, x, **_):
    self.seen.value = self.seen.value + x.named_shape["seq"]
    return x


def _zero_head(model, block=None):
  """Zeroes query head 1 of one block (or every block, in a layer stack)."""
  selection = pz.select(model).at_instances_of(pz.nn.Attention)
  if block is not None:
    selection = (
        pz.select(model).at(lambda m: m.body.sublayers[block])
        .at_instances_of(pz.nn.Attention)
    )
  axis = "query_heads" if model.config.num_heads != model.config.num_kv_heads else "heads"
  return selection.at(lambda a: a.attn_value_to_output.sublayers[0]).insert_after(
      ZeroHead(axis=axis, index=1)
  )


@pytest.mark.parametrize(
    "name,stacked", [("llama_gqa", True), ("gemma3", False), ("gpt2", False)]
)
def test_zeroed_head_patch_runs_identically_in_both_modes(name, stacked):
  model = _model(name, stacked)
  # The last block (found by type: the body also holds norms and hook
  # points); in a stack, patch them all.
  block = None if stacked else max(
      i for i, layer in enumerate(model.body.sublayers)
      if isinstance(layer, TransformerBlock))
  patched = _zero_head(model, block)
  tokens = random_tokens((2, 9), seed=1)
  expected = uncached_logits(patched, tokens, "batch", "seq")
  assert not np.allclose(expected, uncached_logits(model, tokens, "batch", "seq"))
  cached = KVCachingTransformerLM.from_uncached(patched, 12, {"batch": 2})
  assert pz.select(cached).at_instances_of(ZeroHead).count() == 1
  got, _ = run_cached(cached, tokens, prefill=4)
  np.testing.assert_allclose(got, expected, atol=1e-5)


def test_patch_with_its_own_state_variable_survives():
  model = _model("llama_gqa", True)
  counter = CountCalls(seen=pz.StateVariable(value=jnp.array(0), label="probe/seen"))
  patched = (
      pz.select(model)
      .at_instances_of(pz.nn.RMSLayerNorm)
      .where(lambda n: "final_norm" in str(n))
      .insert_before(counter)
  )
  cached = KVCachingTransformerLM.from_uncached(patched, 8, {"batch": 1})
  tokens = random_tokens((1, 6))
  got, state = run_cached(cached, tokens, prefill=3)
  assert int(state["probe/seen"]) == 6
  np.testing.assert_allclose(
      got, uncached_logits(model, tokens, "batch", "seq"), atol=1e-5
  )


def test_layer_stack_equals_unstacked_blocks():
  for name in ("llama_gqa", "gemma3"):
    unstacked = _model(name, False)
    stacked = build_transformer(config(name, True))  # parameter slots
    params = pz.select(pz.freeze_params(unstacked)).at_instances_of(
        pz.ParameterValue).get_sequence()
    by_label = {p.label: p.value for p in params}
    n = unstacked.config.num_layers
    values = {}
    for label, value in by_label.items():
      if "/block_" not in label:
        values[label] = value
      elif label.startswith("transformer/block_0/"):
        suffix = label[len("transformer/block_0/"):]
        per_layer = [by_label[f"transformer/block_{i}/{suffix}"] for i in range(n)]
        values[f"transformer/blocks/{suffix}"] = pz.nx.stack(per_layer, "blocks")
    stacked = pz.bind_variables(
        stacked, [pz.Parameter(value=v, label=k) for k, v in values.items()]
    )
    tokens = random_tokens((1, 10))
    np.testing.assert_allclose(
        uncached_logits(stacked, tokens, "batch", "seq"),
        uncached_logits(unstacked, tokens, "batch", "seq"),
        atol=1e-5,
    )
