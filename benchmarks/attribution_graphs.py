"""Attribution graphs by prompt length: penzai_lm.circuits vs circuit-tracer.

On the same CPU, with the same model, transcoders, prompt and settings,
each side builds the attribution graph of a prompt of each of
``--lengths`` tokens in a fresh process, prunes and scores it; one
invocation prints a markdown table of time and peak memory by length
(details follow it) and checks that the graphs are the same.

* Model: SmolLM2-135M-Instruct, penzai_lm's default GGUF file, dequantized
  by transformers to float32 and saved as a Hugging Face directory whose
  path holds no "llama" (TransformerLens takes such paths for hub names),
  with ``rope_theta`` also at the top of ``config.json`` (transformers 4.57,
  circuit-tracer's, reads it there).
* Transcoders: random JumpReLU per-layer transcoders (``--features`` per
  block, ``mlp.hook_in`` -> ``hook_mlp_out``) in circuit-tracer's
  transcoder-set layout; each layer's thresholds are the (1 - active/F)
  quantile of its pre-activations on the longest prompt's MLP inputs
  (positions 1..T-1), times a per-feature uniform(0.98, 1.02) jitter, so
  about ``--active`` features fire per position (real transcoders: tens).
* Prompt: the BOS id, then `circuits_long_prompts.TEXT` repeated and
  tokenized, cut to each length (shorter prompts are prefixes).
* Sides, one after the other: circuit-tracer 0.5 in
  `peers/circuit_tracer_child.py` (the virtualenv of
  `peers/setup_circuit_tracer.sh`, TransformerLens backend); penzai_lm in
  this file with ``--side penzai``. Each calls ``attribute`` ``--runs``
  times (default 1: penzai_lm's time includes compilation, "time to graph
  in a fresh process"), then ``prune_graph`` and ``compute_graph_scores``.
* Memory: each child's ``ru_maxrss`` right after the scores, before any
  output is built. A watchdog polls the child's VmRSS and MemAvailable
  every 0.5 s and kills it past ``--memory-limit-gb`` or under 1 GB
  available (the table says "stopped at X GB").
* Comparison: safetensors files (no pickle); circuit-tracer's dense
  ``[n_nodes, n_nodes]`` adjacency is read in row blocks against
  penzai_lm's ``edges`` rows; the files are deleted after each length.

Not part of CI (minutes to hours; run on a quiet machine). Usage:
  bash benchmarks/peers/setup_circuit_tracer.sh   # once
  python benchmarks/attribution_graphs.py [--lengths 64,256,1024]
      [--features 4096] [--active 16] [--max-feature-nodes 512]
      [--batch-size 32] [--runs 1] [--memory-limit-gb 20]
      [--max-memory-bytes B] [--keep DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file
import yaml

import circuits_long_prompts
from peers import graph_compare
from peers import watched
import penzai_lm
from penzai_lm import circuits
from penzai_lm.fetch import resolve_model_path
from penzai_lm.sae import load_transcoders

PEER_PYTHON = (Path.home() / ".cache/penzai_lm/peers/circuit-tracer-venv"
               / "bin/python")
CHILD = Path(__file__).resolve().parent / "peers/circuit_tracer_child.py"


def prepare(args) -> None:
  """``--side prepare``: the model directory, the calibrated transcoders
  and the prompt ids (``prompt.json``) under ``args.out``."""
  # torch and transformers only in this child: the penzai_lm child, which
  # imports this file, must not load them (its peak RSS is measured).
  import torch
  import transformers
  out = args.out
  path = resolve_model_path()
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      path.parent, gguf_file=path.name, dtype=torch.float32).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(
      path.parent, gguf_file=path.name)
  del hf.config.quantization_config  # Dequantized: save it as float32.
  hf.hf_quantizer = None
  hf.config.architectures = ["LlamaForCausalLM"]
  model_dir = out / "smollm2-135m"
  hf.save_pretrained(model_dir, safe_serialization=True)
  tokenizer.save_pretrained(model_dir)
  config = json.loads((model_dir / "config.json").read_text())
  config["rope_theta"] = hf.config.rope_parameters["rope_theta"]
  (model_dir / "config.json").write_text(json.dumps(config, indent=2))
  text = circuits_long_prompts.TEXT * (args.length // 40 + 2)
  ids = [tokenizer.bos_token_id, *tokenizer.encode(
      text, add_special_tokens=False)][:args.length]
  inputs = []
  hooks = [layer.mlp.register_forward_pre_hook(
      lambda _, a: inputs.append(a[0][0, 1:].numpy().copy()))
           for layer in hf.model.layers]
  with torch.no_grad():
    hf(torch.tensor([ids]))
  for hook in hooks:
    hook.remove()
  del hf
  active = write_transcoders(out / "transcoders", inputs, args)
  (out / "prompt.json").write_text(json.dumps(
      {"ids": ids, "calibrated_active_per_position": active}))


def write_transcoders(out: Path, inputs: list[np.ndarray], args) -> float:
  """Random JumpReLU transcoders (circuit-tracer's layout) whose
  thresholds let about ``args.active`` of ``args.features`` fire per
  position of ``inputs`` (``[positions, d]`` per layer); returns the mean
  active count per position and layer on ``inputs``."""
  out.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(args.seed)
  f, counts, files = args.features, [], []
  for layer, x in enumerate(inputs):
    d = x.shape[1]
    w_enc = rng.normal(0, 1 / np.sqrt(d), (f, d)).astype(np.float32)
    b_enc = rng.normal(0, 0.1, f).astype(np.float32)
    pre = x @ w_enc.T + b_enc
    threshold = (np.quantile(pre, 1 - args.active / f)
                 * rng.uniform(0.98, 1.02, f)).astype(np.float32)
    counts.append(float((pre > threshold).sum(axis=1).mean()))
    name = f"layer_{layer}.safetensors"
    save_file({
        "W_enc": w_enc, "b_enc": b_enc,
        "W_dec": rng.normal(0, 0.3 / np.sqrt(d), (f, d)).astype(np.float32),
        "b_dec": rng.normal(0, 0.05, d).astype(np.float32),
        "activation_function.threshold": threshold,
    }, str(out / name))
    files.append(name)
  (out / "config.yaml").write_text(yaml.safe_dump({
      "model_kind": "transcoder_set", "scan": "penzai_lm-benchmark",
      "feature_input_hook": "mlp.hook_in",
      "feature_output_hook": "hook_mlp_out", "transcoders": files}))
  return float(np.mean(counts))


def run_penzai(args) -> None:
  """``--side penzai``: penzai_lm's graph, pruned and scored, to
  ``args.out`` (``edges`` rows and the compact edge mask, not the square
  matrix)."""
  jax.config.update("jax_default_matmul_precision", "highest")
  model = penzai_lm.load_model(args.model)
  transcoders = load_transcoders(args.transcoders, model=model)
  prompt = [int(t) for t in args.prompt.split(",")]
  rss_before = _rss_mb()
  times, cpu = [], []
  for _ in range(args.runs):
    start, start_cpu = time.perf_counter(), time.process_time()
    graph = circuits.attribute(
        model, transcoders, prompt, max_n_logits=args.max_n_logits,
        desired_logit_prob=args.desired_logit_prob,
        batch_size=args.batch_size, max_feature_nodes=args.max_feature_nodes,
        max_memory_bytes=args.max_memory_bytes)
    times.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
  pruned = circuits.prune_graph(graph)
  replacement, completeness = circuits.compute_graph_scores(graph)
  peak_rss, done_at = _rss_mb(), time.time()
  arrays = {name: np.ascontiguousarray(getattr(graph, name)) for name in (
      "input_tokens", "active_features", "activation_values",
      "selected_features", "logit_tokens", "logit_probabilities", "edges")}
  arrays.update(node_mask=pruned.node_mask.astype(np.uint8),
                edge_mask=pruned.edge_mask.astype(np.uint8),
                cumulative_scores=pruned.cumulative_scores)
  result = {"replacement": replacement, "completeness": completeness,
            "seconds": times, "cpu_seconds": cpu, "rss_before_mb": rss_before,
            "peak_rss_mb": peak_rss, "done_at": done_at,
            "n_nodes": graph.n_nodes, "jax": jax.__version__}
  save_file(arrays, str(args.out), metadata={"result": json.dumps(result)})


def _rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(length: int, ids: list[int], tmp: Path, args) -> dict:
  """One length: circuit-tracer's child, then penzai_lm's, then the
  comparison; the result files are deleted afterwards."""
  prompt = ",".join(map(str, ids[:length]))
  common = ["--model", str(tmp / "smollm2-135m"),
            "--transcoders", str(tmp / "transcoders/config.yaml"),
            "--prompt", prompt, "--max-n-logits", str(args.max_n_logits),
            "--desired-logit-prob", str(args.desired_logit_prob),
            "--batch-size", str(args.batch_size),
            "--max-feature-nodes", str(args.max_feature_nodes),
            "--runs", str(args.runs)]
  theirs = tmp / f"theirs_{length}.safetensors"
  ours = tmp / f"ours_{length}.safetensors"
  penzai_extra = ([f"--max-memory-bytes={args.max_memory_bytes}"]
                  if args.max_memory_bytes else [])
  sides = {
      "ct": [str(args.peer_python), str(CHILD), *common, "--out",
             str(theirs)],
      "pz": [sys.executable, __file__, "--side", "penzai", *common,
             *penzai_extra, "--out", str(ours)],
  }
  out = {"tokens": length}
  for side, cmd in sides.items():
    log = tmp / f"{side}_{length}.log"
    run = watched.run_watched(cmd, log, args.memory_limit_gb)
    out[side] = run
    if run["stopped"] or run["rc"]:
      run["error"] = run["stopped"] or (
          f"exit {run['rc']}: " + log.read_text()[-2000:].strip())
      continue
    _, result = graph_compare.read(theirs if side == "ct" else ours, ())
    run.update(result, process_s=result["done_at"] - run["started"])
  if "error" not in out["ct"] and "error" not in out["pz"]:
    out["compare"] = graph_compare.compare(ours, theirs, tmp / "transcoders")
  for path in (ours, theirs):
    path.unlink(missing_ok=True)
  return out


def row(r: dict) -> str:
  """A markdown table row of `measure`'s result."""
  ct, pz, c = r["ct"], r["pz"], r.get("compare", {})
  both = "seconds" in ct and "seconds" in pz
  cells = [r["tokens"], c.get("n_active", ""), pz.get("n_nodes", ""),
           *(f"{s['seconds'][0]:.1f}" if "seconds" in s else
             s["error"].splitlines()[0][:60] for s in (ct, pz)),
           f"{ct['seconds'][0] / pz['seconds'][0]:.1f}x" if both else "",
           *(f"{s['process_s']:.1f}" if "process_s" in s else ""
             for s in (ct, pz)),
           *(f"{s['peak_rss_mb']:.0f}" if "peak_rss_mb" in s else
             s.get("stopped") or "" for s in (ct, pz)),
           f"{pz['peak_rss_mb'] / ct['peak_rss_mb']:.2f}" if both else "",
           ("yes" if c["same"] else f"NO ({c['why']})") + (
               f" ({c['adjacency_rel']:.1e})" if "adjacency_rel" in c
               else "") + (f"; {c['active_differ']} features active on one"
                           " side only" if c["active_differ"] else "")
           if c else ""]
  return "| " + " | ".join(map(str, cells)) + " |"


def details(r: dict) -> str:
  """The per-length lines after the table."""
  ct, pz, c = r["ct"], r["pz"], r.get("compare", {})
  lines = [f"{r['tokens']} tokens:"]
  if "tl_vs_hf_max_abs_logit" in ct:
    lines.append(f"  TransformerLens vs transformers last logits, max abs"
                 f" diff: {ct['tl_vs_hf_max_abs_logit']:.2e}")
  for name, side in (("circuit-tracer", ct), ("penzai_lm", pz)):
    if "seconds" in side:
      lines.append(
          f"  {name}: attribute s {[round(s, 2) for s in side['seconds']]},"
          f" cpu s {[round(s, 2) for s in side['cpu_seconds']]}, RSS before"
          f" attribute {side['rss_before_mb']:.0f} MB, peak"
          f" {side['peak_rss_mb']:.0f} MB (watchdog saw"
          f" {side['max_rss_gb']:.2f} GB), replacement"
          f" {side['replacement']:.6f}, completeness"
          f" {side['completeness']:.6f}; 1-min load average at its end"
          f" {side['load']:.1f}")
    else:
      lines.append(f"  {name}: {side['error']}")
  if c:
    lines.append(
        f"  features active on one side only: {c['active_differ']} of"
        f" {c['n_active']} (largest (activation - threshold) / threshold"
        f" {c['active_margin']:.1e})")
  if "adjacency_rel" in c:
    lines.append(
        f"  activations (both sides' active features) max rel diff"
        f" {c['activation_rel']:.1e}; adjacency"
        f" max |diff|/max|A| {c['adjacency_rel']:.1e}, allclose(rtol=1e-4,"
        f" atol=1e-4*max|A|) {c['adjacency_close']}; pruned nodes"
        f" {c['nodes_kept']} kept, {c['nodes_differ']} differ; pruned edges"
        f" {c['edges_kept']} kept, {c['edges_differ']} differ; cumulative"
        f" scores (sorted) max diff {c['cumulative_diff']:.1e}")
  elif c:
    lines.append(f"  graphs differ: {c['why']}")
  return "\n".join(lines)


def header(args, prep: dict) -> str:
  """The lines above the table: machine, versions, settings."""
  flags = Path("/proc/cpuinfo").read_text()
  cpu = flags.split("model name", 1)[-1].split("\n", 1)[0].strip(" :\t")
  threads = subprocess.run(
      [str(args.peer_python), "-c",
       "import torch; print(torch.get_num_threads(), torch.__version__)"],
      capture_output=True, text=True, check=True).stdout.split()
  return "\n".join([
      f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC};"
      f" {shlex.join([sys.executable, *sys.argv])}",
      f"CPU: {cpu}, {os.cpu_count()} cores; avx512_vnni"
      f" {'avx512_vnni' in flags}, avx512_bf16 {'avx512_bf16' in flags};"
      f" torch {threads[1]} ({threads[0]} threads), JAX {jax.__version__}",
      f"SmolLM2-135M-Instruct float32 (dequantized GGUF); JumpReLU"
      f" transcoders, {args.features} features per block, thresholds for"
      f" {args.active} active per position (measured on the longest prompt:"
      f" {prep['calibrated_active_per_position']:.1f}); max_feature_nodes"
      f" {args.max_feature_nodes}, batch_size {args.batch_size},"
      f" max_n_logits {args.max_n_logits}, desired_logit_prob"
      f" {args.desired_logit_prob}, runs {args.runs}, penzai_lm"
      f" max_memory_bytes {args.max_memory_bytes}",
      "Times: the first attribute call in a fresh process (penzai_lm's"
      " includes compilation); process s: from the child's start to its"
      " scores.",
      "",
      "| tokens | active features | nodes | circuit-tracer s | penzai_lm s |"
      " speed-up | circuit-tracer process s | penzai_lm process s |"
      " circuit-tracer peak RSS MB | penzai_lm peak RSS MB | memory ratio |"
      " same graph? (max rel adjacency diff) |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|"])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--side", choices=("prepare", "penzai"),
                      help=argparse.SUPPRESS)
  for hidden in ("--model", "--transcoders", "--out"):
    parser.add_argument(hidden, type=Path, help=argparse.SUPPRESS)
  parser.add_argument("--prompt", help=argparse.SUPPRESS)
  parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
  parser.add_argument("--lengths", default="64,256,1024")
  for flag, default in (("features", 4096), ("active", 16),
                        ("max-feature-nodes", 512), ("batch-size", 32),
                        ("max-n-logits", 10), ("runs", 1), ("seed", 0)):
    parser.add_argument(f"--{flag}", type=int, default=default)
  parser.add_argument("--desired-logit-prob", type=float, default=0.95)
  parser.add_argument("--max-memory-bytes", type=int, default=None,
                      help="penzai_lm's budget (attribute's max_memory_bytes)")
  parser.add_argument("--memory-limit-gb", type=float, default=20.0)
  parser.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
  parser.add_argument("--keep", type=Path, default=None,
                      help="prepare the model and transcoders here (reused"
                      " when prepared with the same settings)")
  args = parser.parse_args()
  if args.side == "prepare":
    prepare(args)
    return
  if args.side == "penzai":
    run_penzai(args)
    return
  lengths = _check(parser, args)
  with tempfile.TemporaryDirectory(prefix="attribution-graphs-") as tmp:
    tmp = args.keep or Path(tmp)
    prep = _prepared(tmp, max(lengths), args)
    print(header(args, prep), flush=True)
    results = []
    for length in lengths:
      results.append(measure(length, prep["ids"], tmp, args))
      print(row(results[-1]), flush=True)
    print()
    for r in results:
      print(details(r), flush=True)


def _check(parser, args) -> list[int]:
  """The lengths, after checking the arguments (exits on a bad one)."""
  try:
    lengths = sorted({int(n) for n in args.lengths.split(",")})
  except ValueError:
    parser.error(f"--lengths takes comma-separated token counts, e.g."
                 f" 64,256; got {args.lengths!r}.")
  if lengths[0] < 2:
    parser.error("--lengths must be at least 2 (BOS and one token).")
  for name in ("features", "active", "max_feature_nodes", "batch_size",
               "runs", "max_n_logits"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be at least 1.")
  if args.active >= args.features:
    parser.error("--active must be smaller than --features.")
  if not args.peer_python.exists():
    sys.exit(f"{args.peer_python} not found: run"
             " `bash benchmarks/peers/setup_circuit_tracer.sh` first.")
  return lengths


def _prepared(tmp: Path, length: int, args) -> dict:
  """Prepares the model, transcoders and prompt in ``tmp`` (a child of
  this virtualenv), unless it already holds them for these settings."""
  settings = {"length": length, "features": args.features,
              "active": args.active, "seed": args.seed}
  stamp = tmp / "settings.json"
  if not (stamp.exists() and json.loads(stamp.read_text()) == settings):
    tmp.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, __file__, "--side", "prepare", "--out", str(tmp),
         "--length", str(length), "--features", str(args.features),
         "--active", str(args.active), "--seed", str(args.seed)],
        capture_output=True, text=True, check=False)
    if done.returncode:
      sys.exit(f"preparing the model failed:\n{done.stderr[-3000:]}")
    stamp.write_text(json.dumps(settings))
  return json.loads((tmp / "prompt.json").read_text())


if __name__ == "__main__":
  main()
