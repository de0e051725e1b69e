"""What a spliced sparse autoencoder costs inside the compiled decode loop.

SmolLM2-135M-Instruct (float32), greedy, ``--new`` tokens per row, at each
batch in ``--batches``, four configurations of the same request:

* ``plain``: the loaded model;
* ``addvector``: one `AddVector` at ``blocks.{L}.resid_post`` (L = the
  middle block), one strength per row;
* ``sae-capture``: an SAE spliced at ``blocks.{L}.resid_post`` (JumpReLU,
  ``d_sae = --expansion x hidden``, 9216 features by default), its top-k
  features (ids and values, ``--top-k``) captured for every token;
* ``sae-steer``: the same SAE with a `FeatureEdit` clamping one feature,
  one value per row (feature steering), nothing captured.

The targets: ``sae-capture`` at most 25% slower than ``plain``,
``sae-steer`` at most 10% slower than ``addvector``. The SAE's weights are
random (the cost of its dense encode and decode does not depend on them).
``sae-steer`` records nothing, so the splice computes only the clamped
feature (`penzai_lm.sae.splice`): its encoder column and decoder row.

Decode throughput is ``timings.decode_tokens_per_s x rows``. Per batch: a
warm-up run per configuration (compilation), then ``--rounds`` rounds in a
rotating order; medians. Every round builds new per-row values (new model
objects): the compile count is checked to stay put. ``uptime`` is printed
at the start and the end: the machine may be shared.

``--random DTYPE`` (float32 or bfloat16) builds SmolLM2-135M's shape with
random weights instead of loading the GGUF (the GPU machine cannot fetch
it; decode cost does not depend on the values) and prompts of random ids.

Usage:
  python benchmarks/sae_overhead.py [--new 64] [--rounds 3] [--batches 1,8]
  python benchmarks/sae_overhead.py --random bfloat16 --batches 1,8,64
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position
import penzai_lm
from penzai_lm import interp
from penzai_lm import sae as sae_lib
from penzai_lm.generation import Engine
from peers.common import MODEL
from peers.common import make_prompts
from peers.common import peak_rss_mb

PROMPT_LEN = 32


def uptime() -> str:
  return subprocess.run(["uptime"], capture_output=True, text=True,
                        check=False).stdout.strip()


def make_sae(model, point: str, expansion: int) -> sae_lib.SparseAutoencoder:
  hidden = model.config.hidden_size
  config = sae_lib.SAEConfig(
      activation="jumprelu", num_features=expansion * hidden,
      input_axes=(("embedding", hidden),),
      output_axes=(("embedding", hidden),), apply_b_dec_to_input=True,
      hook_point=point)
  return sae_lib.SparseAutoencoder.random(config, seed=0)


def random_model(dtype: str):
  """SmolLM2-135M's shape (benchmarks/gpu_decode.py's) with random
  weights, per-layer like a spliced model, and a prompt maker."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from gpu_decode import SHAPES  # pylint: disable=g-import-not-at-top
  config = penzai_lm.TransformerConfig(
      family="llama", **SHAPES["smollm2"],
      parameter_dtype=jnp.dtype(dtype), activation_dtype=jnp.dtype(dtype))
  model = penzai_lm.build_transformer(config, seed=0, on_device=True)
  rng = np.random.default_rng(0)

  def prompts(length, batch):
    return rng.integers(1, config.vocab_size, (batch, length)).tolist()

  return model, prompts


def run_once(engine, model, prompts, new, capture=None):
  result = engine.generate(model, prompts, max_new_tokens=new,
                           temperature=0.0, stop_tokens=[], capture=capture)
  assert all(len(x) == new for x in result.tokens), "a row stopped early"
  return result.timings.decode_tokens_per_s * len(prompts)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ints = lambda s: [int(x) for x in s.split(",") if x]
  parser.add_argument("--new", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--batches", type=ints, default=[1, 8])
  parser.add_argument("--expansion", type=int, default=16)
  parser.add_argument("--top-k", type=int, default=32)
  parser.add_argument("--random", choices=["float32", "bfloat16"],
                      default=None)
  args = parser.parse_args()

  print("start:", uptime(), flush=True)
  if args.random:
    model, prompt_maker = random_model(args.random)
  else:
    model, tokenizer = penzai_lm.load(MODEL)
    prompt_maker = lambda n, b: make_prompts(tokenizer, n, b)
  point = f"blocks.{model.config.num_layers // 2}.resid_post"
  sae = make_sae(model, point, args.expansion)
  start = time.perf_counter()
  spliced = sae_lib.splice(model, sae, top_k=args.top_k)
  print(f"splice (unstacks the model) {time.perf_counter() - start:.2f} s;"
        f" {sae.config.num_features} features at {point}", flush=True)
  features = f"{point}.sae.features"
  capture = [f"{point}.sae.top_ids", f"{point}.sae.top_values"]
  direction = np.random.default_rng(0).standard_normal(
      model.config.hidden_size).astype(np.float32)
  rows = []
  for batch in args.batches:
    prompts = prompt_maker(PROMPT_LEN, batch)

    def values(r):
      return [4.0 * (i % 3) + 0.01 * r for i in range(batch)]

    engine = Engine()
    configs = {
        "plain": lambda r: run_once(engine, model, prompts, args.new),
        "addvector": lambda r: run_once(engine, interp.insert_at(
            model, point, interp.AddVector.build(direction, values(r))),
                                        prompts, args.new),
        "sae-capture": lambda r: run_once(engine, spliced, prompts, args.new,
                                          capture),
        "sae-steer": lambda r: run_once(engine, interp.insert_at(
            spliced, features, sae_lib.FeatureEdit.clamp(sae, [r % 7],
                                                         values(r))),
                                        prompts, args.new),
    }
    for fn in configs.values():  # Warm-up: compiles.
      fn(100)
    compiled = engine.compilations
    names = list(configs)
    results = {name: [] for name in names}
    for r in range(args.rounds):
      for name in names[r % 4:] + names[:r % 4]:
        results[name].append(configs[name](r))
    assert engine.compilations == compiled, "a value change recompiled"
    med = {name: statistics.median(v) for name, v in results.items()}
    rows.append((batch, med))
    print(f"batch {batch}: " + ", ".join(
        f"{n} {med[n]:.1f} tok/s {[round(x, 1) for x in results[n]]}"
        for n in names) + f"; load {os.getloadavg()[0]:.2f}", flush=True)

  print()
  import jax  # pylint: disable=g-import-not-at-top
  kind = (f"random {args.random}" if args.random else "GGUF float32")
  print(f"SmolLM2-135M ({kind}) on {jax.devices()[0].device_kind}, greedy, {args.new} new tokens, prompt"
        f" {PROMPT_LEN}, SAE {sae.config.num_features} features, medians of"
        f" {args.rounds} rotating rounds; decode tok/s over all rows")
  print("batch |  plain  addvec  sae-cap  sae-steer | capture vs plain |"
        " steer vs addvector")
  for batch, med in rows:
    print(f"{batch:5d} | {med['plain']:6.1f} {med['addvector']:7.1f}"
          f" {med['sae-capture']:8.1f} {med['sae-steer']:10.1f} |"
          f" {1 - med['sae-capture'] / med['plain']:15.1%} slower |"
          f" {1 - med['sae-steer'] / med['addvector']:10.1%} slower")
  print(f"peak RSS {peak_rss_mb():.0f} MB")
  print("end:", uptime(), flush=True)


if __name__ == "__main__":
  main()
