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
