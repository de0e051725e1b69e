"""Capturing every point of SmolLM2: ``run_with_cache`` and
``generate(..., capture=...)``, each in a fresh process (compilation
included, as a user's first call).

With ``--baseline DIR`` the same child runs in another checkout too (e.g.
``git worktree add /tmp/before <commit>``), side by side.

Run: python benchmarks/capture_points.py [--points N] [--baseline DIR]
"""

import argparse
import json
import pathlib
import subprocess
import sys

_CHILD = r"""
import json, sys, time
import penzai_lm
from penzai_lm import interp
from penzai_lm.model import points
model, tokenizer = penzai_lm.load("smollm2-135m-instruct")
names = points.point_names(model)[:int(sys.argv[1]) or None]
ids = tokenizer.encode("The capital of France is")
t = time.perf_counter()
interp.run_with_cache(model, [ids], names=names)
cache_s = time.perf_counter() - t
t = time.perf_counter()
penzai_lm.generate(model, [ids], max_new_tokens=2, capture=names)
print(json.dumps({"points": len(names), "run_with_cache_s": cache_s,
                  "generate_capture_s": time.perf_counter() - t}))
"""


def _run(checkout: pathlib.Path, points: int) -> dict:
  done = subprocess.run([sys.executable, "-c", _CHILD, str(points)],
                        cwd=checkout, capture_output=True, text=True,
                        check=True, timeout=1800)
  return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--points", type=int, default=0,
                      help="the first N point names (0: all of them)")
  parser.add_argument("--baseline", type=pathlib.Path,
                      help="another checkout to time the same way")
  args = parser.parse_args()
  here = pathlib.Path(__file__).resolve().parents[1]
  rows = [("this checkout", here)]
  if args.baseline:
    rows.append((str(args.baseline), args.baseline.resolve()))
  print("| checkout | points | run_with_cache s | generate(capture=) s |")
  print("|---|---|---|---|")
  for label, checkout in rows:
    r = _run(checkout, args.points)
    print(f"| {label} | {r['points']} | {r['run_with_cache_s']:.1f} |"
          f" {r['generate_capture_s']:.1f} |")


if __name__ == "__main__":
  main()
