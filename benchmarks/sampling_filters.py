"""Micro-benchmark of ``penzai_lm.sampling.sample_next`` (one decode step).

Prints the median wall time per decode step (ms) for each filter setting at
batch 1 and 8 and vocab 49,152 and 262,144. As in a real generation loop,
``sample_next`` runs inside a jitted ``jax.lax.fori_loop`` of ``--steps``
steps (together with ``update_sampler_state`` and an O(batch) in-place logit
perturbation that keeps XLA from hoisting the work out of the loop); the time
per step is the loop time divided by the step count. Timing separate jitted
calls instead would add the per-call allocation of XLA's temporary buffers,
which inside a generation loop is paid once per ``generate`` call.
"loop" is the cost of the same loop without ``sample_next``.

Two synthetic logit shapes:
  * ``peaked``: p ~ rank**-2 over a random permutation (a typical LM step; the
    top-p nucleus fits in the top-k candidates),
  * ``flat``: standard normal logits (a near-uniform worst case: a top-p
    nucleus of ~100k tokens, which exercises the exact bisection fallback).

Each cell is ``jax/kernel``: the JAX sampler, then the CPU kernel that
makes the same choices in one call (``sample_next(kernel=True)``, what the
decode loop uses on CPU), in the same invocation; "compile s" is the
seconds XLA took to compile each loop (every filter setting runs in one
program: settings are values). Without the kernels only the JAX figures
are printed.

``--compare`` also times the alternatives that were considered: a full sort
of the vocabulary, ``jax.lax.top_k`` for several static caps, and a plain
full-vocabulary ``jax.random.categorical`` draw, each as a separate jitted
call (median of ``--repeats``).

Usage::

  python benchmarks/sampling_filters.py [--repeats 5] [--steps 20] [--compare]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from penzai_lm.kernels import ops
from penzai_lm.sampling import SamplingSettings
from penzai_lm.sampling import init_sampler_state
from penzai_lm.sampling import sample_next
from penzai_lm.sampling import update_sampler_state
from penzai_lm.sampling import sample as sample_lib

CONFIGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top-k 50": dict(temperature=0.8, top_k=50),
    "top-p 0.9": dict(temperature=0.8, top_p=0.9),
    "min-p 0.05": dict(temperature=0.8, min_p=0.05),
    "combined": dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
    "penalties": dict(temperature=0.8, top_p=0.9, repetition_penalty=1.1,
                      presence_penalty=0.5, frequency_penalty=0.5),
    "typical 0.9": dict(temperature=0.8, typical_p=0.9),
    "epsilon 3e-4": dict(temperature=0.8, epsilon_cutoff=3e-4),
    "eta 3e-4": dict(temperature=0.8, eta_cutoff=3e-4),
    "top-p + typical": dict(temperature=0.8, top_p=0.9, typical_p=0.9),
    "xtc 0.5/0.1": dict(temperature=0.8, xtc_probability=0.5,
                        xtc_threshold=0.1),
    "top-k 50 + xtc": dict(temperature=0.8, top_k=50, xtc_probability=0.5,
                           xtc_threshold=0.1),
}


def median_ms(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # Compile and warm up.
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e3


def make_logits(kind: str, batch: int, vocab: int, seed: int = 0) -> jax.Array:
  rng = np.random.default_rng(seed)
  if kind == "flat":
    return jnp.asarray(rng.standard_normal((batch, vocab)), jnp.float32)
  rank = np.stack([rng.permutation(vocab) for _ in range(batch)]) + 1
  return jnp.asarray(-2.0 * np.log(rank), jnp.float32)


def decode_loop(steps: int, sample: bool, kernel: bool = False):
  """A jitted loop of ``steps`` sampling steps, like a generation loop
  (with the CPU kernel if ``kernel``)."""

  def run(logits, settings, state):
    batch, vocab = logits.shape
    rows = jnp.arange(batch)

    def body(i, carry):
      logits, state, total = carry
      # O(batch) in-place change so nothing is loop-invariant.
      col = (i * 7919) % vocab
      logits = logits.at[rows, col].add(1e-3)
      if sample:
        token, logprob = sample_next(logits, settings, state, i,
                                     kernel=kernel)
      else:
        token, logprob = (i + rows) % vocab, logits[:, col]
      state = update_sampler_state(state, token)
      return logits, state, total + logprob

    return jax.lax.fori_loop(0, steps, body,
                             (logits, state, jnp.zeros(batch)))[2]

  return jax.jit(run)


def bench_sampler(batch: int, vocab: int, kind: str, repeats: int,
                  steps: int) -> dict[str, list[float]]:
  """Per cell: the JAX sampler's figure, then the kernel's (if built)."""
  logits = make_logits(kind, batch, vocab)
  prompt = jnp.asarray(np.random.default_rng(1).integers(0, vocab, (batch, 64)))
  state = init_sampler_state(prompt, vocab_size=vocab)
  settings = SamplingSettings.make(batch, vocab)
  empty = decode_loop(steps, False)
  out = {"loop": [median_ms(empty, logits, settings, state,
                            repeats=repeats) / steps]}
  kernels = [False, True] if ops.available() else [False]
  loops, out["compile s"] = {}, []
  for kernel in kernels:
    start = time.perf_counter()
    loops[kernel] = decode_loop(steps, True, kernel).lower(
        logits, settings, state).compile()
    out["compile s"].append(time.perf_counter() - start)
  for name, kwargs in CONFIGS.items():
    settings = SamplingSettings.make(batch, vocab, seed=list(range(batch)),
                                     **kwargs)
    out[name] = [median_ms(loops[kernel], logits, settings, state,
                           repeats=repeats) / steps for kernel in kernels]
  return out


def bench_alternatives(batch: int, vocab: int, repeats: int) -> dict:
  """Primitive costs behind the design choices."""
  logits = make_logits("peaked", batch, vocab)
  keys = sample_lib.row_keys(jnp.arange(batch, dtype=jnp.uint32),
                             jnp.zeros(batch, jnp.int32))
  iota = jnp.broadcast_to(jnp.arange(vocab), (batch, vocab))

  def full_sort(x):  # What a sort-based top-k/top-p pays per step.
    vals, ids = jax.lax.sort((-x, iota), dimension=-1, num_keys=1)
    return jnp.cumsum(jnp.exp(-vals), axis=-1), ids

  def capped_top_k(x, cap):
    vals, ids = jax.lax.optimization_barrier(jax.lax.top_k(x, cap))
    return jnp.cumsum(jnp.exp(vals - vals[:, :1]), axis=-1), ids

  out = {
      "argmax": median_ms(jax.jit(lambda x: jnp.argmax(x, -1)), logits,
                          repeats=repeats),
      "logsumexp": median_ms(jax.jit(lambda x: jax.nn.logsumexp(x, -1)),
                             logits, repeats=repeats),
      "full sort": median_ms(jax.jit(full_sort), logits,
                             repeats=max(3, repeats // 5)),
      "categorical(full vocab)": median_ms(
          jax.jit(lambda k, x: jax.vmap(jax.random.categorical)(k, x)),
          keys, logits, repeats=repeats),
      "two-level gumbel": median_ms(
          jax.jit(lambda k, x: sample_lib.sample_full_vocab(
              sample_lib.row_gumbels(k, sample_lib.noise_size(vocab, 1)), x)),
          keys, logits, repeats=repeats),
  }
  for cap in (64, 256, 1024, 4096):
    out[f"lax.top_k cap={cap}"] = median_ms(
        jax.jit(capped_top_k, static_argnums=1), logits, cap, repeats=repeats)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--steps", type=int, default=20,
                      help="decode steps per timed loop")
  parser.add_argument("--compare", action="store_true",
                      help="also time the alternative primitives")
  parser.add_argument("--kinds", default="peaked,flat")
  args = parser.parse_args()
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; ms per decode "
        f"step, median of {args.repeats} loops of {args.steps} steps")
  for vocab in (49152, 262144):
    for batch in (1, 8):
      for kind in args.kinds.split(","):
        row = bench_sampler(batch, vocab, kind, args.repeats, args.steps)
        cells = "  ".join(f"{k}=" + "/".join(f"{x:.2f}" for x in v)
                          for k, v in row.items())
        print(f"vocab={vocab:6d} batch={batch} {kind:6s} | {cells}", flush=True)
      if args.compare:
        row = bench_alternatives(batch, vocab, args.repeats)
        cells = "  ".join(f"{k}={v:.2f}" for k, v in row.items())
        print(f"vocab={vocab:6d} batch={batch} primitives | {cells}",
              flush=True)


if __name__ == "__main__":
  main()
