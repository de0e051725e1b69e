"""lm-eval requests and ``--model_args`` as penzai_lm arguments, checked.

* `encode_pair`: a (context, continuation) pair as token ids, split as
  lm-eval's ``hf`` model splits it.
* `generation_options`: a ``generate_until`` request's ``gen_kwargs`` as
  stop strings, a token budget and sampling options.
* `load_from_args`: ``model=...,dtype=...`` to a model (steered by a
  control vector, or with one autoencoder feature clamped, if asked), its
  tokenizer and the `LM` options.
* `clamp_feature`: ``sae=...,sae_feature=...,sae_value=...`` on a model:
  the autoencoder spliced in (error term kept) and one feature clamped at
  every position.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable

from penzai_lm.interp.control_vector_files import load_control_vector
from penzai_lm.loading.load import load
from penzai_lm.model.points import insert_at
from penzai_lm.sae.edits import FeatureEdit
from penzai_lm.sae.formats import load_sae
from penzai_lm.sae.splice import splice

# lm-eval's default seed (``--seed``), for sampled generations.
DEFAULT_SEED = 1234
_LM_OPTIONS = ("batch_size", "max_length", "max_gen_toks", "add_bos_token")
_LOAD_OPTIONS = ("dtype", "quantize", "use_layer_stack")
_STEERING = ("control_vector", "control_strength")
_SAE = ("sae", "sae_feature", "sae_value", "sae_point")
# The splice's name: the clamped features are ``{point}.sae.features``.
SPLICE_NAME = "sae"


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
  ``control_strength`` (its factor, default 1); ``sae``, ``sae_feature``,
  ``sae_value`` and optionally ``sae_point`` (see `clamp_feature`; applied
  after a control vector).

  Raises:
    ValueError: for a missing ``model``, an unknown key, a partial or bad
      set of ``sae`` options.
  """
  args = dict(args)
  name = args.pop("model", None) or args.pop("pretrained", None)
  if not name:
    raise ValueError("--model_args needs model=<name or path>, e.g."
                     " model=smollm2-135m-instruct.")
  known = _LOAD_OPTIONS + _LM_OPTIONS + _STEERING + _SAE
  unknown = sorted(set(args) - set(known))
  if unknown:
    raise ValueError(
        f"--model_args {unknown} are not options of the penzai_lm model; it"
        f" takes model, {', '.join(known)}.")
  sae_args = {k[len("sae_"):] if k != "sae" else "path": args[k]
              for k in _SAE if k in args}
  if sae_args:
    _check_sae_args(sae_args)
  load_kwargs = {k: args[k] for k in _LOAD_OPTIONS if k in args}
  model, tokenizer = load(str(name), **load_kwargs)
  if "control_vector" in args:
    vector = load_control_vector(args["control_vector"])
    model = vector.apply(model, float(args.get("control_strength", 1.0)))
  elif "control_strength" in args:
    raise ValueError("control_strength needs control_vector=<file>.")
  if sae_args:
    model = clamp_feature(model, sae_args["path"], sae_args["feature"],
                          sae_args["value"], point=sae_args.get("point"))
  return model, tokenizer, {k: args[k] for k in _LM_OPTIONS if k in args}


def _check_sae_args(sae_args: dict[str, Any]) -> None:
  """Raises unless ``sae_args`` (``path``, ``feature``, ``value``,
  optionally ``point``) are complete; the values are checked by
  `clamp_feature`."""
  if "path" not in sae_args:
    given = ", ".join(f"sae_{k}" for k in sae_args)
    raise ValueError(f"{given} needs sae=<SAELens directory or autoencoder"
                     " file>.")
  missing = [f"sae_{k}" for k in ("feature", "value") if k not in sae_args]
  if missing:
    raise ValueError(
        f"sae= needs {' and '.join(missing)} too: sae_feature=<feature id>"
        " and sae_value=<number> clamp that feature at every position.")


def _feature_id(feature, width: int) -> int:
  if isinstance(feature, str) and feature.strip().lstrip("-").isdigit():
    feature = int(feature)
  if (not isinstance(feature, numbers.Integral) or isinstance(feature, bool)
      or not 0 <= feature < width):
    raise ValueError(f"sae_feature must be a feature id from 0 to"
                     f" {width - 1} (the autoencoder has {width}), got"
                     f" {feature!r}.")
  return int(feature)


def _clamp_value(value) -> float:
  try:
    number = float(value) if not isinstance(value, bool) else math.nan
  except (TypeError, ValueError):
    number = math.nan
  if not math.isfinite(number):
    raise ValueError(f"sae_value must be a finite number, got {value!r}.")
  return number


def clamp_feature(model, path, feature, value, *, point: str | None = None):
  """``model`` with the autoencoder at ``path`` spliced in (error term
  kept: unchanged but for the edit) and ``feature`` clamped to ``value``
  at every position, at ``{point}.sae.features``.

  Args:
    model: A `TransformerLM`.
    path: An autoencoder `penzai_lm.sae.load_sae` reads (a SAELens
      directory, a Gemma Scope or circuit-tracer file).
    feature: The feature id (an int, or its digits as lm-eval passes them).
    value: The clamped activation (a number or its text).
    point: The point it reads (default: the one its file names).

  Returns:
    The spliced, clamped model.

  Raises:
    ValueError: for a feature id out of range, a value that is not a
      finite number, an autoencoder that does not fit the model.
    FileNotFoundError: for a missing ``path``.
  """
  value = _clamp_value(value)
  sae = load_sae(str(path), model=model, point=point)
  feature = _feature_id(feature, sae.config.num_features)
  if sae.config.hook_point is None:
    raise ValueError(f"the autoencoder at {path} names no point it reads:"
                     " pass sae_point=blocks.<i>.resid_post (or another).")
  spliced = splice(model, sae, name=SPLICE_NAME)
  edit = FeatureEdit.clamp(sae, [feature], value)
  return insert_at(spliced, f"{sae.config.hook_point}.{SPLICE_NAME}.features",
                   edit)
