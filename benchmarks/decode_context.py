"""Decode speed against context length on the real SmolLM2, per weight
format: where the per-step cost of attending over the KV cache shows.

Usage:
  python benchmarks/decode_context.py [--formats float32,bfloat16,int8]
      [--contexts 16+32,128+64,512+64] [--repeats 2]
  python benchmarks/decode_context.py --formats q4_0-x8 --contexts 128+64,1024+64

Each context is ``prompt+new`` tokens, greedy, batch 1. Prints the median
decode tokens/s of ``--repeats`` runs after a warm-up run (which compiles).
A format ``q4_0``, ``q8_0``, ``q4_1`` or ``q4_k_m`` keeps the blocks of
that GGUF file (``python benchmarks/peers/make_ggufs.py`` writes them);
``-x8`` adds ``with_cpu_kernels(model, int8_activations=True)``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import penzai_lm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers.make_ggufs import gguf_path  # pylint: disable=g-import-not-at-top,wrong-import-position


def _load(fmt: str):
  """The model of a ``--formats`` entry."""
  base = fmt.removesuffix("-x8")
  if base in ("q4_0", "q8_0", "q4_1", "q4_k_m"):
    model, _ = penzai_lm.load(name_or_path=gguf_path(base), quantize="keep")
  elif base == "int8":
    model, _ = penzai_lm.load(quantize=base)
  else:
    model, _ = penzai_lm.load(dtype=base)
  if fmt.endswith("-x8"):
    model = penzai_lm.kernels.with_cpu_kernels(model, int8_activations=True,
                                               donate=True)
  return model


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--formats", default="float32,bfloat16,int8")
  parser.add_argument("--contexts", default="16+32,128+64,512+64")
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  contexts = [tuple(map(int, c.split("+"))) for c in args.contexts.split(",")]
  print("format     prompt  new  decode tok/s")
  for fmt in args.formats.split(","):
    model = _load(fmt)
    for prompt_len, new in contexts:
      prompt = list(range(1000, 1000 + prompt_len))
      speeds = []
      for i in range(args.repeats + 1):
        result = penzai_lm.generate(model, [prompt], max_new_tokens=new,
                                    temperature=0.0)
        if i:  # the first run compiles
          speeds.append(result.timings.decode_tokens_per_s)
      print(f"{fmt:10s} {prompt_len:6d} {new:4d}  "
            f"{statistics.median(speeds):8.1f}", flush=True)


if __name__ == "__main__":
  main()
