"""Attribution graphs of long prompts: time and peak memory by length.

SmolLM2-135M-Instruct (float32, the default model) with random per-layer
TopK transcoders (``--features`` per block, ``--k`` active per position:
real per-layer transcoders have tens of active features per position), a
prompt of ``--lengths`` tokens (a public-domain text repeated), and
``attribute(..., max_feature_nodes=512)``. Each length runs in a fresh
child process, so peak RSS (``ru_maxrss``) is that length's alone; the
table gives the active features, the graph's nodes and edges array, the
wall time of the call and the child's peak RSS, and the growth between
lengths.

Not part of CI. Usage:
  python benchmarks/circuits_long_prompts.py [--lengths 256,1024,4096]
      [--features 4096] [--k 16] [--max-feature-nodes 512]
      [--batch-size 64] [--max-memory-bytes B]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time

import jax
import numpy as np

import penzai_lm
from penzai_lm import circuits
from penzai_lm.sae import SAEConfig
from penzai_lm.sae import SparseAutoencoder

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of"
    " wisdom, it was the age of foolishness, it was the epoch of belief, it"
    " was the epoch of incredulity, it was the season of Light, it was the"
    " season of Darkness, it was the spring of hope, it was the winter of"
    " despair, we had everything before us, we had nothing before us, we"
    " were all going direct to Heaven, we were all going direct the other"
    " way. ")


def transcoders(model, features: int, k: int, seed: int = 0):
  """Random TopK transcoders, one per block (mlp_in -> mlp_out)."""
  config = model.config
  d = config.hidden_size
  rng = np.random.default_rng(seed)
  out = []
  for layer in range(config.num_layers):
    cfg = SAEConfig(
        activation="topk", num_features=features, k=k,
        input_axes=(("embedding", d),), output_axes=(("embedding", d),),
        hook_point=f"blocks.{layer}.mlp_in",
        output_point=f"blocks.{layer}.mlp_out")
    arrays = {
        "w_enc": rng.normal(0, 1 / np.sqrt(d), (d, features)),
        "b_enc": rng.normal(0, 0.1, features),
        "w_dec": rng.normal(0, 0.3 / np.sqrt(features), (features, d)),
        "b_dec": rng.normal(0, 0.05, d),
    }
    out.append(SparseAutoencoder.from_arrays(
        cfg, **{n: a.astype(np.float32) for n, a in arrays.items()}))
  return out


def child(args) -> None:
  model, tokenizer = penzai_lm.load()
  ids = tokenizer.encode(TEXT * (args.length // 40 + 2))[:args.length]
  tcs = transcoders(model, args.features, args.k)
  start = time.perf_counter()
  graph = circuits.attribute(
      model, tcs, ids, max_feature_nodes=args.max_feature_nodes,
      batch_size=args.batch_size, max_memory_bytes=args.max_memory_bytes)
  seconds = time.perf_counter() - start
  start = time.perf_counter()
  pruned = circuits.prune_graph(graph)
  prune_seconds = time.perf_counter() - start
  print(json.dumps({
      "length": len(ids), "active": len(graph.active_features),
      "nodes": graph.n_nodes, "edges_shape": list(graph.edges.shape),
      "kept_nodes": int(pruned.node_mask.sum()), "seconds": seconds,
      "prune_seconds": prune_seconds,
      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                     / 1024}))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", default="256,1024")
  parser.add_argument("--features", type=int, default=4096)
  parser.add_argument("--k", type=int, default=16)
  parser.add_argument("--max-feature-nodes", type=int, default=512)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--max-memory-bytes", type=int, default=None)
  parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.length:
    child(args)
    return
  print(f"{platform.processor() or platform.machine()},"
        f" {jax.device_count()} device(s); SmolLM2-135M float32,"
        f" TopK transcoders {args.features} features, k={args.k},"
        f" max_feature_nodes={args.max_feature_nodes},"
        f" batch_size={args.batch_size},"
        f" max_memory_bytes={args.max_memory_bytes}")
  print("| tokens | active features | nodes | edges | attribute s |"
        " prune s | peak RSS MB |")
  print("|---|---|---|---|---|---|---|")
  for length in [int(n) for n in args.lengths.split(",")]:
    command = [sys.executable, __file__, "--length", str(length),
               "--features", str(args.features), "--k", str(args.k),
               "--max-feature-nodes", str(args.max_feature_nodes),
               "--batch-size", str(args.batch_size)]
    if args.max_memory_bytes:
      command += ["--max-memory-bytes", str(args.max_memory_bytes)]
    done = subprocess.run(command, capture_output=True, text=True,
                          check=False)
    if done.returncode:
      print(f"| {length} | failed (exit {done.returncode}):"
            f" {done.stderr.strip().splitlines()[-1:]} |||||")
      continue
    r = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"| {r['length']} | {r['active']} | {r['nodes']} |"
          f" {r['edges_shape'][0]} x {r['edges_shape'][1]} |"
          f" {r['seconds']:.1f} | {r['prune_seconds']:.1f} |"
          f" {r['peak_rss_mb']:.0f} |", flush=True)


if __name__ == "__main__":
  main()
