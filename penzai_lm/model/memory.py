"""Memory estimates, checked before a KV cache or a request is allocated.

A KV cache of ``2**40`` slots, a session with ``min_cache_len=2**40`` or a
batch of ``2**31`` rows would otherwise end in XLA's ``RESOURCE_EXHAUSTED``
(or the kernel killing the process) after a long wait. The estimates here
are lower bounds of what the arrays take (activations and compiled code are
not counted), so a refused request could never have run, and a request that
passes may still need a little more.

Three callers share them: `KVCachingTransformerLM.from_uncached`,
`penzai_lm.generation.Session` (``min_cache_len``) and the request planning
of `penzai_lm.generation.generate` (`penzai_lm.generation.shapes.plan`).

Available memory is the free memory of the default JAX device: on CPU the
host's (``MemAvailable`` of ``/proc/meminfo``, lowered to what the memory
cgroup still allows), on an accelerator ``bytes_limit - bytes_in_use`` of
``device.memory_stats()``. Where it cannot be read, nothing is refused.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np

__all__ = [
    "Available",
    "InsufficientMemoryError",
    "available_memory",
    "check_fits",
    "describe_cache",
    "format_bytes",
    "kv_cache_bytes",
    "request_bytes",
]

# Host bytes per request row that no array accounts for: Python lists of
# seeds, limits, stop and forced ids, and per-row bookkeeping of a run.
HOST_BYTES_PER_ROW = 512
# Per row and vocabulary entry: logit bias (f32) and banned mask (bool) of
# the sampling settings, the penalties' counts (i32) and seen mask (bool),
# and one step's logits (f32).
VOCAB_BYTES_PER_ROW = 4 + 1 + 4 + 1 + 4
# Per row and cache slot, besides the keys and values: the cached tokens and
# their positions (i32 each), and the output buffers (token i32, log-prob
# f32, forced flag bool).
SLOT_BYTES = 4 + 4 + 4 + 4 + 1
# cgroup limits at or above this mean "no limit".
_NO_LIMIT = 1 << 60


class InsufficientMemoryError(ValueError):
  """A cache or request needs more memory than the machine has available."""


@dataclasses.dataclass(frozen=True)
class Available:
  """Free memory where a request's arrays go.

  Attributes:
    bytes: Bytes available.
    where: What was measured, for messages (e.g. "host memory").
  """

  bytes: int
  where: str


def format_bytes(n: float) -> str:
  """``n`` bytes in binary units, e.g. ``1.2 PiB``."""
  for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
    if abs(n) < 1024 or unit == "PiB":
      break
    n /= 1024
  if unit == "B":
    return f"{int(n)} B"
  return f"{n:.3g} {unit}" if n < 1000 else f"{n:.0f} {unit}"


def format_count(n: int) -> str:
  """A size as people write it: ``2**40`` for large powers of two."""
  n = int(n)
  if n >= 1024 and n & (n - 1) == 0:
    return f"2**{n.bit_length() - 1}"
  return f"{n:,}"


def kv_cache_bytes(config, rows: int, slots: int) -> int:
  """Bytes of the keys and values of every layer, for ``rows`` rows of
  ``slots`` slots (``config``: a `TransformerConfig`)."""
  itemsize = np.dtype(config.activation_dtype).itemsize
  per_slot = 2 * config.num_layers * config.num_kv_heads * config.head_dim
  return int(rows) * int(slots) * per_slot * itemsize


def describe_cache(config, rows: int, slots: int) -> str:
  """E.g. "a KV cache of 2**40 slots x 1 row (30 layers x 3 KV heads x
  head_dim 64, float32)", for messages."""
  dtype = np.dtype(config.activation_dtype).name
  return (f"a KV cache of {format_count(slots)} slots x {format_count(rows)}"
          f" row{'' if rows == 1 else 's'} ({config.num_layers} layers x"
          f" {config.num_kv_heads} KV heads x head_dim {config.head_dim},"
          f" {dtype})")


def request_bytes(config, rows: int, slots: int, *, top_n: int = 0,
                  kv_cache: bool = True) -> tuple[int, int]:
  """``(device bytes, host bytes)`` of a generation request at least.

  Args:
    config: The model's `TransformerConfig`.
    rows: Decode rows (the batch).
    slots: Cache slots per row (also the length of the output buffers).
    top_n: Top alternatives recorded per token.
    kv_cache: Whether the request decodes with a KV cache.
  """
  rows, slots = int(rows), int(slots)
  outputs = rows * slots * (SLOT_BYTES + 8 * int(top_n))
  per_vocab = rows * int(config.vocab_size) * VOCAB_BYTES_PER_ROW
  device = outputs + per_vocab
  if kv_cache:
    device += kv_cache_bytes(config, rows, slots)
  # The host builds the sampling settings and reads the output buffers.
  host = outputs + per_vocab + rows * HOST_BYTES_PER_ROW
  return device, host


def _meminfo_available() -> int | None:
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  try:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, AttributeError):
    return None


def _read_int(path: str) -> int | None:
  try:
    with open(path, encoding="ascii") as f:
      text = f.read().strip()
    return None if text == "max" else int(text)
  except (OSError, ValueError):
    return None


def _read_stat(path: str, key: str) -> int:
  try:
    with open(path, encoding="ascii") as f:
      for line in f:
        name, _, value = line.partition(" ")
        if name == key:
          return int(value)
  except (OSError, ValueError):
    pass
  return 0


def _cgroup_available() -> int | None:
  """What the memory cgroup still allows (v2, else v1), or None."""
  for d, limit_file, usage_file, stat_key in (
      ("/sys/fs/cgroup/", "memory.max", "memory.current", "inactive_file"),
      ("/sys/fs/cgroup/memory/", "memory.limit_in_bytes",
       "memory.usage_in_bytes", "total_inactive_file")):
    limit, usage = _read_int(d + limit_file), _read_int(d + usage_file)
    if limit is None or usage is None or limit >= _NO_LIMIT:
      continue
    # Usage counts the page cache; its inactive part is reclaimed first.
    inactive = _read_stat(d + "memory.stat", stat_key)
    return max(0, limit - usage + inactive)
  return None


def host_available() -> Available | None:
  """Free host memory, or None if it cannot be read."""
  free = _meminfo_available()
  group = _cgroup_available()
  if free is None and group is None:
    return None
  if group is not None and (free is None or group < free):
    return Available(group, "host memory (cgroup limit)")
  return Available(free, "host memory")


def available_memory(device=None) -> Available | None:
  """Free memory of ``device`` (default: the first JAX device), or None."""
  if device is None:
    device = jax.devices()[0]
  if device.platform == "cpu":
    return host_available()
  try:
    stats = device.memory_stats()
  except Exception:  # pylint: disable=broad-except
    stats = None  # Not every backend reports memory.
  if not stats or "bytes_limit" not in stats:
    return None
  free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
  return Available(max(0, free), f"{device.platform.upper()} memory")


def check_fits(what: str, needed: tuple[int, int] | int, hint: str) -> None:
  """Raises if ``needed`` bytes do not fit in the available memory.

  Args:
    what: The request, e.g. "a KV cache of 2**40 slots x 1 row".
    needed: Bytes, or ``(device bytes, host bytes)`` (summed on CPU, where
      both are host memory).
    hint: How to ask for less, ending the message.

  Raises:
    InsufficientMemoryError: naming the request, the bytes it needs and
      the memory available.
  """
  device_bytes, host_bytes = (needed, 0) if isinstance(needed, int) else (
      needed)
  device = jax.devices()[0]
  checks = [(device_bytes + host_bytes if device.platform == "cpu"
             else device_bytes, available_memory(device))]
  if device.platform != "cpu" and host_bytes:
    checks.append((host_bytes, host_available()))
  for bytes_needed, available in checks:
    if available is not None and bytes_needed > available.bytes:
      raise InsufficientMemoryError(
          f"{what} needs {format_bytes(bytes_needed)}; this machine has"
          f" {format_bytes(available.bytes)} of {available.where} available."
          f" {hint}")
