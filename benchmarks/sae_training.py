"""Training an SAE on SmolLM2 with penzai_lm, and its step speed vs SAELens.

Two parts (not run in CI):

(a) **An SAE for SmolLM2-135M-Instruct** (float32, `penzai_lm.load()`) at
    ``--point`` (default ``blocks.15.resid_post``, hidden size 576), TopK
    with ``--k`` 32 and ``--expansion`` 16 (9216 features). Text: the
    docstrings of Python's standard library on this machine (no network;
    those with runs of one character left out, see `stdlib_text`),
    tokenized; ``--tokens`` of it give the training activations (computed
    once by `PointActivations`, one compiled forward that stops at the
    point; those over 10x the median norm, attention sinks, dropped),
    trained on for ``--steps`` steps of ``--batch`` tokens (cycled,
    reshuffled each pass), and ``--eval-windows`` other windows give the
    held-out figures (`evaluate_sae`: L0, explained variance, dead
    features, CE loss recovered when spliced). ``--save DIR`` writes the
    SAE in SAELens's format.

(b) **Step throughput against SAELens** (``sae-lens``'s ``SAETrainer.step``:
    its training forward pass, backward, gradient clipping, Adam and dead-
    feature bookkeeping) on the same precomputed activations, same SAE
    shape and architecture, same batch: ``--rounds`` timed steps per side
    after two warm-up steps (compilation on ours), one side at a time;
    tokens/s = batch / median step time. SAELens runs in a subprocess of
    ``--sae-lens-python`` (default: this interpreter), with torch's default
    threads; JAX uses XLA's. Model forward passes are excluded on both
    sides. ``--archs`` picks TopK ("topk") and/or ReLU + L1 ("standard").

The machine may be shared: ``uptime`` is printed at the start and the end,
and the figures are medians.

Usage:
  python benchmarks/sae_training.py [--tokens 8192] [--steps 40] \
      [--batch 1024] [--rounds 5] [--archs topk,standard] [--skip-train]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

import numpy as np


_RUNS = re.compile(r"(\S)\1{7,}")


def uptime() -> str:
  return subprocess.run(["uptime"], capture_output=True, text=True,
                        check=False).stdout.strip()


def stdlib_text(chars: int) -> str:
  """Docstrings of the standard library's modules, classes and functions
  (English prose), in a fixed file order."""
  root = sysconfig.get_paths()["stdlib"]
  parts, total = [], 0
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames
                         if d not in ("test", "tests", "site-packages",
                                      "idlelib", "lib2to3"))
    for name in sorted(filenames):
      if not name.endswith(".py"):
        continue
      try:
        with open(os.path.join(dirpath, name), encoding="utf-8") as f:
          tree = ast.parse(f.read())
      except (SyntaxError, UnicodeDecodeError, ValueError):
        continue
      for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)):
          doc = ast.get_docstring(node)
          # Long runs of one character ("99999...", "=====...") make every
          # token of the run an attention sink, with residual norms ~100x
          # the others (like position 0's): they would dominate the MSE.
          if doc and len(doc) > 200 and not _RUNS.search(doc):
            parts.append(doc)
            total += len(doc)
      if total >= chars:
        return "\n\n".join(parts)
  return "\n\n".join(parts)


# -- SAELens side (run in a subprocess) ----------------------------------------


def sae_lens_worker(path: str, arch: str, expansion: int, k: int,
                    batch: int, rounds: int) -> None:
  import torch  # pylint: disable=g-import-not-at-top
  from sae_lens import __version__  # pylint: disable=g-import-not-at-top
  from sae_lens.config import SAETrainerConfig  # pylint: disable=g-import-not-at-top
  from sae_lens import saes  # pylint: disable=g-import-not-at-top
  from sae_lens.training.sae_trainer import SAETrainer  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  acts = torch.from_numpy(np.load(path))
  d_in = acts.shape[1]
  d_sae = expansion * d_in
  if arch == "topk":
    sae = saes.TopKTrainingSAE(saes.TopKTrainingSAEConfig(
        d_in=d_in, d_sae=d_sae, k=k, apply_b_dec_to_input=True))
  else:
    sae = saes.StandardTrainingSAE(saes.StandardTrainingSAEConfig(
        d_in=d_in, d_sae=d_sae, l1_coefficient=5.0,
        apply_b_dec_to_input=True))
  steps = rounds + 2
  trainer = SAETrainer(
      SAETrainerConfig(total_training_samples=steps * batch,
                       train_batch_size_samples=batch, lr=3e-4, lr_end=3e-4,
                       device="cpu"),
      sae, data_provider=iter(()))
  times = []
  for step in range(steps):
    x = acts[(step * batch) % (acts.shape[0] - batch):][:batch]
    start = time.perf_counter()
    trainer.step(x)
    trainer.n_training_steps += 1
    times.append(time.perf_counter() - start)
  print(json.dumps({"times": times[2:], "version": __version__,
                    "threads": torch.get_num_threads()}))


# -- ours ----------------------------------------------------------------------


def our_step_times(acts: np.ndarray, arch: str, d_sae: int, k: int,
                   batch: int, rounds: int) -> list[float]:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from penzai_lm.sae import TrainConfig  # pylint: disable=g-import-not-at-top
  from penzai_lm.sae import train_step as step_lib  # pylint: disable=g-import-not-at-top
  cfg = TrainConfig(activation="topk" if arch == "topk" else "relu",
                    num_features=d_sae, k=k, batch_tokens=batch,
                    steps=rounds + 2, l1_coefficient=5.0)
  h = step_lib.hyper(cfg, cfg.total_steps)
  prog = step_lib.Program.of(cfg)
  state = step_lib.init_state(jnp.zeros(acts.shape[1]), 0, 0.0,
                              features=d_sae, jumprelu=False)
  scale = jnp.float32(1.0)
  times = []
  for step in range(rounds + 2):
    x = acts[(step * batch) % (acts.shape[0] - batch):][:batch]
    start = time.perf_counter()
    state, metrics = step_lib.train_step(state, jnp.asarray(x), scale, h,
                                         prog=prog)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - start)
  return times[2:]


def compare(acts: np.ndarray, args) -> None:
  d_sae = args.expansion * acts.shape[1]
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "acts.npy")
    np.save(path, acts[:max(args.batch * 4, 4096)])
    rows = []
    for arch in args.archs.split(","):
      ours = our_step_times(acts, arch, d_sae, args.k, args.batch,
                            args.rounds)
      out = subprocess.run(
          [args.sae_lens_python, os.path.abspath(__file__),
           "--sae-lens-worker", path, "--arch", arch, "--expansion",
           str(args.expansion), "--k", str(args.k), "--batch",
           str(args.batch), "--rounds", str(args.rounds)],
          capture_output=True, text=True, check=True)
      theirs = json.loads(out.stdout.strip().splitlines()[-1])
      rows.append((arch, ours, theirs))
  print(f"\n(b) SAE training steps, d_in {acts.shape[1]}, d_sae {d_sae}, k"
        f" {args.k} (topk), batch {args.batch} tokens, {args.rounds} timed"
        f" steps each (medians; sae-lens {rows[0][2]['version']},"
        f" torch threads {rows[0][2]['threads']})")
  print(f"  {'arch':<9s} {'penzai_lm s/step':>17s} {'sae-lens s/step':>16s}"
        f" {'penzai_lm tok/s':>16s} {'sae-lens tok/s':>15s} {'ratio':>6s}")
  for arch, ours, theirs in rows:
    a, b = statistics.median(ours), statistics.median(theirs["times"])
    print(f"  {arch:<9s} {a:17.3f} {b:16.3f} {args.batch / a:16.0f}"
          f" {args.batch / b:15.0f} {b / a:6.2f}x")
    print(f"    penzai_lm steps: {[round(t, 3) for t in ours]}")
    print(f"    sae-lens steps:  {[round(t, 3) for t in theirs['times']]}")


def train_smollm2(args):
  """Part (a); returns the training activations for part (b)."""
  import penzai_lm  # pylint: disable=g-import-not-at-top
  from penzai_lm import sae as sae_lib  # pylint: disable=g-import-not-at-top
  from penzai_lm.sae.activations import PointActivations  # pylint: disable=g-import-not-at-top
  model, tokenizer = penzai_lm.load()
  length = args.context
  windows_needed = args.tokens // length + args.eval_windows
  ids = np.asarray(tokenizer.encode(stdlib_text(windows_needed * length * 6)),
                   np.int32)
  windows = ids[:ids.shape[0] // length * length].reshape(-1, length)
  if windows.shape[0] < windows_needed:
    raise SystemExit(f"only {windows.shape[0]} windows of text found")
  train, held = windows[:windows_needed - args.eval_windows], windows[
      windows_needed - args.eval_windows:windows_needed]
  reader = PointActivations(model, args.point, skip_positions=1)
  start = time.perf_counter()
  chunks = [np.asarray(reader(train[i:i + 8]))
            for i in range(0, train.shape[0] // 8 * 8, 8)]
  acts = np.concatenate(chunks)
  forward = time.perf_counter() - start
  print(f"(a) {args.point}: {acts.shape[0]} training activations from"
        f" {train.shape[0]} windows of {length} tokens in {forward:.0f} s"
        f" (compilation included); {held.shape[0]} held-out windows")
  cfg = sae_lib.TrainConfig(
      activation="topk", k=args.k, expansion_factor=args.expansion,
      batch_tokens=args.batch, steps=args.steps, learning_rate=args.lr,
      log_every=max(1, args.steps // 8), dead_feature_window=200)
  sae, report = sae_lib.train_sae_on_activations(acts, cfg,
                                                 hook_point=args.point)
  print(f"  {report.dropped_tokens} activations longer than"
        f" {report.norm_limit:.0f} (10x the median norm) dropped")
  print(f"  {report.steps} steps of {args.batch} tokens"
        f" ({report.tokens / acts.shape[0]:.1f} passes) in"
        f" {report.seconds:.0f} s ({report.tokens_per_s:.0f} tokens/s,"
        " compilation included)")
  for e in report.history:
    print(f"    step {e.step:4d}: loss {e.loss:8.3f}  L0 {e.l0:5.1f}"
          f"  explained variance {e.explained_variance:.3f}  dead"
          f" {e.dead_fraction:.1%}")
  start = time.perf_counter()
  metrics = sae_lib.evaluate_sae(model, sae, held, point=args.point,
                                 max_norm=report.norm_limit)
  print(f"  held out ({time.perf_counter() - start:.0f} s):"
        f" {metrics.summary()}")
  if args.save:
    path = sae_lib.save_sae(sae, args.save,
                            model_name="smollm2-135m-instruct")
    print(f"  saved (SAELens format) to {path}")
  return acts


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--point", default="blocks.15.resid_post")
  parser.add_argument("--tokens", type=int, default=8192)
  parser.add_argument("--context", type=int, default=128)
  parser.add_argument("--eval-windows", type=int, default=8)
  parser.add_argument("--expansion", type=int, default=16)
  parser.add_argument("--k", type=int, default=32)
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--lr", type=float, default=1e-3)
  parser.add_argument("--batch", type=int, default=1024)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--archs", default="topk")
  parser.add_argument("--save", default=None)
  parser.add_argument("--skip-train", action="store_true",
                      help="(b) only, on random activations")
  parser.add_argument("--sae-lens-python", default=sys.executable)
  parser.add_argument("--sae-lens-worker", default=None,
                      help=argparse.SUPPRESS)
  parser.add_argument("--arch", default="topk", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.sae_lens_worker:
    sae_lens_worker(args.sae_lens_worker, args.arch, args.expansion,
                    args.k, args.batch, args.rounds)
    return
  print(f"start: {uptime()}")
  if args.skip_train:
    acts = np.random.default_rng(0).standard_normal(
        (max(args.batch * 4, 4096), 576)).astype(np.float32)
  else:
    acts = train_smollm2(args)
  compare(acts, args)
  print(f"end: {uptime()}")


if __name__ == "__main__":
  main()
