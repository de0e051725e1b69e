"""Decode speed and time to first token on a GPU: penzai_lm against
transformers, on random weights of real shapes.

Shapes (`SHAPES`): SmolLM2-135M, Llama-3.2-1B and Llama-3-8B (bfloat16
weights, activations and caches; ``tiny`` for a smoke run on CPU). For each
shape, each engine runs in its own process (so that neither JAX nor torch
holds the other's memory) and reports:

* decode tok/s per row at each ``--batches`` size: greedy, ``--prompt``
  tokens in, ``--new`` out, the median of ``--repeats`` timed runs after a
  warm-up (which compiles);
* weight reads per second at batch 1 (bytes of the weights x tokens/s), as
  a fraction of the HBM read bandwidth measured first (a jitted sum over a
  4 GiB array);
* time to the first token for prompts of each ``--ttft`` length (median);
* compile seconds of the first generate, and the device's peak memory
  against the weights' bytes.

Engines: ``penzai_lm`` (a layer-stacked model, as ``load`` makes it, on the
default engine: on one GPU prompts run as cuDNN flash attention, and the
stack is unstacked for decoding, a second copy of the weights off CPU),
``penzai_lm-chain`` (`Engine(prompt_attention=None)`: penzai's own
attention layers, for the TTFT comparison), ``penzai_lm-layers`` (a
per-layer model, one copy), ``penzai_lm-scan``
(`Engine(unstack_layer_stacks=False)`: decodes the stack as a scan, one
copy), and the peers ``transformers-eager`` (``generate`` with its dynamic
cache) and ``transformers-compile`` (static cache, with which ``generate``
compiles the forward pass itself on CUDA). ``--formats int8`` adds penzai_lm with int8 weight-only quantization.
Extra XLA flags for the penzai_lm processes (``--xla-flags``) make sweeps of
XLA:GPU options one command.

Run on a GPU machine (``docs/gpu.md`` says how to set one up):

    python benchmarks/gpu_decode.py --shapes smollm2,llama1b \
        --json $OUT/small.json
    python benchmarks/gpu_decode.py --shapes llama8b --formats bf16,int8 \\
        --engines penzai_lm,transformers-compile --ttft ""

Smoke run on CPU:

    python benchmarks/gpu_decode.py --shapes tiny --formats bf16,int8 \\
        --engines penzai_lm,penzai_lm-chain --ttft 64 --new 8 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, mlp_hidden_size=128,
                 tie_embeddings=True, rope_base=10000.0),
    "smollm2": dict(vocab_size=49152, hidden_size=576, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64,
                    mlp_hidden_size=1536, tie_embeddings=True,
                    rope_base=100000.0),
    "llama1b": dict(vocab_size=128256, hidden_size=2048, num_layers=16,
                    num_heads=32, num_kv_heads=8, head_dim=64,
                    mlp_hidden_size=8192, tie_embeddings=True,
                    rope_base=500000.0),
    "llama8b": dict(vocab_size=128256, hidden_size=4096, num_layers=32,
                    num_heads=32, num_kv_heads=8, head_dim=128,
                    mlp_hidden_size=14336, tie_embeddings=False,
                    rope_base=500000.0),
}
# penzai_lm variants: (use_layer_stack of the model, Engine keywords).
PENZAI = {
    # A stacked model (what `load` returns), unstacked by the engine for
    # decoding: on a GPU the per-layer weights are a second copy.
    "penzai_lm": (True, {}),
    # The same with penzai's attention layers for prompts.
    "penzai_lm-chain": (True, dict(prompt_attention=None)),
    # A per-layer model (`load(use_layer_stack=False)`): one copy.
    "penzai_lm-layers": (False, {}),
    # A stacked model decoded as a scan over its stack: one copy.
    "penzai_lm-scan": (True, dict(unstack_layer_stacks=False)),
}
ENGINES = (*PENZAI, "transformers-eager", "transformers-compile")


def _median(xs):
  return statistics.median(xs) if xs else float("nan")


def _prompts(vocab: int, length: int, rows: int, seed: int = 0):
  import numpy as np  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  return rng.integers(3, vocab, (rows, length)).tolist()


# --- children -------------------------------------------------------------


def bandwidth_child(spec: dict) -> dict:
  """HBM read bandwidth: a jitted sum over a large bfloat16 array."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  gpu = jax.devices()[0].platform == "gpu"
  n = (4 << 30 if gpu else 256 << 20) // 2
  x = jnp.ones((n // 4096, 4096), jnp.bfloat16)
  total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
  total(x).block_until_ready()
  times = []
  for _ in range(spec["repeats"] + 5):
    start = time.perf_counter()
    total(x).block_until_ready()
    times.append(time.perf_counter() - start)
  return dict(read_gb_s=x.nbytes / min(times) / 1e9,
              device=str(jax.devices()[0].device_kind))


def penzai_child(spec: dict) -> dict:
  """penzai_lm.generate on a random model of the shape, on the default
  device."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import penzai_lm  # pylint: disable=g-import-not-at-top
  from penzai_lm import quantization  # pylint: disable=g-import-not-at-top
  from penzai_lm.generation import Engine  # pylint: disable=g-import-not-at-top
  from penzai_lm.model import TransformerConfig  # pylint: disable=g-import-not-at-top
  from penzai_lm.model import build_transformer  # pylint: disable=g-import-not-at-top

  stacked, engine_kwargs = PENZAI[spec["engine"]]
  shape = SHAPES[spec["shape"]]
  config = TransformerConfig(family="llama", **shape,
                             parameter_dtype=jnp.bfloat16,
                             activation_dtype=jnp.bfloat16,
                             use_layer_stack=stacked)
  start = time.perf_counter()
  model = build_transformer(config, seed=0, on_device=True)
  jax.block_until_ready(model)
  out = dict(build_s=time.perf_counter() - start)
  if spec["format"] != "bf16":
    start = time.perf_counter()
    model = quantization.quantize(model, spec["format"])
    jax.block_until_ready(model)
    out["quantize_s"] = time.perf_counter() - start
  out["weight_bytes"] = sum(x.nbytes for x in jax.tree_util.tree_leaves(model)
                            if hasattr(x, "nbytes"))
  engine = Engine(**engine_kwargs)
  greedy = dict(temperature=0.0, stop_tokens=[])

  def timed(prompts, new):
    first = engine.generate(model, prompts, max_new_tokens=new, **greedy)
    runs = [engine.generate(model, prompts, max_new_tokens=new,
                            **greedy).timings for _ in range(spec["repeats"])]
    return first.timings, runs

  out["decode"] = {}
  for rows in spec["batches"]:
    first, runs = timed(_prompts(config.vocab_size, spec["prompt"], rows),
                        spec["new"])
    out["decode"][rows] = dict(
        tok_s=_median([t.decode_tokens_per_s for t in runs]),
        ttft_s=_median([t.time_to_first_token_s for t in runs]),
        compile_s=first.compile_s)
  out["ttft"] = {}
  for length in spec["ttft"]:
    first, runs = timed(_prompts(config.vocab_size, length, 1), 2)
    out["ttft"][length] = dict(
        s=_median([t.time_to_first_token_s for t in runs]),
        compile_s=first.compile_s)
  stats = jax.devices()[0].memory_stats() or {}
  out["peak_device_bytes"] = stats.get("peak_bytes_in_use")
  return out


def transformers_child(spec: dict) -> dict:
  """transformers' generate on a random LlamaForCausalLM of the shape."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from peers.transformers_engine import _TokenClock  # pylint: disable=g-import-not-at-top

  shape = SHAPES[spec["shape"]]
  device = "cuda" if torch.cuda.is_available() else "cpu"
  cfg = transformers.LlamaConfig(
      vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
      intermediate_size=shape["mlp_hidden_size"],
      num_hidden_layers=shape["num_layers"],
      num_attention_heads=shape["num_heads"],
      num_key_value_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
      tie_word_embeddings=shape["tie_embeddings"],
      rope_theta=shape["rope_base"], max_position_embeddings=16384)
  start = time.perf_counter()
  # Built in bfloat16 on the device: no float32 copy (32 GB for 8B).
  torch.set_default_dtype(torch.bfloat16)
  with torch.device(device):
    model = transformers.LlamaForCausalLM(cfg).eval()
  torch.set_default_dtype(torch.float32)
  out = dict(build_s=time.perf_counter() - start)
  out["weight_bytes"] = sum(p.numel() * p.element_size()
                            for p in model.parameters())
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  if spec["engine"] == "transformers-compile":
    # A static cache makes generate compile the forward pass itself on
    # CUDA (transformers' auto-compile: fullgraph, "reduce-overhead"), as
    # its users run it. Wrapping `model.forward` in torch.compile besides
    # failed on an H200 with transformers 5.17 and torch 2.11 ("accessing
    # tensor output of CUDAGraphs that has been overwritten").
    model.generation_config.cache_implementation = "static"
  clock = _TokenClock(model)

  def run(prompts, new):
    ids = torch.tensor(prompts, device=device)
    clock.reset()
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids),
                   max_new_tokens=new, do_sample=False,
                   stopping_criteria=transformers.StoppingCriteriaList(
                       [clock.criterion()]))
    if device == "cuda":
      torch.cuda.synchronize()
    times = clock.token_times
    steps = len(times) - 1
    return dict(total_s=time.perf_counter() - start,
                ttft_s=times[0] - clock.prefill_start,
                tok_s=steps / (times[-1] - times[0]) if steps else None)

  def timed(prompts, new):
    start = time.perf_counter()
    run(prompts, new)  # warm-up (compiles)
    warm = time.perf_counter() - start
    return warm, [run(prompts, new) for _ in range(spec["repeats"])]

  with torch.inference_mode():
    out["decode"] = {}
    for rows in spec["batches"]:
      warm, runs = timed(_prompts(cfg.vocab_size, spec["prompt"], rows),
                         spec["new"])
      out["decode"][rows] = dict(
          tok_s=_median([r["tok_s"] for r in runs]),
          ttft_s=_median([r["ttft_s"] for r in runs]), warmup_s=warm)
    out["ttft"] = {}
    for length in spec["ttft"]:
      warm, runs = timed(_prompts(cfg.vocab_size, length, 1), 2)
      out["ttft"][length] = dict(s=_median([r["ttft_s"] for r in runs]),
                                 warmup_s=warm)
  if device == "cuda":
    out["peak_device_bytes"] = torch.cuda.max_memory_allocated()
  return out


def child_main(spec: dict) -> dict:
  if spec["engine"] == "bandwidth":
    return bandwidth_child(spec)
  if spec["engine"].startswith("penzai_lm"):
    return penzai_child(spec)
  return transformers_child(spec)


# --- parent ---------------------------------------------------------------


def run_child(spec: dict, xla_flags: str) -> dict | None:
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  if xla_flags and spec["engine"].startswith("penzai_lm"):
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
  proc = subprocess.run(
      [sys.executable, __file__, "--child", json.dumps(spec)],
      capture_output=True, text=True, env=env, check=False)
  if proc.returncode:
    print(f"  {spec['engine']} {spec.get('shape', '')} failed:\n"
          + proc.stderr[-3000:], file=sys.stderr)
    return None
  return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt(x, spec=".0f"):
  return "-" if x is None or x != x else format(x, spec)


def report(shape: str, results: list[tuple[str, str, dict]], bandwidth: float,
           args) -> None:
  print(f"\n## {shape}: prompt {args.prompt}, {args.new} new tokens, greedy")
  head = (f"{'engine':22} {'fmt':5} "
          + " ".join(f"{'b' + str(b) + ' tok/s':>10}" for b in args.batches)
          + f" {'GB/s':>6} {'of HBM':>6} "
          + " ".join(f"{'ttft ' + str(n):>10}" for n in args.ttft)
          + f" {'compile s':>9} {'peak/weights':>12}")
  print(head)
  for engine, fmt, r in results:
    b1 = r["decode"].get(str(args.batches[0]), {}).get("tok_s")
    gbs = r["weight_bytes"] * b1 / 1e9 if b1 else None
    peak = r.get("peak_device_bytes")
    compile_s = r["decode"].get(str(args.batches[0]), {}).get(
        "compile_s", r["decode"].get(str(args.batches[0]), {}).get(
            "warmup_s"))
    print(f"{engine:22} {fmt:5} "
          + " ".join(f"{_fmt(r['decode'][str(b)]['tok_s']):>10}"
                     for b in args.batches)
          + f" {_fmt(gbs):>6} {_fmt(gbs and 100 * gbs / bandwidth, '.0f'):>5}%"
          + " " + " ".join(f"{_fmt(1e3 * r['ttft'][str(n)]['s'], '.1f'):>8}ms"
                           for n in args.ttft)
          + f" {_fmt(compile_s, '.1f'):>9}"
          + f" {_fmt(peak and peak / r['weight_bytes'], '.2f'):>12}")


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  parser.add_argument("--shapes", default="smollm2,llama1b,llama8b")
  parser.add_argument("--engines", default=",".join(ENGINES))
  parser.add_argument("--formats", default="bf16",
                      help="penzai_lm weight formats: bf16, int8, q8_0, ...")
  parser.add_argument("--batches", default="1,8")
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--new", type=int, default=128)
  parser.add_argument("--ttft", default="1024,4096,8192",
                      help="prompt lengths for the time to first token")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--xla-flags", default="",
                      help="appended to XLA_FLAGS in penzai_lm processes")
  parser.add_argument("--json", default=None, help="write all figures here")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(child_main(json.loads(args.child))))
    return
  shapes = [s for s in args.shapes.split(",") if s]
  engines = [e for e in args.engines.split(",") if e]
  for name, known in (("shape", SHAPES), ("engine", ENGINES)):
    for value in shapes if name == "shape" else engines:
      if value not in known:
        parser.error(f"unknown {name} {value!r}; choose from {list(known)}")
  args.batches = [int(b) for b in args.batches.split(",") if b]
  args.ttft = [int(n) for n in args.ttft.split(",") if n]
  formats = [f for f in args.formats.split(",") if f]
  base = dict(prompt=args.prompt, new=args.new, batches=args.batches,
              ttft=args.ttft, repeats=args.repeats)
  bandwidth = run_child(dict(engine="bandwidth", repeats=args.repeats), "")
  print(f"device: {bandwidth['device']}; measured read bandwidth"
        f" {bandwidth['read_gb_s']:.0f} GB/s")
  everything = dict(bandwidth=bandwidth, args=vars(args), shapes={})
  for shape in shapes:
    results = []
    for engine in engines:
      for fmt in (formats if engine in PENZAI else ["bf16"]):
        r = run_child(dict(base, engine=engine, shape=shape, format=fmt),
                      args.xla_flags)
        if r is not None:
          results.append((engine, fmt, r))
    report(shape, results, bandwidth["read_gb_s"], args)
    everything["shapes"][shape] = [dict(engine=e, format=f, **r)
                                   for e, f, r in results]
  if args.json:
    with open(args.json, "w") as f:
      json.dump(everything, f, indent=1)


if __name__ == "__main__":
  main()
