"""Token streaming: chunks, forced tokens mid-generation, cancellation."""

import threading

from penzai_lm.generation import Engine
from penzai_lm.generation import generate
from penzai_lm.generation import stream
from tests.generation.conftest import MAX_NEW
from tests.generation.conftest import prompts

SETTINGS = dict(max_new_tokens=MAX_NEW, temperature=1.0, stop_tokens=[],
                seed=[3, 4])


def _collect(events):
  rows = {}
  reasons = {}
  for event in events:
    assert event.row not in reasons, "no event after a row's last one"
    rows.setdefault(event.row, []).extend(event.tokens)
    if event.finish_reason is not None:
      reasons[event.row] = event.finish_reason
  return rows, reasons


def test_stream_equals_generate(model):
  rows = prompts([5, 8], seed=20)
  expected = generate(model, rows, **SETTINGS)
  s = stream(model, rows, chunk_size=3, **SETTINGS)
  events = list(s)
  got, reasons = _collect(events)
  assert [got[0], got[1]] == expected.tokens
  assert reasons == {0: "length", 1: "length"}
  # First chunk: one token per row, then chunks of 3.
  assert [len(e.tokens) for e in events[:2]] == [1, 1]
  assert [len(e.tokens) for e in events[2:4]] == [3, 3]
  assert s.result.tokens == expected.tokens
  assert s.result.logprobs == expected.logprobs


def test_stream_rows_finish_separately(model):
  rows = prompts([5, 8], seed=21)
  s = stream(model, rows, chunk_size=2, **dict(SETTINGS, max_new_tokens=[2, 7]))
  events = list(s)
  finished = [e.row for e in events if e.finish_reason]
  assert finished == [0, 1]
  assert s.result.lengths == [2, 7]


def test_force_tokens_mid_generation(model):
  rows = prompts([5, 8], seed=22)
  settings = dict(SETTINGS, temperature=0.0)
  s = stream(model, rows, chunk_size=2, **settings)
  first = next(s)  # Row 0's first token.
  assert first.row == 0 and len(first.tokens) == 1
  s.force(1, [7, 8])
  s.force(0, [9])
  result = s.run_to_end()
  # The forced tokens come right after what was generated before.
  assert result.tokens[0][1] == 9 and result.tokens[1][1:3] == [7, 8]
  assert result.forced[0] == [False, True] + [False] * (MAX_NEW - 2)
  assert result.forced[1] == [False, True, True] + [False] * (MAX_NEW - 3)
  # The rest continues greedily from prompt + generated + forced tokens.
  again = generate(model, [rows[0] + result.tokens[0][:2]],
                   **dict(settings, max_new_tokens=MAX_NEW - 2, seed=3))
  assert again.tokens[0] == result.tokens[0][2:]


def test_cancel_with_event(model):
  cancel = threading.Event()
  rows = prompts([5, 8], seed=23)
  s = stream(model, rows, chunk_size=2, cancel=cancel, **SETTINGS)
  seen = []
  for event in s:
    seen.append(event)
    cancel.set()
  result = s.result
  assert result.finish_reasons == ["cancelled", "cancelled"]
  # Cancelled after the first chunk (1 token per row): nothing more ran.
  assert result.lengths == [1, 1]
  assert [e.finish_reason for e in seen][-2:] == ["cancelled", "cancelled"]
  # generate() honours the event too.
  assert generate(model, rows, cancel=cancel, **SETTINGS).finish_reasons == [
      "cancelled", "cancelled"]


def test_close_the_stream(model):
  rows = prompts([5, 8], seed=24)
  with stream(model, rows, chunk_size=2, **SETTINGS) as s:
    for event in s:
      if event.row == 1:
        break
  result = s.result
  assert result.finish_reasons == ["cancelled", "cancelled"]
  assert result.lengths == [1, 1]
  assert s.run.finished
  assert list(s) == []  # Closed: nothing more comes.
  # Closed before it started: nothing ran at all.
  unstarted = stream(model, rows, **SETTINGS)
  assert unstarted.result.finish_reasons == [None, None]  # Not started yet.
  unstarted.close()
  assert unstarted.result.finish_reasons == ["cancelled", "cancelled"]
  assert unstarted.result.tokens == [[], []]
  assert unstarted.run.view is None


def test_stop_finishes_rows_before_cancel(model):
  rows = prompts([5, 8], seed=25)
  s = stream(model, rows, chunk_size=4,
             **dict(SETTINGS, max_new_tokens=[1, MAX_NEW]))
  events = iter(s)
  next(events), next(events)  # First chunk: row 0 finished (length 1).
  s.close()
  assert s.result.finish_reasons == ["length", "cancelled"]


def test_the_first_tokens_come_from_the_prefill(model):
  # Cached decoding without captures: the prefill picks every row's first
  # token (forced or sampled), so the first event needs no decode call.
  engine = Engine(program_store=None)
  rows = prompts([5, 8], seed=21)
  settings = dict(SETTINGS, forced_tokens=[[7, 9], []])
  expected = engine.generate(model, rows, use_cache=False, **settings)
  s = engine.stream(model, rows, chunk_size=3, **settings)
  first = [next(s), next(s)]
  assert s.run.view.t == 1
  assert [e.tokens for e in first] == [[7], expected.tokens[1][:1]]
  assert [e.forced for e in first] == [[True], [False]]
  got, _ = _collect(first + list(s))
  assert [got[0], got[1]] == expected.tokens
  assert s.result.tokens == expected.tokens
  assert s.result.timings.time_to_first_token_s == (
      s.result.timings.prefill_s)
