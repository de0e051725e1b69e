"""Load time and peak host memory of `penzai_lm.load`; memory during generate.

Loads, each in a fresh subprocess (``--repeats`` times; the table quotes
medians): SmolLM2-135M-Instruct (Q4_1 GGUF), Gemma 3 270M (Q4_K_M GGUF) and
a generated 1.1B-parameter Llama (bfloat16 safetensors in two shards,
written once into ``--workdir``), each as float32 and as bfloat16; on
request (``--models llama8b``, for a GPU machine) a generated Llama-3-8B
(16 GB in four shards), loaded onto the default device. Per load:
wall time of ``penzai_lm.load`` (``load_model`` for the generated model,
which has no tokenizer), the process's peak RSS (VmHWM, everything
included: Python, JAX's runtime, the tokenizer; not ``ru_maxrss``, which
also counts the parent's address space that ``exec`` replaced), the
parameters' bytes, and the peak over the parameters' bytes. ``--dtypes``
may name ``keep``: the GGUF models loaded with ``quantize="keep"`` (their
own blocks, float32 activations). A first row
gives the fixed cost: ``import penzai_lm`` plus one tiny JAX op.

Then the memory of greedy ``generate`` (``--rows`` rows of a 64-token
prompt, ``--new`` new tokens, so a KV cache of the planner's bucketed shape)
for the two GGUF models: device memory from
``jax.devices()[0].memory_stats()`` where the backend has it; on CPU it
returns None, and the script measures host RSS instead (the device is the
host): RSS after the load minus before it (weights), the KV cache's bytes
(computed from its shape), and the peak RSS above the post-load level during
a first call (compiles) and a second (warm) call, the peak reset in between
(``/proc/self/clear_refs``). The process's peak RSS is then set against what
it needs: the weights, the KV cache and a fixed cost, the peak of a
"narrow twin" process that runs the same request on the same architecture
(every layer, head and feature, the same tokenizer) at tiny widths, so that
it compiles and runs the same programs with almost no weights. What XLA
takes to compile a generation program does not grow with the weights:
SmolLM2's two programs take ~0.3 GB while they compile.

The machine may be shared: ``uptime`` is printed at the start and the end.

Usage:
  python benchmarks/load_and_memory.py [--repeats 3] [--workdir DIR] \
      [--models smollm2,gemma3,llama1b] [--dtypes float32,bfloat16,keep]
  GPU machine: python benchmarks/load_and_memory.py --models llama8b \
      --dtypes bfloat16 --repeats 1 --skip-generate
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # for tests.loading.synthetic_checkpoints

MODELS = {
    "smollm2": "smollm2-135m-instruct",
    "gemma3": "gemma3-270m",
    "llama1b": None,  # generated into --workdir
    "llama8b": None,  # generated too; not a default (16 GB): a GPU machine's
}
# The generated checkpoints: `write_random_llama`'s config and shards.
GENERATED = {
    "llama1b": ({}, 2),  # its default: ~1.1B parameters
    "llama8b": (dict(vocab_size=128256, hidden_size=4096,
                     intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8,
                     rope_theta=500000.0), 4),  # Llama-3-8B's sizes
}

_LOAD_CHILD = r"""
import json, sys, time
args = json.loads(sys.argv[1])
start = time.perf_counter()
import jax, numpy as np
import penzai_lm
from penzai import pz
imported = time.perf_counter()
if args["what"] == "fixed":
  jax.numpy.zeros(4).block_until_ready()
  params = []
else:
  kwargs = dict(dtype=args["dtype"], quantize=args.get("quantize"))
  if args["tokenizer"]:
    model, _ = penzai_lm.load(args["what"], **kwargs)
  else:
    model = penzai_lm.load_model(args["what"], **kwargs)
  # By label: a tied embedding is one parameter used twice.
  params = {p.label: p for p in pz.select(model).at_instances_of(
      pz.ParameterValue).get_sequence()}.values()
  jax.block_until_ready([p.value.data_array for p in params])
done = time.perf_counter()
with open("/proc/self/status") as f:
  peak = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
print(json.dumps(dict(
    import_s=imported - start, load_s=done - imported, peak=peak,
    weights=sum(p.value.data_array.nbytes for p in params))))
"""

_GENERATE_CHILD = r"""
import dataclasses, json, sys
args = json.loads(sys.argv[1])
import jax, jax.numpy as jnp
import penzai_lm
from penzai import pz
from penzai_lm.checkpoints import open_checkpoint
from penzai_lm.fetch import resolve_model_path
from penzai_lm.generation import shapes
from penzai_lm.loading.config_mapping import config_from_checkpoint
from penzai_lm.model import build_transformer
from penzai_lm.model import memory
sys.path.insert(0, args["benchmarks"])
from peers.common import make_prompts

def status(key):
  with open("/proc/self/status") as f:
    return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))

def reset_peak():
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")

device = jax.devices()[0]
def device_bytes():
  stats = device.memory_stats()
  return None if not stats else stats.get("bytes_in_use")

path = resolve_model_path(args["model"])
tokenizer = penzai_lm.Tokenizer.from_gguf(path) if args["narrow"] else None
before, dev_before = status("VmRSS:"), device_bytes()
if args["narrow"]:
  # The same programs but for the widths: every layer, head and feature of
  # the model, 64-wide embeddings, a 512-token vocabulary, random weights.
  config = config_from_checkpoint(
      open_checkpoint(path), dtype=jnp.dtype(args["dtype"]))
  config = dataclasses.replace(
      config, hidden_size=64, head_dim=8, mlp_hidden_size=128,
      vocab_size=512, bos_token_id=None, eos_token_ids=(),
      pad_token_id=None, sliding_window=config.sliding_window and 8)
  model = build_transformer(config, seed=0)
else:
  model, tokenizer = penzai_lm.load(args["model"], dtype=args["dtype"])
params = {p.label: p for p in pz.select(model).at_instances_of(
    pz.ParameterValue).get_sequence()}.values()  # tied: one entry
jax.block_until_ready([p.value.data_array for p in params])
loaded, dev_loaded = status("VmRSS:"), device_bytes()
vocab = model.config.vocab_size
prompts = [[t % vocab for t in row]
           for row in make_prompts(tokenizer, 64, args["rows"])]
rows = shapes.next_power_of_two(args["rows"])
cache_len = shapes.bucket(64 + args["new"] - 1)
out = dict(
    measured="device memory_stats" if dev_before is not None else "host RSS",
    weights_bytes=sum(p.value.data_array.nbytes for p in params),
    weights_measured=(dev_loaded - dev_before if dev_before is not None
                      else loaded - before),
    kv_cache_bytes=memory.kv_cache_bytes(model.config, rows, cache_len),
    rows=rows, cache_len=cache_len)
for call in ("first", "warm"):
  if call == "warm":
    out["process_peak"] = status("VmHWM:")
  reset_peak()
  penzai_lm.generate(model, prompts, max_new_tokens=args["new"],
                     temperature=0.0, stop_tokens=[])
  if dev_before is not None:
    out[call + "_peak_above_loaded"] = (
        device.memory_stats()["peak_bytes_in_use"] - dev_loaded)
  else:
    out[call + "_peak_above_loaded"] = status("VmHWM:") - loaded
out["process_peak"] = max(out["process_peak"], status("VmHWM:"))
print(json.dumps(out))
"""


def uptime() -> str:
  return subprocess.run(["uptime"], capture_output=True, text=True,
                        check=False).stdout.strip()


def child(code: str, args: dict) -> dict:
  out = subprocess.run([sys.executable, "-c", code, json.dumps(args)],
                       capture_output=True, text=True, check=False,
                       cwd=str(ROOT), env={**os.environ,
                                           "PENZAI_LM_PROGRESS": "0"})
  if out.returncode:
    raise RuntimeError(f"child failed ({args}):\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def gb(n: float) -> str:
  return f"{n / 1e9:.2f}"


def _median(runs: list[dict], key: str) -> float:
  return statistics.median(r[key] for r in runs)


def load_rows(args, generated: dict[str, Path]) -> list[str]:
  fixed = [child(_LOAD_CHILD, dict(what="fixed")) for _ in range(args.repeats)]
  rows = [f"| fixed cost (import, 1 op) | | {gb(_median(fixed, 'peak'))} |"
          f" | | {_median(fixed, 'import_s'):.1f} (import) |"]
  for key in args.models:
    what = str(generated[key]) if key in GENERATED else MODELS[key]
    for dtype in args.dtypes:
      if dtype == "keep" and key in GENERATED:
        continue  # A safetensors checkpoint: no blocks to keep.
      quantize = "keep" if dtype == "keep" else None
      runs = [child(_LOAD_CHILD, dict(
          what=what, dtype="float32" if quantize else dtype,
          quantize=quantize, tokenizer=key not in GENERATED))
              for _ in range(args.repeats)]
      peak, weights = _median(runs, "peak"), runs[0]["weights"]
      times = [r["load_s"] for r in runs]
      rows.append(f"| {key} | {dtype} | {gb(peak)} | {gb(weights)} |"
                  f" {gb(peak - weights)} | {_median(runs, 'load_s'):.1f}"
                  f" [{min(times):.1f}-{max(times):.1f}] |")
      print(rows[-1], flush=True)
  return rows


def generate_rows(args) -> list[str]:
  rows = []
  for key in [k for k in args.models if k not in GENERATED]:
    for dtype in args.dtypes:
      if dtype == "keep":
        continue
      spec = dict(model=MODELS[key], dtype=dtype, rows=args.rows,
                  new=args.new, benchmarks=str(ROOT / "benchmarks"))
      r = child(_GENERATE_CHILD, dict(spec, narrow=False))
      fixed = child(_GENERATE_CHILD, dict(spec, narrow=True))
      # What the process needs: the weights and the KV cache, plus what the
      # narrow twin's whole process took (import, tokenizer, compiling and
      # running the same programs).
      needed = (r["weights_bytes"] + r["kv_cache_bytes"]
                + fixed["process_peak"])
      rows.append(
          f"| {key} | {dtype} | {r['measured']} | {gb(r['weights_bytes'])} |"
          f" {gb(r['weights_measured'])} | {r['kv_cache_bytes'] / 1e6:.1f}"
          f" ({r['rows']}x{r['cache_len']}) |"
          f" {gb(r['first_peak_above_loaded'])} |"
          f" {gb(r['warm_peak_above_loaded'])} | {gb(r['process_peak'])} |"
          f" {gb(fixed['process_peak'])} |"
          f" {r['process_peak'] / needed:.2f} |")
      print(rows[-1], flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  names = lambda s: [x for x in s.split(",") if x]
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--models", type=names,
                      default=["smollm2", "gemma3", "llama1b"],
                      help=f"of {list(MODELS)}")
  parser.add_argument("--dtypes", type=names, default=["float32", "bfloat16"])
  parser.add_argument("--workdir", default=None,
                      help="where generated checkpoints are written (reused"
                      " if there); default: a temporary directory")
  parser.add_argument("--rows", type=int, default=4)
  parser.add_argument("--new", type=int, default=192)
  parser.add_argument("--skip-generate", action="store_true")
  args = parser.parse_args()
  for key in args.models:
    if key not in MODELS:
      parser.error(f"unknown model {key!r}; choose from {list(MODELS)}")

  print("start:", uptime(), flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    generated = {}
    for key in [k for k in args.models if k in GENERATED]:
      # pylint: disable-next=g-import-not-at-top
      from tests.loading.synthetic_checkpoints import checkpoint_bytes
      # pylint: disable-next=g-import-not-at-top
      from tests.loading.synthetic_checkpoints import write_random_llama
      generated[key] = Path(args.workdir or tmp) / f"{key}-bf16"
      if not (generated[key] / "config.json").is_file():
        config, shards = GENERATED[key]
        write_random_llama(generated[key], config, shards=shards)
      print(f"{key}: {gb(checkpoint_bytes(generated[key]))} GB of bf16"
            f" safetensors in {generated[key]}", flush=True)
    load = load_rows(args, generated)
  print("\nLoads (one fresh process each; medians of"
        f" {args.repeats}; GB = 1e9 bytes)\n")
  print("| model | dtype | peak RSS GB | weights GB | peak - weights GB |"
        " load s [min-max] |")
  print("|---|---|---|---|---|---|")
  print("\n".join(load))
  if not args.skip_generate:
    print(f"\ngenerate: {args.rows} rows x 64-token prompt,"
          f" {args.new} new tokens, greedy\n")
    print("| model | dtype | measured | weights GB | weights measured GB |"
          " KV cache MB (rows x slots) | peak above loaded, 1st call GB |"
          " warm call GB | process peak GB | fixed cost GB (narrow twin) |"
          " peak / (weights + KV + fixed) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(generate_rows(args)))
  print("\nend:", uptime())


if __name__ == "__main__":
  main()
