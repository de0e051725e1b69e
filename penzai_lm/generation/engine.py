"""The compiled generation engine: one prefill call, then a `while_loop`.

Design
------
A request becomes a fixed-shape batch: ``B`` decode rows (the request's rows
plus padding rows up to a power of two), prompts left-padded to a bucket of
``P`` tokens (a power of two, at least 8) and a KV cache of ``C`` slots (a
power of two holding ``P - 1 + max(max_new_tokens)`` tokens). Everything that
varies inside a bucket -- prompt ids and lengths, sampling values, seeds,
``max_new_tokens``, stop ids, forced tokens -- is a traced array, so one
compiled program serves every such request. Compiled programs are cached
(`_cache_size`) under the model's pytree structure plus these shapes; the
weights are arguments of the programs, never constants.

1. **Prefill** (one compiled call): writes the first ``P - 1`` prompt
   columns to the cache with ``stateless_call`` and an explicit
   ``is_padding`` mask (the logits are unused, so XLA drops the output
   projection). With ``num_samples > 1`` the prefill runs once per prompt at
   the prompt batch and the resulting state (caches, positions and any patch
   state with the batch axis) is gathered to the decode rows.
2. **Decode loop** (one compiled call, `jax.lax.while_loop`): each iteration
   feeds every row's pending token (the last prompt token first) through the
   functional cached model, then picks each row's next token: the head of the
   row's forced-token queue if any, else `penzai_lm.sampling.sample_next`
   with the row's own seed and step (so a row never depends on its batch
   slot or its neighbours). Tokens, log-probs, top-n alternatives and a
   forced flag are recorded per row. A row finishes on a stop token
   (``stop``), at its ``max_new_tokens`` (``length``), or when the cache has
   no free slot (``cache_full``); finished rows feed padding from then on,
   which no row attends to. The loop exits as soon as no row needs another
   token, when a row waits for the host (a tool call marker, or its forced
   queue continues on the host), or after ``stop_at`` iterations -- which is
   how streaming runs the same program in chunks of k steps, keeping the
   state on device between chunks.

With ``use_cache=False`` the same loop recomputes the whole sequence with the
uncached model at every step (a reference for the cached path).

Model preparation (host side, cached per model identity and bucket): layer
stacks are replaced by a Sequential of their blocks (`unstack_layers`; a
scanned stack slices -- and, with the stack axis stored last, gathers --
every layer's weights and copies the stacked caches at every decode step),
the model is converted to cached mode for the bucket, frozen and flattened
once. Constant initial state (empty caches, positions) is described by its
shape and fill value and created inside the prefill program. A second
request for the same model and bucket spends about a millisecond on the
host before the prefill starts.

Decode programs do not depend on the prompt bucket (output buffers are sized
by the cache), so prompts of different lengths share one decode program per
cache bucket and batch size.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import time
import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm import sampling
from penzai_lm.generation import requests as requests_lib
from penzai_lm.generation.results import GenerationResult
from penzai_lm.generation.results import Timings
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model import TransformerLM

# Row status codes on device.
RUNNING, STOP, LENGTH, CACHE_FULL, CANCELLED, PADDING_ROW = range(6)
REASON_NAMES = {STOP: "stop", LENGTH: "length", CACHE_FULL: "cache_full",
                CANCELLED: "cancelled"}

MIN_PROMPT_BUCKET = 8
MIN_QUEUE = 16
MIN_STOP_WIDTH = 8
DEFAULT_MAX_NEW_TOKENS = 128


# Compiled-program cache.


class _ProgramCache:
  """Compiled programs keyed on (name, static plan, argument structure and
  shapes). Thread-safe; compile time is measured per call."""

  def __init__(self):
    self._programs: dict[Any, Any] = {}
    self._lock = threading.Lock()
    self._warned = False
    self.compilations = 0

  def get(self, name, fn, static, args, donate=()):
    leaves, treedef = jax.tree_util.tree_flatten(args)
    key = (name, static, treedef, tuple(_aval_key(x) for x in leaves))
    try:
      hash(key)
    except TypeError:
      # A layer with an unhashable static field: compile without caching.
      if not self._warned:
        self._warned = True
        warnings.warn(
            "the model has an unhashable static field (e.g. a list or dict in"
            " a layer's metadata); generation programs cannot be cached and"
            " are recompiled on every call. Use tuples or frozen"
            " dataclasses for static layer fields.")
      key = None
    with self._lock:
      program = None if key is None else self._programs.get(key)
    if program is not None:
      return program, 0.0
    start = time.perf_counter()
    jitted = jax.jit(functools.partial(fn, static), donate_argnums=donate)
    program = jitted.lower(*args).compile()
    elapsed = time.perf_counter() - start
    with self._lock:
      if key is not None:
        self._programs.setdefault(key, program)
      self.compilations += 1
    return program, elapsed

  def size(self, name: str | None = None) -> int:
    with self._lock:
      return sum(1 for k in self._programs if name is None or k[0] == name)

  def clear(self) -> None:
    with self._lock:
      self._programs.clear()


def _aval_key(x):
  dtype = x.dtype if hasattr(x, "dtype") else np.result_type(type(x))
  return (np.shape(x), np.dtype(dtype), bool(getattr(x, "weak_type", False)))


_PROGRAMS = _ProgramCache()


def _cache_size(name: str | None = None) -> int:
  """Number of compiled programs held ("prefill", "decode" or all)."""
  return _PROGRAMS.size(name)


def clear_compiled_cache() -> None:
  """Drops every compiled program and prepared model (rebuilt on demand)."""
  _PROGRAMS.clear()
  _UNSTACKED.clear()
  _PREPARED.clear()


# Layer stacks are unrolled for decoding.
#
# penzai's LayerStack runs its blocks with an unrolled `lax.scan` (so it
# saves no compile time) and slices every stacked weight inside the loop
# body. With the stack axis stored last (as the builder and the random init
# store it) each step gathers every layer's weights with a stride of
# num_layers floats, and the per-layer caches are re-stacked (copied) every
# step. Decoding therefore runs on an equivalent model whose stacks are
# replaced by a Sequential of per-layer blocks (per-layer state variables get
# one variable per layer). The unstacked weights are cached for the most
# recent models (keyed on the identity of their arrays).

# Set to False to decode with the model's layer stacks as they are (for
# benchmarks comparing the two).
UNSTACK_LAYER_STACKS = True

class _IdentityCache:
  """A small LRU cache keyed on a model's identity (see `_model_key`).

  Entries hold weak references to the model's leaves (strong ones where
  weak ones are impossible): an entry whose model has been garbage collected
  is dropped, so the cache never keeps an old model alive.
  """

  def __init__(self, size: int):
    self.size = size
    self._entries: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()

  @staticmethod
  def _refs(leaves):
    refs = []
    for x in leaves:
      try:
        refs.append(weakref.ref(x))
      except TypeError:
        refs.append(lambda x=x: x)
    return refs

  @staticmethod
  def _alive(refs, leaves=None):
    if leaves is None:
      return all(r() is not None for r in refs)
    return all(r() is x for r, x in zip(refs, leaves))

  def get(self, key, leaves):
    with self._lock:
      entry = self._entries.get(key)
      if entry is None:
        return None
      if not self._alive(entry[0], leaves):
        del self._entries[key]
        return None
      self._entries.move_to_end(key)
      return entry[1]

  def put(self, key, leaves, value) -> None:
    with self._lock:
      for k in [k for k, e in self._entries.items() if not self._alive(e[0])]:
        del self._entries[k]
      self._entries[key] = (self._refs(leaves), value)
      while len(self._entries) > self.size:
        self._entries.popitem(last=False)

  def clear(self) -> None:
    with self._lock:
      self._entries.clear()


_UNSTACKED = _IdentityCache(2)


def _slice_axis(tree, axis: str, index: int):
  return (pz.select(tree).at_instances_of(pz.nx.NamedArrayBase)
          .where(lambda x: axis in x.named_shape)
          .apply(lambda x: x[{axis: index}]))


def _unstack(stack: pz.nn.LayerStack) -> pz.nn.Sequential:
  """An equivalent Sequential of the blocks of a LayerStack."""
  axis, n = stack.stack_axis, stack.stack_axis_size
  pure, variables = pz.unbind_state_vars(pz.freeze_params(
      stack.stacked_sublayers))
  per_layer = {}
  for var in variables:
    behavior = var.metadata.get("layerstack_axes", {}).get(axis)
    if behavior == pz.nn.LayerStackVarBehavior.PER_LAYER:
      metadata = dict(var.metadata)
      axes = dict(metadata["layerstack_axes"])
      del axes[axis]
      if axes:
        metadata["layerstack_axes"] = axes
      else:
        del metadata["layerstack_axes"]
      per_layer[var.label] = [
          pz.StateVariable(
              value=_slice_axis(var.value, axis, i),
              label=f"{var.label}/{axis}_{i}", metadata=metadata)
          for i in range(n)
      ]
  blocks = []
  for i in range(n):
    block = _slice_axis(pure, axis, i)
    block = (pz.select(block).at_instances_of(pz.StateVariableSlot)
             .where(lambda slot: slot.label in per_layer)
             .apply(lambda slot: pz.StateVariableSlot(
                 label=f"{slot.label}/{axis}_{i}")))  # noqa: B023
    block_vars = [per_layer[v.label][i] if v.label in per_layer else v
                  for v in variables]
    blocks.append(pz.bind_variables(block, block_vars))
  return pz.nn.Sequential(blocks)


def _model_key(model):
  """A hashable key identifying a model's structure and current arrays.

  Variables (parameters, state) are pytree leaves: their identity and the
  identity of their current value are part of the key, so assigning a new
  value to a parameter gives a new key. Returns ``(key, leaves)``; keep the
  leaves alive as long as the key is used (ids are only unique then).
  """
  leaves, treedef = jax.tree_util.tree_flatten(model)
  ids = tuple((id(x), id(x.value)) if isinstance(x, pz.AbstractVariable)
              else id(x) for x in leaves)
  return (treedef, ids), leaves


def unstack_layers(model):
  """Replaces every `pz.nn.LayerStack` of a model by a Sequential of its
  blocks (the same computation; parameters are frozen). Cached."""
  if not UNSTACK_LAYER_STACKS:
    return model
  key, leaves = _model_key(model)
  hit = _UNSTACKED.get(key, leaves)
  if hit is not None:
    return hit
  selection = pz.select(model).at_instances_of(pz.nn.LayerStack)
  unstacked = selection.apply(_unstack) if selection.count() else model
  _UNSTACKED.put(key, leaves, unstacked)
  return unstacked


# Prepared (converted, frozen, flattened) models, cached per bucket.

_PREPARED = _IdentityCache(4)


@dataclasses.dataclass(frozen=True)
class Prepared:
  """A model ready for the compiled programs.

  Attributes:
    model_leaves: Arrays of the stateless model (weights first of all).
    treedef: Its pytree structure (static in the programs).
    state_treedef: Structure of the initial state (a list of
      StateVariableValue).
    state_spec: Per state leaf, ``(shape, dtype, fill)`` for a constant
      array (built inside the program, so nothing cache-sized is kept or
      transferred) or None for an array passed in ``state_args``.
    state_args: The non-constant initial state arrays.
  """

  model_leaves: list
  treedef: Any
  state_treedef: Any
  state_spec: tuple
  state_args: list


def _constant_fill(x):
  """The value of a constant array (all elements equal), else None."""
  x = jnp.asarray(x)
  if x.size == 0:
    return None
  first = x.reshape(-1)[0]
  if bool(jnp.all(x == first)):
    value = first.item()
    return value
  return None


def _prepare_runnable(runnable) -> Prepared:
  stateless, state0 = pz.unbind_state_vars(
      pz.freeze_params(runnable), freeze=True)
  model_leaves, treedef = jax.tree_util.tree_flatten(stateless)
  state_leaves, state_treedef = jax.tree_util.tree_flatten(list(state0))
  spec, args = [], []
  for x in state_leaves:
    fill = _constant_fill(x) if hasattr(x, "shape") else None
    if fill is None:
      spec.append(None)
      args.append(x)
    else:
      spec.append((tuple(np.shape(x)), np.dtype(x.dtype), fill))
  return Prepared(model_leaves, treedef, state_treedef, tuple(spec), args)


def prepare_model(model, kind: str, plan: "Plan") -> Prepared:
  """Converts (cached mode, unstacked layers, no overflow callback), freezes
  and flattens a model for a plan's batch and cache size. Cached."""
  key, leaves = _model_key(model)
  key = (key, kind, plan.use_cache, plan.cache_len, plan.batch,
         plan.batch_axis, UNSTACK_LAYER_STACKS)
  hit = _PREPARED.get(key, leaves)
  if hit is not None:
    return hit
  _check_bound(model)
  if kind == "cached":
    runnable = _without_overflow_callback(unstack_layers(model))
  elif plan.use_cache:
    runnable = _without_overflow_callback(
        KVCachingTransformerLM.from_uncached(
            unstack_layers(model), plan.cache_len,
            {plan.batch_axis: plan.batch}))
  else:
    runnable = model
  prepared = _prepare_runnable(runnable)
  _PREPARED.put(key, leaves, prepared)
  return prepared


# Static plan of one request.


@dataclasses.dataclass(frozen=True)
class Plan:
  """Compile-time shapes of a request (part of the program cache key).

  Attributes:
    use_cache: Cached decoding (else full recomputation).
    batch_axis: Name of the batch axis.
    batch: Decode rows ``B``.
    prefill_batch: Prefill rows (``B`` unless rows are replicated).
    prompt_len: Prompt bucket ``P``.
    cache_len: Cache slots ``C`` (token buffer length without a cache).
    out_len: Length of the per-row output buffers (``C``).
    queue_len: Forced-token queue length per row and call.
    stop_width: Stop ids per row.
    top_n: Top alternatives recorded per token.
    vocab: Vocabulary size.
    gather: Whether decode rows are gathered from prefill rows.
  """

  use_cache: bool
  batch_axis: str
  batch: int
  prefill_batch: int
  prompt_len: int
  cache_len: int
  out_len: int
  queue_len: int
  stop_width: int
  top_n: int
  vocab: int
  gather: bool


def _bucket(n: int, minimum: int = 1) -> int:
  return max(minimum, requests_lib.next_power_of_two(n))


def _model_kind(model):
  if isinstance(model, KVCachingTransformerLM):
    return "cached"
  if isinstance(model, TransformerLM):
    return "uncached"
  raise TypeError(
      "model must be a penzai_lm TransformerLM (e.g. from build_transformer"
      " or a checkpoint loader) or a KVCachingTransformerLM, got"
      f" {type(model).__name__}.")


def _check_bound(model) -> None:
  unbound = pz.select(model).at_instances_of(pz.ParameterSlot).count()
  if unbound:
    raise ValueError(
        f"the model has {unbound} unbound parameter slot(s); load weights"
        " (pz.bind_variables) or build it with a seed before generating.")


def _empty_cache_check(model: KVCachingTransformerLM) -> None:
  end = model.cache_end_index.value
  if isinstance(end, jax.core.Tracer):
    raise ValueError("generate() cannot be called inside jax.jit.")
  if int(end) != 0:
    raise ValueError(
        f"this KVCachingTransformerLM already holds {int(end)} tokens;"
        " generate() starts from an empty cache. Build a fresh one with"
        " KVCachingTransformerLM.from_uncached(model, cache_len, batch_axes).")


def plan_request(model, request: requests_lib.GenerationRequest,
                 use_cache: bool) -> Plan:
  """Chooses the bucket shapes of a request.

  Raises:
    ValueError: if the request does not fit the model.
  """
  kind = _model_kind(model)
  config = model.config
  rows = request.num_rows
  lengths = [len(p) for p in request.prompts]
  longest = max(lengths)
  max_new = int(request.max_new_tokens.max())
  limit = config.max_position_embeddings
  for r, n_new in enumerate(request.max_new_tokens):
    length = lengths[request.prompt_of_row(r)]
    if length + int(n_new) > limit:
      raise ValueError(
          f"prompt {request.prompt_of_row(r)} has {length} tokens and"
          f" max_new_tokens is {int(n_new)}: {length + int(n_new)} tokens"
          f" exceed the model's context of {limit} tokens"
          " (config.max_position_embeddings). Shorten the prompt or lower"
          " max_new_tokens.")
  gather = request.num_samples > 1

  if kind == "cached":
    if not use_cache:
      raise ValueError(
          "use_cache=False needs the uncached TransformerLM; pass the model"
          " you built the KVCachingTransformerLM from.")
    _empty_cache_check(model)
    if len(model.batch_axes) != 1:
      raise ValueError(
          f"the cached model has batch axes {model.batch_axes}; generate()"
          " supports exactly one batch axis.")
    (axis, batch), = model.batch_axes.items()
    if batch < rows:
      raise ValueError(
          f"the cached model was built for {batch} row(s) but the request"
          f" needs {rows} ({request.num_prompts} prompt(s) x"
          f" {request.num_samples} sample(s)); rebuild it with"
          f" KVCachingTransformerLM.from_uncached(model, cache_len,"
          f" {{{axis!r}: {rows}}}) or pass the uncached model.")
    cache_len = model.cache_len
    if longest > cache_len:
      raise ValueError(
          f"the longest prompt has {longest} tokens but the cached model's"
          f" cache holds only {cache_len}; rebuild it with a larger"
          " cache_len or pass the uncached model (sized automatically).")
    prompt_len = min(_bucket(longest, MIN_PROMPT_BUCKET), cache_len)
    prefill_batch = min(_bucket(request.num_prompts), batch) if gather else batch
  else:
    axis = "batch"
    batch = _bucket(rows)
    prefill_batch = _bucket(request.num_prompts) if gather else batch
    prompt_len = _bucket(longest, MIN_PROMPT_BUCKET)
    cache_len = _bucket(prompt_len + max_new - 1)
    if config.family == "gpt2" and cache_len > limit:
      # GPT-2's cache may not exceed its learned positions.
      cache_len = limit
      if prompt_len + max_new - 1 > cache_len:
        prompt_len = longest

  # Rows can generate at most cache_len - prompt_len + 1 tokens; sizing the
  # output buffers by the cache alone keeps the decode program independent
  # of the prompt bucket (prompts of any length share it).
  out_len = cache_len
  queue = max(len(f) for f in request.forced_tokens)
  stops = max(len(s) for s in request.stop_tokens)
  plan = Plan(
      use_cache=use_cache,
      batch_axis=axis,
      batch=batch,
      prefill_batch=prefill_batch,
      prompt_len=prompt_len,
      cache_len=cache_len,
      out_len=out_len,
      queue_len=_bucket(queue, MIN_QUEUE),
      stop_width=_bucket(stops, MIN_STOP_WIDTH),
      top_n=request.logprobs_top_n,
      vocab=config.vocab_size,
      gather=gather,
  )
  return plan


def _without_overflow_callback(cached):
  """The loop never overflows the cache by construction (it stops at
  ``cache_full``), so the model's run-time overflow check (a host callback,
  which keeps programs out of JAX's persistent cache) is turned off where
  the model supports it."""
  names = {f.name for f in dataclasses.fields(cached)}
  if "runtime_overflow_check" in names and cached.runtime_overflow_check:
    return dataclasses.replace(cached, runtime_overflow_check=False)
  return cached


# Traced helpers.


def _map_batch_arrays(tree, axis: str, fn):
  """Applies ``fn`` (on the batch-leading data) to NamedArrays with ``axis``."""

  def apply(x):
    if isinstance(x, pz.nx.NamedArrayBase) and axis in x.named_shape:
      return pz.nx.nmap(fn)(x.untag(axis)).tag(axis)
    return x

  return jax.tree_util.tree_map(apply, tree, is_leaf=pz.nx.is_namedarray)


def _named(x, axis):
  return pz.nx.wrap(x).tag(axis, "seq")


def _logprob_of(logits, token):
  picked = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def _initial_state(state_static, state_args):
  state_treedef, spec = state_static
  args = iter(state_args)
  leaves = [next(args) if s is None else jnp.full(s[0], s[2], s[1])
            for s in spec]
  return jax.tree_util.tree_unflatten(state_treedef, leaves)


def _prefill(static, model_leaves, state_args, tokens, padding, src, real):
  """Prefill program: returns the initial decode-loop carry."""
  plan, treedef, state_static = static
  model = jax.tree_util.tree_unflatten(treedef, model_leaves)
  state0 = _initial_state(state_static, state_args)
  axis, P = plan.batch_axis, plan.prompt_len
  if plan.gather:
    gather = lambda a: a[src]  # noqa: E731
    dtokens, dpadding = tokens[src], padding[src]
  else:
    gather = None
    dtokens, dpadding = tokens, padding
  if plan.use_cache:
    if plan.gather:
      pmodel = dataclasses.replace(
          model, batch_axes={axis: plan.prefill_batch})
      pstate = _map_batch_arrays(
          state0, axis, lambda a: a[:plan.prefill_batch])
    else:
      pmodel, pstate = model, state0
    if P > 1:
      _, pstate = pmodel.stateless_call(
          pstate, _named(tokens[:, :P - 1], axis),
          is_padding=_named(padding[:, :P - 1], axis))
      pstate = list(pstate)
    mstate = _map_batch_arrays(pstate, axis, gather) if gather else pstate
    mstate = pz.nx.order_like(mstate, state0)
  else:
    C = plan.cache_len
    B = plan.batch
    buf = jnp.zeros((B, C), jnp.int32).at[:, :P - 1].set(dtokens[:, :P - 1])
    real_cols = ~dpadding[:, :P - 1]
    count = jnp.cumsum(real_cols, axis=1, dtype=jnp.int32)
    pos = jnp.full((B, C), -1, jnp.int32).at[:, :P - 1].set(
        jnp.where(real_cols, count - 1, -1))
    mstate = dict(tokens=buf, positions=pos, state=state0)

  B, T, V = plan.batch, plan.out_len, plan.vocab
  carry = dict(
      mstate=mstate,
      slots=jnp.asarray(P - 1, jnp.int32),
      next_token=dtokens[:, P - 1],
      feed=real,
      step=jnp.zeros((B,), jnp.int32),
      reason=jnp.where(real, RUNNING, PADDING_ROW).astype(jnp.int32),
      waiting=jnp.zeros((B,), bool),
      sampler=sampling.init_sampler_state(dtokens, ~dpadding, vocab_size=V),
      out_tokens=jnp.zeros((B, T), jnp.int32),
      out_logprobs=jnp.zeros((B, T), jnp.float32),
      out_forced=jnp.zeros((B, T), bool),
      q_pos=jnp.zeros((B,), jnp.int32),
      t=jnp.asarray(0, jnp.int32),
  )
  if plan.top_n:
    carry["out_top_logprobs"] = jnp.zeros((B, T, plan.top_n), jnp.float32)
    carry["out_top_ids"] = jnp.zeros((B, T, plan.top_n), jnp.int32)
  return carry


def _feed_fn(plan: Plan, model):
  """Returns feed(mstate, slots, token, mask) -> (logits (B, V) f32, mstate)."""
  axis = plan.batch_axis

  if plan.use_cache:

    def feed(mstate, slots, token, mask):
      del slots
      logits, new = model.stateless_call(
          mstate, _named(token[:, None], axis),
          is_padding=_named(~mask[:, None], axis))
      logits = logits.unwrap(axis, "seq", "vocabulary")[:, 0]
      return logits.astype(jnp.float32), pz.nx.order_like(list(new), mstate)

    return feed

  def feed(mstate, slots, token, mask):
    tokens = jax.lax.dynamic_update_slice(
        mstate["tokens"], token[:, None], (0, slots))
    positions = mstate["positions"]
    next_pos = jnp.max(positions, axis=1) + 1
    positions = jax.lax.dynamic_update_slice(
        positions, jnp.where(mask, next_pos, -1)[:, None], (0, slots))
    logits, state = model.stateless_call(
        mstate["state"], _named(tokens, axis),
        token_positions=_named(positions, axis))
    logits = logits.unwrap(axis, "seq", "vocabulary")
    logits = jax.lax.dynamic_index_in_dim(logits, slots, 1, keepdims=False)
    new = dict(tokens=tokens, positions=positions,
               state=pz.nx.order_like(list(state), mstate["state"]))
    return logits.astype(jnp.float32), new

  return feed


def _decode(static, model_leaves, carry, settings, max_new, stop_ids,
            pause_id, stop_at, end_rows, end_reason, resume, q_tokens, q_len,
            q_more):
  """Decode program: runs the loop until done, paused or ``t == stop_at``."""
  plan, treedef = static
  model = jax.tree_util.tree_unflatten(treedef, model_leaves)
  feed_model = _feed_fn(plan, model)
  B, T, Q = plan.batch, plan.out_len, plan.queue_len
  rows = jnp.arange(B)

  # Host control: end rows (stop strings, cancellation), resume paused rows.
  c = dict(carry)
  end = end_rows & (c["reason"] == RUNNING)
  c["reason"] = jnp.where(end, end_reason, c["reason"])
  c["feed"] = c["feed"] & ~end
  c["waiting"] = c["waiting"] & ~end
  resumed = resume & c["waiting"]
  c["feed"] = c["feed"] | resumed
  c["waiting"] = c["waiting"] & ~resumed
  c["q_pos"] = jnp.zeros((B,), jnp.int32)

  def cond(c):
    return ((c["t"] < stop_at) & jnp.any(c["feed"]) & ~jnp.any(c["waiting"])
            & (c["slots"] < plan.cache_len))

  def body(c):
    c = dict(c)
    active = c["feed"]
    logits, c["mstate"] = feed_model(
        c["mstate"], c["slots"], c["next_token"], active)
    c["slots"] = c["slots"] + 1

    sampled, logprob = sampling.sample_next(
        logits, settings, c["sampler"], c["step"])
    has_q = c["q_pos"] < q_len
    queued = jnp.take_along_axis(
        q_tokens, jnp.minimum(c["q_pos"], Q - 1)[:, None], axis=1)[:, 0]
    forced = active & has_q
    token = jnp.where(forced, queued, sampled)
    logprob = jax.lax.cond(
        jnp.any(forced),
        lambda: jnp.where(forced, _logprob_of(logits, token), logprob),
        lambda: logprob)
    c["q_pos"] = c["q_pos"] + forced.astype(jnp.int32)

    index = jnp.where(active, c["step"], T)
    c["out_tokens"] = c["out_tokens"].at[rows, index].set(token, mode="drop")
    c["out_logprobs"] = c["out_logprobs"].at[rows, index].set(
        logprob, mode="drop")
    c["out_forced"] = c["out_forced"].at[rows, index].set(forced, mode="drop")
    if plan.top_n:
      top_lp, top_ids = sampling.top_logprobs(logits, plan.top_n)
      c["out_top_logprobs"] = c["out_top_logprobs"].at[rows, index].set(
          top_lp, mode="drop")
      c["out_top_ids"] = c["out_top_ids"].at[rows, index].set(
          top_ids, mode="drop")
    c["sampler"] = sampling.update_sampler_state(c["sampler"], token, active)
    c["step"] = c["step"] + active.astype(jnp.int32)

    is_stop = active & jnp.any(token[:, None] == stop_ids, axis=1)
    is_len = active & (c["step"] >= max_new)
    c["reason"] = jnp.where(
        is_stop, STOP, jnp.where(is_len, LENGTH, c["reason"]))
    going = active & ~is_stop & ~is_len
    # Pause for the host: a tool-call end marker was sampled, or the forced
    # queue ran out while the host holds more forced tokens for the row.
    pause = going & (
        (~forced & (token == pause_id))
        | (forced & (c["q_pos"] >= q_len) & q_more))
    c["waiting"] = c["waiting"] | pause
    c["feed"] = going & ~pause
    c["next_token"] = jnp.where(active, token, c["next_token"])
    c["t"] = c["t"] + 1
    return c

  c = jax.lax.while_loop(cond, body, c)
  full = c["feed"] & (c["slots"] >= plan.cache_len)
  c["reason"] = jnp.where(full, CACHE_FULL, c["reason"])
  c["feed"] = c["feed"] & ~full
  return c


# Host side.


def _row_lists(values, rows, fill):
  return list(values) + [fill] * (rows - len(values))


class Run:
  """One request in flight: owns the device state and the host bookkeeping.

  Used by `generate` (one decode call, or chunks when the host must take
  part) and by the streaming helpers (chunks of ``k`` steps).
  """

  def __init__(self, model, request: requests_lib.GenerationRequest, *,
               use_cache: bool = True, tool=None):
    self._start = time.perf_counter()
    self.request = request
    self.tool = tool
    plan = plan_request(model, request, use_cache)
    self.plan = plan
    rows, B = request.num_rows, plan.batch
    self.rows = rows
    prepared = prepare_model(model, _model_kind(model), plan)
    self._model_leaves = prepared.model_leaves
    self._treedef = prepared.treedef
    self._state_static = (prepared.state_treedef, prepared.state_spec)
    self._state_args = prepared.state_args

    # Prompts, left-padded to the bucket.
    P = plan.prompt_len
    prefill_rows = plan.prefill_batch
    if plan.gather:
      prompts = request.prompts
      src = [request.prompt_of_row(r) for r in range(rows)]
    else:
      prompts = [request.prompts[request.prompt_of_row(r)] for r in range(rows)]
      src = list(range(rows))
    tokens = np.zeros((prefill_rows, P), np.int32)
    padding = np.ones((prefill_rows, P), bool)
    for i, prompt in enumerate(prompts):
      tokens[i, P - len(prompt):] = prompt
      padding[i, P - len(prompt):] = False
    self._prefill_inputs = (
        tokens, padding, np.asarray(_row_lists(src, B, 0), np.int32),
        np.asarray([r < rows for r in range(B)], bool))

    # Per-row settings, padded with neutral rows.
    values = {name: _row_lists(v, B, requests_lib.SAMPLING_DEFAULTS.get(
        name)) for name, v in request.sampling.items()}
    for name in ("logit_bias", "banned_tokens"):
      values[name] = _row_lists(request.sampling[name], B, None)
    if all(v is None for v in values["logit_bias"]):
      values["logit_bias"] = None
    else:
      values["logit_bias"] = [v or {} for v in values["logit_bias"]]
    if all(v is None for v in values["banned_tokens"]):
      values["banned_tokens"] = None
    else:
      values["banned_tokens"] = [list(v or ()) for v in values["banned_tokens"]]
    try:
      self.settings = sampling.SamplingSettings.make(
          B, plan.vocab, seed=_row_lists(request.seeds, B, 0),
          top_k_cap=request.top_k_cap, always_dense=True, **values)
    except ValueError as e:
      hint = ""
      if request.num_samples > 1:
        hint = (f" (rows are prompt-major: row r is sample r %"
                f" {request.num_samples} of prompt r // {request.num_samples})")
      raise ValueError(f"{e}{hint}") from None
    self._max_new = np.asarray(
        _row_lists(request.max_new_tokens.tolist(), B, 1), np.int32)
    stop_ids = np.full((B, plan.stop_width), -1, np.int32)
    for r, ids in enumerate(request.stop_tokens):
      stop_ids[r, :len(ids)] = ids
    self._stop_ids = stop_ids
    pause = -1 if tool is None else int(tool.pause_token_id)
    self._pause_id = np.asarray(pause, np.int32)

    # Host bookkeeping.
    self.queues: list[list[int]] = [list(f) for f in request.forced_tokens]
    self._end_rows = np.zeros((B,), bool)
    self._end_reason = np.zeros((B,), np.int32)
    self._resume = np.zeros((B,), bool)
    self.host_reason: list[str | None] = [None] * rows
    self.keep: list[int | None] = [None] * rows  # Truncation (stop strings).
    self.emitted = [0] * rows
    self.carry = None
    self.view: dict[str, np.ndarray] | None = None
    self.timings = Timings(batch_rows=B)
    self.timings.prompt_tokens = int(sum(len(p) for p in request.prompts))
    self._first_token_done = False
    self.finished = False

  # Device calls.

  def prefill(self) -> None:
    args = (self._model_leaves, self._state_args, *self._prefill_inputs)
    program, compile_s = _PROGRAMS.get(
        "prefill", _prefill, (self.plan, self._treedef, self._state_static),
        args)
    self.timings.compile_s += compile_s
    start = time.perf_counter()
    self.carry = program(*args)
    jax.block_until_ready(self.carry)
    self.timings.prefill_s = time.perf_counter() - start
    self._fetch()

  def decode(self, steps: int | None = None) -> None:
    """Runs the loop for at most ``steps`` iterations (None: to the end)."""
    if self.finished:
      return
    B, Q = self.plan.batch, self.plan.queue_len
    q_tokens = np.zeros((B, Q), np.int32)
    q_len = np.zeros((B,), np.int32)
    q_more = np.zeros((B,), bool)
    for r, queue in enumerate(self.queues):
      n = min(len(queue), Q)
      q_tokens[r, :n] = queue[:n]
      q_len[r] = n
      q_more[r] = len(queue) > Q
    t = int(self.view["t"])
    stop_at = np.asarray(
        np.iinfo(np.int32).max if steps is None else t + steps, np.int32)
    args = (self._model_leaves, self.carry, self.settings, self._max_new,
            self._stop_ids, self._pause_id, stop_at, self._end_rows,
            self._end_reason, self._resume, q_tokens, q_len, q_more)
    # The decode program does not depend on how the prefill was batched.
    plan = dataclasses.replace(
        self.plan, prefill_batch=0, gather=False, prompt_len=0)
    program, compile_s = _PROGRAMS.get(
        "decode", _decode, (plan, self._treedef), args, donate=(1,))
    self.timings.compile_s += compile_s
    start = time.perf_counter()
    self.carry = program(*args)
    self._fetch()
    elapsed = time.perf_counter() - start
    steps_run = int(self.view["t"]) - t
    if not self._first_token_done and steps_run:
      # The first iteration produces every row's first token.
      self._first_token_done = True
      self.timings.time_to_first_token_s = self.timings.prefill_s + (
          elapsed / steps_run if steps_run > 1 else elapsed)
      if steps_run > 1:
        self.timings.decode_s += elapsed * (steps_run - 1) / steps_run
        self.timings.decode_steps += steps_run - 1
    else:
      self.timings.decode_s += elapsed
      self.timings.decode_steps += steps_run
    self._end_rows[:] = False
    self._resume[:] = False
    consumed = self.view["q_pos"]
    for r in range(self.rows):
      if consumed[r]:
        del self.queues[r][:int(consumed[r])]
    self._handle_waiting()
    self.finished = self._all_done()

  def _fetch(self) -> None:
    keys = ["t", "step", "reason", "waiting", "feed", "q_pos", "out_tokens",
            "out_logprobs", "out_forced"]
    if self.plan.top_n:
      keys += ["out_top_logprobs", "out_top_ids"]
    self.view = jax.device_get({k: self.carry[k] for k in keys})

  def _handle_waiting(self) -> None:
    waiting = self.view["waiting"]
    for r in range(self.rows):
      if not waiting[r]:
        continue
      if self.tool is not None and not self.queues[r]:
        prompt = self.request.prompts[self.request.prompt_of_row(r)]
        reply = self.tool.respond(prompt.tolist() + self.tokens_of(r))
        if reply:
          self.queues[r].extend(int(t) for t in reply)
      self._resume[r] = True

  def _all_done(self) -> bool:
    reason = self.view["reason"]
    return all(self.host_reason[r] is not None or reason[r] != RUNNING
               for r in range(self.rows))

  # Host control.

  def end_row(self, row: int, reason: str, keep: int | None = None) -> None:
    """Ends a row from the host (stop string, cancellation)."""
    if self.host_reason[row] is not None:
      return
    if self.view is None:
      raise RuntimeError("end_row() needs a started run.")
    if self.view["reason"][row] != RUNNING and keep is None:
      return
    self.host_reason[row] = reason
    if keep is not None:
      self.keep[row] = keep
    self._end_rows[row] = True
    self._end_reason[row] = STOP if reason == "stop" else CANCELLED
    self.finished = self._all_done()

  def force(self, row: int, tokens) -> None:
    """Queues forced tokens for a row (consumed before sampling)."""
    if not 0 <= row < self.rows:
      raise IndexError(f"row {row} is outside [0, {self.rows}).")
    ids = requests_lib._token_list("forced tokens", tokens, self.plan.vocab)  # pylint: disable=protected-access
    self.queues[row].extend(ids)

  def cancel(self) -> None:
    """Ends every running row with "cancelled" (nothing more runs)."""
    for r in range(self.rows):
      if self.finish_reason(r) is None:
        self.host_reason[r] = "cancelled"
    self.finished = True

  # Reading.

  def row_length(self, row: int) -> int:
    if self.view is None:
      return 0
    n = int(self.view["step"][row])
    return n if self.keep[row] is None else min(n, self.keep[row])

  def tokens_of(self, row: int, start: int = 0) -> list[int]:
    return self.view["out_tokens"][row, start:self.row_length(row)].tolist()

  def finish_reason(self, row: int) -> str | None:
    if self.host_reason[row] is not None:
      return self.host_reason[row]
    if self.view is None:
      return None
    return REASON_NAMES.get(int(self.view["reason"][row]))

  def new_tokens(self, row: int) -> tuple[list[int], list[float], list[bool]]:
    """Tokens of a row not yet taken with this method."""
    start, end = self.emitted[row], self.row_length(row)
    self.emitted[row] = max(start, end)
    v = self.view
    return (v["out_tokens"][row, start:end].tolist(),
            v["out_logprobs"][row, start:end].tolist(),
            v["out_forced"][row, start:end].tolist())

  def result(self) -> GenerationResult:
    v = self.view
    if v is None:  # Nothing ran (e.g. cancelled before the prefill).
      B, T, n = self.plan.batch, self.plan.out_len, max(1, self.plan.top_n)
      v = dict(
          step=np.zeros((B,), np.int32), out_tokens=np.zeros((B, T), np.int32),
          out_logprobs=np.zeros((B, T), np.float32),
          out_forced=np.zeros((B, T), bool),
          out_top_ids=np.zeros((B, T, n), np.int32),
          out_top_logprobs=np.zeros((B, T, n), np.float32))
    n = self.request.num_samples
    tokens, logprobs, forced, reasons = [], [], [], []
    top = [] if self.plan.top_n else None
    for r in range(self.rows):
      end = self.row_length(r)
      tokens.append(v["out_tokens"][r, :end].tolist())
      logprobs.append(v["out_logprobs"][r, :end].tolist())
      forced.append(v["out_forced"][r, :end].tolist())
      reasons.append(self.finish_reason(r))  # None: still running.
      if top is not None:
        ids = v["out_top_ids"][r, :end].tolist()
        lps = v["out_top_logprobs"][r, :end].tolist()
        top.append([list(zip(i, l)) for i, l in zip(ids, lps)])
    t = self.timings
    t.total_s = time.perf_counter() - self._start
    t.generated_tokens = sum(len(x) for x in tokens)
    if t.time_to_first_token_s:
      t.prefill_tokens_per_s = t.prompt_tokens / t.time_to_first_token_s
    if t.decode_s and t.decode_steps:
      t.decode_tokens_per_s = t.decode_steps / t.decode_s
    return GenerationResult(
        tokens=tokens,
        finish_reasons=reasons,
        logprobs=logprobs,
        forced=forced,
        prompt_indices=[r // n for r in range(self.rows)],
        sample_indices=[r % n for r in range(self.rows)],
        seeds=list(self.request.seeds),
        prompt_lengths=self.request.row_prompt_lengths,
        timings=t,
        top_logprobs=top,
    )


# Public entry point.


def start_run(model, prompts, *, max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
              temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
              repetition_penalty=1.0, presence_penalty=0.0,
              frequency_penalty=0.0, logit_bias=None, banned_tokens=None,
              seed=None, stop_tokens=None, num_samples=1, use_cache=True,
              logprobs_top_n=0, forced_tokens=None, tool=None,
              default_stop_tokens=None) -> Run:
  """Validates a request and prepares (but does not start) a `Run`."""
  kind = _model_kind(model)
  if not isinstance(use_cache, bool):
    raise ValueError(f"use_cache must be True or False, got {use_cache!r}.")
  if default_stop_tokens is None:
    default_stop_tokens = model.config.eos_token_ids
  batch_axis = None
  if kind == "cached" and len(model.batch_axes) == 1:
    batch_axis = next(iter(model.batch_axes))
  if tool is not None and not hasattr(tool, "respond"):
    raise TypeError(
        "tool must provide pause_token_id and respond(tokens) (e.g."
        " penzai_lm.generation.CalculatorTool).")
  request = requests_lib.build_request(
      prompts,
      vocab_size=model.config.vocab_size,
      default_stop_tokens=default_stop_tokens,
      max_new_tokens=max_new_tokens,
      num_samples=num_samples,
      seed=seed,
      stop_tokens=stop_tokens,
      forced_tokens=forced_tokens,
      logprobs_top_n=logprobs_top_n,
      logit_bias=logit_bias,
      banned_tokens=banned_tokens,
      batch_axis=batch_axis,
      temperature=temperature,
      top_k=top_k,
      top_p=top_p,
      min_p=min_p,
      repetition_penalty=repetition_penalty,
      presence_penalty=presence_penalty,
      frequency_penalty=frequency_penalty,
  )
  return Run(model, request, use_cache=use_cache, tool=tool)


def generate(
    model: TransformerLM | KVCachingTransformerLM,
    prompts: Any,
    *,
    max_new_tokens: int | list[int] = DEFAULT_MAX_NEW_TOKENS,
    temperature: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    top_p: float | list[float] = 1.0,
    min_p: float | list[float] = 0.0,
    repetition_penalty: float | list[float] = 1.0,
    presence_penalty: float | list[float] = 0.0,
    frequency_penalty: float | list[float] = 0.0,
    logit_bias: dict[int, float] | list[dict[int, float]] | None = None,
    banned_tokens: list[int] | list[list[int]] | None = None,
    seed: int | list[int] | None = None,
    stop_tokens: list[int] | list[list[int]] | None = None,
    num_samples: int = 1,
    use_cache: bool = True,
    logprobs_top_n: int = 0,
    forced_tokens: list[int] | list[list[int]] | None = None,
    tool: Any = None,
    cancel: threading.Event | None = None,
    chunk_size: int = 8,
) -> GenerationResult:
  """Generates tokens for one prompt or a batch, in compiled JAX.

  Token level: knows nothing about text (see `generate_text` for that).

  Args:
    model: An uncached `TransformerLM` (converted to cached mode with a cache
      sized for the request) or a `KVCachingTransformerLM` with an empty
      cache, one batch axis of at least ``num_rows`` rows; its cache size is
      then fixed, and rows that reach it end with ``"cache_full"``.
    prompts: One prompt (a list of ids or a 1-D array), a ragged list of
      prompts, a 2-D array, or a ``pz.nx.NamedArray`` with a ``seq`` axis and
      at most one batch axis. Prompts are taken whole (no padding is guessed).
    max_new_tokens: Maximum tokens generated per row (forced ones included).
    temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
      frequency_penalty, logit_bias, banned_tokens: Sampling settings (see
      `penzai_lm.sampling.SamplingSettings`); each may be one value or a list
      per prompt / per row. ``temperature=0`` is greedy.
    seed: Int, list per prompt, or None for a fresh random seed (reported in
      ``result.seeds``). Sample ``j > 0`` of a prompt uses a seed derived
      from the prompt's seed.
    stop_tokens: Ids that end a row (included in its output); default
      ``model.config.eos_token_ids``; ``[]`` disables. Per-row lists allowed.
    num_samples: Samples per prompt: one prefill per prompt, then the cache
      is replicated to ``num_samples`` independent rows.
    use_cache: False recomputes the whole sequence each step with the
      uncached model (slow; a reference for the cached path).
    logprobs_top_n: Record the top-n alternatives of every token (static:
      changing it compiles a new program).
    forced_tokens: Tokens forced at the start of every row's output (or per
      prompt / per row lists); marked in ``result.forced``.
    tool: A tool such as `CalculatorTool`: rows pause on its end marker and
      the host injects its reply as forced tokens.
    cancel: A ``threading.Event``; when set, generation stops at the next
      chunk boundary (``chunk_size`` steps) with finish reason
      ``"cancelled"``.
    chunk_size: Steps per compiled call when ``cancel`` is given.

  Returns:
    A `GenerationResult`.

  Raises:
    ValueError / TypeError: for invalid requests, before anything runs.
  """
  run = start_run(
      model, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
      top_k=top_k, top_p=top_p, min_p=min_p,
      repetition_penalty=repetition_penalty,
      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
      logit_bias=logit_bias, banned_tokens=banned_tokens, seed=seed,
      stop_tokens=stop_tokens, num_samples=num_samples, use_cache=use_cache,
      logprobs_top_n=logprobs_top_n, forced_tokens=forced_tokens, tool=tool)
  _check_chunk_size(chunk_size)
  run.prefill()
  run.decode(1)
  while not run.finished:
    if cancel is not None:
      if cancel.is_set():
        run.cancel()
        break
      run.decode(chunk_size)
    else:
      run.decode(None)
  return run.result()


def _check_chunk_size(chunk_size) -> None:
  if (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
      or chunk_size < 1):
    raise ValueError(
        f"chunk_size must be a positive integer, got {chunk_size!r}.")
