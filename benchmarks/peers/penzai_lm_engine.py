"""The ``penzai_lm*`` engines of generate_vs_peers.py: penzai_lm.generate.

Greedy decoding without stop tokens; every figure comes from the
``result.timings`` that penzai_lm.generate returns. The engine's variants
differ only in the keyword arguments of ``penzai_lm.load``: `VARIANTS` maps
each engine name to them (the spec carries them as ``load_kwargs``) and to
the llama.cpp variant it is best compared with. `ENABLED` are the variants
that generate_vs_peers.py runs by default; the others can be named in
``--engines``.
"""

from __future__ import annotations

import time

from peers.common import run_record
from peers.make_ggufs import gguf_path

# Engine name -> (keyword arguments of penzai_lm.load, closest llama.cpp
# engine). The GGUF variants are the files of make_ggufs.py (made from the
# same SmolLM2 file that ``penzai_lm.load()`` reads by default).
VARIANTS = {
    "penzai_lm": (dict(), "llamacpp-f32"),
    "penzai_lm-bf16": (dict(dtype="bfloat16"), "llamacpp-f16"),
    "penzai_lm-int8": (dict(quantize="int8"), "llamacpp-q8_0"),
    "penzai_lm-q8_0": (dict(name_or_path=gguf_path("q8_0"), quantize="keep"),
                       "llamacpp-q8_0"),
    "penzai_lm-q4_0": (dict(name_or_path=gguf_path("q4_0"), quantize="keep"),
                       "llamacpp-q4_0"),
    "penzai_lm-q4_1": (dict(name_or_path=gguf_path("q4_1"), quantize="keep"),
                       "llamacpp-q4_1"),
    "penzai_lm-q4_k_m": (dict(name_or_path=gguf_path("q4_k_m"),
                              quantize="keep"), "llamacpp-q4_k_m"),
    # The model's own file (--model), kept in its blocks: for Gemma 3 270M
    # the Q4_K_M mix of Q4_K, Q6_K, Q5_0 and Q8_0.
    "penzai_lm-keep": (dict(quantize="keep"), "llamacpp-file"),
}
# "<variant>-x8": the same model with int8 activations in its quantized
# products (`penzai_lm.kernels.with_cpu_kernels(model,
# int8_activations=True)`), llama.cpp's own arithmetic on CPU.
X8 = "-x8"
for _name in [n for n in VARIANTS if n.split("-")[-1][:2] in ("q8", "q4")]:
  VARIANTS[_name + X8] = VARIANTS[_name]
del _name
ENABLED = tuple(VARIANTS)
# The variants that load the --model file itself (the others read
# make_ggufs.py's SmolLM2 files).
ANY_MODEL = ("penzai_lm", "penzai_lm-bf16", "penzai_lm-int8", "penzai_lm-keep")


def load_kwargs(engine: str) -> dict:
  """The ``penzai_lm.load`` keyword arguments of variant ``engine``."""
  return dict(VARIANTS[engine][0])


def int8_activations(engine: str) -> bool:
  """Whether variant ``engine`` runs its products on int8 activations."""
  return engine.endswith(X8)


def peer(engine: str) -> str:
  """The llama.cpp engine that variant ``engine`` is compared with."""
  return VARIANTS[engine][1]


def run(spec: dict) -> dict:
  """penzai_lm.generate, greedy, timings from ``result.timings``.

  Args:
    spec: ``prompts``, ``new``, ``repeats`` and optionally ``load_kwargs``
      (passed to ``penzai_lm.load``; none: float32 SmolLM2).

  Returns:
    The engine record of generate_vs_peers.py.
  """
  import penzai_lm  # pylint: disable=g-import-not-at-top

  kwargs = dict(spec.get("load_kwargs") or {})
  if "model" in spec:
    kwargs.setdefault("name_or_path", spec["model"])
  start = time.perf_counter()
  model, _ = penzai_lm.load(**kwargs)
  if spec.get("int8_activations"):
    # donate: the rows of the weights that move into tiles are deleted as
    # they move (peak memory holds one copy), as a user reassigning `model`
    # would.
    model = penzai_lm.kernels.with_cpu_kernels(model, int8_activations=True,
                                               donate=True)
  out = dict(load_s=time.perf_counter() - start, load_kwargs=kwargs)
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
