"""Decode speed of penzai_lm.generation on a random SmolLM2-sized model, and
an inspection of the compiled decode-loop HLO for weight- or cache-sized
copies and transposes.

Usage:
  python benchmarks/decode_loop_hlo.py [--batch 1 8] [--stack both|stacked|unstacked]
      [--prompt 128] [--new 128] [--repeats 2] [--hlo-dir /tmp/hlo]
      [--keep-stacks] [--stream-chunk 8]

Reports, per configuration: compile time, time to first token, prefill and
decode tokens/s (medians over repeats, after a warm-up call), and the large
(>= 1 MB) copy / transpose / dynamic-update-slice ops inside the while-loop
body of the optimized HLO.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import time

import numpy as np

from penzai_lm.generation import Engine
from penzai_lm.model import TransformerConfig
from penzai_lm.model import build_transformer

SMOLLM2 = TransformerConfig(
    family="llama", vocab_size=49152, hidden_size=576, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, mlp_hidden_size=1536,
    tie_embeddings=True, rope_base=1e5, max_position_embeddings=8192,
)

_SHAPE = re.compile(r"(f32|s32|bf16|f16|pred|u32)\[([0-9,]*)\]")
_BYTES = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "pred": 1, "u32": 4}


def _op_bytes(line: str) -> int:
  m = _SHAPE.search(line.split("=", 1)[1] if "=" in line else line)
  if not m:
    return 0
  dims = [int(d) for d in m.group(2).split(",") if d]
  return int(np.prod(dims)) * _BYTES[m.group(1)] if dims else _BYTES[m.group(1)]


def _computations(hlo: str) -> dict[str, list[str]]:
  comps, name, lines = {}, None, []
  for line in hlo.splitlines():
    header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if header and not line.startswith(" "):
      name, lines = header.group(2), []
      comps[name] = lines
    elif name is not None:
      lines.append(line)
  return comps


_INSTR = re.compile(
    r"^\s*(?:ROOT )?%[\w.\-]+ = (\w+)\[([0-9,]*)\]\S* ([\w\-]+)\(")


def _called(lines, include_fusions):
  """Computations called by these instructions (fusion bodies optional)."""
  out = set()
  for line in lines:
    keys = ["body=", "condition=", "to_apply=", "branch_computations={",
            "true_computation=", "false_computation="]
    if include_fusions or " fusion(" not in line:
      keys.append("calls=")
    for key in keys:
      for m in re.finditer(re.escape(key) + r"%?([\w.\-]+(?:, %?[\w.\-]+)*)",
                           line):
        out.update(x.strip().lstrip("%") for x in m.group(1).split(","))
  return out


def inspect_loop_body(hlo: str, threshold: int = 1 << 20):
  """Materialized large copies / transposes / concatenates / in-place
  updates executed by each decode step (the outer while loop's body).

  Only top-level instructions count (and fusions, by their root op): a
  transpose inside a fusion that only feeds a gather or a dot is computed
  element by element and never written out.
  """
  comps = _computations(hlo)
  entry = next((n for n in comps if n.startswith("main")), None)
  bodies = [re.search(r"body=%?([\w.\-]+)", l).group(1)
            for l in comps.get(entry, []) if " while(" in l]
  if not bodies:
    return {}
  body = max(bodies, key=lambda b: len(comps.get(b, [])))
  seen, todo = set(), [body]
  while todo:
    c = todo.pop()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    todo.extend(_called(comps[c], include_fusions=False))
  found, sizes = collections.Counter(), {}
  for c in seen:
    for line in comps[c]:
      m = _INSTR.match(line)
      if not m:
        continue
      dtype, dims, op = m.groups()
      if op == "fusion":
        called = re.search(r"calls=%?([\w.\-]+)", line)
        roots = [l for l in comps.get(called.group(1), [])
                 if l.strip().startswith("ROOT")] if called else []
        root = _INSTR.match(roots[0]) if roots else None
        op = f"fusion({root.group(3)})" if root else "fusion"
      if not any(k in op for k in ("copy", "transpose", "concatenate",
                                   "dynamic-update-slice")):
        continue
      shape = [int(d) for d in dims.split(",") if d]
      nbytes = int(np.prod(shape or [1])) * _BYTES.get(dtype, 4)
      if nbytes >= threshold:
        key = f"{op} {dtype}{shape}"
        found[key] += 1
        sizes[key] = nbytes
  return {k: (n, sizes[k]) for k, n in found.most_common()}


def measure_stream(engine, model, batch, prompt_len, new, chunk_size):
  """Streaming: wall-clock decode tok/s per row, host work included."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 49152, prompt_len).tolist() for _ in range(batch)]
  settings = dict(max_new_tokens=new, temperature=0.0, stop_tokens=[])
  engine.stream(model, prompts, chunk_size=chunk_size, **settings).run_to_end()
  s = engine.stream(model, prompts, chunk_size=chunk_size, **settings)
  start = time.perf_counter()
  first = None
  for _ in s:
    if first is None:
      first = time.perf_counter()
  end = time.perf_counter()
  result = s.result
  steps = max(result.lengths) - 1
  return dict(
      stream_chunk=chunk_size,
      stream_ttft_ms=(first - start) * 1e3,
      stream_decode_tok_s_per_row=steps / (end - first),
  )


def measure(engine, model, batch, prompt_len, new, repeats):
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 49152, prompt_len).tolist() for _ in range(batch)]
  settings = dict(max_new_tokens=new, temperature=0.0, stop_tokens=[])
  first = engine.generate(model, prompts, **settings)
  runs = [engine.generate(model, prompts, **settings) for _ in range(repeats)]
  med = lambda f: statistics.median(f(r.timings) for r in runs)  # noqa: E731
  return dict(
      compile_s=first.timings.compile_s,
      ttft_ms=med(lambda t: t.time_to_first_token_s) * 1e3,
      prefill_tok_s=med(lambda t: t.prefill_tokens_per_s),
      decode_tok_s_per_row=med(lambda t: t.decode_tokens_per_s),
      decode_tok_s_total=med(lambda t: t.decode_tokens_per_s) * batch,
      steps=runs[0].timings.decode_steps,
  )


def blocks_first(model, axis="blocks"):
  """The same model with every stacked array stored with ``axis`` first."""
  from penzai import pz  # pylint: disable=g-import-not-at-top

  def relayout(x):
    if axis in x.named_shape and list(x.named_shape)[0] != axis:
      names = [axis] + [n for n in x.named_shape if n != axis]
      return pz.nx.wrap(np.asarray(x.unwrap(*names))).tag(*names)
    return x

  frozen = pz.freeze_params(model)
  return (pz.select(frozen).at_instances_of(pz.nx.NamedArrayBase)
          .apply(relayout))


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--stack", default="both")
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--new", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--hlo-dir", default=None)
  parser.add_argument("--blocks-first", action="store_true",
                      help="store stacked weights with the layer axis first")
  parser.add_argument("--stream-chunk", type=int, default=0,
                      help="also measure streaming with this chunk size")
  parser.add_argument(
      "--keep-stacks", action="store_true",
      help="decode with the model's layer stack as is (no unstacking)")
  args = parser.parse_args()
  stacks = {"both": [True, False], "stacked": [True],
            "unstacked": [False]}[args.stack]
  for stacked in stacks:
    start = time.perf_counter()
    model = build_transformer(SMOLLM2.replace(use_layer_stack=stacked), seed=0)
    if args.blocks_first:
      model = blocks_first(model)
    print(f"\n== use_layer_stack={stacked} (built in"
          f" {time.perf_counter() - start:.1f}s)", flush=True)
    for batch in args.batch:
      engine = Engine(unstack_layer_stacks=not args.keep_stacks)
      stats = measure(engine, model, batch, args.prompt, args.new, args.repeats)
      print(f"batch {batch}: " + ", ".join(
          f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
          for k, v in stats.items()), flush=True)
      if args.stream_chunk:
        stats = measure_stream(engine, model, batch, args.prompt, args.new,
                               args.stream_chunk)
        print(f"batch {batch} streamed: " + ", ".join(
            f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
            for k, v in stats.items()), flush=True)
      for _, program in engine.programs.items("decode"):
        hlo = program.as_text()
        if args.hlo_dir:
          os.makedirs(args.hlo_dir, exist_ok=True)
          path = os.path.join(
              args.hlo_dir, f"decode_b{batch}_{'stack' if stacked else 'unrolled'}"
              f"{'_kept' if args.keep_stacks else ''}.txt")
          with open(path, "w") as f:
            f.write(hlo)
        big = inspect_loop_body(hlo)
        print("  materialized copy/transpose/update ops >= 1 MiB per decode"
              " step (dynamic-update-slice = in-place cache write):")
        for k, (n, b) in big.items():
          print(f"    {n:3d} x {k}  ({b / 2**20:.1f} MiB each)")


if __name__ == "__main__":
  main()
