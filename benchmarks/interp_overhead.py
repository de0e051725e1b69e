"""What interventions and captures cost inside the compiled generation loop.

SmolLM2-135M-Instruct (float32), greedy, ``--new`` tokens per row, at each
batch in ``--batches``, three configurations of the same request:

* ``plain``: the loaded model;
* ``steer``: one `AddVector` at ``blocks.{L}.resid_post`` (L = the middle
  block) with one strength per row (rows at 0, 4, 8, ...) and the
  ``"generated"`` token rule -- per-row data and a rule, the general case;
* ``capture``: ``capture=`` of ``resid_post`` at 3 blocks, every token's
  values recorded in the loop's buffers and returned per row.

Decode throughput is ``timings.decode_tokens_per_s x rows``. Per batch: one
warm-up run per configuration (compilation), then ``--rounds`` rounds in a
rotating order; the table quotes medians and the overhead
``1 - config / plain``. Each steering round builds a new `AddVector` with
other strengths (a new model object): the engine prepares it again but
compiles nothing (the script checks the compile count), so the decode
figure is the loop's cost and the "prepare" column what a changed value
costs on the host.

For context, the peers run interventions in eager Python: nnsight reports
its tracing/intervention graph overhead per forward pass and TransformerLens
runs a Python hook per point per step; neither keeps a compiled decode loop.

The machine may be shared: ``uptime`` is printed at the start and the end.

Usage:
  python benchmarks/interp_overhead.py [--new 128] [--rounds 3] \
      [--batches 1,8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

# ``peers`` (the shared prompt text) lives next to this file.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position
import penzai_lm
from penzai_lm import interp
from penzai_lm.generation import Engine
from peers.common import MODEL
from peers.common import make_prompts
from peers.common import peak_rss_mb

PROMPT_LEN = 32


def uptime() -> str:
  return subprocess.run(["uptime"], capture_output=True, text=True,
                        check=False).stdout.strip()


def steered(model, rows: int, round_index: int):
  layer = model.config.num_layers // 2
  direction = np.random.default_rng(round_index).standard_normal(
      model.config.hidden_size).astype(np.float32)
  direction /= np.linalg.norm(direction)
  strengths = [4.0 * (r % 3) + 0.01 * round_index for r in range(rows)]
  return interp.insert_at(model, f"blocks.{layer}.resid_post",
                          interp.AddVector.build(direction, strengths,
                                                 where="generated"))


def run_once(engine, model, prompts, new, capture=None):
  start = time.perf_counter()
  result = engine.generate(model, prompts, max_new_tokens=new,
                           temperature=0.0, stop_tokens=[], capture=capture)
  total = time.perf_counter() - start
  t = result.timings
  assert all(len(x) == new for x in result.tokens), "a row stopped early"
  host = total - t.compile_s - t.prefill_s - t.decode_s
  return dict(decode=t.decode_tokens_per_s * len(prompts), host_s=host,
              compile_s=t.compile_s)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ints = lambda s: [int(x) for x in s.split(",") if x]
  parser.add_argument("--new", type=int, default=128)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--batches", type=ints, default=[1, 8])
  args = parser.parse_args()

  print("start:", uptime(), flush=True)
  model, tokenizer = penzai_lm.load(MODEL)
  n = model.config.num_layers
  capture = [f"blocks.{i}.resid_post" for i in (n // 4, n // 2, 3 * n // 4)]
  rows = []
  for batch in args.batches:
    prompts = make_prompts(tokenizer, PROMPT_LEN, batch)
    engine = Engine()
    configs = {
        "plain": lambda r: run_once(engine, model, prompts, args.new),
        "steer": lambda r: run_once(engine, steered(model, batch, r),
                                    prompts, args.new),
        "capture": lambda r: run_once(engine, model, prompts, args.new,
                                      capture),
    }
    for name, fn in configs.items():  # Warm-up: compiles.
      fn(100)
    compiled = engine.compilations
    results = {name: [] for name in configs}
    names = list(configs)
    for r in range(args.rounds):
      for name in names[r % 3:] + names[:r % 3]:
        results[name].append(configs[name](r))
    assert engine.compilations == compiled, "a value change recompiled"
    med = {name: statistics.median(x["decode"] for x in v)
           for name, v in results.items()}
    host = {name: statistics.median(x["host_s"] for x in v)
            for name, v in results.items()}
    rows.append((batch, med, host))
    print(f"batch {batch}: " + ", ".join(
        f"{name} {med[name]:.1f} tok/s"
        f" {[round(x['decode'], 1) for x in results[name]]}"
        for name in names) + f"; load {os.getloadavg()[0]:.2f}", flush=True)

  print()
  print(f"SmolLM2-135M fp32, greedy, {args.new} new tokens, prompt"
        f" {PROMPT_LEN}, medians of {args.rounds} rotating rounds; decode"
        " tok/s aggregate over rows")
  print("batch |  plain  steer  capture | steer overhead  capture overhead |"
        " host s plain/steer/capture")
  for batch, med, host in rows:
    print(f"{batch:5d} | {med['plain']:6.1f} {med['steer']:6.1f}"
          f" {med['capture']:8.1f} | {1 - med['steer'] / med['plain']:14.1%}"
          f"  {1 - med['capture'] / med['plain']:16.1%} |"
          f" {host['plain']:.2f}/{host['steer']:.2f}/{host['capture']:.2f}")
  print(f"peak RSS {peak_rss_mb():.0f} MB")
  print("end:", uptime(), flush=True)


if __name__ == "__main__":
  main()
