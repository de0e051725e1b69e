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

``--engine`` measures the engine's own prefill program instead
(``Engine(prefill_over_stacks=True)`` against the default per-layer
prefill) for each of ``--variants`` (float32, bfloat16, or a GGUF format
kept quantized, e.g. q4_0, from ``peers/make_ggufs.py``): the first
request's compile+trace and prefill seconds (``result.timings``; the
decode program compiles beside it, as in every first request), the
median of --warm more prefills, and the peak RSS. It answers what the
setting trades: first-request time against warm prefill speed.

  python benchmarks/stacked_prefill.py [--rounds 2] [--prompt 128]
  python benchmarks/stacked_prefill.py --engine [--variants float32,q4_0]
"""

from __future__ import annotations

import argparse
import json
import pathlib
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


_ENGINE_CHILD = r"""
import json, pathlib, resource, sys
import jax, numpy as np
jax.config.update("jax_enable_compilation_cache", False)
import penzai_lm
from penzai_lm.generation import Engine
stacked, prompt, warm, variant = (sys.argv[1] == "1", int(sys.argv[2]),
                                  int(sys.argv[3]), sys.argv[4])
if variant in ("float32", "bfloat16"):
  model = penzai_lm.load_model(dtype=variant)
else:
  sys.path.insert(0, str(pathlib.Path(sys.argv[5])))
  from peers.make_ggufs import gguf_path
  model = penzai_lm.load_model(gguf_path(variant), quantize="keep")
engine = Engine(prefill_over_stacks=stacked)
ids = [int(i) for i in np.arange(prompt) % 1000 + 100]

def prefill():
  run = engine.start(model, ids, max_new_tokens=16, temperature=0.0)
  run.prefill()
  return run

first = prefill()
compile_s, first_run_s = first.timings.compile_s, first.timings.prefill_s
first.decode(1)  # Waits for the decode program compiling beside it.
times = sorted(prefill().timings.prefill_s for _ in range(warm))
print(json.dumps({"compile_s": compile_s, "first_run_s": first_run_s,
                  "warm_s": times[len(times) // 2],
                  "peak_rss_mb":
                      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                      / 1024}))
"""


def run_child(stacked: bool, prompt: int, warm: int,
              variant: str | None = None) -> dict:
  child = [_CHILD] if variant is None else [_ENGINE_CHILD]
  extra = [] if variant is None else [
      variant, str(pathlib.Path(__file__).resolve().parent)]
  out = subprocess.run(
      [sys.executable, "-c", *child, "1" if stacked else "0", str(prompt),
       str(warm), *extra], capture_output=True, text=True, check=False)
  if out.returncode != 0:
    raise SystemExit(f"child failed ({out.returncode}):\n{out.stderr[-2000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--warm", type=int, default=3)
  parser.add_argument("--engine", action="store_true",
                      help="the engine's prefill program, per variant")
  parser.add_argument("--variants", default="float32,bfloat16,q8_0,q4_0")
  args = parser.parse_args()
  if min(args.rounds, args.prompt, args.warm) < 1:
    parser.error("--rounds, --prompt and --warm must be at least 1")
  variants = args.variants.split(",") if args.engine else [None]
  runs = {(v, s): [] for v in variants for s in (True, False)}
  for _ in range(args.rounds):
    for variant in variants:
      for stacked in (True, False):
        runs[variant, stacked].append(
            run_child(stacked, args.prompt, args.warm, variant))
  what = ("the engine's prefill program (first request: compile+trace and"
          " first run)" if args.engine else "uncached forward")
  print(f"SmolLM2-135M, [1, {args.prompt}] prompt, {what}, fresh processes,"
        f" medians of {args.rounds}")
  print(f"{'variant':<10}{'layers':<11}{'compile s':>10}{'first run s':>13}"
        f"{'warm s':>9}{'peak RSS MB':>13}")
  for (variant, stacked), got in runs.items():
    med = {k: statistics.median(r[k] for r in got) for k in got[0]}
    print(f"{variant or 'float32':<10}"
          f"{'stacked' if stacked else 'per layer':<11}"
          f"{med['compile_s']:>10.2f}{med['first_run_s']:>13.2f}"
          f"{med['warm_s']:>9.3f}{med['peak_rss_mb']:>13.0f}")


if __name__ == "__main__":
  main()
