"""Memory estimates, and caches too large for the machine refused up front."""

import time

import jax
import pytest

from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model import memory
from tests.generation.conftest import tiny_model


def test_formatting():
  assert memory.format_bytes(512) == "512 B"
  assert memory.format_bytes(21 << 30) == "21 GiB"
  assert memory.format_bytes(1.2 * 2**50) == "1.2 PiB"
  assert memory.format_bytes(3000 * 2**50) == "3000 PiB"
  assert memory.format_count(2**40) == "2**40"
  assert memory.format_count(1000) == "1,000"


def test_kv_cache_bytes_counts_every_layer_and_head():
  config = tiny_model().config
  per_slot = (2 * config.num_layers * config.num_kv_heads * config.head_dim
              * jax.numpy.dtype(config.activation_dtype).itemsize)
  assert memory.kv_cache_bytes(config, 3, 16) == 3 * 16 * per_slot
  device, host = memory.request_bytes(config, 3, 16, top_n=2)
  assert device > memory.kv_cache_bytes(config, 3, 16) and host > 0
  device_nokv, _ = memory.request_bytes(config, 3, 16, top_n=2,
                                        kv_cache=False)
  assert device - device_nokv == memory.kv_cache_bytes(config, 3, 16)


def test_available_memory():
  available = memory.available_memory()
  assert available is not None and available.bytes > 0
  assert "host memory" in available.where


class _FakeDevice:
  platform = "gpu"

  def __init__(self, stats):
    self._stats = stats

  def memory_stats(self):
    if isinstance(self._stats, Exception):
      raise self._stats
    return self._stats


def test_accelerator_memory_from_memory_stats():
  gpu = _FakeDevice({"bytes_limit": 80 << 30, "bytes_in_use": 30 << 30})
  assert memory.available_memory(gpu) == memory.Available(
      50 << 30, "GPU memory")
  assert memory.available_memory(_FakeDevice(None)) is None
  assert memory.available_memory(_FakeDevice(RuntimeError("no"))) is None


@pytest.mark.parametrize("cache_len, rows", [(2**40, 1), (16, 2**31)])
def test_from_uncached_refuses_a_cache_that_cannot_fit(cache_len, rows):
  start = time.perf_counter()
  with pytest.raises(memory.InsufficientMemoryError) as info:
    KVCachingTransformerLM.from_uncached(tiny_model(), cache_len,
                                         {"batch": rows})
  assert time.perf_counter() - start < 5
  message = str(info.value)
  assert "from_uncached" in message and "available" in message
  assert "Lower cache_len or the batch" in message
  assert memory.format_count(cache_len) in message
  assert isinstance(info.value, ValueError)


def test_check_fits_names_the_request_and_the_limit(monkeypatch):
  monkeypatch.setattr(memory, "available_memory", lambda device=None: (
      memory.Available(1 << 20, "test memory")))
  memory.check_fits("a small thing", 1000, "Ask for less.")
  with pytest.raises(memory.InsufficientMemoryError,
                     match=r"a big thing needs 2 MiB; this machine has 1 MiB"
                     r" of test memory available\. Ask for less\."):
    memory.check_fits("a big thing", 2 << 20, "Ask for less.")
  with pytest.raises(memory.InsufficientMemoryError, match="from_uncached"):
    KVCachingTransformerLM.from_uncached(tiny_model(), 2**14, {"batch": 8})
