"""The penzai-lm command line, on the real default model."""

import io
import json

import pytest

from penzai_lm import cli

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def _run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


def test_generate_json_is_greedy_and_reports_everything(capsys):
  code, out, err = _run(
      capsys, "generate", PROMPT, "--max-new-tokens", "8", "--json"
  )
  assert code == 0
  result = json.loads(out)
  assert "Paris" in result["texts"][0]
  assert result["finish_reasons"] == ["length"]
  assert len(result["tokens"][0]) == 8
  assert "decode" in err and "tok/s" in err


def test_generate_with_the_files_own_quantized_blocks(capsys):
  code, out, _ = _run(capsys, "generate", PROMPT, "--max-new-tokens", "4",
                      "--json", "--quantize", "keep")
  assert code == 0
  assert "Paris" in json.loads(out)["texts"][0]


def test_streamed_text_equals_the_json_text(capsys):
  _, out, _ = _run(capsys, "generate", PROMPT, "--max-new-tokens", "8", "--json")
  text = json.loads(out)["texts"][0]
  code, streamed, err = _run(capsys, "generate", PROMPT, "--max-new-tokens", "8")
  assert code == 0
  assert streamed == PROMPT + text + "\n"
  assert "time to first token" in err


def test_prompt_from_stdin_and_stop_string(capsys, monkeypatch):
  monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT))
  code, out, _ = _run(
      capsys, "generate", "--max-new-tokens", "16", "--stop", "Paris", "--json"
  )
  assert code == 0
  result = json.loads(out)
  assert "Paris" not in result["texts"][0]
  assert result["finish_reasons"] == ["stop"]


def test_bad_sampling_value_is_a_clear_error(capsys):
  code, _, err = _run(capsys, "generate", PROMPT, "--top-p", "2")
  assert code == 2
  assert "top_p" in err


class _InterruptAfter:
  """Wraps a text stream; raises KeyboardInterrupt (Ctrl-C) after n events."""

  def __init__(self, stream, n):
    self.stream, self.n, self.pieces = stream, n, []

  def __iter__(self):
    return self

  def __next__(self):
    if len(self.pieces) == self.n:
      raise KeyboardInterrupt
    event = next(self.stream)
    self.pieces.append(event.text)
    return event

  def close(self):
    self.stream.close()

  @property
  def result(self):
    return self.stream.result


def test_ctrl_c_stops_generate_and_keeps_the_text(capsys, monkeypatch):
  from penzai_lm import generation  # pylint: disable=g-import-not-at-top

  real = generation.stream_text
  seen = []

  def interrupted(*args, **kwargs):
    seen.append(_InterruptAfter(real(*args, **kwargs), 2))
    return seen[-1]

  monkeypatch.setattr(generation, "stream_text", interrupted)
  code, out, err = _run(capsys, "generate", PROMPT, "--max-new-tokens", "32")
  assert code == 0
  assert out == PROMPT + "".join(seen[0].pieces) + "\n"
  assert seen[0].pieces and "finish: cancelled" in err


def test_chat_keeps_the_cache_across_turns(capsys, monkeypatch):
  lines = iter(["What is the capital of France?", "And of Italy?", ""])
  monkeypatch.setattr("builtins.input", lambda _: next(lines))
  code, out, err = _run(capsys, "chat", "--max-new-tokens", "24")
  assert code == 0
  first, second = out.splitlines()[:2]
  assert "Paris" in first and "Rome" in second
  stats = [l for l in err.splitlines() if "tokens cached" in l]
  assert len(stats) == 2 and all("0 re-reads" in l for l in stats)


def test_chat_ctrl_c_stops_a_reply_and_the_chat_goes_on(capsys, monkeypatch):
  from penzai_lm.generation.chat import ChatSession  # pylint: disable=g-import-not-at-top

  real_send = ChatSession.send
  calls = []

  def send(self, content, **kwargs):
    stream = real_send(self, content, **kwargs)
    if not calls:  # Interrupt the first reply only.
      stream = _InterruptAfter(stream, 1)
    calls.append(content)
    return stream

  monkeypatch.setattr(ChatSession, "send", send)
  lines = iter(["Write a long poem about the sea.", "What is 2+2?", ""])
  monkeypatch.setattr("builtins.input", lambda _: next(lines))
  code, _, err = _run(capsys, "chat", "--max-new-tokens", "24")
  assert code == 0 and len(calls) == 2
  stats = [l for l in err.splitlines() if "tokens cached" in l]
  assert "finish: cancelled" in stats[0] and "finish: cancelled" not in stats[1]
  assert "0 re-reads" in stats[1]
