"""The penzai-lm command line, on the real default model; Ctrl-C on a tiny
one (in a subprocess, with a real SIGINT)."""

import gc
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

from penzai import pz
import pytest
import tokenizers

from penzai_lm import cli
from penzai_lm.quantization import QuantizedLinear
from penzai_lm.tokenizer import Tokenizer
from tests.checkpoints.corrupt_file_builders import valid_hf

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


def test_int8_activations_generate_and_need_quantized_weights(capsys):
  code, out, _ = _run(capsys, "generate", PROMPT, "--max-new-tokens", "4",
                      "--json", "--quantize", "keep", "--int8-activations")
  assert code == 0
  assert "Paris" in json.loads(out)["texts"][0]
  code, out, err = _run(capsys, "generate", PROMPT, "--max-new-tokens", "4",
                        "--int8-activations")
  assert code == 2 and not out
  assert "--int8-activations" in err and "--quantize keep" in err
  args = cli.build_parser().parse_args(
      ["generate", PROMPT, "--quantize", "keep", "--int8-activations"])
  model, _ = cli._load(args)  # pylint: disable=protected-access
  layers = pz.select(model).at_instances_of(QuantizedLinear).get_sequence()
  assert layers and all(layer.int8_activations for layer in layers)
  assert all(layer.tiled for layer in layers)  # SmolLM2's Q8_0: all tile


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
  assert code == cli.EXIT_INTERRUPTED
  assert out == PROMPT + "".join(seen[0].pieces) + "\n"
  assert seen[0].pieces and "finish: cancelled" in err
  assert "[interrupted]" in err and "Traceback" not in err


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


# ---- Ctrl-C, on a tiny model ------------------------------------------------

# Long enough that the run is still going when the signal comes; stop tokens
# are banned (--min-new-tokens) so that it does not end early.
LONG = ["--max-new-tokens", "3000", "--min-new-tokens", "3000",
        "--temperature", "1"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  """A tiny random llama (32 ids) with a 7-token tokenizer, as a Hugging Face
  directory."""
  d = valid_hf(tmp_path_factory.mktemp("tiny"),
               {"max_position_embeddings": 4096, "eos_token_id": 1})
  vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "c": 4, "Ġ": 5, "Ġa": 6}
  backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [("Ġ", "a")]))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
      add_prefix_space=False)
  backend.decoder = tokenizers.decoders.ByteLevel()
  backend.add_special_tokens(["<s>", "</s>"])
  backend.save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text(
      json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
  return d


class _Cli:
  """``python -m penzai_lm.cli`` in a subprocess; its stdout and stderr
  are read as they come."""

  def __init__(self, *argv):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if cache:  # The test session's cache (tests/conftest.py), not ~/.cache.
      env["PENZAI_LM_JAX_CACHE"] = cache
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "penzai_lm.cli", *argv], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    self.out, self.err = [], []
    self._readers = [
        threading.Thread(target=self._read, args=(f, into), daemon=True)
        for f, into in ((self.proc.stdout, self.out),
                        (self.proc.stderr, self.err))]
    for t in self._readers:
      t.start()

  def _read(self, stream, into):
    while piece := stream.read(1):
      into.append(piece)

  def wait_for(self, what: str, in_stdout=False, timeout=60.0):
    seen = self.out if in_stdout else self.err
    end = time.monotonic() + timeout
    while what not in "".join(seen):
      assert self.proc.poll() is None, "".join(self.err)
      assert time.monotonic() < end, f"no {what!r}: {''.join(self.err)}"
      time.sleep(0.02)

  def interrupt(self):
    self.proc.send_signal(signal.SIGINT)

  def finish(self, timeout=60.0):
    code = self.proc.wait(timeout)
    for t in self._readers:
      t.join(5)
    return code, "".join(self.out), "".join(self.err)


@pytest.fixture
def session_cache(monkeypatch):
  """The CLI's compilation cache: the test session's (tests/conftest.py)."""
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if cache:
    monkeypatch.setenv("PENZAI_LM_JAX_CACHE", cache)


def _sigint_after(monkeypatch, tokens: int):
  """Sends this process a real SIGINT once ``tokens`` tokens were decoded."""
  from penzai_lm.generation import text  # pylint: disable=g-import-not-at-top

  real, seen = text.TextView.push, [0]

  def push(self, row, new_tokens, finish_reason):
    seen[0] += len(new_tokens)
    if seen[0] >= tokens and seen[0] - len(new_tokens) < tokens:
      os.kill(os.getpid(), signal.SIGINT)
    return real(self, row, new_tokens, finish_reason)

  monkeypatch.setattr(text.TextView, "push", push)


@pytest.mark.parametrize("mode", ["stream", "--json", "--no-stream"])
def test_ctrl_c_keeps_the_text(capsys, monkeypatch, tiny_dir, session_cache,
                               mode):
  _sigint_after(monkeypatch, 40)
  # Python's handler, or SIG_IGN where the suite was started in the
  # background by a shell without job control.
  before = signal.getsignal(signal.SIGINT)
  extra = [] if mode == "stream" else [mode]
  code, out, err = _run(capsys, "generate", "--model", str(tiny_dir), "a b",
                        *extra, *LONG)
  assert code == cli.EXIT_INTERRUPTED, err
  assert err.count("[interrupted") == 1 and "Traceback" not in err
  assert "finish: cancelled" in err
  assert signal.getsignal(signal.SIGINT) is before
  tok = Tokenizer.from_hf(tiny_dir)
  if mode == "--json":
    result = json.loads(out)
    assert result["finish_reasons"] == ["cancelled"]
    assert result["interrupted"] is True
    tokens = result["tokens"][0]
    assert 40 <= len(tokens) < 3000  # Stopped at the chunk after the 40th.
    assert result["texts"][0] == tok.decode(tokens)
  else:
    text = out[len("a b"):] if mode == "stream" else out
    assert out.startswith("a b") == (mode == "stream")
    assert 40 <= len(text) < 3000 and text.endswith("\n")
    assert set(text) <= set("abc <s></s>\n")


def test_ctrl_c_in_a_real_process_prints_valid_json(tiny_dir):
  """python -m penzai_lm.cli, interrupted by a real SIGINT once loaded."""
  cli_run = _Cli("generate", "--model", str(tiny_dir), "a b", "--json", *LONG)
  cli_run.wait_for("[loaded in", timeout=300)
  time.sleep(0.5)  # Compiling or generating: Ctrl-C now cancels the run.
  cli_run.interrupt()
  code, out, err = cli_run.finish(timeout=300)
  assert code == cli.EXIT_INTERRUPTED, err
  assert "Traceback" not in err and "[interrupted" in err
  result = json.loads(out)
  assert result["finish_reasons"] == ["cancelled"]
  tokens = result["tokens"][0]
  assert len(tokens) < 3000
  assert result["texts"][0] == Tokenizer.from_hf(tiny_dir).decode(tokens)


def test_ctrl_c_while_loading_exits_130_without_a_traceback(
    capsys, monkeypatch):
  import penzai_lm  # pylint: disable=g-import-not-at-top

  def interrupted_load(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(penzai_lm, "load", interrupted_load)
  for mode in ([], ["--json"], ["--no-stream"]):
    code, out, err = _run(capsys, "generate", PROMPT, *mode)
    assert code == cli.EXIT_INTERRUPTED
    assert out == "" and err.strip().endswith("[interrupted]")
  code, out, err = _run(capsys, "chat")
  assert code == cli.EXIT_INTERRUPTED and "[interrupted]" in err


def test_generate_and_chat_start_without_the_circuits_package():
  """The command line imports `penzai_lm.circuits` (attribution graphs,
  SAEs: 0.14-0.17 s) only when `graph` runs, not to generate or chat."""
  script = ("import sys; from penzai_lm import cli; cli.build_parser()"
            ".parse_args(['generate', 'x']);"
            " print(sorted(m for m in sys.modules if m.startswith("
            "('penzai_lm.circuits', 'penzai_lm.sae'))))")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True,
                       text=True, check=True, timeout=120)
  assert out.stdout.strip() == "[]"
  parsed = cli.build_parser().parse_args(["graph", "g.safetensors",
                                          "--html", "g.html"])
  assert parsed.func is cli.cmd_graph


def test_the_program_exits_with_mains_code_and_its_objects_frozen(capsys):
  """`cli.run` (the ``penzai-lm`` script) exits with `main`'s code, after
  moving the run's objects out of the collector's reach (Python's shutdown
  would walk them all); `main` in-process leaves the collector as it was."""
  script = ("import atexit, gc; from penzai_lm import cli;"
            " cli.main = lambda: 3;"
            " atexit.register(lambda: print('frozen', gc.get_freeze_count()"
            " > 1000, flush=True)); cli.run()")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True,
                       text=True, timeout=120, check=False)
  assert out.returncode == 3, out.stderr
  assert out.stdout.strip() == "frozen True"
  frozen = gc.get_freeze_count()
  code, _, _ = _run(capsys, "generate", PROMPT, "--top-p", "2")
  assert code == 2 and gc.get_freeze_count() == frozen
