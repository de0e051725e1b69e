"""Whether two checkouts compile the same generation programs.

For a change that moves code without changing behaviour (a refactor), the
strongest check of "decode speed unchanged" is that XLA compiles the very
same programs. This runs one `generate` per checkout in a fresh process
(a tiny random model of every family layout the tests use, greedy and
sampled rows), takes the optimized HLO of its prefill and decode programs,
drops what names source files and Python frames (those move with the
code), and compares the rest.

Run: git worktree add /tmp/before HEAD~1
     python benchmarks/same_programs.py --baseline /tmp/before
Prints one line per program; exits 1 if any differs.
"""

import argparse
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys

_CHILD = r"""
import json, re, sys
from penzai_lm import generation
from tests.generation.conftest import tiny_model
out = {}
for name, stacked in (("llama_gqa", True), ("gemma3", False)):
  engine = generation.Engine(program_store=None)
  engine.generate(tiny_model(name, stacked), [[1, 2, 3, 4], [5, 6]],
                  max_new_tokens=4, temperature=[0.0, 0.7], top_p=0.9,
                  seed=1)
  for program in ("prefill", "decode"):
    (_, compiled), = engine.programs.items(program)
    out[f"{name}/{program}"] = compiled.as_text()
json.dump(out, sys.stdout)
"""


def _programs(checkout: pathlib.Path) -> dict[str, str]:
  env = dict(os.environ, PYTHONPATH=str(checkout))
  done = subprocess.run([sys.executable, "-c", _CHILD], cwd=checkout,
                        env=env, capture_output=True, text=True, check=False)
  if done.returncode:
    raise SystemExit(f"generate failed in {checkout}:\n{done.stderr}")
  return json.loads(done.stdout)


def _code(hlo: str) -> str:
  """The HLO without source locations: metadata, file and frame tables."""
  hlo = re.sub(r"metadata=\{[^}]*\}", "", hlo)
  hlo = re.sub(r",? *stack_frame_id=\d+", "", hlo)
  return "\n".join(line for line in hlo.splitlines()
                   if not re.match(r"^\d+ ", line))


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--baseline", required=True, type=pathlib.Path,
                      help="a checkout of the commit to compare with")
  args = parser.parse_args()
  here = pathlib.Path(__file__).resolve().parents[1]
  ours, theirs = _programs(here), _programs(args.baseline.resolve())
  differ = 0
  for key in sorted(ours):
    a, b = _code(ours[key]), _code(theirs.get(key, ""))
    same = a == b
    differ += not same
    digest = hashlib.sha256(a.encode()).hexdigest()[:12]
    print(f"{key:20s} {'same' if same else 'DIFFERENT'}"
          f" ({len(a.splitlines())} HLO lines, {digest})")
  return 1 if differ else 0


if __name__ == "__main__":
  sys.exit(main())
