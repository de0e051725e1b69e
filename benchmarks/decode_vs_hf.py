"""SmolLM2-135M fp32, batch 1: decode and prefill speed of
penzai_lm.generation.generate vs Hugging Face transformers (torch CPU),
run back to back on the same machine (so both see the same load), plus a
pure weight-streaming ceiling (a compiled loop of matvecs over the same
538 MB of fp32 weights).

Usage: python benchmarks/decode_vs_hf.py [--prompt 128] [--new 128] [--skip-hf]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np


def ceiling(steps: int = 64) -> float:
  """Steps/s of a loop that reads SmolLM2's fp32 weights once per step."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  shapes = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536),
            (576, 1536), (1536, 576)]
  weights = [jnp.asarray(rng.standard_normal(s, np.float32))
             for _ in range(30) for s in shapes]
  emb = jnp.asarray(rng.standard_normal((49152, 576), np.float32))

  @jax.jit
  def run(weights, emb, x):
    def body(_, x):
      for l in range(30):
        q, k, v, o, g, u, d = weights[7 * l:7 * l + 7]
        a = jnp.tanh(x @ q) + jnp.sum(x @ k) + jnp.sum(x @ v)
        x = x + a @ o
        x = x + (jax.nn.silu(x @ g) * (x @ u)) @ d
        x = x / jnp.linalg.norm(x)
      return x + jnp.argmax(emb @ x[0]) * 1e-9
    return jax.lax.fori_loop(0, steps, body, x)

  x = jnp.ones((1, 576)) / 24
  run(weights, emb, x).block_until_ready()
  best = 0.0
  for _ in range(2):
    start = time.perf_counter()
    run(weights, emb, x).block_until_ready()
    best = max(best, steps / (time.perf_counter() - start))
  return best


def penzai(prompt_ids, new):
  import penzai_lm  # pylint: disable=g-import-not-at-top
  from penzai_lm.generation import generate  # pylint: disable=g-import-not-at-top

  model, _ = penzai_lm.load()
  settings = dict(max_new_tokens=new, temperature=0.0, stop_tokens=[])
  generate(model, prompt_ids, **settings)  # Compile.
  runs = [generate(model, prompt_ids, **settings) for _ in range(2)]
  best = max(runs, key=lambda r: r.timings.decode_tokens_per_s)
  return best.tokens[0], best.timings


def hf(prompt_ids, new):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from penzai_lm.fetch import resolve_model_path  # pylint: disable=g-import-not-at-top

  path = resolve_model_path("smollm2-135m-instruct")
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
  model.eval()
  ids = torch.tensor([prompt_ids])
  out = {}
  with torch.inference_mode():
    model.generate(ids, max_new_tokens=4, do_sample=False)
    start = time.perf_counter()
    model(ids)
    out["prefill_tok_s"] = len(prompt_ids) / (time.perf_counter() - start)
    start = time.perf_counter()
    tokens = model.generate(ids, max_new_tokens=new, min_new_tokens=new,
                            do_sample=False)
    total = time.perf_counter() - start
  prefill = len(prompt_ids) / out["prefill_tok_s"]
  out["decode_tok_s"] = (new - 1) / max(total - prefill, 1e-9)
  return tokens[0, len(prompt_ids):].tolist(), out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--new", type=int, default=128)
  parser.add_argument("--skip-hf", action="store_true")
  parser.add_argument("--hf-only", action="store_true",
                      help=argparse.SUPPRESS)  # Internal: child process.
  args = parser.parse_args()
  import penzai_lm  # pylint: disable=g-import-not-at-top

  _, tokenizer = penzai_lm.load()
  text = ("The Roman Empire was the post-Republican state of ancient Rome. "
          "It is generally understood to mean the period and territory ruled"
          " by the Romans following Octavian's assumption of sole rule. ") * 8
  prompt_ids = tokenizer.encode(text)[:args.prompt]
  if args.hf_only:
    tokens, stats = hf(prompt_ids, args.new)
    print(json.dumps(dict(tokens=tokens, **stats)))
    return
  print(f"ceiling (weights read once per step): {ceiling():.1f} steps/s",
        flush=True)
  ours, timings = penzai(prompt_ids, args.new)
  print(f"penzai_lm: decode {timings.decode_tokens_per_s:.1f} tok/s, prefill"
        f" {timings.prefill_tokens_per_s:.0f} tok/s, ttft"
        f" {timings.time_to_first_token_s * 1e3:.0f} ms", flush=True)
  if not args.skip_hf:
    # Torch runs in its own process: XLA's CPU threads must not compete.
    child = subprocess.run(
        [sys.executable, __file__, "--hf-only", "--prompt", str(args.prompt),
         "--new", str(args.new)], capture_output=True, text=True, check=True)
    stats = json.loads(child.stdout.strip().splitlines()[-1])
    theirs = stats["tokens"]
    print(f"transformers: decode {stats['decode_tok_s']:.1f} tok/s, prefill"
          f" {stats['prefill_tok_s']:.0f} tok/s", flush=True)
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                min(len(ours), len(theirs)))
    print(f"greedy tokens identical for the first {same} tokens")
  print(f"ceiling again: {ceiling():.1f} steps/s")


if __name__ == "__main__":
  main()
