"""Decode speed with and without the decode program's XLA CPU options.

Decode programs used to compile on CPU with
``xla_cpu_experimental_ynn_fusion_type: ""`` (XLA's YNNPACK fusions off).
This script measures greedy decode throughput of SmolLM2-135M-Instruct
(float32, per-layer weights) with and without that option for several batch
sizes and cache sizes, through two engines
(``Engine(compiler_options=...)``); its figures are why
`penzai_lm.runtime.compiler_options.default_compiler_options` is XLA's defaults.

How:

* Shapes: every ``--batches`` x ``--caches`` pair, and the caches in
  ``--big-caches`` only at ``--big-batches`` (their prefill is long). The
  cache bucket is reached through the prompt length: the engine sizes the
  cache as ``next_pow2(prompt_bucket + new - 1)``, so each shape uses a
  prompt of ``P`` tokens, ``P`` the largest power of two (>= 8) with
  ``P + new - 1 <= cache``. Rows are different slices of one text, all of
  the same length (no padding).
* ``penzai_lm.generate(..., temperature=0.0, stop_tokens=[])``: every row
  decodes exactly ``--new`` tokens. Decode throughput is
  ``timings.decode_tokens_per_s x rows`` (aggregate over the batch); the
  prefill's is ``timings.prompt_tokens / timings.prefill_s`` (the prefill
  call alone: ``prefill_tokens_per_s`` divides by the time to the first
  token, which includes one step of the decode program).
* Per shape: one warm-up run per option set (compilation, first-run
  overheads), then ``--rounds`` rounds alternating with/without (the order
  flips every round); the table quotes medians. Each engine keeps its
  programs, so alternating compiles nothing; the script checks that.
* The prefill is compiled with the defaults in both engines, so its
  with/without ratio shows the measurement noise.

The machine may be shared: ``uptime`` is printed at the start and the end.

Usage:
  python benchmarks/compiler_options.py [--new 48] [--rounds 3] \
      [--batches 1,2,4,8] [--caches 64,256] [--big-caches 2048] \
      [--big-batches 1,8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

# ``peers`` (the shared prompt text) lives next to this file.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position
import penzai_lm
from penzai_lm.generation import Engine
from peers.common import MODEL
from peers.common import make_prompts

YNN_OFF = {"xla_cpu_experimental_ynn_fusion_type": ""}


def engine_with_decode_options(options: dict | None) -> Engine:
  """An engine whose decode programs compile with ``options`` on CPU."""
  return Engine(compiler_options=lambda name, shape: dict(
      options or {}) if name == "decode" else {})


def prompt_len_for(cache: int, new: int) -> int:
  p = 8
  while 2 * p + new - 1 <= cache:
    p *= 2
  if p + new - 1 > cache:
    raise ValueError(f"--new {new} does not fit a {cache}-slot cache")
  return p


def run_once(engine, model, prompts, new):
  result = engine.generate(
      model, prompts, max_new_tokens=new, temperature=0.0, stop_tokens=[])
  t = result.timings
  assert all(len(x) == new for x in result.tokens), "a row stopped early"
  # Prefill alone (``prefill_tokens_per_s`` divides by the time to the first
  # token, which includes the first decode step).
  return dict(decode=t.decode_tokens_per_s * len(prompts),
              prefill=t.prompt_tokens / t.prefill_s, compile_s=t.compile_s,
              tokens=result.tokens)


def uptime() -> str:
  return subprocess.run(["uptime"], capture_output=True, text=True,
                        check=False).stdout.strip()


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ints = lambda s: [int(x) for x in s.split(",") if x]
  parser.add_argument("--new", type=int, default=48)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--batches", type=ints, default=[1, 2, 4, 8])
  parser.add_argument("--caches", type=ints, default=[64, 256])
  parser.add_argument("--big-caches", type=ints, default=[2048])
  parser.add_argument("--big-batches", type=ints, default=[1, 8])
  args = parser.parse_args()

  print("start:", uptime(), flush=True)
  start = time.perf_counter()
  model, tokenizer = penzai_lm.load(MODEL, use_layer_stack=False)
  shapes = [(b, c) for c in args.caches for b in args.batches]
  shapes += [(b, c) for c in args.big_caches for b in args.big_batches]
  configs = {"with": YNN_OFF, "without": None}
  rows = []
  for batch, cache in shapes:
    plen = prompt_len_for(cache, args.new)
    prompts = make_prompts(tokenizer, plen, batch)
    results = {name: [] for name in configs}
    compile_s = {}
    tokens = {}
    engines = {name: engine_with_decode_options(options)
               for name, options in configs.items()}
    for name, engine in engines.items():  # Warm-up: compiles.
      warm = run_once(engine, model, prompts, args.new)
      compile_s[name] = warm["compile_s"]
      tokens[name] = warm["tokens"]
    for r in range(args.rounds):
      order = list(configs) if r % 2 == 0 else list(configs)[::-1]
      for name in order:
        results[name].append(run_once(engines[name], model, prompts,
                                      args.new))
    compiled = [e.compilations for e in engines.values()]
    assert compiled == [2, 2], f"expected 2 compilations each, got {compiled}"
    med = {n: {k: statistics.median(x[k] for x in v)
               for k in ("decode", "prefill")} for n, v in results.items()}
    row = dict(
        batch=batch, cache=cache, prompt=plen,
        with_=med["with"]["decode"], without=med["without"]["decode"],
        with_all=[x["decode"] for x in results["with"]],
        without_all=[x["decode"] for x in results["without"]],
        prefill_with=med["with"]["prefill"],
        prefill_without=med["without"]["prefill"],
        compile_with=compile_s["with"], compile_without=compile_s["without"],
        same_tokens=tokens["with"] == tokens["without"],
        load=os.getloadavg()[0])
    rows.append(row)
    print(f"batch {batch} cache {cache} (prompt {plen}): decode with"
          f" {row['with_']:.1f} {[round(x, 1) for x in row['with_all']]},"
          f" without {row['without']:.1f}"
          f" {[round(x, 1) for x in row['without_all']]} tok/s;"
          f" prefill {row['prefill_with']:.0f}/{row['prefill_without']:.0f}"
          f" tok/s; compile incl. prefill {row['compile_with']:.1f}"
          f"/{row['compile_without']:.1f} s; same tokens"
          f" {row['same_tokens']}; load {row['load']:.2f}", flush=True)

  print()
  print(f"SmolLM2-135M fp32, greedy, {args.new} new tokens, medians of"
        f" {args.rounds} interleaved rounds; decode tok/s aggregate over rows")
  print("batch  cache  prompt |  with  without  with/without |"
        " prefill with/without")
  for r in rows:
    print(f"{r['batch']:5d}  {r['cache']:5d}  {r['prompt']:6d} |"
          f" {r['with_']:5.1f}  {r['without']:7.1f}"
          f"  {r['with_'] / r['without']:12.2f} |"
          f" {r['prefill_with'] / r['prefill_without']:.2f}")
  print(f"\ntotal {time.perf_counter() - start:.0f} s")
  print("end:", uptime(), flush=True)


if __name__ == "__main__":
  main()
