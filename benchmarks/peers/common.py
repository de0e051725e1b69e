"""Helpers shared by generate_vs_peers.py and its engine modules.

The fixed prompt text and how prompts are cut from it, the per-run timing
record and its summary, and the process and machine counters (peak RSS, CPU
seconds) that the benchmark reports.
"""

from __future__ import annotations

import os
import resource
import statistics

MODEL = "smollm2-135m-instruct"
# --model choices: penzai_lm's named models (both GGUF files from PyPI).
MODELS = ("smollm2-135m-instruct", "gemma3-270m")

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
  """One timed run, with the definitions of generate_vs_peers' docstring."""
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
