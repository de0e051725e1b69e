"""penzai_lm.generate vs its peers on SmolLM2-135M-Instruct, float32, CPU.

What it measures, on one machine in one invocation (greedy decoding, no stop
tokens, so every engine produces exactly the requested number of tokens):

* ``penzai_lm``: ``penzai_lm.load()`` then ``penzai_lm.generate(model,
  prompts, temperature=0.0, stop_tokens=[])`` (one compiled prefill and one
  compiled decode loop).
* ``transformers``: Hugging Face transformers on torch CPU, float32, loading
  the same GGUF file (dequantized to float32), ``model.generate(...,
  do_sample=False)`` with its default KV cache, ``--threads`` torch threads.
* ``penzai_loop``: Penzai's own sampler as shipped,
  ``penzai.models.transformer.simple_decoding_loop.temperature_sample_pyloop``
  on Penzai's own llama model converted from the transformers model and
  wrapped in ``KVCachingTransformerLM.from_uncached``. It is an eager Python
  loop (~0.5 tok/s here), so it decodes only ``--loop-new`` tokens. It has no
  greedy mode (it divides the log-probs by the temperature and samples), so
  it runs at temperature 1e-4 with a fixed key, which picks the argmax unless
  two logits are within ~1e-3; the token agreement line checks it. Penzai
  0.2.5's ``llama_from_huggingface_model`` rejects transformers 5 configs
  (new attributes such as ``rope_parameters``), so the model is converted
  with ``llamalike_common.llamalike_from_huggingface_model`` after checking
  the fields it relies on here.

Batch 1 uses the first ``--prompt`` tokens of a fixed text; batch ``--batch``
(default 8; penzai_lm and transformers) uses that many different slices of
the same text, all of the same length (so no padding is needed; transformers
still gets an explicit attention mask), and reports aggregate throughput
(rows x decode steps / decode time).

How: every (engine, batch) pair runs in its own subprocess
(``sys.executable __file__ --engine NAME``) so torch and XLA threads never
compete and the peak RSS (``ru_maxrss``) belongs to one engine. Each does a
warm-up call (compilation, op caches) and then ``--repeats`` timed runs; the
table quotes medians with [min-max]. For every engine the same definitions
are used:

* time to first token (TTFT): from the start of the prefill until the first
  new token of every row is on the host;
* prefill tok/s: rows x prompt tokens / TTFT;
* decode tok/s: (new tokens - 1) per row / time from the first to the last
  token (times rows for the aggregate batch figure).

penzai_lm's figures are its own ``result.timings``; transformers' come from a
forward pre-hook (prefill start) and a stopping criterion that timestamps each
token; penzai_loop's from a wrapper around the model call. XLA uses all
cores. The machine may be shared: the load average is printed before and
after, and for each engine how many cores other processes used while it ran
(from /proc/stat); torch in particular slows down several-fold when another
process competes for its threads. ``--ceiling`` adds the steps/s of a compiled loop that only streams
the 538 MB of fp32 weights once per step (an upper bound for fp32 batch-1
decode).

Layout: this file is the entry point (arguments, one subprocess per
(engine, batch), the table, the ratios and the JSON); each engine's
measurement code is in ``peers/`` next to it (``penzai_lm_engine.py``,
``transformers_engine.py``, ``penzai_loop_engine.py``,
``weight_streaming_ceiling.py``), with the shared prompt text, timing
record and CPU/RSS counters in ``peers/common.py``.

Usage:
  python benchmarks/generate_vs_peers.py [--engines penzai_lm,transformers,penzai_loop]
      [--prompt 128] [--new 128] [--loop-new 8] [--batch 8] [--batch-new 128]
      [--repeats 3] [--threads 2] [--ceiling] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# Run as a script from any directory: ``peers`` lives next to this file.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position
from peers import penzai_lm_engine
from peers import penzai_loop_engine
from peers import transformers_engine
from peers import weight_streaming_ceiling
from peers.common import busy_cpu_s
from peers.common import children_cpu_s
from peers.common import make_prompts
from peers.common import MODEL
from peers.common import peak_rss_mb
from peers.common import summarize
# pylint: enable=g-import-not-at-top,wrong-import-position

ENGINES = ("penzai_lm", "transformers", "penzai_loop")
MARKER = "RESULT_JSON: "

CHILDREN = dict(penzai_lm=penzai_lm_engine.run,
                transformers=transformers_engine.run,
                penzai_loop=penzai_loop_engine.run,
                ceiling=weight_streaming_ceiling.run)


def leading_agreement(a: list[int], b: list[int]) -> int:
  """Number of identical leading tokens."""
  n = min(len(a), len(b))
  return next((i for i in range(n) if a[i] != b[i]), n)


def child_main(engine: str, spec_path: str):
  """Runs one engine and prints its figures as one JSON line."""
  with open(spec_path) as f:
    spec = json.load(f)
  out = CHILDREN[engine](spec)
  out["peak_rss_mb"] = peak_rss_mb()
  if "runs" in out:
    out["summary"] = summarize(out["runs"])
  print(MARKER + json.dumps(out), flush=True)


# ----------------------------------------------------------------------------
# Parent: runs the children and prints the table.


def run_child(engine: str, spec: dict) -> dict | None:
  """Runs ``engine`` in a fresh process; None (and its stderr) on failure."""
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump(spec, f)
  start, busy, ours = time.perf_counter(), busy_cpu_s(), children_cpu_s()
  label = engine if engine == "ceiling" else (
      f"{engine} (batch {len(spec['prompts'])}, {spec['new']} new)")
  print(f"running {label} ...", end=" ", flush=True)
  child = subprocess.run(
      [sys.executable, os.path.abspath(__file__), "--engine", engine,
       "--spec", f.name], capture_output=True, text=True, check=False)
  os.unlink(f.name)
  lines = [l for l in child.stdout.splitlines() if l.startswith(MARKER)]
  wall = time.perf_counter() - start
  # CPU that other processes took meanwhile: the noise on a shared machine.
  others = (busy_cpu_s() - busy) - (children_cpu_s() - ours)
  print(f"{wall:.0f} s (other processes used {max(others, 0) / wall:.2f}"
        f" of {os.cpu_count()} cores meanwhile)", flush=True)
  if child.returncode or not lines:
    print(f"  FAILED (exit {child.returncode}):\n"
          + "\n".join(child.stderr.splitlines()[-15:]), flush=True)
    return None
  out = json.loads(lines[-1][len(MARKER):])
  out.update(engine=engine, batch=len(spec["prompts"]), new=spec["new"],
             wall_s=wall, other_processes_cores=max(others, 0) / wall)
  return out


def _fmt(stat: dict, scale: float = 1.0, digits: int = 1) -> str:
  m, lo, hi = (stat[k] * scale for k in ("median", "min", "max"))
  return f"{m:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def print_table(results: list[dict]):
  """One row per (engine, batch): medians [min-max]."""
  head = (f"{'engine':<13}{'batch':>5}{'new':>5}  {'decode tok/s':<20}"
          f"{'prefill tok/s':<20}{'TTFT ms':<20}{'load s':>7}"
          f"{'warm-up s':>10}{'compile s':>10}{'peak RSS MB':>12}")
  print(head)
  print("-" * len(head))
  for r in results:
    s = r["summary"]
    decode = s["decode_agg_tok_s" if r["batch"] > 1 else "decode_tok_s"]
    compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
    print(f"{r['engine']:<13}{r['batch']:>5}{r['new']:>5}  "
          f"{_fmt(decode):<20}{_fmt(s['prefill_tok_s'], digits=0):<20}"
          f"{_fmt(s['ttft_s'], 1e3, 0):<20}{r['load_s']:>7.1f}"
          f"{r['warmup_s']:>10.1f}{compile_s:>10}{r['peak_rss_mb']:>12.0f}")
  print("(batch > 1: decode and prefill are aggregate over rows; decode per "
        "row = aggregate / batch)")


def ratios(ours: dict, peer: dict) -> dict:
  """Speed-ups of penzai_lm over a peer (> 1: penzai_lm faster)."""
  a, b = ours["summary"], peer["summary"]
  return dict(
      decode=a["decode_agg_tok_s"]["median"] / b["decode_agg_tok_s"]["median"],
      prefill=a["prefill_tok_s"]["median"] / b["prefill_tok_s"]["median"],
      ttft=b["ttft_s"]["median"] / a["ttft_s"]["median"])


def report(results: list[dict], extra: dict):
  """Prints the table, the ratios and the greedy token agreement."""
  by = {(r["engine"], r["batch"]): r for r in results}
  print()
  print_table(results)
  if "ceiling_steps_per_s" in extra:
    print(f"\nweight-streaming ceiling (538 MB fp32 read once per step): "
          f"{extra['ceiling_steps_per_s']:.1f} steps/s")
  extra["ratios"], extra["agreement"] = {}, {}
  pairs = [(e, b, p, by[("penzai_lm", b)]) for (e, b), p in by.items()
           if e != "penzai_lm" and ("penzai_lm", b) in by]
  if not pairs:
    return
  print("\nspeed-ups of penzai_lm (medians; > 1 means penzai_lm is faster; "
        "TTFT = peer TTFT / penzai_lm TTFT):")
  for engine, batch, peer, ours in pairs:
    r = ratios(ours, peer)
    extra["ratios"][f"penzai_lm/{engine}@batch{batch}"] = r
    print(f"  penzai_lm / {engine:<12} batch {batch}: decode "
          f"{r['decode']:.2f}x, prefill {r['prefill']:.2f}x, TTFT "
          f"{r['ttft']:.2f}x")
    same = [leading_agreement(a, b) for a, b in
            zip(ours["tokens"], peer["tokens"])]
    extra["agreement"][f"penzai_lm/{engine}@batch{batch}"] = dict(
        engine=engine, batch=batch, compared=min(ours["new"], peer["new"]),
        identical_leading_tokens=same)
  print("\ngreedy agreement with penzai_lm (identical leading tokens):")
  for a in extra["agreement"].values():
    same = a["identical_leading_tokens"]
    rows = f"min over {len(same)} rows " if len(same) > 1 else ""
    print(f"  {a['engine']:<12} batch {a['batch']}: {rows}{min(same)} of "
          f"{a['compared']}")


def build_parser() -> argparse.ArgumentParser:
  """The command-line flags (``--engine`` and ``--spec``: child process)."""
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--engines", default=",".join(ENGINES),
                      help="comma-separated subset of " + ",".join(ENGINES))
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--new", type=int, default=128)
  parser.add_argument("--loop-new", type=int, default=8,
                      help="new tokens for penzai_loop (~2 s each)")
  parser.add_argument("--batch", type=int, default=8,
                      help="batch size of the aggregate run (0: skip)")
  parser.add_argument("--batch-new", type=int, default=None,
                      help="new tokens in the batch run (default: --new)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--threads", type=int, default=2,
                      help="torch threads (transformers)")
  parser.add_argument("--ceiling", action="store_true",
                      help="also measure the weight-streaming ceiling")
  parser.add_argument("--json", default=None, help="write all figures here")
  parser.add_argument("--engine", help=argparse.SUPPRESS)  # Child process.
  parser.add_argument("--spec", help=argparse.SUPPRESS)
  return parser


def make_jobs(args, engines: list[str]) -> list[tuple[str, dict]]:
  """(engine, spec) per child: batch 1 for all, then ``--batch`` rows."""
  from penzai_lm.fetch import resolve_model_path  # pylint: disable=g-import-not-at-top
  from penzai_lm.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top

  tokenizer = Tokenizer.from_gguf(resolve_model_path(MODEL))
  common = dict(repeats=args.repeats, threads=args.threads)
  jobs = []
  for engine in engines:
    new = args.loop_new if engine == "penzai_loop" else args.new
    jobs.append((engine, dict(
        common, new=new, prompts=make_prompts(tokenizer, args.prompt, 1))))
  if args.batch > 1:
    for engine in [e for e in engines if e != "penzai_loop"]:
      jobs.append((engine, dict(
          common, new=args.batch_new or args.new,
          prompts=make_prompts(tokenizer, args.prompt, args.batch))))
  return jobs


def main():
  parser = build_parser()
  args = parser.parse_args()
  if args.engine:
    child_main(args.engine, args.spec)
    return
  engines = [e for e in args.engines.split(",") if e]
  unknown = set(engines) - set(ENGINES)
  if unknown:
    parser.error(f"unknown engines {sorted(unknown)}; choose from {ENGINES}")
  jobs = make_jobs(args, engines)

  extra = dict(model=MODEL, dtype="float32", prompt_tokens=args.prompt,
               repeats=args.repeats, threads=args.threads,
               cpu_count=os.cpu_count(), loadavg_before=os.getloadavg())
  print(f"SmolLM2-135M-Instruct float32, greedy, {args.prompt}-token prompts,"
        f" {args.repeats} timed runs after a warm-up; {os.cpu_count()} CPUs;"
        f" load average before: "
        + ", ".join(f"{x:.2f}" for x in extra["loadavg_before"]), flush=True)
  results = [r for r in (run_child(e, s) for e, s in jobs) if r is not None]
  if args.ceiling:
    out = run_child("ceiling", dict(repeats=args.repeats,
                                    threads=args.threads, new=0,
                                    prompts=[[]]))
    if out:
      extra["ceiling_steps_per_s"] = out["steps_per_s"]
  extra["loadavg_after"] = os.getloadavg()
  report(results, extra)
  print("load average after: "
        + ", ".join(f"{x:.2f}" for x in extra["loadavg_after"]))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(extra, results=results), f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
