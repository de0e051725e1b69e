"""Where one decode step's time goes, op by op (SmolLM2-135M, CPU).

Loads the model (``--weights``: float32 or bfloat16 from the default file,
or a kept GGUF variant from the peers' folder, ``benchmarks/peers/
make_ggufs.py``; ``--x8``: int8 activations), generates once to compile,
then traces one greedy generate (``--batch`` rows of ``--prompt`` tokens in, ``--new`` out)
with ``jax.profiler`` and sums the decode program's ops per step: the
kernel calls (``ffi_call``: the products, attention, the sampler) apart
from XLA's own ops, with their count per step and the costliest kinds.
Under the profiler a step takes longer than without it; the split between
the kernels and XLA's small ops is what to read.

  python benchmarks/decode_step_ops.py --weights q4_0 --x8
  python benchmarks/decode_step_ops.py --weights bfloat16 --top 20
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position
import penzai_lm
from penzai_lm.generation import default_engine
from peers.make_ggufs import gguf_path


def load(weights: str, x8: bool):
  if weights in ("float32", "bfloat16"):
    model, _ = penzai_lm.load(dtype=weights)
  else:
    model, _ = penzai_lm.load(gguf_path(weights), quantize="keep")
  if x8:
    model = penzai_lm.kernels.with_cpu_kernels(model, int8_activations=True,
                                               donate=True)
  return model


# Ops whose events span the ops they run (counted there).
_CONTAINERS = ("while", "call", "conditional")


def step_ops(trace_path: str, steps: int):
  """Microseconds and counts per decode step by op kind (``ffi`` for the
  kernel calls)."""
  with gzip.open(trace_path) as f:
    events = json.load(f)["traceEvents"]
  spent, count = collections.Counter(), collections.Counter()
  for event in events:
    args = event.get("args", {})
    if (event.get("ph") != "X"
        or args.get("hlo_module") != "jit_decode_program"
        or event["name"].startswith(("ThunkExecutor", "end: "))):
      continue
    kind = ("ffi" if event["name"].startswith("ffi_call")
            else event["name"].rstrip("0123456789_."))
    if kind in _CONTAINERS:
      continue
    spent[kind] += event["dur"] / steps
    count[kind] += 1 / steps
  return spent, count


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  parser.add_argument("--weights", default="q4_0",
                      help="float32, bfloat16, q8_0, q4_0, q4_1 or q4_k_m")
  parser.add_argument("--x8", action="store_true",
                      help="int8 activations (with_cpu_kernels)")
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--new", type=int, default=64)
  parser.add_argument("--batch", type=int, default=1,
                      help="rows (the same prompt in each)")
  parser.add_argument("--top", type=int, default=10)
  args = parser.parse_args()
  model = load(args.weights, args.x8)
  engine = default_engine()
  prompts = [list(range(100, 100 + args.prompt))] * args.batch
  engine.generate(model, prompts, max_new_tokens=args.new, temperature=0.0)
  with tempfile.TemporaryDirectory() as folder:
    with jax.profiler.trace(folder, create_perfetto_trace=True):
      timings = engine.generate(model, prompts, max_new_tokens=args.new,
                                temperature=0.0).timings
    (path,) = glob.glob(f"{folder}/**/perfetto_trace.json.gz",
                        recursive=True)
    spent, count = step_ops(path, timings.decode_steps)
  other = sum(v for k, v in spent.items() if k != "ffi")
  print(f"{args.weights}{' x8' if args.x8 else ''}, batch {args.batch}:"
        f" {timings.decode_steps} steps traced,"
        f" {timings.decode_tokens_per_s:.1f} tok/s a row under the profiler")
  ops = sum(count.values()) - count["ffi"]
  print(f"kernel calls: {spent['ffi']:.0f} us a step ({count['ffi']:.0f}"
        f" calls); XLA's ops: {other:.0f} us ({ops:.0f} ops)")
  for kind, us in spent.most_common(args.top + 1):
    if kind != "ffi":
      print(f"  {us:7.1f} us  {count[kind]:6.1f} a step  {kind}")


if __name__ == "__main__":
  main()
