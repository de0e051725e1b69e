"""The ``penzai-lm`` command line.

    penzai-lm generate "The capital of France is"
    penzai-lm generate --chat --temperature 0.7 "Write a haiku about JAX"
    echo "Once upon a time" | penzai-lm generate --max-new-tokens 64 --json
    penzai-lm generate --model model-Q4_K_M.gguf --quantize keep \
        --int8-activations "Hello"
    penzai-lm chat

Text streams to stdout; a stats line (time to first token, prefill and decode
tokens/s) goes to stderr. JAX's persistent compilation cache is on (and the
engine keeps its exported programs in it), so a second run neither traces nor
compiles the generation programs again.

Ctrl-C: during generation it stops the run at the next chunk of steps and
keeps what was generated (streamed, printed, or as JSON with the finish
reason "cancelled"); anywhere else (loading, compiling after a second Ctrl-C)
it stops at once. Either way one line on stderr says so and the exit code is
130 (128 + SIGINT), with no traceback. In ``chat``, Ctrl-C stops the reply
and the chat goes on; at the prompt it quits.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
from pathlib import Path
import signal
import sys
import threading
import time

import jax

import penzai_lm
from penzai_lm import generation
from penzai_lm import kernels
from penzai_lm.generation.chat import ChatSession
from penzai_lm.paths import jax_cache_dir
from penzai_lm.paths import private_dir
from penzai_lm.paths import unsafe_reason

DEFAULT_MAX_NEW_TOKENS = 128
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C.


def _enable_compilation_cache() -> None:
  """XLA's persistent cache (and the program store in it) in a folder of
  the user's own; off, with a line saying why, in any other folder (it
  holds compiled code that the next run executes)."""
  path = jax_cache_dir()
  problem = unsafe_reason(path)
  if problem is not None:
    why, fix = problem
    print(f"[not caching compiled programs in {path}: it is {why}; {fix}"
          "set PENZAI_LM_JAX_CACHE to a folder of your own]", file=sys.stderr)
    return
  jax.config.update("jax_compilation_cache_dir", str(private_dir(path)))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _sampling_args(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--model", default=None,
                      help="model name (smollm2-135m-instruct, gemma3-270m),"
                      " GGUF file or Hugging Face directory")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--quantize", default=None,
                      choices=["keep", "int8", "q8_0", "q4_0", "q4_1"],
                      help="keep the projections quantized: 'keep' a GGUF"
                      " file's own blocks (Q8_0, Q4_x, Q5_x, K-quants), or"
                      " quantize them"
                      " (decoding reads the blocks in compiled CPU kernels)")
  parser.add_argument("--int8-activations", action="store_true",
                      help="with --quantize, on CPU: round the activations"
                      " of the quantized products to int8 blocks, as"
                      " llama.cpp does (faster; not exact against the"
                      " dequantized weights)")
  parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
  parser.add_argument("--min-new-tokens", type=int, default=0,
                      help="tokens to generate before a stop token may end"
                      " the reply")
  parser.add_argument("--greedy", action="store_true",
                      help="always pick the most likely token (the default"
                      " unless --temperature is given)")
  parser.add_argument("--temperature", type=float, default=None)
  parser.add_argument("--top-k", type=int, default=0)
  parser.add_argument("--top-p", type=float, default=1.0)
  parser.add_argument("--min-p", type=float, default=0.0)
  parser.add_argument("--typical-p", type=float, default=1.0,
                      help="locally typical sampling mass (1 = off)")
  parser.add_argument("--epsilon-cutoff", type=float, default=0.0,
                      help="drop tokens with p below this (0 = off)")
  parser.add_argument("--eta-cutoff", type=float, default=0.0,
                      help="eta sampling (0 = off; 3e-4 to 2e-3 suggested)")
  parser.add_argument("--xtc-probability", type=float, default=0.0,
                      help="XTC, exclude top choices: how often (0 = off)")
  parser.add_argument("--xtc-threshold", type=float, default=0.1,
                      help="XTC: tokens at least this likely are the top"
                      " choices (above 0.5 = off)")
  parser.add_argument("--repetition-penalty", type=float, default=1.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--stop", action="append", default=[],
                      help="stop string (repeatable)")


def _settings(args) -> dict:
  temperature = 0.0 if args.greedy or args.temperature is None else args.temperature
  return dict(
      max_new_tokens=args.max_new_tokens,
      min_new_tokens=args.min_new_tokens, temperature=temperature,
      top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
      typical_p=args.typical_p, epsilon_cutoff=args.epsilon_cutoff,
      eta_cutoff=args.eta_cutoff, xtc_probability=args.xtc_probability,
      xtc_threshold=args.xtc_threshold,
      repetition_penalty=args.repetition_penalty, seed=args.seed,
  )


def _stats_line(timings, reasons, extra: str = "") -> str:
  return (
      f"[{timings.prompt_tokens} prompt tokens, {timings.generated_tokens}"
      f" generated; time to first token {timings.time_to_first_token_s:.2f}s,"
      f" prefill {timings.prefill_tokens_per_s:.0f} tok/s, decode"
      f" {timings.decode_tokens_per_s:.1f} tok/s, compile"
      f" {timings.compile_s:.1f}s; finish: {', '.join(reasons)}{extra}]"
  )


@contextlib.contextmanager
def _ctrl_c_cancels(cancel: threading.Event):
  """While inside, the first Ctrl-C sets ``cancel`` (the run ends at its next
  chunk and keeps its text) and a second one interrupts at once.

  A signal handler, not ``except KeyboardInterrupt``: the exception could
  land anywhere (inside a compiled call, or the detokenizer), the event is
  checked where stopping is safe. Handlers can only be set on the main
  thread; elsewhere Ctrl-C stays an exception.
  """
  if threading.current_thread() is not threading.main_thread():
    yield
    return

  previous = signal.getsignal(signal.SIGINT)
  if previous is None:  # Set outside Python: restore Python's default.
    previous = signal.default_int_handler

  def handler(signum, frame):  # pylint: disable=unused-argument
    cancel.set()
    signal.signal(signal.SIGINT, previous)  # A second Ctrl-C: at once.
    print("\n[interrupted: stopping at the next chunk, keeping the text;"
          " Ctrl-C again stops at once]", file=sys.stderr, flush=True)

  signal.signal(signal.SIGINT, handler)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)


def _print_stream(stream) -> bool:
  """Writes a text stream to stdout; True if Ctrl-C ended it (the text so
  far is kept)."""
  interrupted = False
  try:
    for event in stream:
      sys.stdout.write(event.text)
      sys.stdout.flush()
  except KeyboardInterrupt:
    stream.close()
    interrupted = True
    print("\n[interrupted]", file=sys.stderr)
  print()
  return interrupted


def _read_prompt(args) -> str:
  if args.prompt is not None and args.prompt != "-":
    return args.prompt
  if sys.stdin.isatty():
    raise SystemExit("error: give a prompt as an argument or on stdin.")
  return sys.stdin.read()


def _check_int8_activations(quantize: str | None) -> None:
  """Refuses --int8-activations where it would change nothing: without
  quantized weights, off CPU, or without the CPU kernels."""
  if quantize is None:
    raise ValueError("--int8-activations applies to quantized weights: add"
                     " --quantize keep (a GGUF file's own blocks) or"
                     " --quantize q8_0 / q4_0 / q4_1 / int8.")
  if jax.default_backend() != "cpu":
    raise ValueError("--int8-activations runs on the CPU kernels, but JAX's"
                     f" default device here is {jax.default_backend()}; run"
                     " with JAX_PLATFORMS=cpu, or leave the flag off.")
  if not kernels.ops.available():
    raise ValueError("--int8-activations needs penzai_lm's CPU kernels,"
                     " which could not be built here (is a C++ compiler"
                     " installed?); leave the flag off.")


def _load(args):
  if args.int8_activations:
    _check_int8_activations(args.quantize)
  print(f"[loading {args.model or 'the default model'}]", file=sys.stderr,
        flush=True)
  start = time.perf_counter()
  # With its layer stack: a fresh prompt's prefill then compiles one block
  # (the engine decodes on per-layer views of the stacked weights, no copy;
  # docs/cpu-speed.md, "The first token from a fresh process").
  model, tokenizer = penzai_lm.load(args.model, dtype=args.dtype,
                                    quantize=args.quantize)
  if args.int8_activations:
    # The weights move into the kernels' tiles; donate: no second copy.
    model = kernels.with_cpu_kernels(model, int8_activations=True,
                                     donate=True)
  print(f"[loaded in {time.perf_counter() - start:.1f}s]", file=sys.stderr)
  return model, tokenizer


def cmd_generate(args) -> int:
  prompt = _read_prompt(args)
  model, tokenizer = _load(args)
  request = [{"role": "user", "content": prompt}] if args.chat else prompt
  settings = _settings(args)
  cancel = threading.Event()
  if args.num_samples > 1 or args.no_stream or args.json:
    # With cancel= the run goes in chunks, so Ctrl-C keeps the text so far.
    with _ctrl_c_cancels(cancel):
      result = generation.generate_text(
          model, tokenizer, request, stop_strings=args.stop or None,
          num_samples=args.num_samples, cancel=cancel, **settings,
      )
    if args.json:
      print(json.dumps({
          "texts": result.texts, "tokens": result.tokens,
          "finish_reasons": result.finish_reasons,
          "interrupted": cancel.is_set(),
          "timings": vars(result.timings),
      }, indent=2, default=float))
    else:
      for i, text in enumerate(result.texts):
        if args.num_samples > 1:
          print(f"--- sample {i} ---")
        print(text)
    print(_stats_line(result.timings, result.finish_reasons), file=sys.stderr)
    return EXIT_INTERRUPTED if cancel.is_set() else 0

  stream = generation.stream_text(
      model, tokenizer, request, stop_strings=args.stop or None,
      cancel=cancel, **settings
  )
  if not args.chat:
    sys.stdout.write(prompt)
  with _ctrl_c_cancels(cancel):
    interrupted = _print_stream(stream)
  result = stream.result
  print(_stats_line(result.timings, result.finish_reasons), file=sys.stderr)
  return EXIT_INTERRUPTED if interrupted or cancel.is_set() else 0


def cmd_chat(args) -> int:
  model, tokenizer = _load(args)
  chat = ChatSession(model, tokenizer, system=args.system,
                     min_cache_len=args.cache_len)
  settings = _settings(args)
  print("[chat: empty line or Ctrl-D quits, /reset starts over, Ctrl-C stops"
        " a reply]", file=sys.stderr)
  turn = 0
  while True:
    try:
      line = input("> ")
    except (EOFError, KeyboardInterrupt):
      print()
      break
    if not line.strip():
      break
    if line.strip() == "/reset":
      chat.reset()
      print("[conversation cleared]", file=sys.stderr)
      continue
    turn_settings = dict(settings, seed=settings["seed"] + turn)
    turn += 1
    cancel = threading.Event()
    with _ctrl_c_cancels(cancel):
      _print_stream(chat.send(line, stop_strings=args.stop or None,
                              cancel=cancel, **turn_settings))
    result = chat.last_result
    print(_stats_line(
        result.timings, result.finish_reasons,
        f"; {chat.session.cached_tokens} tokens cached,"
        f" {chat.rereads} re-reads"), file=sys.stderr)
  return 0


_GRAPH_DESCRIPTION = """\
Writes a graph saved by Graph.save, pruned as circuit-tracer prunes it, as
Neuronpedia's graph JSON (--json), circuit-tracer's graph folder (--folder:
<slug>.json and graph-metadata.json, for its local server) and/or a
self-contained HTML page (--html).

  penzai-lm graph prompt.safetensors --html prompt.html
  penzai-lm graph prompt.safetensors --json prompt.json --scan gemma-2-2b
  penzai-lm graph prompt.safetensors --folder graphs/ --tokenizer model.gguf
"""


def _graph_args(commands) -> None:
  """Adds ``graph`` (`penzai_lm.circuits.graph_command`) to the
  subcommands."""
  parser = commands.add_parser(
      "graph", help="write a saved attribution graph as Neuronpedia JSON"
      " and/or a self-contained HTML page", description=_GRAPH_DESCRIPTION,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("graph", help="a graph file written by Graph.save")
  parser.add_argument("--json", type=Path, help="write Neuronpedia's graph"
                      " JSON to this file")
  parser.add_argument("--folder", type=Path, help="write <slug>.json and"
                      " graph-metadata.json here (circuit-tracer's files)")
  parser.add_argument("--html", type=Path, help="write the HTML page here")
  parser.add_argument("--slug", default=None, help="the graph's name"
                      " (default: the graph file's name without suffix)")
  parser.add_argument("--scan", default=None, help="the transcoders'"
                      " Neuronpedia scan id (needed to upload)")
  parser.add_argument("--tokenizer", type=Path, default=None,
                      help="a GGUF file or Hugging Face directory whose"
                      " tokenizer decodes the tokens")
  parser.add_argument("--prompt", default=None, help="the prompt's text"
                      " (default: decoded from the tokens)")
  parser.add_argument("--node-threshold", type=float, default=0.8)
  parser.add_argument("--edge-threshold", type=float, default=0.98)
  parser.add_argument("--distinct-error-ids", action="store_true",
                      help="error node ids '{layer}_-1_{pos}' (circuit-"
                      "tracer after 0.5) instead of 0.5's '0_{layer}_{pos}'")
  parser.set_defaults(func=cmd_graph)


def cmd_graph(args: argparse.Namespace) -> int:
  """``penzai-lm graph``: `penzai_lm.circuits.graph_command`."""
  # Imported here, not at the top: the circuits package (attribution
  # graphs, SAEs) adds 0.14-0.17 s to the start of every command that does
  # not need it (docs/cpu-speed.md, "Every row at 8b28a8e").
  from penzai_lm.circuits import graph_command  # pylint: disable=g-import-not-at-top
  return graph_command.run_graph_command(args)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="penzai-lm", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  commands = parser.add_subparsers(dest="command", required=True)
  gen = commands.add_parser("generate", help="continue a prompt")
  gen.add_argument("prompt", nargs="?", default=None,
                   help="the prompt; read from stdin when absent or '-'")
  _sampling_args(gen)
  gen.add_argument("--num-samples", type=int, default=1)
  gen.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template")
  gen.add_argument("--no-stream", action="store_true")
  gen.add_argument("--json", action="store_true", help="print a JSON result")
  gen.set_defaults(func=cmd_generate)
  chat = commands.add_parser(
      "chat", help="interactive multi-turn chat (the KV cache is kept"
      " between turns)")
  _sampling_args(chat)
  chat.add_argument("--system", default=None, help="system message")
  chat.add_argument("--cache-len", type=int, default=512,
                    help="initial KV cache size; the cache grows (and new"
                    " programs compile) when the conversation needs more")
  chat.set_defaults(func=cmd_chat)
  _graph_args(commands)
  return parser


def main(argv: list[str] | None = None) -> int:
  """Runs the command line; returns the exit code (see the module
  docstring for Ctrl-C)."""
  try:
    args = build_parser().parse_args(argv)
    _enable_compilation_cache()
    return args.func(args)
  except (ValueError, FileNotFoundError) as error:
    print(f"error: {error}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("\n[interrupted]", file=sys.stderr)
    return EXIT_INTERRUPTED


def run() -> None:
  """The ``penzai-lm`` program: `main`, then the process's exit.

  Before it exits, the objects the run made are moved out of the cyclic
  garbage collector's reach (``gc.freeze``): Python's shutdown runs full
  collections over every object of JAX, the model and the compiled
  programs, and they are freed with the process anyway (the stats line to
  the exit: 0.38-0.49 s, 0.12-0.15 s frozen; docs/cpu-speed.md, "The
  collector paused"). Only here, where the process ends: `main` called
  in-process (tests, scripts) leaves the collector alone."""
  code = main()
  gc.freeze()
  sys.exit(code)


if __name__ == "__main__":
  run()
