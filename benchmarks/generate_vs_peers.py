"""penzai_lm.generate vs its peers on SmolLM2-135M-Instruct, CPU.

What it measures, on one machine in one invocation (greedy decoding, no stop
tokens, so every engine produces exactly the requested number of tokens):

* ``penzai_lm``: ``penzai_lm.load()`` (float32) then ``penzai_lm.generate(
  model, prompts, temperature=0.0, stop_tokens=[])`` (one compiled prefill and
  one compiled decode loop). Variants differ only in ``penzai_lm.load``'s
  arguments (the table ``VARIANTS`` in ``peers/penzai_lm_engine.py``):
  ``penzai_lm-bf16`` (``dtype="bfloat16"``), and, when penzai_lm supports
  them, ``penzai_lm-int8`` (``quantize="int8"``) and ``penzai_lm-q8_0`` /
  ``penzai_lm-q4_1`` (the GGUF files below, ``quantize="keep"``).
* ``llamacpp-f32``, ``llamacpp-f16``, ``llamacpp-q8_0``, ``llamacpp-q4_1``:
  llama.cpp (llama-cpp-python's low-level API, argmax of the logits, all
  rows of a batch as sequences of one ``llama_batch``), ``--threads``
  threads, on GGUF files that ``peers/make_ggufs.py`` writes from the very
  file penzai_lm loads. It runs in its own virtualenv (built by
  ``peers/setup_llamacpp.sh``, outside the repository); without it, or
  without the files, these engines are skipped with a line saying how to
  set them up. llama.cpp runs at its defaults (weights repacked at load
  where it has a layout for the CPU); ``llamacpp-<variant>-norepack``
  (not run by default) turns that off, and ``llamacpp-noamx-<variant>``
  runs a llama.cpp built without AMX (``setup_llamacpp.sh noamx``; its
  AMX path crashes on this project's Intel machines).
* ``transformers``: Hugging Face transformers on torch CPU, float32, loading
  the same GGUF file (dequantized to float32), ``model.generate(...,
  do_sample=False)`` with its default KV cache, ``--threads`` torch threads.
* ``penzai_loop``: Penzai 0.2.5's own eager sampler
  (``simple_decoding_loop.temperature_sample_pyloop`` on Penzai's llama
  converted from the transformers model; see ``peers/penzai_loop_engine.py``).
  At ~0.5 tok/s it decodes only ``--loop-new`` tokens, batch 1 only; having
  no greedy mode, it runs at temperature 1e-4 with a fixed key.

``--model gemma3-270m`` runs Gemma 3 270M instead, from its Q4_K_M file:
``penzai_lm`` (float32), ``penzai_lm-bf16``, ``penzai_lm-int8``,
``penzai_lm-keep`` (``quantize="keep"``: the file's Q4_K, Q6_K, Q5_0 and
Q8_0 blocks), ``transformers`` and ``llamacpp-file`` (llama.cpp on that same
file; with SmolLM2 it is the Q4_1 source file).

Batch 1 uses the first ``--prompt`` tokens of a fixed text; batch ``--batch``
(default 8) uses that many different slices of the same text, all of the
same length (no padding), and reports aggregate throughput (rows x decode
steps / decode time). All engines get the same token ids.

How: every (engine, batch) pair runs in its own subprocess (llama.cpp's
with the llama.cpp venv's python) so that threads never compete and the peak
RSS (``ru_maxrss``) belongs to one engine. Each does a warm-up call
(compilation, op caches) and then ``--repeats`` timed runs. ``--rounds``
rounds each run every (engine, batch) once, in a rotated order, so that a
burst of load on a shared machine hits every engine alike; the table quotes
medians [min-max] over rounds x repeats (load and warm-up: medians over
rounds; peak RSS: the largest). Definitions, the same for every engine:

* time to first token (TTFT): from the start of the prefill until the first
  new token of every row is on the host;
* prefill tok/s: rows x prompt tokens / TTFT;
* decode tok/s: (new tokens - 1) per row / time from the first to the last
  token (times rows for the aggregate batch figure).

penzai_lm's figures are its own ``result.timings``; transformers' come from a
forward pre-hook and a stopping criterion that timestamps each token;
llama.cpp's from timestamps around its ``llama_decode`` calls;
penzai_loop's from a wrapper around the model call. The ratios compare
penzai_lm (float32) with every other engine and each penzai_lm variant with
its closest llama.cpp variant; the greedy agreement counts, per row, the
identical leading tokens among the first ``--agree`` (32) of every engine
and penzai_lm float32. The load average is printed before and after, and for
each child how many cores other processes used while it ran (/proc/stat).
llama.cpp (and torch) synchronize their threads with OpenMP barriers, which
spin by default: with another process on one of the 2 cores here, 2-thread
llama.cpp F32 decode fell from 23-28 tok/s (nearly idle) to 0.3-0.5.
``--omp-wait passive`` sets ``OMP_WAIT_POLICY=passive`` in every child:
sleeping barriers, 14 tok/s under that load but ~8 tok/s nearly idle.
``--ceiling`` adds the steps/s of a compiled loop that only streams the
538 MB of fp32 weights once per step (an upper bound for fp32 batch-1
decode).

Layout: this file is the entry point (arguments, the children, the table,
the ratios and the JSON); each engine's code is in ``peers/`` next to it,
with the shared prompt text, timing record and CPU/RSS counters in
``peers/common.py``.

Usage:
  bash benchmarks/peers/setup_llamacpp.sh      # once: llama.cpp (~10 min)
  python benchmarks/peers/make_ggufs.py        # once: the GGUF variants
  python benchmarks/generate_vs_peers.py [--engines penzai_lm,llamacpp-f32,...]
      [--model smollm2-135m-instruct|gemma3-270m] [--prompt 128] [--new 128] [--loop-new 8] [--batch 8] [--batch-new N]
      [--repeats 3] [--rounds 2] [--threads 2] [--agree 32]
      [--omp-wait default|passive|active] [--ceiling] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

# Run as a script from any directory: ``peers`` lives next to this file.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# pylint: disable=g-import-not-at-top,wrong-import-position
from peers import llamacpp_engine
from peers import penzai_lm_engine
from peers.common import busy_cpu_s
from peers.common import children_cpu_s
from peers.common import make_prompts
from peers.common import MODEL
from peers.common import MODELS
from peers.common import summarize
# pylint: enable=g-import-not-at-top,wrong-import-position

PENZAI_LM = tuple(penzai_lm_engine.VARIANTS)
ENGINES = (*PENZAI_LM, "transformers", "penzai_loop", *llamacpp_engine.ENGINES)
DEFAULT_ENGINES = (*penzai_lm_engine.ENABLED, "transformers", "penzai_loop",
                   *(e for e in llamacpp_engine.ENGINES
                     if llamacpp_engine.variant(e)[1]))
MARKER = llamacpp_engine.MARKER
REFERENCE = "penzai_lm"  # float32: the ratios and the agreement compare to it.
CHILD_ENV = {}  # Extra environment variables of every child (--omp-wait).

# Engine -> module with ``run(spec)``, imported in the child process only.
CHILDREN = dict({e: "peers.penzai_lm_engine" for e in PENZAI_LM},
                transformers="peers.transformers_engine",
                penzai_loop="peers.penzai_loop_engine",
                ceiling="peers.weight_streaming_ceiling")


def leading_agreement(a: list[int], b: list[int]) -> int:
  """Number of identical leading tokens."""
  n = min(len(a), len(b))
  return next((i for i in range(n) if a[i] != b[i]), n)


def child_main(engine: str, spec_path: str):
  """Runs one engine and prints its figures as one JSON line."""
  from peers.common import peak_rss_mb  # pylint: disable=g-import-not-at-top
  with open(spec_path) as f:
    spec = json.load(f)
  out = importlib.import_module(CHILDREN[engine]).run(spec)
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
  if engine in llamacpp_engine.ENGINES:
    command = [llamacpp_engine.python_of(engine), llamacpp_engine.__file__,
               "--spec", f.name]
  else:
    command = [sys.executable, os.path.abspath(__file__), "--engine", engine,
               "--spec", f.name]
  start, busy, ours = time.perf_counter(), busy_cpu_s(), children_cpu_s()
  label = engine if engine == "ceiling" else (
      f"{engine} (batch {len(spec['prompts'])}, {spec['new']} new)")
  print(f"running {label} ...", end=" ", flush=True)
  child = subprocess.run(command, capture_output=True, text=True, check=False,
                         env=dict(os.environ, **CHILD_ENV))
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


def merge_rounds(outs: list[dict]) -> dict:
  """One record from the rounds of one (engine, batch): runs pooled."""
  out = dict(outs[0], rounds=len(outs))
  out["runs"] = [r for o in outs for r in o["runs"]]
  out["summary"] = summarize(out["runs"])
  for key in ("load_s", "warmup_s", "compile_s", "other_processes_cores"):
    if key in out:
      out[key] = statistics.median(o[key] for o in outs)
  out["peak_rss_mb"] = max(o["peak_rss_mb"] for o in outs)
  out["wall_s"] = sum(o["wall_s"] for o in outs)
  out["tokens_same_every_round"] = all(o["tokens"] == outs[0]["tokens"]
                                       for o in outs)
  return out


def run_rounds(jobs: list[tuple[str, dict]], rounds: int) -> list[dict]:
  """Every job once per round (order rotated each round); merged records."""
  done = {i: [] for i in range(len(jobs))}
  for r in range(rounds):
    print(f"-- round {r + 1} of {rounds}", flush=True)
    shift = r % len(jobs)
    for i in [*range(shift, len(jobs)), *range(shift)]:
      out = run_child(*jobs[i])
      if out is not None:
        done[i].append(out)
  return [merge_rounds(outs) for outs in done.values() if outs]


def _fmt(stat: dict, scale: float = 1.0, digits: int = 1) -> str:
  m, lo, hi = (stat[k] * scale for k in ("median", "min", "max"))
  return f"{m:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


def print_table(results: list[dict]):
  """One row per (engine, batch): medians [min-max]."""
  head = (f"{'engine':<15}{'batch':>5}{'new':>5}  {'decode tok/s':<20}"
          f"{'prefill tok/s':<20}{'TTFT ms':<20}{'load s':>7}"
          f"{'warm-up s':>10}{'compile s':>10}{'peak RSS MB':>12}")
  print(head)
  print("-" * len(head))
  for r in results:
    s = r["summary"]
    decode = s["decode_agg_tok_s" if r["batch"] > 1 else "decode_tok_s"]
    compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
    print(f"{r['engine']:<15}{r['batch']:>5}{r['new']:>5}  "
          f"{_fmt(decode):<20}{_fmt(s['prefill_tok_s'], digits=0):<20}"
          f"{_fmt(s['ttft_s'], 1e3, 0):<20}{r['load_s']:>7.1f}"
          f"{r['warmup_s']:>10.1f}{compile_s:>10}{r['peak_rss_mb']:>12.0f}")
  print("(medians [min-max] over rounds x repeats; batch > 1: decode and "
        "prefill are aggregate over rows; decode per row = aggregate / batch)")


def ratios(ours: dict, peer: dict) -> dict:
  """Speed-ups of penzai_lm over a peer (> 1: penzai_lm faster)."""
  a, b = ours["summary"], peer["summary"]
  return dict(
      decode=a["decode_agg_tok_s"]["median"] / b["decode_agg_tok_s"]["median"],
      prefill=a["prefill_tok_s"]["median"] / b["prefill_tok_s"]["median"],
      ttft=b["ttft_s"]["median"] / a["ttft_s"]["median"])


def report(results: list[dict], extra: dict, agree: int):
  """Prints the table, the ratios and the greedy token agreement."""
  by = {(r["engine"], r["batch"]): r for r in results}
  print()
  print_table(results)
  if "ceiling_steps_per_s" in extra:
    print(f"\nweight-streaming ceiling (538 MB fp32 read once per step): "
          f"{extra['ceiling_steps_per_s']:.1f} steps/s")
  extra["ratios"], extra["agreement"] = {}, {}
  pairs = [(REFERENCE, e, b) for (e, b) in by
           if e != REFERENCE and (REFERENCE, b) in by]
  # Each variant against every llama.cpp build and repack setting of its
  # closest file that ran (the native build's defaults may have crashed).
  peer_pairs = [
      (e, peer, b) for (e, b) in by if e in PENZAI_LM and e != REFERENCE
      for (peer, pb) in by if pb == b and peer in llamacpp_engine.ENGINES
      and llamacpp_engine.variant(peer)[0] == llamacpp_engine.variant(
          penzai_lm_engine.peer(e))[0]]
  pairs += peer_pairs
  if pairs:  # Each penzai_lm engine vs each peer at the same batch.
    print("\nspeed-ups (medians; > 1 means the penzai_lm engine is faster; "
          "TTFT = peer TTFT / penzai_lm TTFT):")
  for ours, engine, batch in pairs:
    r = ratios(by[(ours, batch)], by[(engine, batch)])
    extra["ratios"][f"{ours}/{engine}@batch{batch}"] = r
    print(f"  {ours:<14} / {engine:<14} batch {batch}: decode "
          f"{r['decode']:.2f}x, prefill {r['prefill']:.2f}x, TTFT "
          f"{r['ttft']:.2f}x")
  for (engine, batch), peer in by.items():
    ref = by.get((REFERENCE, batch))
    if engine == REFERENCE or ref is None:
      continue
    n = min(agree, ref["new"], peer["new"])
    extra["agreement"][f"{REFERENCE}/{engine}@batch{batch}"] = dict(
        engine=engine, batch=batch, compared=n,
        identical_leading_tokens=[leading_agreement(a[:n], b[:n]) for a, b
                                  in zip(ref["tokens"], peer["tokens"])])
  if extra["agreement"]:
    print(f"\ngreedy agreement with {REFERENCE} (float32): identical leading"
          f" tokens among the first {agree}:")
  for a in extra["agreement"].values():
    same = a["identical_leading_tokens"]
    rows = f"min over {len(same)} rows " if len(same) > 1 else ""
    print(f"  {a['engine']:<15} batch {a['batch']}: {rows}{min(same)} of "
          f"{a['compared']}" + (f" (rows: {same})" if len(same) > 1 else ""))
  # Where the arithmetic is the same (each -x8 variant quantizes its
  # activations to int8 blocks as llama.cpp does), the tokens should be
  # too: every penzai_lm variant against the llama.cpp runs of its file.
  extra["peer_agreement"] = {}
  for ours, engine, batch in peer_pairs:
    a, b = by[(ours, batch)], by[(engine, batch)]
    n = min(agree, a["new"], b["new"])
    extra["peer_agreement"][f"{ours}/{engine}@batch{batch}"] = same = [
        leading_agreement(x[:n], y[:n]) for x, y in zip(a["tokens"],
                                                        b["tokens"])]
  if extra["peer_agreement"]:
    print(f"\ngreedy agreement of each variant with llama.cpp on its file:"
          f" identical leading tokens among the first {agree} (min over"
          " rows):")
  for key, same in extra["peer_agreement"].items():
    print(f"  {key}: {min(same)}" + (f" (rows: {same})" if len(same) > 1
                                     else ""))
  unstable = [r["engine"] for r in results
              if not r.get("tokens_same_every_round", True)]
  if unstable:
    print(f"  tokens changed between rounds: {unstable}")


def build_parser() -> argparse.ArgumentParser:
  """The command-line flags (``--engine`` and ``--spec``: child process)."""
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                      help="comma-separated subset of " + ",".join(ENGINES))
  parser.add_argument("--model", choices=MODELS, default=MODEL,
                      help="the model (its own GGUF file for penzai_lm-keep"
                      " and llamacpp-file; the make_ggufs.py variants are"
                      " SmolLM2's)")
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--new", type=int, default=128)
  parser.add_argument("--loop-new", type=int, default=8,
                      help="new tokens for penzai_loop (~2 s each)")
  parser.add_argument("--batch", type=int, default=8,
                      help="batch size of the aggregate run (0: skip)")
  parser.add_argument("--batch-new", type=int, default=None,
                      help="new tokens in the batch run (default: --new)")
  parser.add_argument("--repeats", type=int, default=3,
                      help="timed runs per child, after its warm-up")
  parser.add_argument("--rounds", type=int, default=2,
                      help="each round runs every (engine, batch) once")
  parser.add_argument("--threads", type=int, default=2,
                      help="torch threads (transformers), llama.cpp threads")
  parser.add_argument("--agree", type=int, default=32,
                      help="greedy agreement over this many first tokens")
  parser.add_argument("--omp-wait", choices=("default", "passive", "active"),
                      default="default", help="OMP_WAIT_POLICY of the "
                      "children (llama.cpp, torch); passive: no spinning")
  parser.add_argument("--ceiling", action="store_true",
                      help="also measure the weight-streaming ceiling")
  parser.add_argument("--json", default=None, help="write all figures here")
  parser.add_argument("--engine", help=argparse.SUPPRESS)  # Child process.
  parser.add_argument("--spec", help=argparse.SUPPRESS)
  return parser


def unavailable(engine: str, model: str = MODEL) -> str | None:
  """Why ``engine`` cannot run here (with how to set it up), or None."""
  if model != MODEL and engine not in (
      *penzai_lm_engine.ANY_MODEL, "llamacpp-file", "llamacpp-file-norepack",
      "transformers"):
    return f"its files are SmolLM2's, and --model is {model}"
  if engine in llamacpp_engine.ENGINES:
    return llamacpp_engine.missing(engine)
  path = penzai_lm_engine.VARIANTS.get(engine, ({},))[0].get("name_or_path")
  if path and not os.path.exists(path):
    return f"no {path}; write it with: python benchmarks/peers/make_ggufs.py"
  return None


def make_jobs(args, engines: list[str]) -> list[tuple[str, dict]]:
  """(engine, spec) per child: batch 1 for all, then ``--batch`` rows."""
  from penzai_lm.fetch import resolve_model_path  # pylint: disable=g-import-not-at-top
  from penzai_lm.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top

  model_path = resolve_model_path(args.model)
  tokenizer = Tokenizer.from_gguf(model_path)
  common = dict(repeats=args.repeats, threads=args.threads, model=args.model)

  def spec(engine, new, rows):
    out = dict(common, new=new,
               prompts=make_prompts(tokenizer, args.prompt, rows))
    if engine in PENZAI_LM:
      out["load_kwargs"] = penzai_lm_engine.load_kwargs(engine)
      out["int8_activations"] = penzai_lm_engine.int8_activations(engine)
    if engine in llamacpp_engine.ENGINES:
      name, out["repack"] = llamacpp_engine.variant(engine)
      out["gguf"] = (str(model_path) if name == "file"
                     else llamacpp_engine.gguf_path(name))
    return out

  jobs = [(e, spec(e, args.loop_new if e == "penzai_loop" else args.new, 1))
          for e in engines]
  if args.batch > 1:
    jobs += [(e, spec(e, args.batch_new or args.new, args.batch))
             for e in engines if e != "penzai_loop"]
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
  for engine in list(engines):
    why = unavailable(engine, args.model)
    if why:
      print(f"skipping {engine}: {why}")
      engines.remove(engine)
  jobs = make_jobs(args, engines)
  if args.omp_wait != "default":
    CHILD_ENV["OMP_WAIT_POLICY"] = args.omp_wait

  extra = dict(model=args.model, engines=engines, prompt_tokens=args.prompt,
               repeats=args.repeats, rounds=args.rounds, threads=args.threads,
               child_env=CHILD_ENV,
               cpu_count=os.cpu_count(), loadavg_before=os.getloadavg())
  print(f"{args.model}, greedy, {args.prompt}-token prompts,"
        f" {args.rounds} rounds of a warm-up and {args.repeats} timed runs;"
        f" {os.cpu_count()} CPUs; {CHILD_ENV or 'no extra env'}; load average"
        " before: "
        + ", ".join(f"{x:.2f}" for x in extra["loadavg_before"]), flush=True)
  results = run_rounds(jobs, args.rounds) if jobs else []
  if args.ceiling:
    out = run_child("ceiling", dict(repeats=args.repeats,
                                    threads=args.threads, new=0,
                                    prompts=[[]]))
    if out:
      extra["ceiling_steps_per_s"] = out["steps_per_s"]
  extra["loadavg_after"] = os.getloadavg()
  report(results, extra, args.agree)
  print("load average after: "
        + ", ".join(f"{x:.2f}" for x in extra["loadavg_after"]))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(extra, results=results), f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
