"""Threads: a shared Engine, and Sessions used from several threads."""

import gc
import threading
import time

import numpy as np
import pytest

from penzai_lm.generation import Engine
from penzai_lm.generation import generate
from penzai_lm.generation.chat import ChatSession
from penzai_lm.generation.session import Session
from penzai_lm.generation.session import SessionBusyError
from penzai_lm.generation.turns import TurnGate
from tests.generation.conftest import prompts

GREEDY = dict(temperature=0.0, stop_tokens=[])


def _in_threads(fn, n):
  """Runs ``fn(i)`` in ``n`` threads started together; their results, or
  re-raises the first error."""
  barrier = threading.Barrier(n)
  results, errors = [None] * n, []

  def work(i):
    barrier.wait()
    try:
      results[i] = fn(i)
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=300)
  assert not any(t.is_alive() for t in threads), "a thread hung"
  if errors:
    raise errors[0]
  return results


def test_concurrent_generate_on_one_model_equals_sequential(model):
  engine = Engine()  # Fresh: the threads race to compile the same programs.
  batches = [prompts([5, 7], seed=60 + i) for i in range(4)]
  options = dict(max_new_tokens=6, temperature=0.8, top_k=20, stop_tokens=[])
  together = _in_threads(lambda i: generate(
      model, batches[i], engine=engine, seed=[i, 10 + i], **options), 4)
  # One prefill and one decode program: concurrent misses compiled once.
  assert engine.compilations == 2
  for i, result in enumerate(together):
    alone = generate(model, batches[i], engine=engine, seed=[i, 10 + i],
                     **options)
    assert result.tokens == alone.tokens
    np.testing.assert_allclose(result.logprobs[0], alone.logprobs[0],
                               atol=1e-6)
  assert engine.compilations == 2


def _split_turns(tokens, turns):
  """The order in which ``turns`` (prompt + reply lists) make ``tokens``."""
  order, rest, at = [], dict(enumerate(turns)), 0
  while rest:
    i = next((i for i, t in rest.items() if tokens[at:at + len(t)] == t),
             None)
    assert i is not None, f"no turn continues the conversation at {at}"
    order.append(i)
    at += len(rest.pop(i))
  assert at == len(tokens), "the conversation has tokens of no turn"
  return order


def test_concurrent_turns_on_one_session_are_all_kept(model):
  n = 6
  session = Session(model, min_cache_len=64)
  asks = prompts([3] * n, seed=70)
  results = _in_threads(
      lambda i: session.generate(asks[i], max_new_tokens=2, **GREEDY), n)
  turns = [asks[i] + r.tokens[0] for i, r in enumerate(results)]
  assert all(len(r.tokens[0]) == 2 for r in results)
  order = _split_turns(session.tokens, turns)
  assert sorted(order) == list(range(n))
  # The cache holds exactly that conversation: the next turn equals one
  # call on all of it.
  conversation = session.tokens
  after = session.generate([5], max_new_tokens=3, **GREEDY)
  assert after.tokens == generate(model, [conversation + [5]],
                                  max_new_tokens=3, **GREEDY).tokens


def test_a_second_stream_is_refused_and_generate_waits(model):
  session = Session(model)
  a, b, c = prompts([4, 4, 4], seed=71)
  opened, release = threading.Event(), threading.Event()
  first = {}

  def streamer():
    with session.stream(a, chunk_size=2, max_new_tokens=4, **GREEDY) as s:
      first["event"] = next(s)
      opened.set()
      release.wait(60)
      first["result"] = s.run_to_end()

  t = threading.Thread(target=streamer)
  t.start()
  assert opened.wait(120)
  with pytest.raises(SessionBusyError, match="another thread"):
    session.stream(b, max_new_tokens=2)
  waited = {}
  waiter = threading.Thread(target=lambda: waited.setdefault(
      "result", session.generate(c, max_new_tokens=2, **GREEDY)))
  waiter.start()
  time.sleep(0.5)
  assert "result" not in waited  # Waiting for the open stream.
  release.set()
  t.join(120)
  waiter.join(120)
  reply = first["result"].tokens[0]
  assert len(reply) == 4  # The stream was not cut by the waiting call.
  assert session.tokens == a + reply + c + waited["result"].tokens[0]


def test_an_abandoned_stream_frees_the_session(model):
  session = Session(model)
  a, b = prompts([4, 4], seed=72)

  def abandon():
    s = session.stream(a, chunk_size=2, max_new_tokens=6, **GREEDY)
    next(s)  # Dropped unfinished when the thread ends.

  t = threading.Thread(target=abandon)
  t.start()
  t.join(120)
  gc.collect()
  done = threading.Event()
  threading.Thread(target=lambda: (session.generate(
      b, max_new_tokens=2, **GREEDY), done.set())).start()
  assert done.wait(120)
  assert session.tokens[:4] == a


def test_a_call_from_inside_its_own_turn_is_refused():
  gate = TurnGate("this Session")
  turn = gate.begin("call")
  with pytest.raises(SessionBusyError, match="inside its own"):
    gate.begin("call")
  gate.end(turn)
  gate.end(turn)  # Idempotent.
  assert not gate.active(turn)
  gate.end(gate.begin("stream"))


def test_concurrent_chat_replies_keep_every_exchange(text_model, tok):
  chat = ChatSession(text_model, tok, min_cache_len=256)
  questions = [f"Question {i}?" for i in range(3)]
  replies = _in_threads(lambda i: chat.reply(
      questions[i], max_new_tokens=3, temperature=0.0), 3)
  messages = chat.messages
  assert [m["role"] for m in messages] == ["user", "assistant"] * 3
  for i, question in enumerate(questions):
    k = [m["content"] for m in messages].index(question)
    assert messages[k + 1]["content"] == replies[i]
