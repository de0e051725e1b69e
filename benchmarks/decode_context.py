"""Decode speed against context length on the real SmolLM2, per weight
format: where the per-step cost of attending over the KV cache shows.

Usage:
  python benchmarks/decode_context.py [--formats float32,bfloat16,int8]
      [--contexts 16+32,128+64,512+64] [--repeats 2]

Each context is ``prompt+new`` tokens, greedy, batch 1. Prints the median
decode tokens/s of ``--repeats`` runs after a warm-up run (which compiles).
"""

from __future__ import annotations

import argparse
import statistics

import penzai_lm


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--formats", default="float32,bfloat16,int8")
  parser.add_argument("--contexts", default="16+32,128+64,512+64")
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  contexts = [tuple(map(int, c.split("+"))) for c in args.contexts.split(",")]
  print("format     prompt  new  decode tok/s")
  for fmt in args.formats.split(","):
    kwargs = {"quantize": fmt} if fmt in ("int8",) else {"dtype": fmt}
    model, _ = penzai_lm.load(**kwargs)
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
