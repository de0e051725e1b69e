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

Usage:
  python benchmarks/generate_vs_peers.py [--engines penzai_lm,transformers,penzai_loop]
      [--prompt 128] [--new 128] [--loop-new 8] [--batch 8] [--batch-new 128]
      [--repeats 3] [--threads 2] [--ceiling] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ENGINES = ("penzai_lm", "transformers", "penzai_loop")
MODEL = "smollm2-135m-instruct"
LOOP_TEMPERATURE = 1e-4
MARKER = "RESULT_JSON: "

TEXT = (
    "The lighthouse keeper kept a logbook in which every ship, storm and "
    "unusual bird was recorded in small, careful handwriting. In the spring "
    "of that year the entries grew longer: a fishing boat had lost its mast "
    "off the northern reef, two whales had been seen feeding near the "
    "harbour mouth, and the fog had arrived earlier each morning. The keeper "
    "noted the barometer readings at six, noon and six again, and compared "
    "them with the forecasts sent by telegraph from the mainland. When the "
    "readings and the forecasts disagreed, he trusted the barometer. Visitors "
    "were rare. A botanist came in May to collect samples of the sea thrift "
    "and the lichens that covered the western rocks; she stayed for three "
    "days and left a pressed flower between the pages of the logbook. In "
    "July the supply boat brought paraffin, flour, tinned fish, a new lens "
    "cloth and a letter from his sister, who wrote that the village school "
    "had finally been given a piano and that the children were learning to "
    "sing in parts. He read the letter twice, then climbed the spiral stairs "
    "to polish the great lens before dusk. The lamp had to be lit at sunset "
    "exactly, the clockwork wound every four hours, and the wick trimmed so "
    "that the flame burned white rather than yellow. On clear nights the "
    "beam reached nearly twenty miles, and captains who had never met him "
    "knew his light by its rhythm: two short flashes and one long, repeated "
    "every fifteen seconds. In autumn the storms returned. Waves broke over "
    "the gallery rail, salt crusted the windows, and for eleven days no boat "
    "could land. He rationed the paraffin, mended a cracked pane with "
    "canvas and pitch, and wrote in the logbook each evening that the light "
    "had been kept burning."
)


# ----------------------------------------------------------------------------
# Shared helpers.


def make_prompts(tokenizer, length: int, batch: int) -> list[list[int]]:
  """``batch`` different ``length``-token slices of `TEXT` (cycled)."""
  ids = tokenizer.encode(TEXT)
  stride = max(1, min(24, (len(ids) - length) // max(batch - 1, 1)))
  need = length + stride * (batch - 1)
  ids = (ids * (need // len(ids) + 1))[:need]
  return [ids[i * stride:i * stride + length] for i in range(batch)]


def peak_rss_mb() -> float:
  """Peak resident set size of this process (Linux reports KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_record(rows, prompt, ttft, decode_steps, decode_s, total_s):
  """One timed run with the definitions of the module docstring."""
  per_row = decode_steps / decode_s if decode_s > 0 else float("nan")
  return dict(ttft_s=ttft, prefill_tok_s=rows * prompt / ttft,
              decode_tok_s=per_row, decode_agg_tok_s=rows * per_row,
              decode_steps=decode_steps, total_s=total_s)


def summarize(runs: list[dict]) -> dict:
  """Median, min and max of every timed figure."""
  out = {}
  for key in ("ttft_s", "prefill_tok_s", "decode_tok_s", "decode_agg_tok_s",
              "total_s"):
    vals = [r[key] for r in runs]
    out[key] = dict(median=statistics.median(vals), min=min(vals),
                    max=max(vals))
  return out


def busy_cpu_s() -> float:
  """CPU seconds all processes on this machine have used (Linux /proc/stat)."""
  try:
    with open("/proc/stat") as f:
      fields = [int(x) for x in f.readline().split()[1:]]
  except (OSError, ValueError):
    return float("nan")
  idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
  return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
  """CPU seconds used by this process's finished children."""
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def leading_agreement(a: list[int], b: list[int]) -> int:
  """Number of identical leading tokens."""
  n = min(len(a), len(b))
  return next((i for i in range(n) if a[i] != b[i]), n)


# ----------------------------------------------------------------------------
# Engines (each runs in its own child process).


def engine_penzai_lm(spec: dict) -> dict:
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


class _TokenClock:
  """Forward pre-hook + stopping criterion that timestamp a HF generate."""

  def __init__(self):
    self.prefill_start = None
    self.token_times = []

  def reset(self):
    self.prefill_start, self.token_times = None, []

  def pre_hook(self, module, args, kwargs):  # pylint: disable=unused-argument
    if self.prefill_start is None:
      self.prefill_start = time.perf_counter()

  def criterion(self):
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top

    clock = self

    class Stamp(transformers.StoppingCriteria):

      def __call__(self, input_ids, scores, **kwargs):
        clock.token_times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    return Stamp()


def load_hf(threads: int):
  """The transformers model (float32) from the same GGUF file."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from penzai_lm.fetch import resolve_model_path  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(threads)
  path = resolve_model_path(MODEL)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32)
  model.eval()
  # No stop token at all (min_new_tokens would mask EOS and change greedy).
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = model.config.pad_token_id
  return model


def engine_transformers(spec: dict) -> dict:
  """HF model.generate, greedy, timed by `_TokenClock`."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  model = load_hf(spec["threads"])
  out = dict(load_s=time.perf_counter() - start, runs=[])
  prompts, new = spec["prompts"], spec["new"]
  ids = torch.tensor(prompts)
  clock = _TokenClock()
  model.register_forward_pre_hook(clock.pre_hook, with_kwargs=True)
  kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new,
                do_sample=False,
                stopping_criteria=transformers.StoppingCriteriaList(
                    [clock.criterion()]))
  with torch.inference_mode():
    start = time.perf_counter()
    model.generate(ids, **kwargs)
    out["warmup_s"] = time.perf_counter() - start
    for _ in range(spec["repeats"]):
      clock.reset()
      start = time.perf_counter()
      tokens = model.generate(ids, **kwargs)
      total = time.perf_counter() - start
      times = clock.token_times
      out["runs"].append(run_record(
          len(prompts), len(prompts[0]), times[0] - clock.prefill_start,
          len(times) - 1, times[-1] - times[0], total))
  out["tokens"] = tokens[:, ids.shape[1]:].tolist()
  return out


def penzai_llama(hf_model):
  """Penzai 0.2.5's own llama model converted from the transformers one."""
  from penzai.models.transformer.variants import llamalike_common  # pylint: disable=g-import-not-at-top

  config = hf_model.config
  rope = getattr(config, "rope_parameters", None) or {}
  assert rope.get("rope_type", "default") == "default", rope
  assert not config.attention_bias and not config.mlp_bias
  assert config.hidden_act == "silu"
  assert getattr(config, "sliding_window", None) is None
  if not hasattr(config, "rope_theta"):
    config.rope_theta = rope["rope_theta"]
  return llamalike_common.llamalike_from_huggingface_model(hf_model)


class _TimedLM:
  """Wraps a KVCachingTransformerLM to timestamp Penzai's Python loop.

  The second model call happens right after the first token was sampled:
  blocking on its input there gives the time to first token.
  """

  def __init__(self, lm):
    self._lm = lm
    self.calls = 0
    self.first_token_time = None

  def __getattr__(self, name):
    return getattr(self._lm, name)

  def __call__(self, tokens, **kwargs):
    import jax  # pylint: disable=g-import-not-at-top

    self.calls += 1
    if self.calls == 2:
      jax.block_until_ready(tokens)
      self.first_token_time = time.perf_counter()
    return self._lm(tokens, **kwargs)


def _pyloop_once(model, prompt_ids, new):
  """One call of temperature_sample_pyloop on a fresh KV cache."""
  import jax  # pylint: disable=g-import-not-at-top
  from penzai import pz  # pylint: disable=g-import-not-at-top
  from penzai.models.transformer import sampling_mode  # pylint: disable=g-import-not-at-top
  from penzai.models.transformer import simple_decoding_loop  # pylint: disable=g-import-not-at-top

  lm = _TimedLM(sampling_mode.KVCachingTransformerLM.from_uncached(
      model, cache_len=len(prompt_ids) + new, batch_axes={"batch": 1}))
  prompt = pz.nx.wrap(np.asarray([prompt_ids], np.int32)).tag("batch", "seq")
  start = time.perf_counter()
  out = simple_decoding_loop.temperature_sample_pyloop(
      lm, prompt, jax.random.key(0), temperature=LOOP_TEMPERATURE,
      max_sampling_steps=new)
  tokens = np.asarray(out.unwrap("batch", "seq"))
  end = time.perf_counter()
  first = lm.first_token_time or end
  record = run_record(1, len(prompt_ids), first - start, tokens.shape[1] - 1,
                      end - first, end - start)
  return record, tokens[0].tolist()


def engine_penzai_loop(spec: dict) -> dict:
  """Penzai's temperature_sample_pyloop on Penzai's llama, as shipped."""
  start = time.perf_counter()
  model = penzai_llama(load_hf(spec["threads"]))
  out = dict(load_s=time.perf_counter() - start, runs=[],
             temperature=LOOP_TEMPERATURE)
  prompt, new = spec["prompts"][0], spec["new"]
  start = time.perf_counter()
  _pyloop_once(model, prompt, new)
  out["warmup_s"] = time.perf_counter() - start
  for _ in range(spec["repeats"]):
    record, tokens = _pyloop_once(model, prompt, new)
    out["runs"].append(record)
  out["tokens"] = [tokens]
  return out


def ceiling(steps: int = 64) -> float:
  """Steps/s of a loop that reads SmolLM2's fp32 weights once per step."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  shapes = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536),
            (576, 1536), (1536, 576)]
  weights = [jnp.asarray(rng.standard_normal(s, np.float32))
             for _ in range(30) for s in shapes]
  emb = jnp.asarray(rng.standard_normal((49152, 576), np.float32))

  @jax.jit
  def run(weights, emb, x):
    def body(_, x):
      for l in range(30):
        q, k, v, o, g, u, d = weights[7 * l:7 * l + 7]
        a = jnp.tanh(x @ q) + jnp.sum(x @ k) + jnp.sum(x @ v)
        x = x + a @ o
        x = x + (jax.nn.silu(x @ g) * (x @ u)) @ d
        x = x / jnp.linalg.norm(x)
      return x + jnp.argmax(emb @ x[0]) * 1e-9
    return jax.lax.fori_loop(0, steps, body, x)

  x = jnp.ones((1, 576)) / 24
  run(weights, emb, x).block_until_ready()
  best = 0.0
  for _ in range(3):
    start = time.perf_counter()
    run(weights, emb, x).block_until_ready()
    best = max(best, steps / (time.perf_counter() - start))
  return best


def engine_ceiling(spec: dict) -> dict:  # pylint: disable=unused-argument
  return dict(steps_per_s=ceiling())


CHILDREN = dict(penzai_lm=engine_penzai_lm, transformers=engine_transformers,
                penzai_loop=engine_penzai_loop, ceiling=engine_ceiling)


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


def main():
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
  args = parser.parse_args()
  if args.engine:
    child_main(args.engine, args.spec)
    return
  engines = [e for e in args.engines.split(",") if e]
  unknown = set(engines) - set(ENGINES)
  if unknown:
    parser.error(f"unknown engines {sorted(unknown)}; choose from {ENGINES}")

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

  extra = dict(model=MODEL, dtype="float32", prompt_tokens=args.prompt,
               repeats=args.repeats, threads=args.threads,
               cpu_count=os.cpu_count(), loadavg_before=os.getloadavg())
  print(f"SmolLM2-135M-Instruct float32, greedy, {args.prompt}-token prompts,"
        f" {args.repeats} timed runs after a warm-up; {os.cpu_count()} CPUs;"
        f" load average before: "
        + ", ".join(f"{x:.2f}" for x in extra["loadavg_before"]), flush=True)
  results = [r for r in (run_child(e, s) for e, s in jobs) if r is not None]
  if args.ceiling:
    out = run_child("ceiling", dict(common, new=0, prompts=[[]]))
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
