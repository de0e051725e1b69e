"""Patches with their own state run in the compiled loop (issue: a
SaveIntermediate patch crashed generate, and so did one called before)."""

import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz
from penzai.toolshed.save_intermediates import SaveIntermediate

import penzai_lm
from tests.generation import conftest

GREEDY = dict(max_new_tokens=4, temperature=0.0, stop_tokens=[])


def _with_saved_embeddings(model):
  return (pz.select(model).at_instances_of(pz.nn.EmbeddingLookup)
          .insert_after(SaveIntermediate()))


def _embedding(model, token):
  table = pz.select(model).at_instances_of(pz.nn.EmbeddingTable).get()
  return np.asarray(table.embeddings.value.unwrap("vocabulary",
                                                  "embedding"))[token]


@pytest.mark.parametrize("stacked", [True, False])
def test_save_intermediate_runs_and_reports_its_last_value(stacked):
  model = conftest.tiny_model("llama_gqa", stacked)
  patched = _with_saved_embeddings(model)
  rows = conftest.prompts([5, 3], seed=50)
  plain = penzai_lm.generate(model, rows, **GREEDY)
  result = penzai_lm.generate(patched, rows, **GREEDY)
  assert result.tokens == plain.tokens  # The patch is an identity.
  (saved,) = result.state.values()
  assert dict(saved.named_shape) == {"batch": 2, "seq": 1, "embedding": 32}
  for r, tokens in enumerate(result.tokens):
    # The last decode step fed the second to last generated token.
    np.testing.assert_allclose(
        saved[{"batch": r, "seq": 0}].unwrap("embedding"),
        _embedding(model, tokens[-2]), rtol=1e-6)


def test_a_patch_called_before_generating_still_runs():
  model = conftest.tiny_model("llama_gqa", False)
  patched = _with_saved_embeddings(model)
  patched(pz.nx.wrap(jnp.arange(1, 8)[None]).tag("batch", "seq"))
  (before,) = [v.value for v in pz.unbind_state_vars(patched)[1]]
  assert before.named_shape["seq"] == 7
  rows = conftest.prompts([4], seed=51)
  result = penzai_lm.generate(patched, rows, **GREEDY)
  assert result.tokens == penzai_lm.generate(model, rows, **GREEDY).tokens
  # The model's own variable is untouched (generation is functional).
  (after,) = [v.value for v in pz.unbind_state_vars(patched)[1]]
  assert after is before


def test_patch_state_in_a_cached_model_and_a_session():
  model = conftest.tiny_model("llama_gqa", False)
  patched = _with_saved_embeddings(model)
  cached = penzai_lm.KVCachingTransformerLM.from_uncached(
      patched, 16, {"batch": 1})
  rows = conftest.prompts([4], seed=52)
  result = penzai_lm.generate(cached, rows, **GREEDY)
  assert result.tokens == penzai_lm.generate(model, rows, **GREEDY).tokens
  (saved,) = result.state.values()
  np.testing.assert_allclose(saved.unwrap("batch", "seq", "embedding")[0, 0],
                             _embedding(model, result.tokens[0][-2]),
                             rtol=1e-6)
  session = penzai_lm.Session(patched)
  first = session.generate(rows[0], **GREEDY)
  second = session.generate([5, 6], **GREEDY)
  (saved,) = second.state.values()
  assert first.tokens and second.tokens
  np.testing.assert_allclose(saved.unwrap("batch", "seq", "embedding")[0, 0],
                             _embedding(model, second.tokens[0][-2]),
                             rtol=1e-6)


def test_counting_patch_state_is_carried_not_reset():
  # CallRecorder counts tokens it sees. The model is shared by the tests of
  # this package (cached), and forward passes leave their counts in it.
  model = conftest.patched_model()
  recorder = pz.select(model).at_instances_of(conftest.CallRecorder).get()
  start = int(recorder.seen.value)
  rows = conftest.prompts([5], seed=53)
  result = penzai_lm.generate(model, rows, **GREEDY)
  (seen,) = result.state.values()
  # Prefill: the 8-token bucket but its last column; then one per step.
  assert int(seen) == start + 7 + GREEDY["max_new_tokens"]
  assert int(recorder.seen.value) == start  # generate is functional.
