"""The ``llamacpp-*`` engines of generate_vs_peers.py: llama.cpp, greedy.

llama.cpp through llama-cpp-python's low-level ctypes API, on the GGUF
variants of SmolLM2-135M-Instruct that ``make_ggufs.py`` writes from the
file penzai_lm loads (``llamacpp-f32``, ``llamacpp-f16``, ``llamacpp-q8_0``,
``llamacpp-q4_1``). It runs in the llama.cpp virtualenv that
``setup_llamacpp.sh`` builds (``VENV_PYTHON``), never in penzai_lm's: this
module imports neither jax nor penzai_lm, and generate_vs_peers.py starts it
as ``VENV_PYTHON llamacpp_engine.py --spec PATH``.

How it decodes (the calls of ``llama_cpp.Llama.eval``, without its Python
bookkeeping, and with several sequences when the batch has several rows):
one context with ``n_seq_max`` = rows, one ``llama_batch`` holding every
row's prompt (sequence ids 0..rows-1, logits only for each row's last
token) and one ``llama_decode`` for the prefill; then per step one
``llama_batch`` with each row's new token at its next position and one
``llama_decode``. The next token is the argmax of each row's logits
(``llama_get_logits_ith``; greedy, i.e. temperature 0 / top-k 1; no stop
tokens, so every row gets exactly ``new`` tokens). llama.cpp's own defaults
are kept otherwise, as its users run it: weights repacked at load into its
CPU "extra" buffer types where it has a layout for the format and the CPU
(interleaved Q4_0/Q8_0 blocks for AVX2/AVX-512), F16 KV cache, flash
attention "auto", ``n_ubatch`` 512; ``n_threads`` and ``n_threads_batch``
are the spec's ``threads``. Each engine has a ``-norepack`` twin with the
repacking off (llama.cpp's ``--no-repack``), for comparing kernels on the
file's own layout.

Timings, as for the other engines: TTFT runs from the start of the prefill
until every row's first token is on the host (after the argmax), each later
token is timestamped after its argmax, and decode time runs from the first
to the last token. Batch 1 and batch 8 both go through this one code path;
at batch 1 it gave the same tokens and speed as a loop of ``Llama.eval``
calls, and row 0 of a batch of 8 the same tokens as batch 1.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import sys
import time

import numpy as np

if __name__ == "__main__":  # Run as a script: ``peers`` is next to this dir.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
      __file__))))

# pylint: disable=g-import-not-at-top,wrong-import-position
from peers.common import peak_rss_mb
from peers.common import run_record
from peers.common import summarize
from peers.make_ggufs import gguf_path
from peers.make_ggufs import PEERS_DIR
from peers.make_ggufs import VARIANTS
# pylint: enable=g-import-not-at-top,wrong-import-position

VENV_PYTHON = os.path.join(PEERS_DIR, "llamacpp-venv", "bin", "python")
# The same llama.cpp built without AMX (``setup_llamacpp.sh noamx``).
NOAMX_VENV_PYTHON = os.path.join(PEERS_DIR, "llamacpp-noamx-venv", "bin",
                                 "python")
# llamacpp-file: the --model's own GGUF file, as penzai_lm fetched it.
_FILES = (*VARIANTS, "file")
ENGINES = tuple(f"llamacpp-{build}{v}{repack}"
                for build in ("", "noamx-") for v in _FILES
                for repack in ("", "-norepack"))
MARKER = "RESULT_JSON: "  # generate_vs_peers.py reads the line with this.


def variant(engine: str) -> tuple[str, bool]:
  """``(file variant, repack)`` of an engine name: ``"llamacpp-q8_0"`` ->
  ``("q8_0", True)``, ``"llamacpp-noamx-file-norepack"`` ->
  ``("file", False)``."""
  name = engine.split("-", 1)[1].removeprefix("noamx-")
  if name.endswith("-norepack"):
    return name[:-len("-norepack")], False
  return name, True


def python_of(engine: str) -> str:
  """The python of the llama.cpp build that ``engine`` runs on: ``noamx``
  engines on the build without AMX, the others on the native one."""
  return NOAMX_VENV_PYTHON if "-noamx-" in engine else VENV_PYTHON


def missing(engine: str) -> str | None:
  """Why ``engine`` cannot run here (and how to fix it), or None."""
  python = python_of(engine)
  venv = os.path.dirname(os.path.dirname(python))
  if not (os.path.exists(python) and glob.glob(os.path.join(
      venv, "lib", "python*", "site-packages", "llama_cpp", "lib", "*"))):
    flavour = " noamx" if python == NOAMX_VENV_PYTHON else ""
    return (f"no llama.cpp build in {venv}; build it (~10 min) with:"
            f" bash benchmarks/peers/setup_llamacpp.sh{flavour}")
  if variant(engine)[0] == "file":
    return None
  path = gguf_path(variant(engine)[0])
  if not os.path.exists(path):
    return (f"no {path}; write it with: python benchmarks/peers/make_ggufs.py")
  return None


class _Decoder:
  """A llama.cpp model and context for ``rows`` sequences of greedy decoding."""

  def __init__(self, path: str, rows: int, n_ctx: int, n_batch: int,
               threads: int, repack: bool = True):
    import llama_cpp  # pylint: disable=g-import-not-at-top
    self.lib = lib = llama_cpp
    lib.llama_backend_init()
    mparams = lib.llama_model_default_params()
    if not repack:  # llama.cpp's --no-repack: the file's own block layout.
      mparams.use_extra_bufts = False
    self.model = lib.llama_model_load_from_file(path.encode(), mparams)
    if not self.model:
      raise RuntimeError(f"llama.cpp could not load {path}")
    cparams = lib.llama_context_default_params()
    cparams.n_ctx, cparams.n_batch = n_ctx, n_batch
    cparams.n_ubatch = min(512, n_batch)
    cparams.n_seq_max = rows
    cparams.n_threads = cparams.n_threads_batch = threads
    self.ctx = lib.llama_init_from_model(self.model, cparams)
    if not self.ctx:
      raise RuntimeError("llama.cpp could not create the context")
    self.n_vocab = lib.llama_vocab_n_tokens(
        lib.llama_model_get_vocab(self.model))
    self.rows = rows
    self.batch = lib.llama_batch_init(n_batch, 0, rows)

  def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
    """Decodes (token, position, sequence, wants logits) entries in one
    ``llama_batch``; returns the argmax token of each entry with logits."""
    b = self.batch
    for i, (tok, pos, seq, logits) in enumerate(entries):
      b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
      b.seq_id[i][0], b.logits[i] = seq, int(logits)
    b.n_tokens = len(entries)
    status = self.lib.llama_decode(self.ctx, b)
    if status:
      raise RuntimeError(f"llama_decode returned {status}")
    out = []
    for i, entry in enumerate(entries):
      if entry[3]:
        ptr = self.lib.llama_get_logits_ith(self.ctx, i)
        row = np.ctypeslib.as_array(
            ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
            shape=(self.n_vocab,))
        out.append(int(np.argmax(row)))
    return out

  def generate(self, prompts: list[list[int]], new: int):
    """Greedy ``new`` tokens per row; (tokens, prefill start, token times)."""
    self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
    n = len(prompts[0])
    start = time.perf_counter()
    last = self._decode([(tok, pos, seq, pos == n - 1)
                         for seq, prompt in enumerate(prompts)
                         for pos, tok in enumerate(prompt)])
    times = [time.perf_counter()]
    tokens = [[t] for t in last]
    for step in range(new - 1):
      last = self._decode([(tok, n + step, seq, True)
                           for seq, tok in enumerate(last)])
      times.append(time.perf_counter())
      for row, t in zip(tokens, last):
        row.append(t)
    return tokens, start, times

  def close(self):
    self.lib.llama_batch_free(self.batch)
    self.lib.llama_free(self.ctx)
    self.lib.llama_model_free(self.model)


def run(spec: dict) -> dict:
  """llama.cpp greedy decoding of ``spec['prompts']`` with ``spec['gguf']``.

  Args:
    spec: As for the other engines (``prompts``, ``new``, ``repeats``,
      ``threads``) plus ``gguf``, the GGUF file to load, and ``repack``
      (False: llama.cpp's ``--no-repack``).

  Returns:
    The engine record of generate_vs_peers.py (``load_s``, ``warmup_s``,
    ``runs``, ``tokens``) plus llama.cpp's version and the file's name.
  """
  import llama_cpp  # pylint: disable=g-import-not-at-top
  prompts, new = spec["prompts"], spec["new"]
  rows, length = len(prompts), len(prompts[0])
  if any(len(p) != length for p in prompts):
    raise ValueError("all prompts must have the same length")
  per_row = -(-(length + new) // 256) * 256
  start = time.perf_counter()
  decoder = _Decoder(spec["gguf"], rows, n_ctx=rows * per_row,
                     n_batch=max(rows * length, rows), threads=spec["threads"],
                     repack=spec.get("repack", True))
  out = dict(load_s=time.perf_counter() - start, runs=[],
             repack=spec.get("repack", True),
             gguf=os.path.basename(spec["gguf"]),
             llama_cpp_python=llama_cpp.__version__)
  start = time.perf_counter()
  decoder.generate(prompts, new)
  out["warmup_s"] = time.perf_counter() - start
  for _ in range(spec["repeats"]):
    start = time.perf_counter()
    tokens, prefill_start, times = decoder.generate(prompts, new)
    total = time.perf_counter() - start
    out["runs"].append(run_record(
        rows, length, times[0] - prefill_start, len(times) - 1,
        times[-1] - times[0], total))
  out["tokens"] = tokens
  decoder.close()
  return out


def main():
  """Child process: runs the spec and prints one RESULT_JSON line."""
  spec_path = sys.argv[sys.argv.index("--spec") + 1]
  with open(spec_path) as f:
    spec = json.load(f)
  out = run(spec)
  out["peak_rss_mb"] = peak_rss_mb()
  out["summary"] = summarize(out["runs"])
  print(MARKER + json.dumps(out), flush=True)


if __name__ == "__main__":
  main()
