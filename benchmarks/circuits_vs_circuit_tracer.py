"""penzai_lm.circuits against circuit-tracer 0.5's own ``attribute``.

One small random Llama (SmolLM2-like, shrunk: ``--layers`` blocks of width
``--hidden``, grouped-query attention, untied unembedding) is built with
transformers and saved as a Hugging Face directory (safetensors, a
word-level ``tokenizer.json``); random per-layer transcoders (ReLU or
JumpReLU, optionally with skip connections) are saved in circuit-tracer's
transcoder-set layout (``config.yaml`` listing ``layer_{i}.safetensors``),
or with ``--clt`` a random cross-layer transcoder (ReLU or JumpReLU, no
skip: circuit-tracer's ``load_clt`` reads none) in its CLT layout
(``W_enc_{i}.safetensors`` and ``W_dec_{i}.safetensors``, features reading
``mlp.hook_in`` and writing ``hook_mlp_out``). Both sides read the same
files, offline:

* circuit-tracer: `benchmarks/peers/circuit_tracer_child.py` in the
  virtualenv of `benchmarks/peers/setup_circuit_tracer.sh` (TransformerLens
  backend), a child process;
* penzai_lm: ``penzai_lm.load_model`` and ``penzai_lm.sae.load_transcoders``,
  in a child process of this virtualenv (so that both peak RSS figures are
  one process's).

Each side runs ``attribute`` twice (cold, then warm: penzai_lm's cold run
compiles), prunes with its own ``prune_graph`` and scores with its own
``compute_graph_scores``; results come back as safetensors files (no
pickle). The table compares active features, activations, logit nodes,
selected features, the adjacency matrix (max difference relative to the
largest edge, and ``allclose`` at ``rtol=1e-4``), the pruned node and edge
sets and the two scores, then wall times and peak RSS.

Not part of CI. Usage:
  bash benchmarks/peers/setup_circuit_tracer.sh   # once
  python benchmarks/circuits_vs_circuit_tracer.py [--activation relu]
      [--skip | --clt] [--layers 4] [--hidden 64] [--features 256] [--seq 8]
      [--max-feature-nodes N] [--batch-size 512] [--max-memory-bytes B]
      [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file
import yaml

import penzai_lm
from penzai_lm import circuits
from penzai_lm.circuits import prune
from penzai_lm.sae import load_transcoders

PEER_PYTHON = (Path.home() / ".cache/penzai_lm/peers/circuit-tracer-venv"
               / "bin/python")
CHILD = Path(__file__).resolve().parent / "peers/circuit_tracer_child.py"
SPECIAL = ("<unk>", "<s>", "</s>")  # ids 0, 1 (BOS), 2


def write_model(out: Path, args) -> None:
  """A random Llama and a word-level tokenizer, as a Hugging Face dir."""
  # torch and transformers only here: the penzai_lm child must not load
  # them (its peak RSS is measured).
  import tokenizers
  import torch
  import transformers
  torch.manual_seed(args.seed)
  config = transformers.LlamaConfig(
      vocab_size=args.vocab, hidden_size=args.hidden,
      intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
      num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
      tie_word_embeddings=False, initializer_range=0.15,
      bos_token_id=1, eos_token_id=2)
  model = transformers.LlamaForCausalLM(config).float()
  model.save_pretrained(out, safe_serialization=True)
  vocab = {t: i for i, t in enumerate(SPECIAL)}
  vocab.update({f"t{i}": i for i in range(len(SPECIAL), args.vocab)})
  core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "<unk>"))
  core.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
      eos_token="</s>", pad_token="</s>", add_bos_token=True)
  fast.save_pretrained(out)


def write_transcoders(out: Path, args) -> Path:
  """Random per-layer transcoders in circuit-tracer's layout; returns the
  ``config.yaml`` path."""
  rng = np.random.default_rng(args.seed + 1)
  d, f = args.hidden, args.features
  files = []
  for layer in range(args.layers):
    tensors = {
        "W_enc": rng.normal(0, 1 / np.sqrt(d), (f, d)).astype(np.float32),
        "b_enc": rng.normal(0, 0.3, f).astype(np.float32),
        "W_dec": rng.normal(0, 0.3 / np.sqrt(d), (f, d)).astype(np.float32),
        "b_dec": rng.normal(0, 0.05, d).astype(np.float32),
    }
    if args.activation == "jumprelu":
      tensors["activation_function.threshold"] = rng.uniform(
          0.2, 0.8, f).astype(np.float32)
    if args.skip:
      tensors["W_skip"] = rng.normal(0, 0.1 / np.sqrt(d), (d, d)).astype(
          np.float32)
    name = f"layer_{layer}.safetensors"
    save_file(tensors, str(out / name))
    files.append(name)
  config = out / "config.yaml"
  config.write_text(yaml.safe_dump({
      "model_kind": "transcoder_set", "scan": "penzai_lm-benchmark",
      "feature_input_hook": "mlp.hook_in",
      "feature_output_hook": "hook_mlp_out", "transcoders": files}))
  return config


def write_clt(out: Path, args) -> Path:
  """A random cross-layer transcoder in circuit-tracer's layout; returns
  the ``config.yaml`` path."""
  rng = np.random.default_rng(args.seed + 1)
  d, f, n = args.hidden, args.features, args.layers
  for layer in range(n):
    tensors = {
        f"W_enc_{layer}": rng.normal(0, 1 / np.sqrt(d), (f, d)),
        f"b_enc_{layer}": rng.normal(0, 0.3, f),
        f"b_dec_{layer}": rng.normal(0, 0.05, d),
    }
    if args.activation == "jumprelu":
      tensors[f"threshold_{layer}"] = rng.uniform(0.2, 0.8, f)
    save_file({k: v.astype(np.float32) for k, v in tensors.items()},
              str(out / f"W_enc_{layer}.safetensors"))
    w_dec = rng.normal(0, 0.3 / np.sqrt(d * (n - layer)), (f, n - layer, d))
    save_file({f"W_dec_{layer}": w_dec.astype(np.float32)},
              str(out / f"W_dec_{layer}.safetensors"))
  config = out / "config.yaml"
  config.write_text(yaml.safe_dump({
      "model_kind": "cross_layer_transcoder", "scan": "penzai_lm-benchmark",
      "feature_input_hook": "mlp.hook_in",
      "feature_output_hook": "hook_mlp_out"}))
  return config


def run_penzai(args) -> None:
  """The penzai_lm side (``--side penzai``): same outputs as the child."""
  jax.config.update("jax_default_matmul_precision", "highest")
  model = penzai_lm.load_model(args.model)
  transcoders = load_transcoders(args.transcoders, model=model)
  prompt = [int(t) for t in args.prompt.split(",")]
  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  times, cpu = [], []
  for _ in range(2):
    start, start_cpu = time.perf_counter(), time.process_time()
    graph = circuits.attribute(model, transcoders, prompt,
                               max_n_logits=args.max_n_logits,
                               batch_size=args.batch_size,
                               max_feature_nodes=args.max_feature_nodes,
                               max_memory_bytes=args.max_memory_bytes)
    times.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
  pruned = circuits.prune_graph(graph)
  replacement, completeness = circuits.compute_graph_scores(graph)
  arrays = {name: np.ascontiguousarray(getattr(graph, name)) for name in (
      "input_tokens", "active_features", "activation_values",
      "selected_features", "logit_tokens", "logit_probabilities",
      "adjacency_matrix")}
  arrays.update(node_mask=pruned.node_mask.astype(np.uint8),
                edge_mask=pruned.dense_edge_mask(graph).astype(np.uint8),
                cumulative_scores=pruned.cumulative_scores)
  result = {"replacement": replacement, "completeness": completeness,
            "seconds": times, "cpu_seconds": cpu,
            "rss_before_mb": rss_before,
            "peak_rss_mb": resource.getrusage(
                resource.RUSAGE_SELF).ru_maxrss / 1024,
            "jax": jax.__version__}
  save_file(arrays, str(args.out), metadata={"result": json.dumps(result)})


def _read(path: Path) -> tuple[dict, dict]:
  with safe_open(str(path), framework="np") as f:
    arrays = {k: f.get_tensor(k) for k in f.keys()}
    result = json.loads(f.metadata()["result"])
  return arrays, result


def compare(ours: dict, theirs: dict) -> list[tuple[str, str, bool]]:
  """``(what, measured, ok)`` rows of the parity table."""
  rows = []
  same = lambda k: (ours[k].shape == theirs[k].shape
                    and np.array_equal(ours[k], theirs[k]))
  n_active = len(theirs["active_features"])
  rows.append(("active features (layer, pos, id)",
               f"{len(ours['active_features'])} vs {n_active}",
               same("active_features")))
  if same("active_features"):
    diff = np.abs(ours["activation_values"] - theirs["activation_values"])
    rel = diff.max() / np.abs(theirs["activation_values"]).max()
    rows.append(("activation values, max rel diff", f"{rel:.2e}",
                 rel < 1e-4))
  rows.append(("logit nodes (token ids, order)",
               f"{ours['logit_tokens'].tolist()}", same("logit_tokens")))
  if same("logit_tokens"):
    diff = np.abs(ours["logit_probabilities"]
                  - theirs["logit_probabilities"]).max()
    rows.append(("logit probabilities, max abs diff", f"{diff:.2e}",
                 diff < 1e-5))
  rows.append(("selected features", f"{len(theirs['selected_features'])}",
               same("selected_features")))
  a, b = ours["adjacency_matrix"], theirs["adjacency_matrix"]
  if a.shape != b.shape:
    rows.append(("adjacency shape", f"{a.shape} vs {b.shape}", False))
    return rows
  scale = np.abs(b).max()
  rel = np.abs(a - b).max() / scale
  close = np.allclose(a, b, rtol=1e-4, atol=1e-4 * scale)
  rows.append((f"adjacency {a.shape[0]}x{a.shape[1]}, max |diff| / max |A|",
               f"{rel:.2e}", close))
  rows.append(("adjacency nonzero pattern",
               f"{int((a != 0).sum())} vs {int((b != 0).sum())}",
               np.array_equal(a != 0, b != 0) or close))
  nodes = ours["node_mask"].astype(bool), theirs["node_mask"].astype(bool)
  rows.append(("pruned node set",
               f"{int(nodes[0].sum())} vs {int(nodes[1].sum())} kept,"
               f" {int((nodes[0] != nodes[1]).sum())} differ",
               np.array_equal(*nodes)))
  edges = ours["edge_mask"].astype(bool), theirs["edge_mask"].astype(bool)
  gap = _threshold_gap(ours, edges[0] != edges[1])
  rows.append(("pruned edge set",
               f"{int(edges[0].sum())} vs {int(edges[1].sum())} kept,"
               f" {int((edges[0] != edges[1]).sum())} differ"
               + (f" (all within {gap:.1e} of the threshold)" if gap else ""),
               np.array_equal(*edges) or gap < 1e-3))
  # Sorted: nodes of (nearly) equal influence may swap ranks between sides.
  mine, peer = ours["cumulative_scores"], theirs["cumulative_scores"]
  diff = np.abs(np.sort(mine) - np.sort(peer)).max()
  swapped = int((np.argsort(mine, kind="stable")
                 != np.argsort(peer, kind="stable")).sum())
  rows.append(("cumulative node scores (sorted), max abs diff",
               f"{diff:.2e}, {swapped} nodes at swapped ranks", diff < 1e-4))
  return rows


def _threshold_gap(ours: dict, differ: np.ndarray) -> float:
  """How far (relative) the edges kept on one side only score from the
  edge threshold, on penzai_lm's graph; 0 when none differ. Both sides
  divide the same running sums by the total of every edge score, which
  torch sums in its own order (it may differ in the last bit), so an edge
  at the threshold can fall either way."""
  if not differ.any():
    return 0.0
  a = ours["adjacency_matrix"]
  weights = np.zeros(len(a), np.float32)
  weights[len(a) - len(ours["logit_tokens"]):] = ours["logit_probabilities"]
  influence = prune.compute_node_influence(a, weights)
  keep = influence >= prune.find_threshold(influence, 0.8)
  keep[len(a) - len(ours["logit_tokens"]) - len(ours["input_tokens"]):] = True
  pruned = np.where(keep[:, None] & keep[None, :], a, 0).astype(np.float32)
  scores = prune.compute_edge_influence(pruned, weights)
  threshold = prune.find_threshold(scores, 0.98)
  return float(np.abs(scores[differ] - threshold).max() / threshold)


def _child(cmd: list[str], env=None) -> None:
  done = subprocess.run(cmd, capture_output=True, text=True, env=env)
  if done.returncode:
    sys.exit(f"{cmd[1]} failed ({done.returncode}):\n{done.stderr[-4000:]}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--side", choices=("penzai",), default=None,
                      help=argparse.SUPPRESS)
  parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
  parser.add_argument("--transcoders", type=Path, help=argparse.SUPPRESS)
  parser.add_argument("--prompt", help=argparse.SUPPRESS)
  parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
  parser.add_argument("--activation", choices=("relu", "jumprelu"),
                      default="jumprelu")
  parser.add_argument("--skip", action="store_true",
                      help="transcoders with skip connections")
  parser.add_argument("--clt", action="store_true",
                      help="a cross-layer transcoder instead of per-layer"
                      " ones")
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--hidden", type=int, default=64)
  parser.add_argument("--vocab", type=int, default=256)
  parser.add_argument("--features", type=int, default=256)
  parser.add_argument("--seq", type=int, default=8)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--max-n-logits", type=int, default=10)
  parser.add_argument("--batch-size", type=int, default=512)
  parser.add_argument("--max-feature-nodes", type=int, default=None)
  parser.add_argument("--max-memory-bytes", type=int, default=None,
                      help="penzai_lm's budget (attribute's max_memory_bytes)")
  parser.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
  parser.add_argument("--keep", type=Path, default=None,
                      help="write the model, transcoders and both results"
                      " here instead of a temporary directory")
  args = parser.parse_args()
  if args.side == "penzai":
    run_penzai(args)
    return
  if args.clt and args.skip:
    parser.error("--clt takes no --skip: circuit-tracer's load_clt reads no"
                 " skip connection from CLT files.")
  if not args.peer_python.exists():
    sys.exit(f"{args.peer_python} not found: run"
             " `bash benchmarks/peers/setup_circuit_tracer.sh` first.")
  rng = np.random.default_rng(args.seed + 2)
  prompt = ",".join(map(str, [1, *rng.integers(3, args.vocab,
                                               args.seq - 1)]))
  with tempfile.TemporaryDirectory() as tmp:
    tmp = args.keep or Path(tmp)
    model_dir, tc_dir = tmp / "tiny-model", tmp / "transcoders"
    model_dir.mkdir(parents=True, exist_ok=True)
    tc_dir.mkdir(exist_ok=True)
    write_model(model_dir, args)
    config = (write_clt if args.clt else write_transcoders)(tc_dir, args)
    common = ["--model", str(model_dir), "--transcoders", str(config),
              "--prompt", prompt, "--max-n-logits", str(args.max_n_logits),
              "--batch-size", str(args.batch_size)]
    if args.max_feature_nodes:
      common += ["--max-feature-nodes", str(args.max_feature_nodes)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    _child([str(args.peer_python), str(CHILD), *common, "--out",
            str(tmp / "theirs.safetensors")], env)
    ours_args = common + ([f"--max-memory-bytes={args.max_memory_bytes}"]
                          if args.max_memory_bytes else [])
    _child([sys.executable, __file__, "--side", "penzai", *ours_args, "--out",
            str(tmp / "ours.safetensors")], env)
    theirs, their_result = _read(tmp / "theirs.safetensors")
    ours, our_result = _read(tmp / "ours.safetensors")
  _print(args, prompt, compare(ours, theirs), our_result, their_result)


def _print(args, prompt, rows, ours: dict, theirs: dict) -> None:
  kind = "cross-layer transcoder" if args.clt else "transcoders"
  print(f"Random Llama: {args.layers} blocks, width {args.hidden}, vocab"
        f" {args.vocab}; {args.activation} {kind},"
        f" {args.features} features{' per block' if args.clt else ''}"
        f"{', skip' if args.skip else ''};"
        f" prompt {prompt}")
  print(f"TransformerLens vs transformers logits (peer side): max abs diff"
        f" {theirs['tl_vs_hf_max_abs_logit']:.2e}")
  for name in ("replacement", "completeness"):
    diff = abs(ours[name] - theirs[name])
    rows.append((f"{name} score", f"{ours[name]:.6f} vs {theirs[name]:.6f}"
                 f" ({diff:.1e})", diff < 1e-4))
  width = max(len(r[0]) for r in rows)
  print(f"\n{'check':<{width}}  {'measured':<56} same")
  for what, measured, ok in rows:
    print(f"{what:<{width}}  {measured:<56} {'yes' if ok else 'NO'}")
  print(f"\n{'side':<28} {'cold s':>8} {'warm s':>8} {'warm cpu s':>11}"
        f" {'peak RSS MB':>12}")
  for side, r in (("penzai_lm (jax " + ours["jax"] + ")", ours),
                  ("circuit-tracer 0.5 (torch)", theirs)):
    print(f"{side:<28} {r['seconds'][0]:>8.2f} {r['seconds'][1]:>8.2f}"
          f" {r['cpu_seconds'][1]:>11.2f} {r['peak_rss_mb']:>12.0f}")

if __name__ == "__main__":
  main()
