"""The ``penzai_lm`` engine of generate_vs_peers.py: penzai_lm.generate.

Greedy decoding without stop tokens; every figure comes from the
``result.timings`` that penzai_lm.generate returns.
"""

from __future__ import annotations

import time

from peers.common import run_record


def run(spec: dict) -> dict:
  """penzai_lm.generate, greedy, timings from ``result.timings``."""
  import penzai_lm  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  model, _ = penzai_lm.load()
  out = dict(load_s=time.perf_counter() - start)
  prompts, new = spec["prompts"], spec["new"]
  settings = dict(max_new_tokens=new, temperature=0.0, stop_tokens=[])
  start = time.perf_counter()
  warm = penzai_lm.generate(model, prompts, **settings)
  out.update(warmup_s=time.perf_counter() - start,
             compile_s=warm.timings.compile_s, runs=[])
  for _ in range(spec["repeats"]):
    result = penzai_lm.generate(model, prompts, **settings)
    t = result.timings
    out["runs"].append(run_record(
        len(prompts), len(prompts[0]), t.time_to_first_token_s,
        t.decode_steps, t.decode_s, t.total_s))
    out["compile_s_timed_runs"] = t.compile_s
  out["tokens"] = result.tokens
  return out
