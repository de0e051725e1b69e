"""What a new process spends before its first token (SmolLM2-135M, CPU).

Runs three fresh processes that each load the model and generate 16 tokens
from a 128-token prompt: without a persistent cache, then twice with a new
JAX compilation cache directory (the first fills it and the engine's
`ProgramStore` inside it; the second reads both back). Prints, per process,
the engine's host preparation and compile+trace seconds
(``timings.prepare_s``, ``timings.compile_s``), JAX's own trace and XLA
compile totals, the process's CPU seconds for the request (all threads: on a
shared machine wall times grow with the load, CPU time much less) and the
wall time from start to the first token. Target (issue 28): compile+trace
<= 3 s without a persistent cache.

Run: python benchmarks/new_process.py [--dtype bfloat16] [--quantize int8]
"""

import argparse
import json
import os
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
r = penzai_lm.generate(model, list(range(100, 228)), max_new_tokens=16,
                       temperature=0.0)
t = r.timings
print(json.dumps(dict(
    load_s=loaded - start, prepare_s=t.prepare_s, compile_s=t.compile_s,
    cpu_s=time.process_time() - cpu,
    trace_s=events["/jax/core/compile/jaxpr_trace_duration"],
    xla_s=events["/jax/core/compile/backend_compile_duration"],
    first_token_s=loaded - start + (t.total_s - t.decode_s),
    decode_tok_s=t.decode_tokens_per_s)))
"""


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--quantize", default="")
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as cache:
    runs = [("no persistent cache", ""), ("cache: first process", cache),
            ("cache: next process", cache)]
    print(f"SmolLM2-135M {args.dtype} {args.quantize or ''}: 128-token prompt,"
          " 16 new tokens, one fresh process each")
    print(f"{'process':22} {'prepare s':>9} {'compile+trace s':>15}"
          f" {'trace s':>8} {'XLA s':>6} {'CPU s':>6}"
          f" {'start->1st token s':>18} {'decode tok/s':>12}")
    for label, directory in runs:
      out = subprocess.run(
          [sys.executable, "-c", _CHILD, directory, args.dtype, args.quantize],
          capture_output=True, text=True, check=True, env=os.environ)
      r = json.loads(out.stdout.strip().splitlines()[-1])
      print(f"{label:22} {r['prepare_s']:9.2f} {r['compile_s']:15.2f}"
            f" {r['trace_s']:8.2f} {r['xla_s']:6.2f} {r['cpu_s']:6.2f}"
            f" {r['first_token_s']:18.2f}"
            f" {r['decode_tok_s']:12.1f}")


if __name__ == "__main__":
  main()
