"""How long ``penzai-lm generate`` takes to print its first generated text.

Runs ``python -m penzai_lm.cli generate "The capital of France is"
--max-new-tokens 8`` (the default model, SmolLM2-135M-Instruct) in fresh
processes, each with a new, empty persistent compilation cache folder
(``PENZAI_LM_JAX_CACHE``), as a first run on a machine finds it: the
import, the load (model and tokenizer), tracing and compiling, the
prefill. Prints, per process, the seconds from its start to the first
generated text on its stdout and to its exit, and the text; then the
medians. ``--baseline DIR`` (a checkout of another commit, e.g. from
``git worktree add``) alternates its processes with this checkout's, a
pair per round, so that both sides share a round's load on a shared
machine, and prints in how many rounds this checkout was faster.

  python benchmarks/cli_first_text.py [--rounds 5] [--baseline /tmp/before]
      [--filled] [-- extra generate arguments, e.g. --quantize keep]

``--filled`` keeps one cache folder per side across the rounds (after a
first run that fills it): the second and later runs on a machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = "The capital of France is"
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_once(checkout: str, cache: str, extra: list[str]) -> dict:
  """One fresh ``penzai-lm generate`` process of ``checkout``."""
  env = dict(os.environ, PYTHONPATH=checkout, PENZAI_LM_JAX_CACHE=cache)
  # stderr goes to a file: a pipe nobody reads until stdout ends would
  # stall a command that wrote more than the pipe holds there.
  with tempfile.TemporaryFile() as err_file:
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "penzai_lm.cli", "generate", PROMPT,
         "--max-new-tokens", "8", *extra],
        stdout=subprocess.PIPE, stderr=err_file, env=env, cwd=checkout)
    out = b""
    # The command prints the prompt, then the generated text as it comes.
    while not out[len(PROMPT):].strip():
      byte = proc.stdout.read(1)
      if not byte:
        break
      out += byte
    first = time.perf_counter() - start
    out += proc.stdout.read()
    code = proc.wait()
    exit_s = time.perf_counter() - start
    err_file.seek(0)
    err = err_file.read().decode(errors="replace")
  if code != 0:
    raise RuntimeError(f"{checkout}: penzai-lm exited {code}:\n"
                       f"{err[-2000:]}")
  return dict(first_s=first, exit_s=exit_s,
              text=out.decode(errors="replace").strip())


def main():
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--baseline", default="",
                      help="a checkout of another commit to alternate with")
  parser.add_argument("--filled", action="store_true",
                      help="reuse each side's cache folder across rounds")
  parser.add_argument("extra", nargs="*",
                      help="more `generate` arguments (after --)")
  args = parser.parse_args()
  if args.rounds < 1:
    parser.error("--rounds must be positive")
  sides = {"this checkout": HERE}
  if args.baseline:
    if not os.path.isdir(os.path.join(args.baseline, "penzai_lm")):
      parser.error(f"--baseline {args.baseline}: no penzai_lm package there")
    sides = {"baseline": os.path.abspath(args.baseline), **sides}
  runs = {label: [] for label in sides}
  with tempfile.TemporaryDirectory() as root:
    kept = {label: os.path.join(root, str(i)) for i, label in enumerate(sides)}
    if args.filled:
      for label, checkout in sides.items():
        run_once(checkout, kept[label], args.extra)
    for n in range(args.rounds):
      for label, checkout in sides.items():
        cache = kept[label] if args.filled else os.path.join(
            root, f"{label}-{n}")
        r = run_once(checkout, cache, args.extra)
        runs[label].append(r)
        print(f"{label:14} first text {r['first_s']:5.2f} s, exit"
              f" {r['exit_s']:5.2f} s, load average {os.getloadavg()[0]:.2f}:"
              f" {r['text'][:60]!r}", flush=True)
  for label, rs in runs.items():
    print(f"{label:14} median: first text"
          f" {statistics.median(r['first_s'] for r in rs):.2f} s, exit"
          f" {statistics.median(r['exit_s'] for r in rs):.2f} s")
  if len(sides) == 2:
    base, this = runs.values()
    faster = sum(b["first_s"] > t["first_s"] for b, t in zip(base, this))
    print(f"this checkout's first text sooner in {faster} of {args.rounds}"
          " rounds")


if __name__ == "__main__":
  main()
