"""README.md's code runs as written.

Every ```python block of README.md runs, in the README's order, in one
fresh Python process (a reader's session), with the real default model;
tracebacks name README.md and its line. A Python block right after a
```bash block of one line ``VAR=value ... python`` (the README's way of
saying "start a new Python with these variables") runs instead in a
process of its own with those variables: the simulated-devices flag
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` must be set before
JAX is imported. Nothing is skipped: a block that cannot run in CI would
need a visible marker here and in the README.

The set-up commands (the README's first block) are what .ci/run runs.
"""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# Fenced blocks: the fence's language and body, and the body's first line.
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
# A shell line that starts Python with environment variables.
_PYTHON_WITH_ENV = re.compile(r"^((?:\w+=\S+\s+)+)python3?$")

# Runs blocks [(first_line, code)] in one namespace: compiled with
# README.md as file name and padded to their line, tracebacks point there.
_RUNNER = textwrap.dedent("""\
    import json, sys
    namespace = {"__name__": "__main__"}
    for line, code in json.loads(sys.argv[1]):
      print(f"--- README.md:{line}", flush=True)
      exec(compile("\\n" * (line - 1) + code, "README.md", "exec"), namespace)
    """)


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
  """``(language, first line of the body, body)`` of each fenced block."""
  return [(m.group(1), text.count("\n", 0, m.start(2)) + 1, m.group(2))
          for m in _FENCE.finditer(text)]


def _python_env(block) -> dict[str, str] | None:
  """The variables of a one-line ``VAR=value ... python`` bash block."""
  language, _, code = block
  lines = code.strip().splitlines()
  if language != "bash" or len(lines) != 1:
    return None
  start = _PYTHON_WITH_ENV.match(lines[0].split("#")[0].strip())
  if not start:
    return None
  return dict(a.split("=", 1) for a in shlex.split(start.group(1)))


def python_runs(text: str) -> list[tuple[dict[str, str], list]]:
  """The README's Python blocks grouped into processes.

  Returns:
    ``[(extra environment, [(line, code), ...])]``: first the process of
    every plain block, in order, then one per block that a ``VAR=... python``
    line introduces.
  """
  blocks = fenced_blocks(text)
  shared, own = [], []
  for i, (language, line, code) in enumerate(blocks):
    if language != "python":
      continue
    env = _python_env(blocks[i - 1]) if i else None
    if env is None:
      shared.append((line, code))
    else:
      own.append((env, [(line, code)]))
  return [({}, shared)] + own


def _run(env: dict[str, str], blocks: list, cwd: pathlib.Path) -> None:
  result = subprocess.run(
      [sys.executable, "-c", _RUNNER, json.dumps(blocks)],
      cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True,
      timeout=900, check=False)
  assert result.returncode == 0, (
      f"README.md's blocks at lines {[line for line, _ in blocks]} failed"
      f" (environment {env}):\n{result.stdout[-4000:]}\n"
      f"{result.stderr[-6000:]}")


def test_readme_opens_with_the_two_set_up_commands():
  language, _, code = fenced_blocks(README.read_text())[0]
  assert language == "bash"
  assert code.splitlines() == [
      'pip install -e . && penzai-lm generate "The capital of France is"',
      'pip install -e ".[test]" && pytest',
  ]
  # .ci/run runs the second one as it is written.
  assert 'pip install -e ".[test]" && pytest' in (
      ROOT / ".ci" / "run").read_text()


def test_every_python_block_is_run_and_the_device_flag_is_parsed():
  runs = python_runs(README.read_text())
  blocks = [b for _, run in runs for b in run]
  assert len(blocks) == sum(
      language == "python" for language, _, _ in fenced_blocks(
          README.read_text()))
  assert len(runs[0][1]) >= 5
  own = [env for env, _ in runs[1:]]
  assert {"XLA_FLAGS": "--xla_force_host_platform_device_count=6"} in own


def test_a_block_after_a_python_line_with_variables_runs_alone():
  text = textwrap.dedent("""\
      ```python
      a = 1
      ```
      ```bash
      FOO=1 BAR=x python
      ```
      ```python
      b = 2
      ```
      ```bash
      pip install x
      ```
      ```python
      c = a
      ```
      """)
  assert python_runs(text) == [
      ({}, [(2, "a = 1\n"), (14, "c = a\n")]),
      ({"FOO": "1", "BAR": "x"}, [(8, "b = 2\n")]),
  ]


@pytest.mark.slow
def test_readme_python_blocks_run(tmp_path):
  """The plain blocks in one process (files they write land in tmp_path)."""
  env, blocks = python_runs(README.read_text())[0]
  _run(env, blocks, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "index", range(len(python_runs(README.read_text())) - 1))
def test_readme_blocks_of_their_own_process_run(index, tmp_path):
  env, blocks = python_runs(README.read_text())[1 + index]
  _run(env, blocks, tmp_path)
