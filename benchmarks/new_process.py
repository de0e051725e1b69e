"""What a new process spends before its first token (SmolLM2-135M, CPU).

Runs three fresh processes that each load the model and generate 16 tokens
from a 128-token prompt: without a persistent cache, then twice with a new
JAX compilation cache directory (the first fills it and the engine's
`ProgramStore` inside it; the second reads both back). Prints, per process,
the engine's host preparation and compile+trace seconds
(``timings.prepare_s``, ``timings.compile_s``), JAX's own trace and XLA
compile totals, the process's CPU seconds for the request (all threads: on a
shared machine wall times grow with the load, CPU time much less) and the
wall time from start to the first token (the first event of
``Engine.stream``, chunks of 8 tokens). Target (issue 28): compile+trace
<= 3 s without a persistent cache.

``--cold N`` runs N rounds of processes without a persistent cache
instead, ``--stacked-prefill`` runs them on engines that prefill over the
layer stack and per layer (``Engine(prefill_over_stacks=True / False)``),
and ``--baseline DIR`` (a checkout of another commit, e.g. from
``git worktree add``) alternates them with processes that import
penzai_lm from DIR, for a side-by-side comparison on a shared machine; the
medians close the table, and then each round's pair compared (the median
of the differences, and how often the second side was lower). The
prefill's first run pays costs of its own (XLA:CPU builds the YNNPACK
dots' packed weights on their first call).

Run: python benchmarks/new_process.py [--dtype bfloat16] [--quantize int8]
     [--cold 5 [--baseline /tmp/before] [--stacked-prefill]]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import collections, json, sys, time
start = time.perf_counter()
import jax
from jax import monitoring
events = collections.defaultdict(float)
monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: events.__setitem__(name, events[name] + secs))
if sys.argv[1]:
  jax.config.update("jax_compilation_cache_dir", sys.argv[1])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
import penzai_lm
model = penzai_lm.load_model("smollm2-135m-instruct", dtype=sys.argv[2],
                             quantize=sys.argv[3] or None)
loaded = time.perf_counter()
cpu = time.process_time()
from penzai_lm.generation import Engine, default_engine
engine = default_engine() if sys.argv[4] == "default" else Engine(
    prefill_over_stacks=sys.argv[4] == "1")
stream = engine.stream(model, list(range(100, 228)), max_new_tokens=16,
                       temperature=0.0)
first = None
for _ in stream:
  first = first or time.perf_counter()
t = stream.result.timings
print(json.dumps(dict(
    load_s=loaded - start, prepare_s=t.prepare_s, compile_s=t.compile_s,
    cpu_s=time.process_time() - cpu,
    trace_s=events["/jax/core/compile/jaxpr_trace_duration"],
    xla_s=events["/jax/core/compile/backend_compile_duration"],
    prefill_s=t.prefill_s, package=penzai_lm.__file__,
    first_token_s=first - start,
    decode_tok_s=t.decode_tokens_per_s)))
"""


def run_child(args, cache_dir: str, pythonpath: str | None = None,
              stacked: bool | None = None) -> dict:
  """One fresh process's figures (penzai_lm from ``pythonpath`` if given;
  ``stacked``: on ``Engine(prefill_over_stacks=stacked)``, None: the
  default engine)."""
  env = dict(os.environ)
  if pythonpath:
    env["PYTHONPATH"] = os.pathsep.join(
        [pythonpath] + [p for p in [env.get("PYTHONPATH")] if p])
  out = subprocess.run(
      [sys.executable, "-c", _CHILD, cache_dir, args.dtype, args.quantize,
       {None: "default", True: "1", False: "0"}[stacked]],
      capture_output=True, text=True, check=True, env=env,
      cwd=pythonpath)  # The working directory comes first on sys.path.
  r = json.loads(out.stdout.strip().splitlines()[-1])
  if pythonpath and not r["package"].startswith(pythonpath):
    raise RuntimeError(f"the baseline imported {r['package']}")
  return r


def cold_rounds(args) -> None:
  """``--cold``: rounds of processes without a persistent cache."""
  sides = [("this checkout", None, None)]
  if args.baseline:
    sides.insert(0, ("baseline", os.path.abspath(args.baseline), None))
  if args.stacked_prefill:
    sides = [("over stacks", None, True), ("per layer", None, False)]
  print(f"SmolLM2-135M {args.dtype} {args.quantize or ''}: 128-token prompt,"
        f" 16 new tokens, no persistent cache, {args.cold} rounds")
  columns = ("compile_s", "prefill_s", "xla_s", "cpu_s")
  print(f"{'process':15} {'compile+trace s':>15} {'1st prefill s':>13}"
        f" {'XLA s':>6} {'CPU s':>6} {'1st token s':>11} {'load':>5}")
  figures = {label: [] for label, _, _ in sides}
  for _ in range(args.cold):
    for label, path, stacked in sides:
      r = run_child(args, "", path, stacked)
      figures[label].append(r)
      print(f"{label:15} {r['compile_s']:15.2f} {r['prefill_s']:13.2f}"
            f" {r['xla_s']:6.2f} {r['cpu_s']:6.2f} {r['first_token_s']:11.2f}"
            f" {os.getloadavg()[0]:5.2f}", flush=True)
  for label, runs in figures.items():
    med = {c: statistics.median(r[c] for r in runs)
           for c in columns + ("first_token_s",)}
    first = statistics.median(r["compile_s"] + r["prefill_s"] for r in runs)
    print(f"{label + ' median':15} {med['compile_s']:15.2f}"
          f" {med['prefill_s']:13.2f} {med['xla_s']:6.2f}"
          f" {med['cpu_s']:6.2f} {med['first_token_s']:11.2f};"
          f" compile+trace+prefill {first:.2f}")
  if len(sides) == 2:
    print_pairs(*(figures[label] for label, _, _ in sides),
                [label for label, _, _ in sides])


def print_pairs(a: list[dict], b: list[dict], labels: list[str]) -> None:
  """Each round's second process against its first: on a shared machine the
  load drifts between rounds, and a pair shares a round's load."""
  print(f"pairs ({labels[1]} - {labels[0]}), median of the rounds'"
        " differences, and in how many rounds the second was lower:")
  for column in ("compile_s", "prefill_s", "xla_s", "cpu_s",
                 "first_token_s"):
    diffs = [y[column] - x[column] for x, y in zip(a, b)]
    lower = sum(d < 0 for d in diffs)
    print(f"  {column:14} {statistics.median(diffs):+6.2f} s,"
          f" lower in {lower} of {len(diffs)}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--quantize", default="")
  parser.add_argument("--cold", type=int, default=0)
  parser.add_argument("--baseline", default="")
  parser.add_argument("--stacked-prefill", action="store_true",
                      help="with --cold: processes on"
                      " Engine(prefill_over_stacks=True) and on False")
  args = parser.parse_args()
  if args.cold:
    cold_rounds(args)
    return
  with tempfile.TemporaryDirectory() as cache:
    runs = [("no persistent cache", ""), ("cache: first process", cache),
            ("cache: next process", cache)]
    print(f"SmolLM2-135M {args.dtype} {args.quantize or ''}: 128-token prompt,"
          " 16 new tokens, one fresh process each")
    print(f"{'process':22} {'prepare s':>9} {'compile+trace s':>15}"
          f" {'trace s':>8} {'XLA s':>6} {'CPU s':>6}"
          f" {'start->1st token s':>18} {'decode tok/s':>12}")
    for label, directory in runs:
      r = run_child(args, directory)
      print(f"{label:22} {r['prepare_s']:9.2f} {r['compile_s']:15.2f}"
            f" {r['trace_s']:8.2f} {r['xla_s']:6.2f} {r['cpu_s']:6.2f}"
            f" {r['first_token_s']:18.2f}"
            f" {r['decode_tok_s']:12.1f}")


if __name__ == "__main__":
  main()
