"""Decode (or prefill) speed of this checkout against another one, in fresh
processes.

For a change to the kernels or the decode program, on a shared machine
where one process's figures move by 10-30%: each round runs one process
per variant and side, alternating which side goes first, and the table
quotes the medians. A process loads SmolLM2-135M-Instruct (``f32``,
``bf16``; or one of ``benchmarks/peers/make_ggufs.py``'s GGUF variants,
``q8_0``, ``q4_0``, ``q4_1``, ``q4_k_m``, kept in their blocks; with the
suffix ``-x8`` on int8 activations, `with_cpu_kernels(...,
int8_activations=True, donate=True)`), generates ``--new`` greedy tokens
after a ``--prompt``-token prompt at ``--batch`` rows four times, and
reports the median decode tok/s per row of the last three
(``result.timings.decode_tokens_per_s``; with ``--measure prefill``,
``prefill_tokens_per_s``: the batch's prompt tokens over the time to the
first token).

  git worktree add /tmp/before HEAD~1
  python benchmarks/decode_vs_baseline.py --baseline /tmp/before \\
      --variants bf16,q8_0,f32,q4_k_m --rounds 3
  python benchmarks/decode_vs_baseline.py --baseline /tmp/before \\
      --variants q8_0-x8,q4_0-x8 --measure prefill
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import json, statistics, sys
import penzai_lm
from penzai_lm import kernels
sys.path.insert(0, sys.argv[5])
from peers.make_ggufs import gguf_path
variant, batch, prompt, new = sys.argv[1], *map(int, sys.argv[2:5])
measure = sys.argv[6]
base = variant.removesuffix("-x8")
if base in ("f32", "bf16"):
  kwargs = dict(dtype="float32" if base == "f32" else "bfloat16")
else:
  kwargs = dict(name_or_path=gguf_path(base), quantize="keep")
model, _ = penzai_lm.load(**kwargs)
if variant.endswith("-x8"):
  model = kernels.with_cpu_kernels(model, int8_activations=True, donate=True)
prompts = [list(range(100 + r, 100 + r + prompt)) for r in range(batch)]
rates = []
for i in range(4):
  result = penzai_lm.generate(model, prompts, max_new_tokens=new,
                              temperature=0.0, stop_tokens=[])
  if i:
    rates.append(getattr(result.timings, f"{measure}_tokens_per_s"))
print(json.dumps(dict(tok_s=statistics.median(rates),
                      package=penzai_lm.__file__)))
"""


FORMATS = ("f32", "bf16", "q8_0", "q4_0", "q4_1", "q4_k_m")


def check_args(parser, args) -> None:
  """Refuses unknown variants and a baseline that is not a checkout, before
  any process runs."""
  for variant in args.variants.split(","):
    base = variant.removesuffix("-x8")
    if base not in FORMATS or (variant.endswith("-x8")
                               and base in ("f32", "bf16")):
      parser.error(f"unknown variant {variant!r}: one of {', '.join(FORMATS)},"
                   " the quantized ones also with the suffix -x8")
  if not os.path.isfile(os.path.join(args.baseline, "penzai_lm",
                                     "__init__.py")):
    parser.error(f"--baseline {args.baseline!r} is not a penzai_lm checkout"
                 " (no penzai_lm/__init__.py there); make one with: git"
                 " worktree add /tmp/before HEAD~1")


def run_child(args, variant: str, checkout: str) -> float:
  """Median tok/s (``args.measure``) of one fresh process importing from
  ``checkout``."""
  env = dict(os.environ, PYTHONPATH=checkout)
  out = subprocess.run(
      [sys.executable, "-c", _CHILD, variant, str(args.batch),
       str(args.prompt), str(args.new), os.path.dirname(__file__),
       args.measure],
      capture_output=True, text=True, env=env, cwd=checkout, check=False)
  if out.returncode:
    raise SystemExit(f"{variant} in {checkout} failed:\n{out.stderr[-3000:]}")
  record = json.loads(out.stdout.strip().splitlines()[-1])
  if not record["package"].startswith(checkout):
    raise SystemExit(f"{checkout}: the process imported {record['package']}")
  return record["tok_s"]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--baseline", required=True,
                      help="a checkout of the other commit")
  parser.add_argument("--variants", default="bf16,q8_0")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--new", type=int, default=64)
  parser.add_argument("--measure", choices=("decode", "prefill"),
                      default="decode")
  args = parser.parse_args()
  check_args(parser, args)
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sides = [("baseline", os.path.abspath(args.baseline)), ("this", here)]
  rates = {}
  for r in range(args.rounds):
    for variant in args.variants.split(","):
      for side, checkout in sides if r % 2 == 0 else sides[::-1]:
        tok_s = run_child(args, variant, checkout)
        rates.setdefault((variant, side), []).append(tok_s)
        print(f"round {r + 1} {variant:10} {side:8} {tok_s:7.1f} tok/s",
              flush=True)
  per = "per row" if args.measure == "decode" else "of the batch"
  print(f"\nbatch {args.batch}, {args.measure} tok/s {per}, medians of"
        f" {args.rounds}:")
  for variant in args.variants.split(","):
    before = statistics.median(rates[(variant, "baseline")])
    after = statistics.median(rates[(variant, "this")])
    print(f"{variant:10} baseline {before:7.1f}  this {after:7.1f}"
          f"  {after / before:.2f}x")


if __name__ == "__main__":
  main()
