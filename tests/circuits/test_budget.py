"""attribute under max_memory_bytes: smaller batches and chunked feature
read-outs give the same graph (uncapped and capped), the plan fits the
budget, and a budget the graph cannot fit is a clear error up front."""

import numpy as np
import pytest

from penzai_lm import circuits
from penzai_lm.circuits import budget
from tests.circuits.test_attribute import LAYERS
from tests.circuits.test_attribute import PROMPT
from tests.circuits.test_attribute import WIDTH
from tests.circuits.test_attribute import _graph
from tests.circuits.test_attribute import _model
from tests.circuits.test_attribute import _transcoders


def _plan_for(graph, max_memory_bytes, batch_size=32):
  """The plan for ``graph``'s sizes (uncapped)."""
  n_active = len(graph.active_features)
  width = n_active + LAYERS * len(PROMPT) + len(PROMPT)
  return budget.plan(
      max_memory_bytes, batch_size=batch_size,
      padded_features=max(64, 1 << (n_active - 1).bit_length()),
      width=width, n_targets=len(graph.edges), n_sources=graph.n_sources,
      n_held_rows=0,
      num_layers=LAYERS, seq=len(PROMPT), hidden=WIDTH,
      vocab=graph.vocab_size)


def _other_bytes(monkeypatch, **kwargs) -> int:
  """What `attribute` counts besides the edges, rows and batches (its
  sources and forward pass), from a run without a budget."""
  calls, original = [], budget.plan

  def record(*args, **plan_kwargs):
    calls.append(plan_kwargs["other_bytes"])
    return original(*args, **plan_kwargs)

  monkeypatch.setattr(budget, "plan", record)
  circuits.attribute(_model(), list(_transcoders()), PROMPT, **kwargs)
  monkeypatch.setattr(budget, "plan", original)
  [other] = calls
  assert other > 0
  return other


def _tight_budget(graph, other_bytes: int):
  """A budget that forces batches of fewer than 32 targets and chunks of
  fewer than all the features."""
  n_active = len(graph.active_features)
  width = n_active + LAYERS * len(PROMPT) + len(PROMPT)
  fixed = budget.fixed_bytes(len(graph.edges), graph.n_sources, 0, width)
  return fixed + other_bytes + 12 * budget.per_target_bytes(
      width, 16, LAYERS, len(PROMPT), WIDTH, graph.vocab_size)


def _recording(monkeypatch) -> list:
  """Records the plans `attribute` makes."""
  plans, original = [], budget.plan

  def record(*args, **kwargs):
    plans.append(original(*args, **kwargs))
    return plans[-1]

  monkeypatch.setattr(budget, "plan", record)
  return plans


def test_budgeted_graph_is_the_same_graph(monkeypatch):
  full = _graph()
  limit = _tight_budget(full, _other_bytes(monkeypatch, batch_size=32,
                                           zero_positions=0))
  plans = _recording(monkeypatch)
  chunked = circuits.attribute(_model(), list(_transcoders()), PROMPT,
                               batch_size=32, zero_positions=0,
                               max_memory_bytes=limit)
  padded = max(64, 1 << (len(full.active_features) - 1).bit_length())
  [plan] = plans
  assert plan.batch < 32 and plan.chunk < padded  # Both really split.
  np.testing.assert_array_equal(chunked.active_features,
                                full.active_features)
  np.testing.assert_array_equal(chunked.logit_tokens, full.logit_tokens)
  scale = np.abs(full.edges).max()
  np.testing.assert_allclose(chunked.edges, full.edges, rtol=1e-6,
                             atol=1e-6 * scale)


def test_budgeted_capped_graph_is_the_same_graph(monkeypatch):
  """With max_feature_nodes the re-ranking interval stays batch_size
  targets, so the same features are visited in the same order."""
  kwargs = dict(batch_size=8, zero_positions=0, max_feature_nodes=20,
                update_interval=1)
  capped = circuits.attribute(_model(), list(_transcoders()), PROMPT,
                              **kwargs)
  width = len(capped.active_features) + (LAYERS + 1) * len(PROMPT)
  fixed = budget.fixed_bytes(len(capped.edges), capped.n_sources,
                             capped.n_features + capped.n_logits, width)
  limit = fixed + _other_bytes(monkeypatch, **kwargs) + 3 * (
      budget.per_target_bytes(width, 64, LAYERS, len(PROMPT), WIDTH,
                              capped.vocab_size))
  plans = _recording(monkeypatch)
  chunked = circuits.attribute(_model(), list(_transcoders()), PROMPT,
                               max_memory_bytes=limit, **kwargs)
  assert plans[0].batch < 8
  np.testing.assert_array_equal(chunked.selected_features,
                                capped.selected_features)
  # Batches of other sizes run XLA's float32 GEMMs blocked otherwise: on
  # an AVX2-only AMD EPYC one edge of 1320 moved by 4.9e-6 relative.
  np.testing.assert_allclose(chunked.edges, capped.edges, rtol=1e-5,
                             atol=1e-7)


@pytest.mark.parametrize("limit", [2 * 10**6, 4 * 10**6, 10**8, None])
def test_plan_fits_the_budget(limit):
  graph = _graph()
  plan = _plan_for(graph, limit, batch_size=512)
  padded = max(64, 1 << (len(graph.active_features) - 1).bit_length())
  assert 1 <= plan.batch <= 512 and padded % plan.chunk == 0
  assert 512 * plan.chunk * WIDTH <= budget.STEP_FLOATS
  if limit is None:
    assert plan == budget.Plan(512, budget.STEP_FLOATS // (512 * WIDTH))
    return
  width = len(graph.active_features) + (LAYERS + 1) * len(PROMPT)
  used = budget.fixed_bytes(len(graph.edges), graph.n_sources, 0,
                            width) + plan.batch * (
      budget.per_target_bytes(width, plan.chunk, LAYERS, len(PROMPT), WIDTH,
                              graph.vocab_size))
  assert used <= limit


def test_budget_smaller_than_the_graph_is_a_clear_error():
  with pytest.raises(ValueError, match="max_memory_bytes=1000 is too small"
                     ".*edges"):
    circuits.attribute(_model(), list(_transcoders()), PROMPT,
                       max_memory_bytes=1000)
  with pytest.raises(ValueError, match="max_memory_bytes"):
    circuits.attribute(_model(), list(_transcoders()), PROMPT,
                       max_memory_bytes=0)


def test_default_chunk_bounds_the_gather():
  """Without a budget a read-out step still gathers at most STEP_FLOATS
  floats: one step over every feature would be batch x features x D."""
  assert budget.default_chunk(512, 16384, 2304) == 1  # Gemma-2-2B sized.
  assert budget.default_chunk(512, 4096, 64) == 64
  assert budget.default_chunk(8, 64, 32) == 64  # All features at once.
  plan = budget.plan(None, batch_size=512, padded_features=16384,
                     width=20000, n_targets=20000, n_sources=20000,
                     n_held_rows=0,
                     num_layers=26, seq=20, hidden=2304, vocab=256000)
  assert plan == budget.Plan(512, 1)


def test_long_prompts_keep_the_chunk():
  """At 4,096 tokens of SmolLM2 a target's gradients fill its share: a
  smaller chunk would not make the batch larger, so the chunk stays (one
  feature a step made the read-out crawl)."""
  kwargs = dict(batch_size=32, padded_features=1 << 21, width=2_100_000,
                n_targets=522, n_sources=130_000, n_held_rows=522,
                other_bytes=2 * 10**9, num_layers=30, seq=4096, hidden=576,
                vocab=49152)
  plan = budget.plan(10**10, **kwargs)
  assert plan.chunk == budget.default_chunk(32, 1 << 21, 576) > 1
  assert 1 <= plan.batch < 16
