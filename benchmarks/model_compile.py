"""Compile time and cached/uncached agreement of a SmolLM2-sized random model.

Prints, for a 30-layer model with SmolLM2-135M's shapes (random fp32 weights),
the compile time of the uncached forward pass and of the cached prefill and
decode steps, with and without a layer stack, and the max abs difference
between cached (prefill, then one token at a time) and uncached logits.

Run: python benchmarks/model_compile.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model import TransformerConfig
from penzai_lm.model import build_transformer

SMOLLM2_SHAPES = dict(
    family="llama", vocab_size=49152, hidden_size=576, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, mlp_hidden_size=1536,
    rope_base=1e5, tie_embeddings=True,
)
PROMPT, STEPS = 64, 16


def _timed_compile(fn, *args):
  start = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, time.perf_counter() - start


def measure(stacked: bool) -> dict[str, float]:
  model = build_transformer(
      TransformerConfig(**SMOLLM2_SHAPES, use_layer_stack=stacked), seed=0
  )
  frozen = pz.freeze_params(model)
  ids = np.random.RandomState(0).randint(0, 49152, (1, PROMPT + STEPS))
  tokens = pz.nx.wrap(jnp.asarray(ids, jnp.int32)).tag("batch", "seq")
  forward, compile_uncached = _timed_compile(lambda m, t: m(t), frozen, tokens)
  expected = np.asarray(forward(frozen, tokens).unwrap("batch", "seq", "vocabulary"))

  cached = KVCachingTransformerLM.from_uncached(model, PROMPT + STEPS, {"batch": 1})
  stateless, state = pz.unbind_state_vars(pz.freeze_params(cached), freeze=True)
  # The model is an argument, so its weights are not compile-time constants.
  step = lambda m, s, t: m.stateless_call(s, t)
  prefill, compile_prefill = _timed_compile(
      step, stateless, state, tokens[{"seq": slice(0, PROMPT)}]
  )
  decode, compile_decode = _timed_compile(
      step, stateless, state, tokens[{"seq": slice(0, 1)}]
  )
  out, state = prefill(stateless, state, tokens[{"seq": slice(0, PROMPT)}])
  outs = [out]
  for t in range(PROMPT, PROMPT + STEPS):
    out, state = decode(stateless, state, tokens[{"seq": slice(t, t + 1)}])
    outs.append(out)
  got = np.concatenate([np.asarray(o.unwrap("batch", "seq", "vocabulary")) for o in outs], 1)
  return dict(
      compile_uncached_s=compile_uncached,
      compile_prefill_s=compile_prefill,
      compile_decode_s=compile_decode,
      max_abs_diff=float(np.abs(got - expected).max()),
      logit_scale=float(np.abs(expected).max()),
  )


if __name__ == "__main__":
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
  for stacked in (True, False):
    r = measure(stacked)
    print(
        f"{'layer stack' if stacked else 'unstacked  '}: compile uncached"
        f" {r['compile_uncached_s']:.1f}s, cached prefill"
        f" {r['compile_prefill_s']:.1f}s, cached decode"
        f" {r['compile_decode_s']:.1f}s; max |cached - uncached| ="
        f" {r['max_abs_diff']:.2e} (logits up to {r['logit_scale']:.1f})"
    )
