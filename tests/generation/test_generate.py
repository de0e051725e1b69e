"""Token-level generation: correctness, invariances, stopping, samples,
compile reuse, patched models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

from penzai_lm.generation import default_engine
from penzai_lm.generation import Engine
from penzai_lm.generation import generate
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.runtime.unstack import unstack_layers
from tests.generation import conftest
from tests.generation.conftest import MAX_NEW
from tests.generation.conftest import prompts


def _greedy(model, rows, **kw):
  kw = dict(dict(max_new_tokens=MAX_NEW, temperature=0.0, stop_tokens=[]),
            **kw)
  return generate(model, rows, **kw)


@jax.jit
def _logits(model, tokens):
  return model(tokens).unwrap("seq", "vocabulary")


def _reference_greedy(model, prompt, n):
  """Greedy decoding by recomputing the uncached model (jitted) each step."""
  frozen = pz.freeze_params(model)
  seq, out = list(prompt), []
  for _ in range(n):
    tokens = pz.nx.wrap(jnp.asarray(seq, jnp.int32)).tag("seq")
    token = int(np.argmax(np.asarray(_logits(frozen, tokens))[-1]))
    out.append(token)
    seq.append(token)
  return out


def test_cached_equals_uncached_and_reference(model):
  rows = prompts([5, 8])
  cached = _greedy(model, rows)
  uncached = _greedy(model, rows, use_cache=False)
  assert cached.tokens == uncached.tokens
  assert cached.finish_reasons == ["length", "length"]
  assert cached.lengths == [MAX_NEW, MAX_NEW]
  # Different rows really are different continuations.
  assert cached.tokens[0] != cached.tokens[1]
  assert cached.tokens[1] == _reference_greedy(model, rows[1], MAX_NEW)
  np.testing.assert_allclose(
      cached.logprobs, uncached.logprobs, rtol=1e-4, atol=1e-4)
  assert all(lp <= 0 for row in cached.logprobs for lp in row)
  assert cached.forced == [[False] * MAX_NEW] * 2


def test_top_k_1_and_tiny_top_p_equal_greedy(model):
  rows = prompts([5, 8])
  greedy = _greedy(model, rows)
  top_k = generate(model, rows, max_new_tokens=MAX_NEW, temperature=1.0,
                   top_k=1, seed=5, stop_tokens=[])
  top_p = generate(model, rows, max_new_tokens=MAX_NEW, temperature=0.9,
                   top_p=1e-6, seed=6, stop_tokens=[])
  assert top_k.tokens == greedy.tokens
  assert top_p.tokens == greedy.tokens


def test_seed_reproducibility_and_batch_invariance(model):
  rows = prompts([6, 3, 8, 5], seed=1)
  settings = dict(max_new_tokens=MAX_NEW, temperature=1.0, stop_tokens=[])
  batch = generate(model, rows, seed=[11, 12, 13, 14], **settings)
  again = generate(model, rows, seed=[11, 12, 13, 14], **settings)
  assert batch.tokens == again.tokens
  assert batch.seeds == [11, 12, 13, 14]
  # Sampling really is random: other seeds give other tokens.
  other = generate(model, rows, seed=[21, 22, 23, 24], **settings)
  assert other.tokens != batch.tokens
  # Row 2 alone, and in another slot of another batch, is unchanged.
  alone = generate(model, rows[2], seed=13, **settings)
  assert alone.tokens[0] == batch.tokens[2]
  moved = generate(model, [rows[2], rows[0], rows[1]], seed=[13, 11, 12],
                   **settings)
  assert moved.tokens == [batch.tokens[2], batch.tokens[0], batch.tokens[1]]
  # Settings of other rows do not matter either.
  mixed = generate(model, [rows[0], rows[2]], seed=[11, 13],
                   temperature=[0.0, 1.0], max_new_tokens=[3, MAX_NEW],
                   stop_tokens=[])
  assert mixed.tokens[1] == batch.tokens[2]
  assert mixed.lengths[0] == 3


def test_seed_none_is_random_and_reported(model):
  row = prompts([4], seed=2)[0]
  settings = dict(max_new_tokens=MAX_NEW, temperature=1.0, stop_tokens=[])
  first = generate(model, row, **settings)
  replay = generate(model, row, seed=first.seeds[0], **settings)
  assert replay.tokens == first.tokens


def test_ragged_batch_rows_equal_solo_runs(model):
  rows = prompts([1, 8, 4, 2], seed=3)
  batch = _greedy(model, rows)
  for i, row in enumerate(rows):
    assert _greedy(model, row).tokens[0] == batch.tokens[i], i
  assert batch.prompt_lengths == [1, 8, 4, 2]


def test_prompt_forms_agree(model):
  rows = prompts([5, 5], seed=4)
  as_list = _greedy(model, rows)
  as_array = _greedy(model, np.asarray(rows))
  named = pz.nx.wrap(jnp.asarray(rows, jnp.int32)).tag("batch", "seq")
  as_named = _greedy(model, named)
  one_named = _greedy(model, pz.nx.wrap(jnp.asarray(rows[0])).tag("seq"))
  assert as_list.tokens == as_array.tokens == as_named.tokens
  assert one_named.tokens == as_list.tokens[:1]


def test_finish_reasons_stop_token_and_length(model):
  row = prompts([5], seed=5)[0]
  free = _greedy(model, row)
  target = free.tokens[0][3]
  first = free.tokens[0].index(target)
  stopped = _greedy(model, row, stop_tokens=[target])
  assert stopped.finish_reasons == ["stop"]
  assert stopped.tokens[0] == free.tokens[0][:first + 1]  # Stop id kept.
  # The model's own eos ids are the default stop tokens; [] disables them.
  cfg_model = type(model)(body=model.body, config=model.config.replace(
      eos_token_ids=(target, 3)))
  run = default_engine().start(cfg_model, [row, row], stop_tokens=None)
  assert run.request.stop_tokens == ((target, 3), (target, 3))
  no_stops = default_engine().start(cfg_model, row, stop_tokens=[])
  assert no_stops.request.stop_tokens == ((),)
  # Per-row stop tokens and max_new_tokens.
  both = _greedy(model, [row, row], stop_tokens=[[target], []],
                 max_new_tokens=[MAX_NEW, 2])
  assert both.finish_reasons == ["stop", "length"]
  assert both.tokens == [stopped.tokens[0], free.tokens[0][:2]]
  # min_new_tokens holds the stop token back for that many tokens, per row.
  held = _greedy(model, [row, row], stop_tokens=[target],
                 min_new_tokens=[first + 2, 0])
  assert held.tokens[1] == stopped.tokens[0]
  assert target not in held.tokens[0][:first + 2]
  assert held.tokens[0][:first] == free.tokens[0][:first]
  assert held.tokens[0][first] != target


def test_cache_full_with_a_small_cached_model(model):
  row = prompts([6], seed=6)[0]
  cached = KVCachingTransformerLM.from_uncached(model, 10, {"batch": 2})
  result = _greedy(cached, [row, row[:2]], max_new_tokens=[MAX_NEW, 3])
  # Prompt bucket 8: 7 slots prefilled, 3 left for the 8-token request.
  assert result.finish_reasons == ["cache_full", "length"]
  assert result.lengths == [3, 3]
  assert result.tokens[0] == _greedy(model, row).tokens[0][:3]
  # The caller's cached model is untouched and can be used again.
  assert int(cached.cache_end_index.value) == 0
  again = _greedy(cached, [row, row[:2]], max_new_tokens=[MAX_NEW, 3])
  assert again.tokens == result.tokens


def test_num_samples_one_prefill_and_independent_rows():
  model = conftest.patched_model()
  row = prompts([5], seed=7)[0]
  settings = dict(max_new_tokens=MAX_NEW, temperature=1.0, stop_tokens=[],
                  seed=42)
  conftest.CALLS.clear()
  result = generate(model, row, num_samples=3, **settings)
  jax.effects_barrier()
  calls = list(conftest.CALLS)
  # One prefill at batch 1 (the whole prompt bucket: it picks the first
  # tokens), then one single-token call per later step at the decode batch
  # (3 rows -> bucket 4).
  assert calls[0] == (1, 8)
  assert [c for c in calls if c[1] != 1] == [(1, 8)]
  assert set(calls[1:]) == {(4, 1)}
  assert len(calls) == MAX_NEW
  assert result.num_rows == 3
  assert result.prompt_indices == [0, 0, 0]
  assert result.sample_indices == [0, 1, 2]
  assert len({tuple(t) for t in result.tokens}) == 3  # Samples differ...
  assert len({t[0] for t in result.tokens}) > 1  # ...from the first token.
  again = generate(model, row, num_samples=3, **settings)
  assert again.tokens == result.tokens
  # Sample 0 uses the seed itself: it equals a plain run with that seed.
  single = generate(model, row, **settings)
  assert single.tokens[0] == result.tokens[0]
  # Sample j alone with its reported seed reproduces it.
  alone = generate(model, row, **dict(settings, seed=result.seeds[2]))
  assert alone.tokens[0] == result.tokens[2]


def test_num_samples_with_several_prompts(model):
  rows = prompts([3, 6], seed=8)
  result = generate(model, rows, num_samples=2, max_new_tokens=MAX_NEW,
                    temperature=[0.0, 1.0], seed=[1, 2], stop_tokens=[])
  assert result.prompt_indices == [0, 0, 1, 1]
  greedy = _greedy(model, rows)
  assert result.tokens[0] == result.tokens[1] == greedy.tokens[0]
  assert result.tokens[2] != result.tokens[3]


def test_patched_model_with_state_runs_in_the_loop():
  model = conftest.patched_model()
  rows = prompts([5, 8], seed=9)
  plain = _greedy(conftest.tiny_model(), rows)
  patched = _greedy(model, rows)
  assert patched.tokens == plain.tokens  # The recorder is an identity.


@pytest.mark.parametrize("name", ["gemma3", "gpt2"])
def test_unstacked_layers_compute_the_same(name):
  model = conftest.tiny_model(name, True)
  unstacked = unstack_layers(model)
  assert not pz.select(unstacked).at_instances_of(pz.nn.LayerStack).count()
  tokens = pz.nx.wrap(jnp.asarray(prompts([9], seed=10)[0])).tag("seq")
  np.testing.assert_allclose(
      _logits(pz.freeze_params(model), tokens),
      _logits(pz.freeze_params(unstacked), tokens), rtol=1e-5, atol=1e-5)


def test_logprobs_top_n(model):
  row = prompts([5], seed=11)[0]
  result = _greedy(model, row, logprobs_top_n=3)
  top = result.top_logprobs[0]
  assert len(top) == MAX_NEW and all(len(t) == 3 for t in top)
  for token, logprob, alternatives in zip(
      result.tokens[0], result.logprobs[0], top):
    assert alternatives[0][0] == token  # Greedy picks the most likely.
    assert alternatives[0][1] == pytest.approx(logprob, abs=1e-5)
    assert alternatives[0][1] >= alternatives[1][1] >= alternatives[2][1]


def test_forced_tokens_at_start(model):
  row = prompts([5], seed=12)[0]
  result = _greedy(model, [row, row], forced_tokens=[[5, 6, 7], []])
  assert result.tokens[0][:3] == [5, 6, 7]
  assert result.forced[0] == [True] * 3 + [False] * (MAX_NEW - 3)
  assert result.forced[1] == [False] * MAX_NEW
  # The continuation is the greedy continuation of prompt + forced tokens.
  assert result.tokens[0][3:] == _greedy(
      model, row + [5, 6, 7], max_new_tokens=MAX_NEW - 3).tokens[0]


def test_one_compilation_serves_a_bucket(model):
  rows = prompts([5, 8], seed=13)
  generate(model, rows, max_new_tokens=MAX_NEW, temperature=0.5, seed=1)
  before = (default_engine().program_count("prefill"), default_engine().program_count("decode"))
  compiled = default_engine().compilations
  for lengths, settings in [
      ([2, 7], dict(temperature=0.0)),
      ([8, 1], dict(temperature=[0.3, 1.5], top_k=[5, 0], top_p=0.8,
                    min_p=0.05, seed=[3, 4])),
      ([3, 3], dict(repetition_penalty=1.3, presence_penalty=0.5,
                    frequency_penalty=[0.1, 0.2], logit_bias={3: 2.0},
                    banned_tokens=[[4], [5, 6]], max_new_tokens=[2, 5])),
      ([6, 4], dict(max_new_tokens=3, stop_tokens=[[1, 2], [3]],
                    forced_tokens=[[1], []])),
      ([5, 2], dict(temperature=0.9, typical_p=[0.8, 1.0], top_k=[0, 7],
                    epsilon_cutoff=0.01, eta_cutoff=[0.0, 0.002],
                    min_new_tokens=[4, 0], stop_tokens=[[1], [2]])),
  ]:
    settings.setdefault("max_new_tokens", MAX_NEW)
    result = generate(model, prompts(lengths, seed=len(lengths)), **settings)
    assert result.timings.compile_s == 0.0
  assert (default_engine().program_count("prefill"),
          default_engine().program_count("decode")) == before
  assert default_engine().compilations == compiled


def test_timings_are_reported(model):
  result = _greedy(model, prompts([5, 8], seed=14))
  t = result.timings
  assert t.time_to_first_token_s > 0 and t.decode_s > 0
  assert t.prompt_tokens == 13 and t.generated_tokens == 2 * MAX_NEW
  assert t.decode_steps == MAX_NEW - 1
  assert t.prefill_tokens_per_s > 0 and t.decode_tokens_per_s > 0
  assert "tok/s" in result.summary()


def test_changed_parameters_are_seen():
  """Prepared (unstacked, converted) models are cached per model identity;
  assigning a new parameter value must not reuse stale weights."""
  # Mutable `pz.Parameter`s (freeze=False): the value is assigned in place.
  model = conftest.build_transformer(conftest.config("llama_gqa"), seed=7,
                                     freeze=False)
  rows = prompts([5, 8], seed=15)
  before = _greedy(model, rows)
  head = pz.select(model).at_instances_of(pz.Parameter).where(
      lambda p: "lm_head" in p.label).get_sequence()[0]
  head.value = -head.value
  after = _greedy(model, rows)
  assert after.tokens != before.tokens
  assert after.tokens == _greedy(model, rows, use_cache=False).tokens


def test_decode_program_is_shared_across_prompt_buckets(model):
  # An engine of its own: the default one's LRU may be full from earlier
  # tests, and a new prefill would then evict a decode program.
  engine = Engine()
  _greedy(model, prompts([5, 8], seed=16), engine=engine)  # Prompt 8, cache 16.
  assert engine.program_count("decode") == 1
  # Prompt bucket 16 with the same cache bucket: only a new prefill.
  result = _greedy(model, prompts([12, 3], seed=16), max_new_tokens=1,
                   engine=engine)
  assert engine.program_count("decode") == 1
  assert engine.program_count("prefill") == 2
  assert result.lengths == [1, 1]
  assert result.tokens[1] == _greedy(
      model, prompts([12, 3], seed=16)[1]).tokens[0][:1]
