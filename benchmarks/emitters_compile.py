"""First-generate compile time with XLA:CPU's newer and older fusion emitters.

`penzai_lm.runtime.compiler_options.default_compiler_options` compiles the prefill
and decode programs of models with at most ``FEW_BLOCKS`` transformer
blocks with the older emitters (``xla_cpu_use_fusion_emitters: False``).
This script measures why: for each block count, fresh processes build a
random model with SmolLM2's shapes (vocabulary 49152, hidden 576, 9 heads, 3
KV heads) and that many blocks, and time one greedy ``generate`` (128-token
prompt, 64 new tokens) through an engine whose compiler options force one
emitter or the other. It prints medians over ``--rounds`` processes per cell
(the two emitters alternate, so a load change on a shared machine hits
both): compile+trace seconds (``timings.compile_s``), XLA's compile seconds
summed over the programs, and decode tokens per second.

Usage:
  python benchmarks/emitters_compile.py [--blocks 1,2,4,8] [--rounds 3]
"""

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = r"""
import collections, json, sys
from jax import monitoring
events = collections.defaultdict(float)
monitoring.register_event_duration_secs_listener(
    lambda name, secs, **kw: events.__setitem__(name, events[name] + secs))
from penzai_lm.generation import Engine
from penzai_lm.model import TransformerConfig, build_transformer
blocks, older = int(sys.argv[1]), sys.argv[2] == "older"
config = TransformerConfig(
    family="llama", vocab_size=49152, hidden_size=576, num_layers=blocks,
    num_heads=9, num_kv_heads=3, head_dim=64, mlp_hidden_size=1536,
    rope_base=1e5, tie_embeddings=True)
engine = Engine(compiler_options=lambda program, shape: (
    {"xla_cpu_use_fusion_emitters": False} if older else {}))
t = engine.generate(build_transformer(config, seed=0), list(range(100, 228)),
                    max_new_tokens=64, temperature=0.0).timings
print(json.dumps(dict(
    compile_s=t.compile_s, decode_tok_s=t.decode_tokens_per_s,
    xla_s=events["/jax/core/compile/backend_compile_duration"])))
"""


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--blocks", default="1,2,4,8")
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  print(f"{'blocks':>6} {'emitters':>8} {'compile+trace s':>15}"
        f" {'XLA s':>6} {'decode tok/s':>12}   (medians of {args.rounds})")
  for blocks in [int(b) for b in args.blocks.split(",")]:
    runs = {"newer": [], "older": []}
    for i in range(args.rounds):
      for emitters in (("newer", "older") if i % 2 == 0
                       else ("older", "newer")):
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, str(blocks), emitters],
            capture_output=True, text=True, check=True)
        runs[emitters].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for emitters, rs in runs.items():
      med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
      print(f"{blocks:6d} {emitters:>8} {med['compile_s']:15.2f}"
            f" {med['xla_s']:6.2f} {med['decode_tok_s']:12.1f}")


if __name__ == "__main__":
  main()
