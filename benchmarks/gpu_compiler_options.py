"""Decode speed on a GPU under XLA:GPU compile options, in one process.

The question: how much of a small model's decode step on a GPU is launch
overhead, and do XLA's command buffers (CUDA graphs) take it away? Each
variant in `VARIANTS` is an `Engine(compiler_options=...)` over the same
model (random bfloat16 weights of a real shape, `gpu_decode.SHAPES`, one
copy of the weights: a per-layer model):

* ``default``: the engine's default options (XLA's defaults on a GPU);
* ``cb-off``: ``xla_gpu_enable_command_buffer=""``: every kernel launched
  on its own;
* ``cb-while``: command buffers for fusions, library calls and custom
  calls, and for ``while`` and ``conditional`` too (the decode loop's body
  becomes one graph), from a single command up
  (``xla_gpu_graph_min_graph_size=1``).

Per shape and batch (``--plan smollm2:1,8/llama1b:1``): one warm-up per
variant (compiles the prefill and the decode loop), then ``--rounds``
rounds of greedy decoding (128-token random prompts, ``--new`` tokens),
alternating the variants' order; the table quotes each variant's median
decode tok/s per row, the step time, and the weights read per second
against the card's read bandwidth (a jitted sum over 4 GiB, measured
first). ``--trace DIR`` writes a Perfetto trace of a 32-token generate of
the first shape at batch 1 for each variant (``trace-<variant>.json.gz``);
``--ttft 8192`` times the first token of long prompts on the last shape
(the first variant; a prompt is cut to the context less the 2 new tokens).

Run on a GPU machine (``docs/gpu.md``):

    python benchmarks/gpu_compiler_options.py --json options.json --trace . \\
        --ttft 8192

Smoke run on CPU:

    python benchmarks/gpu_compiler_options.py --plan tiny:1 --new 8 \\
        --rounds 1
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position
from gpu_decode import SHAPES
from gpu_decode import _prompts
from gpu_decode import bandwidth_child
from penzai_lm.generation import Engine
from penzai_lm.model import TransformerConfig
from penzai_lm.model import build_transformer

_LIBRARIES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
VARIANTS = {
    "default": None,
    "cb-off": {"xla_gpu_enable_command_buffer": ""},
    "cb-while": {"xla_gpu_enable_command_buffer":
                 _LIBRARIES + ",CONDITIONAL,WHILE",
                 "xla_gpu_graph_min_graph_size": 1},
}
GREEDY = dict(temperature=0.0, stop_tokens=[])


def engine_for(options) -> Engine:
  if options is None:
    return Engine()
  return Engine(compiler_options=lambda program, shape: dict(options))


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  parser.add_argument("--plan", default="smollm2:1,8/llama1b:1",
                      help="shape:batches, separated by '/'")
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--new", type=int, default=128)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--trace", default=None,
                      help="folder for Perfetto traces (first shape, b1)")
  parser.add_argument("--ttft", default="",
                      help="prompt lengths for first-token times (last shape)")
  parser.add_argument("--json", default=None)
  args = parser.parse_args()
  plan = {}
  for item in args.plan.split("/"):
    shape, _, batches = item.partition(":")
    if shape not in SHAPES:
      parser.error(f"unknown shape {shape!r}; choose from {list(SHAPES)}")
    plan[shape] = [int(b) for b in batches.split(",") if b]
  variants = [v for v in args.variants.split(",") if v]
  for v in variants:
    if v not in VARIANTS:
      parser.error(f"unknown variant {v!r}; choose from {list(VARIANTS)}")

  bandwidth = bandwidth_child(dict(repeats=3))["read_gb_s"]
  print(f"device {jax.devices()[0].device_kind}: read {bandwidth:.0f} GB/s",
        flush=True)
  results = dict(read_gb_s=bandwidth, device=jax.devices()[0].device_kind)
  for index, (shape, batches) in enumerate(plan.items()):
    config = TransformerConfig(family="llama", **SHAPES[shape],
                               parameter_dtype=jnp.bfloat16,
                               activation_dtype=jnp.bfloat16,
                               use_layer_stack=False)
    model = build_transformer(config, seed=0, on_device=True)
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(model)
                       if hasattr(x, "nbytes"))
    engines = {v: engine_for(VARIANTS[v]) for v in variants}
    for rows in batches:
      prompts = _prompts(config.vocab_size, 128, rows)
      compile_s = {}
      for name, engine in engines.items():
        first = engine.generate(model, prompts, max_new_tokens=args.new,
                                **GREEDY)
        compile_s[name] = first.timings.compile_s
      tok_s = {name: [] for name in engines}
      for round_ in range(args.rounds):
        order = list(engines)[::(-1 if round_ % 2 else 1)]
        for name in order:
          timings = engines[name].generate(
              model, prompts, max_new_tokens=args.new, **GREEDY).timings
          tok_s[name].append(timings.decode_tokens_per_s)
      for name in engines:
        median = statistics.median(tok_s[name])
        reads = weight_bytes * median / 1e9
        print(f"{shape} b{rows} {name:9} {median:8.1f} tok/s/row"
              f" ({', '.join(f'{t:.0f}' for t in tok_s[name])}),"
              f" step {1e3 / median:.3f} ms, weights {reads:.0f} GB/s ="
              f" {100 * reads / bandwidth:.0f}% of read,"
              f" compile {compile_s[name]:.1f} s", flush=True)
        results[f"{shape}/b{rows}/{name}"] = dict(
            tok_s=tok_s[name], compile_s=compile_s[name],
            weight_bytes=weight_bytes)
    if index == 0 and args.trace:
      prompts = _prompts(config.vocab_size, 128, 1)
      for name, engine in engines.items():
        folder = os.path.join(args.trace, f"profile-{name}")
        with jax.profiler.trace(folder, create_perfetto_trace=True):
          engine.generate(model, prompts, max_new_tokens=32, **GREEDY)
        for path in glob.glob(f"{folder}/**/perfetto_trace.json.gz",
                              recursive=True):
          shutil.copy(path, os.path.join(args.trace, f"trace-{name}.json.gz"))
        shutil.rmtree(folder, ignore_errors=True)
    if index == len(plan) - 1 and args.ttft:
      engine = next(iter(engines.values()))
      for length in [int(n) for n in args.ttft.split(",") if n]:
        # The prompt and its 2 new tokens fit the model's context.
        length = min(length, config.max_position_embeddings - 2)
        prompts = _prompts(config.vocab_size, length, 1)
        first = engine.generate(model, prompts, max_new_tokens=2, **GREEDY)
        times = [engine.generate(model, prompts, max_new_tokens=2, **GREEDY)
                 .timings.time_to_first_token_s for _ in range(3)]
        print(f"{shape} first token after {length} tokens:"
              f" {1e3 * statistics.median(times):.1f} ms"
              f" ({', '.join(f'{1e3 * t:.1f}' for t in times)}),"
              f" compile {first.timings.compile_s:.1f} s", flush=True)
        results[f"{shape}/ttft{length}"] = times
    del model, engines
    if args.json:
      with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
