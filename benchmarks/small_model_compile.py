"""First-generate compile time and decode speed of small models, compiled
as larger models are and with `small_model_options`.

`penzai_lm.runtime.compiler_options.default_compiler_options` compiles the
programs of models of at most ``SMALL_MODEL`` parameters with
`small_model_options` (LLVM -O0 without its expensive passes, XLA:CPU's
older fusion emitters). This script measures why: for each model below,
fresh processes build a random model and time one greedy ``generate`` (a
16-token prompt, 256 new tokens) at batch 1 and then at batch 8, through an
engine whose compiler options are those a larger model of as many blocks
gets ("default") or `small_model_options` ("small"). It prints medians over
``--rounds`` processes per cell (the two settings alternate): XLA's compile
seconds of each generate and its decode tokens per second.

Models (the suite's tiny models; a grokking-sized one; wider ones):
  tiny   vocab 97, hidden 32, 3 blocks (tests/model/configs.py's size)
  deep   vocab 97, hidden 32, 8 blocks
  grok   vocab 114, hidden 128, 1 block, MLP 512 (modular addition)
  small  vocab 4096, hidden 128, 4 blocks, MLP 512
  vocab  vocab 49152, hidden 16, 2 blocks (SmolLM2's vocabulary)
  wide   vocab 8192, hidden 256, 4 blocks, MLP 1024

Usage:
  python benchmarks/small_model_compile.py [--models tiny,grok] [--rounds 3]
"""

import argparse
import json
import statistics
import subprocess
import sys

MODELS = {
    "tiny": dict(vocab_size=97, hidden_size=32, num_layers=3, num_heads=4,
                 num_kv_heads=2, head_dim=8, mlp_hidden_size=64),
    "deep": dict(vocab_size=97, hidden_size=32, num_layers=8, num_heads=4,
                 num_kv_heads=2, head_dim=8, mlp_hidden_size=64),
    "grok": dict(vocab_size=114, hidden_size=128, num_layers=1, num_heads=4,
                 num_kv_heads=4, head_dim=32, mlp_hidden_size=512),
    "small": dict(vocab_size=4096, hidden_size=128, num_layers=4,
                  num_heads=4, num_kv_heads=2, head_dim=32,
                  mlp_hidden_size=512),
    "vocab": dict(vocab_size=49152, hidden_size=16, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=8, mlp_hidden_size=32),
    "wide": dict(vocab_size=8192, hidden_size=256, num_layers=4, num_heads=8,
                 num_kv_heads=4, head_dim=32, mlp_hidden_size=1024),
}

_CHILD = r"""
import collections, json, sys
from jax import monitoring
events = collections.defaultdict(float)
monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: events.__setitem__(name, events[name] + secs))
from penzai_lm.generation import Engine
from penzai_lm.runtime.compiler_options import default_compiler_options
from penzai_lm.runtime.compiler_options import small_model_options
from penzai_lm.model import TransformerConfig, build_transformer
shape, small = json.loads(sys.argv[1]), sys.argv[2] == "small"
model = build_transformer(TransformerConfig(family="llama", **shape), seed=0)
engine = Engine(compiler_options=lambda program, program_shape: (
    small_model_options() if small else default_compiler_options(
        program, program_shape, blocks=shape["num_layers"])))
prompt = [i % shape["vocab_size"] for i in range(1, 17)]
out = {}
for batch in (1, 8):
  before = events["/jax/core/compile/backend_compile_duration"]
  t = engine.generate(model, [prompt] * batch, max_new_tokens=256,
                      temperature=0.0, stop_tokens=[]).timings
  out[f"xla_s_{batch}"] = (
      events["/jax/core/compile/backend_compile_duration"] - before)
  out[f"tok_s_{batch}"] = t.decode_tokens_per_s
print(json.dumps(out))
"""


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  print(f"{'model':>6} {'params':>9} {'options':>7} {'XLA s b1':>8}"
        f" {'tok/s b1':>9} {'XLA s b8':>8} {'tok/s b8':>9}"
        f"   (medians of {args.rounds})")
  for name in args.models.split(","):
    shape = MODELS[name]
    runs = {"default": [], "small": []}
    for i in range(args.rounds):
      for options in (("default", "small") if i % 2 == 0
                      else ("small", "default")):
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(shape), options],
            capture_output=True, text=True, check=True)
        runs[options].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for options, results in runs.items():
      med = lambda key: statistics.median(r[key] for r in results)  # noqa: E731
      print(f"{name:>6} {_parameters(shape):>9,} {options:>7}"
            f" {med('xla_s_1'):8.2f} {med('tok_s_1'):9.0f}"
            f" {med('xla_s_8'):8.2f} {med('tok_s_8'):9.0f}")


def _parameters(shape) -> int:
  """Weights of a llama-family model of this shape (untied embeddings)."""
  h, v, m = shape["hidden_size"], shape["vocab_size"], shape["mlp_hidden_size"]
  attn = h * shape["head_dim"] * (2 * shape["num_heads"]
                                  + 2 * shape["num_kv_heads"])
  return 2 * v * h + shape["num_layers"] * (attn + 3 * h * m + 2 * h) + h


if __name__ == "__main__":
  main()
