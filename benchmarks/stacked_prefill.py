"""A prompt's first run, scanned over the layer stack or per layer.

Each measurement is a fresh process (no persistent compilation cache): it
loads the default model (SmolLM2-135M-Instruct, float32) with
``use_layer_stack=True`` (one block body, scanned) or ``False`` (30 blocks,
unrolled, as the engine's prefill runs today), compiles the uncached
forward pass over a [1, --prompt] prompt, runs it once (on CPU, XLA builds
its fused kernels' runtimes on that first call) and then --warm times.
Reports compile s, first-run s, the warm median and the process's peak
RSS, medians over --rounds alternating processes. The question it answers:
how much of a new process's first-token time and fixed memory a prefill
over the layer stack would save (`docs/cpu-speed.md`).

  python benchmarks/stacked_prefill.py [--rounds 2] [--prompt 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = r"""
import json, resource, sys, time
import jax, jax.numpy as jnp, numpy as np
from penzai import pz
import penzai_lm
# Cold compiles, even where the environment names a persistent cache.
jax.config.update("jax_enable_compilation_cache", False)
stacked, prompt, warm = sys.argv[1] == "1", int(sys.argv[2]), int(sys.argv[3])
model = penzai_lm.load_model(use_layer_stack=stacked)
ids = (np.arange(prompt)[None] % 1000 + 100).astype(np.int32)
tokens = pz.nx.wrap(jnp.asarray(ids)).tag("batch", "seq")
f = jax.jit(lambda m, t: m(t).unwrap("batch", "seq", "vocabulary"))
t0 = time.perf_counter()
compiled = f.lower(model, tokens).compile()
t1 = time.perf_counter()
compiled(model, tokens).block_until_ready()
t2 = time.perf_counter()
times = []
for _ in range(warm):
  s = time.perf_counter()
  compiled(model, tokens).block_until_ready()
  times.append(time.perf_counter() - s)
print(json.dumps({"compile_s": t1 - t0, "first_run_s": t2 - t1,
                  "warm_s": sorted(times)[len(times) // 2],
                  "peak_rss_mb":
                      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                      / 1024}))
"""


def run_child(stacked: bool, prompt: int, warm: int) -> dict:
  out = subprocess.run(
      [sys.executable, "-c", _CHILD, "1" if stacked else "0", str(prompt),
       str(warm)], capture_output=True, text=True, check=False)
  if out.returncode != 0:
    raise SystemExit(f"child failed ({out.returncode}):\n{out.stderr[-2000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--warm", type=int, default=3)
  args = parser.parse_args()
  if min(args.rounds, args.prompt, args.warm) < 1:
    parser.error("--rounds, --prompt and --warm must be at least 1")
  runs = {True: [], False: []}
  for _ in range(args.rounds):
    for stacked in (True, False):
      runs[stacked].append(run_child(stacked, args.prompt, args.warm))
  print(f"SmolLM2-135M float32, [1, {args.prompt}] prompt, uncached forward,"
        f" fresh processes, medians of {args.rounds}")
  print(f"{'layers':<10}{'compile s':>11}{'first run s':>13}{'warm s':>9}"
        f"{'peak RSS MB':>13}")
  for stacked in (True, False):
    med = {k: statistics.median(r[k] for r in runs[stacked])
           for k in runs[stacked][0]}
    print(f"{'scanned' if stacked else 'per layer':<10}"
          f"{med['compile_s']:>11.2f}{med['first_run_s']:>13.2f}"
          f"{med['warm_s']:>9.3f}{med['peak_rss_mb']:>13.0f}")


if __name__ == "__main__":
  main()
