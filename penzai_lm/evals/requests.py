"""lm-eval requests and ``--model_args`` as penzai_lm arguments, checked.

* `encode_pair`: a (context, continuation) pair as token ids, split as
  lm-eval's ``hf`` model splits it.
* `generation_options`: a ``generate_until`` request's ``gen_kwargs`` as
  stop strings, a token budget and sampling options.
* `load_from_args`: ``model=...,dtype=...`` to a model (steered by a
  control vector if asked), its tokenizer and the `LM` options.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable

from penzai_lm.interp.control_vector_files import load_control_vector
from penzai_lm.loading.load import load

# lm-eval's default seed (``--seed``), for sampled generations.
DEFAULT_SEED = 1234
_LM_OPTIONS = ("batch_size", "max_length", "max_gen_toks", "add_bos_token")
_LOAD_OPTIONS = ("dtype", "quantize", "use_layer_stack")
_STEERING = ("control_vector", "control_strength")


def encode_pair(encode: Callable[[str], list[int]], context: str,
                continuation: str) -> tuple[list[int], list[int]]:
  """(context ids, continuation ids): the context's trailing whitespace
  moves to the continuation, and the continuation's ids are those of the
  whole text after the context's (so a token spanning the boundary is
  the continuation's)."""
  spaces = len(context) - len(context.rstrip())
  if spaces:
    continuation = context[-spaces:] + continuation
    context = context[:-spaces]
  whole = encode(context + continuation)
  context_ids = encode(context)
  return context_ids, whole[len(context_ids):]


def generation_options(gen_kwargs: dict[str, Any], tokenizer,
                       default_max: int) -> tuple[list[str], int, dict]:
  """(stop strings, max new tokens, sampling options) of ``gen_kwargs``.

  Raises:
    ValueError: for keys penzai_lm does not implement, or bad values.
  """
  kwargs = dict(gen_kwargs or {})
  until = kwargs.pop("until", None)
  until = [until] if isinstance(until, str) else list(until or [])
  if not all(isinstance(u, str) for u in until):
    raise ValueError(f"gen_kwargs until must be strings, got {until!r}.")
  new = kwargs.pop("max_gen_toks", default_max)
  if not isinstance(new, numbers.Integral) or new < 1:
    raise ValueError(f"gen_kwargs max_gen_toks must be an int >= 1, got"
                     f" {new!r}.")
  temperature = kwargs.pop("temperature", None)
  do_sample = kwargs.pop("do_sample", None)
  if do_sample is None:
    do_sample = temperature not in (None, 0, 0.0)
  sampling: dict[str, Any] = {"temperature": 0.0}
  if do_sample:
    sampling = {"temperature": 1.0 if temperature is None
                else float(temperature), "seed": DEFAULT_SEED}
    for key in ("top_p", "top_k"):
      if kwargs.get(key) is not None:
        sampling[key] = kwargs.pop(key)
  for key in ("top_p", "top_k"):
    kwargs.pop(key, None)  # Ignored when greedy, as transformers does.
  if kwargs:
    raise ValueError(
        f"gen_kwargs {sorted(kwargs)} are not supported by the penzai_lm"
        " model (it takes until, max_gen_toks, do_sample, temperature,"
        " top_p, top_k).")
  del tokenizer  # Stops at the model's EOS ids, as generate does.
  return until, int(new), sampling


def load_from_args(args: dict[str, Any]):
  """``(model, tokenizer, LM options)`` from ``--model_args``.

  Keys: ``model`` (a name or path `penzai_lm.load` takes; required),
  ``dtype``, ``quantize``, ``use_layer_stack`` (as `penzai_lm.load`),
  ``batch_size``, ``max_length``, ``max_gen_toks``, ``add_bos_token``
  (as `LM`), ``control_vector`` (a llama.cpp control-vector file) and
  ``control_strength`` (its factor, default 1).

  Raises:
    ValueError: for a missing ``model`` or an unknown key.
  """
  args = dict(args)
  name = args.pop("model", None) or args.pop("pretrained", None)
  if not name:
    raise ValueError("--model_args needs model=<name or path>, e.g."
                     " model=smollm2-135m-instruct.")
  unknown = sorted(set(args) - set(_LM_OPTIONS + _LOAD_OPTIONS + _STEERING))
  if unknown:
    raise ValueError(
        f"--model_args {unknown} are not options of the penzai_lm model; it"
        f" takes model, {', '.join(_LOAD_OPTIONS + _LM_OPTIONS + _STEERING)}.")
  load_kwargs = {k: args[k] for k in _LOAD_OPTIONS if k in args}
  model, tokenizer = load(str(name), **load_kwargs)
  if "control_vector" in args:
    vector = load_control_vector(args["control_vector"])
    model = vector.apply(model, float(args.get("control_strength", 1.0)))
  elif "control_strength" in args:
    raise ValueError("control_strength needs control_vector=<file>.")
  return model, tokenizer, {k: args[k] for k in _LM_OPTIONS if k in args}
