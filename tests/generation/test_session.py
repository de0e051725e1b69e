"""Sessions: the KV cache kept across calls equals re-reading everything."""

import threading

import numpy as np
import pytest

from penzai_lm.generation import generate
from penzai_lm.generation import default_engine
from penzai_lm.generation.session import Session
from penzai_lm.model import KVCachingTransformerLM
from tests.generation.conftest import VOCAB
from tests.generation.conftest import patched_model
from tests.generation.conftest import prompts

GREEDY = dict(temperature=0.0, stop_tokens=[])


def _same_as_one_call(model, conversation, result, **settings):
  """``result`` equals generating after the whole conversation at once."""
  expected = generate(model, [conversation], **settings)
  assert result.tokens == expected.tokens
  np.testing.assert_allclose(result.logprobs[0], expected.logprobs[0],
                             atol=2e-5)


def test_turns_equal_one_call_on_the_whole_conversation(model):
  a, b, c = prompts([7, 5, 8], seed=40)
  session = Session(model)
  first = session.generate(a, max_new_tokens=6, **GREEDY)
  _same_as_one_call(model, a, first, max_new_tokens=6, **GREEDY)
  second = session.generate(b, max_new_tokens=20, **GREEDY)  # Grows the cache.
  _same_as_one_call(model, a + first.tokens[0] + b, second,
                    max_new_tokens=20, **GREEDY)
  third = session.generate(c, max_new_tokens=5, **GREEDY)
  history = a + first.tokens[0] + b + second.tokens[0] + c
  _same_as_one_call(model, history, third, max_new_tokens=5, **GREEDY)
  assert session.tokens == history + third.tokens[0]
  assert session.pending == third.tokens[0][-1:]
  assert session.cached_tokens == len(session.tokens) - 1
  # Only the new tokens (and the pending one) were prefilled.
  assert third.timings.prompt_tokens == len(c) + 1
  assert session.cache_len >= session.slots_used >= session.cached_tokens


def test_sampling_and_penalties_see_the_whole_conversation(model):
  a, b = prompts([6, 4], seed=41)
  settings = dict(temperature=1.0, seed=5, repetition_penalty=1.5,
                  presence_penalty=0.5, stop_tokens=[], max_new_tokens=7)
  session = Session(model)
  first = session.generate(a, **settings)
  second = session.generate(b, **dict(settings, seed=6))
  _same_as_one_call(model, a + first.tokens[0] + b, second,
                    **dict(settings, seed=6))


def test_continue_without_new_tokens(model):
  a, = prompts([5], seed=42)
  session = Session(model)
  first = session.generate(a, max_new_tokens=4, **GREEDY)
  more = session.generate([], max_new_tokens=5, **GREEDY)
  whole = generate(model, [a], max_new_tokens=9, **GREEDY)
  assert first.tokens[0] + more.tokens[0] == whole.tokens[0]


def test_tokens_past_the_kept_ones_leave_the_cache(model):
  a, b = prompts([6, 3], seed=43)
  session = Session(model)
  s = session.stream(a, chunk_size=4, max_new_tokens=8, **GREEDY)
  next(s)  # One token.
  next(s)  # Four more: five generated and four of them fed to the cache.
  s.end_row(0, "stop", keep=2)  # E.g. a stop string matched in token 2.
  kept = s.run_to_end().tokens[0]
  assert len(kept) == 2
  after = session.generate(b, max_new_tokens=6, **GREEDY)
  _same_as_one_call(model, a + kept + b, after, max_new_tokens=6, **GREEDY)
  assert session.tokens == a + kept + b + after.tokens[0]


def test_a_cancelled_reply_keeps_its_tokens(model):
  a, b = prompts([4, 4], seed=44)
  session = Session(model)
  s = session.stream(a, chunk_size=2, max_new_tokens=8, **GREEDY)
  next(s)
  s.close()
  partial = s.result
  assert partial.finish_reasons == ["cancelled"]
  after = session.generate(b, max_new_tokens=4, **GREEDY)
  _same_as_one_call(model, a + partial.tokens[0] + b, after,
                    max_new_tokens=4, **GREEDY)


def test_cancelled_before_it_starts_changes_nothing(model):
  a, b = prompts([4, 5], seed=45)
  session = Session(model)
  session.generate(a, max_new_tokens=3, **GREEDY)
  before = list(session.tokens)
  cancel = threading.Event()
  cancel.set()
  nothing = session.generate(b, max_new_tokens=3, cancel=cancel, **GREEDY)
  assert nothing.tokens == [[]] and nothing.finish_reasons == ["cancelled"]
  assert session.tokens == before + b
  after = session.generate([], max_new_tokens=3, **GREEDY)
  _same_as_one_call(model, before + b, after, max_new_tokens=3, **GREEDY)


def test_starting_a_turn_ends_the_streaming_one(model):
  a, b = prompts([4, 4], seed=46)
  session = Session(model)
  s = session.stream(a, chunk_size=2, max_new_tokens=8, **GREEDY)
  next(s)
  after = session.generate(b, max_new_tokens=3, **GREEDY)
  assert s.result.finish_reasons == ["cancelled"]
  _same_as_one_call(model, a + s.result.tokens[0] + b, after,
                    max_new_tokens=3, **GREEDY)


def test_turns_in_the_same_buckets_do_not_recompile(model):
  session = Session(model)
  a, b, c = prompts([5, 3, 4], seed=47)
  session.generate(a, max_new_tokens=3, **GREEDY)
  session.generate(b, max_new_tokens=3, **GREEDY)  # Compiles a continuation.
  before = default_engine().compilations
  session.generate(c, max_new_tokens=2, temperature=0.7, seed=3,
                   stop_tokens=[])
  assert default_engine().compilations == before


def test_reset_starts_over(model):
  a, b = prompts([5, 6], seed=48)
  session = Session(model)
  session.generate(a, max_new_tokens=3, **GREEDY)
  session.reset()
  assert session.tokens == [] and session.cache_len == 0
  fresh = session.generate(b, max_new_tokens=4, **GREEDY)
  _same_as_one_call(model, b, fresh, max_new_tokens=4, **GREEDY)


def test_patch_state_is_carried_across_turns():
  model = patched_model()
  a, b = prompts([5, 4], seed=49)
  session = Session(model)
  first = session.generate(a, max_new_tokens=3, **GREEDY)
  second = session.generate(b, max_new_tokens=3, **GREEDY)
  _same_as_one_call(model, a + first.tokens[0] + b, second,
                    max_new_tokens=3, **GREEDY)


def test_errors(model):
  cached = KVCachingTransformerLM.from_uncached(model, 16, {"batch": 1})
  with pytest.raises(TypeError, match="uncached TransformerLM"):
    Session(cached)
  session = Session(model)
  with pytest.raises(ValueError, match="give at least one token"):
    session.generate([])
  with pytest.raises(ValueError, match="num_samples"):
    session.generate([1, 2], num_samples=2)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    session.generate([1, VOCAB])
  with pytest.raises(ValueError, match="one flat list"):
    session.generate([[1, 2], [3]])
  with pytest.raises(TypeError, match="list of token ids"):
    session.generate("hello")
  assert session.tokens == []
  session.generate([1, 2, 3], max_new_tokens=2, **GREEDY)
  limit = model.config.max_position_embeddings
  with pytest.raises(ValueError, match="holds 4 cached tokens"):
    session.generate([4] * (limit - 10), max_new_tokens=20)
  assert len(session.tokens) == 5  # Nothing changed.


def test_min_cache_len_avoids_growth(model):
  a, b = prompts([5, 6], seed=50)
  session = Session(model, min_cache_len=40)
  first = session.generate(a, max_new_tokens=3, **GREEDY)
  assert session.cache_len == 64
  second = session.generate(b, max_new_tokens=20, **GREEDY)
  assert session.cache_len == 64  # 8 + 3 + 8 + 20 slots fit.
  _same_as_one_call(model, a + first.tokens[0] + b, second,
                    max_new_tokens=20, **GREEDY)
  with pytest.raises(ValueError, match="min_cache_len"):
    Session(model, min_cache_len=-1)


def test_reading_the_state_mid_stream_leaves_the_reply_running(model):
  a, = prompts([5], seed=51)
  session = Session(model)
  s = session.stream(a, chunk_size=2, max_new_tokens=6, **GREEDY)
  next(s)
  assert session.tokens == [] and session.cached_tokens == 0
  result = s.run_to_end()
  assert result.finish_reasons == ["length"] and len(result.tokens[0]) == 6
  assert session.tokens == a + result.tokens[0]
