"""Per-row sampling settings as a JAX pytree.

Array conventions:
  * Every numeric setting is a JAX array of leading shape ``(batch,)``; row
    ``r`` of every array belongs to row ``r`` of the logits ``(batch, vocab)``.
  * ``logit_bias`` is ``None`` or a dense ``(batch, vocab)`` float32 array;
    ``banned_tokens`` is ``None`` or a ``(batch, vocab)`` bool mask (True =
    banned).
  * ``top_k_cap`` is a *static* (compile-time) Python int: the number of
    candidates the sampler extracts with ``jax.lax.top_k``. Changing it
    changes the pytree structure and therefore recompiles; changing any
    array value never does.

Neutral values (the filter is off): ``temperature=1``, ``top_k=0``,
``top_p=1``, ``min_p=0``, ``typical_p=1``, ``epsilon_cutoff=0``,
``eta_cutoff=0``, ``xtc_probability=0``, ``repetition_penalty=1``,
``presence_penalty=0``, ``frequency_penalty=0``. ``temperature=0`` means
greedy decoding. ``xtc_threshold`` defaults to 0.1 (llama.cpp's default);
XTC is off while ``xtc_probability`` is 0.

Build settings on the host with :meth:`SamplingSettings.make`, which checks
every value and raises a ``ValueError`` explaining what is wrong. Values are
Python numbers, sequences, numpy arrays or concrete ``jax.Array`` values
(read on the host with :func:`host_value`; a traced value is refused).

A new sampling control is one `FIELDS` entry and its dataclass field below,
its filter (``filters.py`` or ``entropy_filters.py``) and its call in
``sample.py``: ``make``, padding and ``generate``'s keywords follow the
table. Until the CPU kernel implements it too (``kernel=True`` in its entry,
its code in ``kernels/sampler.cc``), `sample_next` runs the JAX sampler on
CPU as well: a setting the kernel lacks is never ignored.
"""

from __future__ import annotations

import dataclasses
import numbers
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from penzai_lm.sampling.row_values import as_float
from penzai_lm.sampling.row_values import as_int
from penzai_lm.sampling.row_values import banned_rows
from penzai_lm.sampling.row_values import check_rows
from penzai_lm.sampling.row_values import host_value
from penzai_lm.sampling.row_values import is_sequence
from penzai_lm.sampling.row_values import logit_bias_rows
from penzai_lm.sampling.row_values import per_row
from penzai_lm.sampling.row_values import positive_int

# Default static number of top-k candidates; see benchmarks/sampling_filters.py.
DEFAULT_TOP_K_CAP = 256


@dataclasses.dataclass(frozen=True)
class SamplingField:
  """One per-row sampling setting: how it is given, checked and padded.

  Attributes:
    name: Keyword of `SamplingSettings.make` (and of ``generate``) and
      attribute of `SamplingSettings`.
    neutral: The value that turns the filter off (padding rows get it).
    kind: ``"float"`` or ``"int"`` (one number per row), ``"token_bias"``
      (a ``{token_id: float}`` dict per row, stored dense) or
      ``"token_set"`` (a list of token ids per row, stored as a mask).
    ok: For numbers, a predicate every row's value must satisfy.
    requirement: What ``ok`` demands, for the error message.
    kernel: Whether penzai_lm's CPU sampling kernel (``kernels/sampler.cc``)
      implements the setting. ``sample_next(kernel=True)`` calls the kernel
      only when every field does (:func:`kernel_implements_all`) and runs
      the JAX sampler otherwise. The kernel reads ``top_k``, ``logit_bias``
      and ``banned_tokens`` from buffers of their own and every other
      setting it implements from one float32 column of its per-row
      parameters, in this table's order (`KERNEL_PARAMS`;
      ``sampler.cc``'s ``PZLM_SAMPLE_PARAMS`` lists the same names in the
      same order, as a test checks).
  """

  name: str
  neutral: Any
  kind: str
  ok: Callable[[Any], bool] | None = None
  requirement: str = ""
  kernel: bool = False

  def is_row_value(self, value: Any) -> bool:
    """Whether ``value`` is one row's value (not a list of per-row values)."""
    if self.kind == "token_bias":
      return value is None or isinstance(value, Mapping)
    if self.kind == "token_set":
      return value is None or (is_sequence(value) and not any(
          is_sequence(v) for v in value))
    return not is_sequence(value)


# Every per-row setting, in filter order. Adding a filter means one entry
# here and its field below, the filter in filters.py and its call in
# sample.py; `make`, padding and `generate`'s keywords follow this table.
# `kernel=True` once kernels/sampler.cc implements it too.
FIELDS: tuple[SamplingField, ...] = (
    SamplingField("repetition_penalty", 1.0, "float", lambda p: p > 0,
                  "must be > 0 (1 turns it off)", kernel=True),
    SamplingField("presence_penalty", 0.0, "float", kernel=True),
    SamplingField("frequency_penalty", 0.0, "float", kernel=True),
    SamplingField("logit_bias", None, "token_bias", kernel=True),
    SamplingField("banned_tokens", None, "token_set", kernel=True),
    SamplingField("temperature", 1.0, "float", lambda t: t >= 0,
                  "must be >= 0 and finite (0 means greedy)", kernel=True),
    # Checked against top_k_cap.
    SamplingField("top_k", 0, "int", kernel=True),
    SamplingField("top_p", 1.0, "float", lambda p: 0 < p <= 1,
                  "must be in (0, 1] (1 turns top-p off)", kernel=True),
    SamplingField("min_p", 0.0, "float", lambda p: 0 <= p < 1,
                  "must be in [0, 1) (0 turns min-p off)", kernel=True),
    SamplingField("typical_p", 1.0, "float", lambda p: 0 < p <= 1,
                  "must be in (0, 1] (1 turns typical sampling off)",
                  kernel=True),
    SamplingField("epsilon_cutoff", 0.0, "float", lambda e: 0 <= e < 1,
                  "must be in [0, 1) (0 turns it off)", kernel=True),
    SamplingField("eta_cutoff", 0.0, "float", lambda e: 0 <= e < 1,
                  "must be in [0, 1) (0 turns it off)", kernel=True),
    SamplingField("xtc_probability", 0.0, "float", lambda p: 0 <= p <= 1,
                  "must be in [0, 1] (0 turns XTC off)", kernel=True),
    # Neutral: llama.cpp's default threshold (XTC is off at probability 0).
    SamplingField("xtc_threshold", 0.1, "float", lambda t: 0 <= t <= 1,
                  "must be in [0, 1] (values above 0.5 turn XTC off)",
                  kernel=True),
)
FIELD_NAMES = tuple(f.name for f in FIELDS)


# The settings the CPU kernel reads from buffers of their own; every other
# setting it implements is one float32 column of its per-row parameters.
KERNEL_BUFFERS = ("top_k", "logit_bias", "banned_tokens")


def kernel_params(fields: Sequence[SamplingField] = FIELDS
                  ) -> tuple[str, ...]:
  """The columns of the CPU kernel's per-row parameters, in order: the
  settings of ``fields`` it implements, but `KERNEL_BUFFERS`, in the
  table's order (``sampler.cc``'s ``PZLM_SAMPLE_PARAMS`` lists them)."""
  return tuple(f.name for f in fields
               if f.kernel and f.name not in KERNEL_BUFFERS)


# The kernel's per-row parameters for `FIELDS`.
KERNEL_PARAMS = kernel_params()


def kernel_implements_all(fields: Sequence[SamplingField] = FIELDS) -> bool:
  """Whether the CPU sampling kernel implements every setting of ``fields``.

  The settings' values are traced data, so whether a row uses a setting is
  unknown when a program is compiled: the choice between the kernel and the
  JAX sampler is made once, from the table. ``sample_next(kernel=True)``
  calls the kernel only when this is True for `FIELDS`.
  """
  return all(f.kernel for f in fields)


def top_k_cap_for(top_k: Any, vocab_size: int) -> int:
  """The static top-k candidate count that serves ``top_k`` (a value or a
  list per row): `DEFAULT_TOP_K_CAP`, or the next power of two above the
  largest value (capped at the vocabulary)."""
  top_k = host_value("top_k", top_k)
  values = [v for v in (top_k if is_sequence(top_k) else [top_k])
            if isinstance(v, numbers.Integral) and not isinstance(v, bool)]
  if not values or max(values) <= DEFAULT_TOP_K_CAP:
    return DEFAULT_TOP_K_CAP
  return 1 << (int(min(max(values), vocab_size)) - 1).bit_length()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingSettings:
  """Per-row sampling parameters; all array leaves have leading dim batch.

  Attributes:
    temperature: f32 (batch,). 0 = greedy (argmax of the penalised, biased
      logits; top-k/top-p/min-p are then ignored). Values below 1e-5 are
      treated as greedy to avoid overflow.
    top_k: i32 (batch,). 0 = off. Must be <= ``top_k_cap``.
    top_p: f32 (batch,). 1 = off. Nucleus sampling, HF semantics.
    min_p: f32 (batch,). 0 = off. Keeps tokens with p >= min_p * p_max.
    typical_p: f32 (batch,). 1 = off. Locally typical sampling (Meister et
      al. 2022, HF semantics): keeps the tokens whose surprisal is closest to
      the entropy, up to ``typical_p`` of the mass.
    epsilon_cutoff: f32 (batch,). 0 = off. Drops tokens with p < epsilon
      (Hewitt et al. 2022); the most likely token always stays.
    eta_cutoff: f32 (batch,). 0 = off. Drops tokens with p < min(eta,
      sqrt(eta) * exp(-entropy)) (Hewitt et al. 2022); the most likely
      token always stays.
    xtc_probability: f32 (batch,). 0 = off. XTC ("exclude top choices",
      llama.cpp's definition): at each step, with this probability (a
      uniform draw from the row's key at that step), of the tokens still
      kept whose probability is >= ``xtc_threshold``, all but the least
      likely are removed when there are at least two of them.
    xtc_threshold: f32 (batch,), default 0.1; values above 0.5 turn XTC
      off.
    repetition_penalty: f32 (batch,). 1 = off. HF/CTRL semantics over tokens
      seen in the prompt or the generated output: positive logits are divided
      by it, negative logits multiplied.
    presence_penalty: f32 (batch,). 0 = off. OpenAI semantics over
      *generated* tokens only: subtracted once from every token generated at
      least once.
    frequency_penalty: f32 (batch,). 0 = off. OpenAI semantics over
      *generated* tokens only: subtracted ``count`` times.
    seed: u32 (batch,). Row r's randomness at its step s depends only on
      ``(seed[r], s)``.
    logit_bias: ``None`` or f32 (batch, vocab), added to the logits.
    banned_tokens: ``None`` or bool (batch, vocab); True tokens get -inf.
    top_k_cap: static int, number of candidates extracted for top-k/top-p.
  """

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  min_p: jax.Array
  typical_p: jax.Array
  epsilon_cutoff: jax.Array
  eta_cutoff: jax.Array
  xtc_probability: jax.Array
  xtc_threshold: jax.Array
  repetition_penalty: jax.Array
  presence_penalty: jax.Array
  frequency_penalty: jax.Array
  seed: jax.Array
  logit_bias: jax.Array | None = None
  banned_tokens: jax.Array | None = None
  top_k_cap: int = dataclasses.field(
      default=DEFAULT_TOP_K_CAP, metadata=dict(static=True))

  @property
  def batch_size(self) -> int:
    return self.temperature.shape[0]

  @classmethod
  def make(
      cls,
      batch_size: int,
      vocab_size: int,
      *,
      seed: Any = 0,
      top_k_cap: int = DEFAULT_TOP_K_CAP,
      always_dense: bool = False,
      **values: Any,
  ) -> SamplingSettings:
    """Builds validated settings on the host.

    Each setting of `FIELDS` is a keyword: a scalar (used for every row) or a
    sequence with one value per row (a list, tuple, numpy array or concrete
    ``jax.Array``; a 0-d array is a scalar). Omitted (or None) settings are
    off.

    Args:
      batch_size: Number of rows.
      vocab_size: Vocabulary size (last dim of the logits).
      seed: Integer in [0, 2**32) or None, or one per row. ``None`` draws a
        fresh random seed on the host (independently per row); the drawn
        value is stored in the returned ``seed`` array so the run can be
        reproduced.
      top_k_cap: Static number of top-k candidates (>= 1).
      always_dense: If True, allocate ``logit_bias`` and ``banned_tokens``
        even when unused, so every request has the same pytree structure and
        reuses one compiled program.
      **values: The settings: ``temperature`` (>= 0; 0 = greedy), ``top_k``
        (in [0, top_k_cap]; 0 = off), ``top_p`` (in (0, 1]; 1 = off),
        ``min_p`` (in [0, 1); 0 = off), ``typical_p`` (in (0, 1]; 1 =
        off), ``epsilon_cutoff`` and ``eta_cutoff`` (in [0, 1); 0 = off),
        ``xtc_probability`` (in [0, 1]; 0 = off) and ``xtc_threshold`` (in
        [0, 1], default 0.1; above 0.5 = off), ``repetition_penalty`` (>
        0; 1 = off), ``presence_penalty`` and ``frequency_penalty``
        (finite; 0 = off), ``logit_bias``
        (``{token_id: bias}`` for every row, a list of such dicts, or None)
        and ``banned_tokens`` (a list of ids for every row, a list of lists,
        or None).

    Returns:
      A ``SamplingSettings``.

    Raises:
      ValueError: If any value is invalid; the message names the setting, the
        row and the accepted range.
      TypeError: For a keyword that is not a sampling setting.
    """
    unknown = sorted(set(values) - set(FIELD_NAMES))
    if unknown:
      raise TypeError(
          f"unknown sampling setting(s) {unknown}; the settings are"
          f" {list(FIELD_NAMES)}.")
    values = {k: host_value(k, v) for k, v in values.items()}
    seed = host_value("seed", seed)
    batch_size = positive_int("batch_size", host_value("batch_size",
                                                        batch_size))
    vocab_size = positive_int("vocab_size", host_value("vocab_size",
                                                        vocab_size))
    top_k_cap = positive_int("top_k_cap", host_value("top_k_cap", top_k_cap))
    arrays = {}
    for field in FIELDS:
      value = values.get(field.name)
      if value is None:
        value = field.neutral
      if field.kind == "token_bias":
        arrays[field.name] = logit_bias_rows(value, batch_size, vocab_size)
        continue
      if field.kind == "token_set":
        arrays[field.name] = banned_rows(value, batch_size, vocab_size)
        continue
      rows = per_row(field.name, value, batch_size)
      if field.kind == "float":
        rows = [as_float(field.name, r, v) for r, v in enumerate(rows)]
        # Checked as stored: a value float32 rounds to 0 (a top_p of 1e-300)
        # breaks its requirement like 0 does.
        checked = np.asarray(rows, np.float32).tolist()
      else:
        rows = checked = [as_int(field.name, r, v) for r, v in enumerate(rows)]
      if field.ok is not None:
        check_rows(field.name, rows, field.ok, field.requirement, checked)
      if field.name == "top_k":  # Before the int32 cast (no overflow).
        check_rows("top_k", rows, lambda k: 0 <= k <= top_k_cap,
                    f"must be in [0, top_k_cap={top_k_cap}] (0 turns top-k "
                    "off); pass a larger top_k_cap to SamplingSettings.make "
                    "if you need more candidates")
      arrays[field.name] = np.asarray(
          rows, np.float32 if field.kind == "float" else np.int32)
    seeds = [secrets.randbits(32) if v is None else as_int("seed", r, v)
             for r, v in enumerate(per_row("seed", seed, batch_size))]
    check_rows("seed", seeds, lambda s: 0 <= s < 2**32,
                "must be in [0, 2**32); reduce it modulo 2**32")
    if always_dense:
      if arrays["logit_bias"] is None:
        arrays["logit_bias"] = np.zeros((batch_size, vocab_size), np.float32)
      if arrays["banned_tokens"] is None:
        arrays["banned_tokens"] = np.zeros((batch_size, vocab_size), bool)
    # device_put, not jnp.asarray: in JAX 0.10 that compiles a copy program
    # per shape and dtype (five in a process's first request).
    arrays = {k: None if v is None else jax.device_put(v)
              for k, v in arrays.items()}
    return cls(seed=jax.device_put(np.asarray(seeds, np.uint32)),
               top_k_cap=top_k_cap, **arrays)

  def pad_rows(self, batch_size: int) -> SamplingSettings:
    """These settings with neutral rows appended up to ``batch_size`` rows
    (seed 0, every filter off)."""
    extra = batch_size - self.batch_size
    if extra < 0:
      raise ValueError(
          f"cannot pad {self.batch_size} rows down to {batch_size}.")
    if not extra:
      return self
    neutral = {f.name: f.neutral for f in FIELDS}

    def pad(name, x):
      if x is None:
        return None
      fill = neutral.get(name)
      fill = 0 if fill is None else fill
      tail = jnp.full((extra, *x.shape[1:]), fill, x.dtype)
      return jnp.concatenate([x, tail])

    return dataclasses.replace(self, **{
        f.name: pad(f.name, getattr(self, f.name))
        for f in dataclasses.fields(self) if f.name != "top_k_cap"})
