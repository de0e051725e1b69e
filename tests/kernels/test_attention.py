"""The decode- and prompt-attention kernels against a float64 reference,
and `KernelCachedAttention` against penzai's own attention layers on every
family, for prompts and inside the engine's compiled decode loop."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

from penzai_lm.generation import Engine
from penzai_lm.kernels import KernelCachedAttention
from penzai_lm.kernels import ops
from penzai_lm.kernels import with_cpu_kernels
from penzai_lm.model.attention_chain import plain_chain
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model import build_transformer
from penzai_lm.model.cache_attention import InPlaceKVCachingAttention
from tests.model.cached_calls import cached_calls
from tests.model.configs import CONFIGS

pytestmark = pytest.mark.skipif(not ops.available(),
                                reason="no C++ compiler for the kernels")


def _reference(q, k, v, q_pos, kv_pos, window, softcap):
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  out = np.zeros(q.shape)
  for r in range(q.shape[0]):
    p = kv_pos[r]
    valid = (p >= 0) & (p <= q_pos[r]) & (q_pos[r] - p < window)
    if not valid.any():
      continue
    for g in range(q.shape[1]):
      s = q[r, g] @ k[r, g].T  # [Q, L]
      if softcap:
        s = softcap * np.tanh(s / softcap)
      s = np.where(valid, s, -np.inf)
      w = np.exp(s - s.max(-1, keepdims=True))
      w /= w.sum(-1, keepdims=True)
      out[r, g] = w @ v[r, g].T  # v: [D, L]
  return out


def _inputs(rows, groups, per_group, dim, slots, dtype, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((rows, groups, per_group, dim)).astype(np.float32)
  k = rng.standard_normal((rows, groups, slots, dim)).astype(np.float32)
  v = rng.standard_normal((rows, groups, dim, slots)).astype(np.float32)
  k, v = (np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))
          for a in (k, v))  # the values the kernel sees
  # Row 0: slots written in order; row 1: left padding, then a gap of
  # unwritten slots; row 2: nothing attended.
  kv_pos = np.full((rows, slots), -1, np.int32)
  kv_pos[0, :slots - 3] = np.arange(slots - 3)
  q_pos = np.full((rows,), slots - 4, np.int32)
  if rows > 1:
    kv_pos[1, 5:slots - 9] = np.arange(slots - 14)
    q_pos[1] = slots - 15
  if rows > 2:
    q_pos[2] = -1
  return q, k, v, q_pos, kv_pos


# (rows, groups, query heads per group, head size, slots).
SHAPES = [
    (3, 2, 3, 64, 300),   # several chunks of slots, tails of 16
    (3, 1, 4, 12, 37),    # one key/value head, a head size below 16
    (2, 4, 1, 80, 129),   # one query head per group, 80 = 5 x 16
    (1, 2, 7, 64, 50),    # 7 query heads a group (fixed at compile time)
    (2, 1, 12, 32, 70),   # 12: more than the fixed counts (1-8)
]
WINDOW_SOFTCAP = [(2**31 - 1, None), (7, None), (2**31 - 1, 0.7)]
DTYPES = ["float32", "bfloat16", "float16"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window,softcap", WINDOW_SOFTCAP)
def test_kernel_matches_reference(dtype, shape, window, softcap):
  q, k, v, q_pos, kv_pos = _inputs(*shape, dtype)
  rows, groups, _, dim, slots = shape
  end = slots - 4  # row 0's query slot: written by the kernel
  rng = np.random.default_rng(1)
  k_new, v_new = (np.asarray(jnp.asarray(
      rng.standard_normal((rows, groups, dim)), dtype).astype(jnp.float32))
                  for _ in range(2))
  heads, k_out, v_out = ops.decode_attention(
      jnp.asarray(q), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
      jnp.asarray(k_new, dtype), jnp.asarray(v_new, dtype), jnp.int32(end),
      jnp.asarray(q_pos), jnp.asarray(kv_pos), jnp.int32(window), softcap)
  k, v = k.copy(), v.copy()
  k[:, :, end], v[:, :, :, end] = k_new, v_new
  np.testing.assert_array_equal(np.asarray(k_out, np.float32), k)
  np.testing.assert_array_equal(np.asarray(v_out, np.float32), v)
  want = _reference(q, k, v, q_pos, kv_pos, window, softcap)
  np.testing.assert_allclose(np.asarray(heads), want, atol=2e-5, rtol=2e-5)
  if rows > 2:
    assert not np.asarray(heads)[2].any()  # nothing to attend: zeros


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window,softcap", WINDOW_SOFTCAP)
def test_prompt_kernel_matches_reference(dtype, shape, window, softcap):
  rows, groups, per_group, dim, slots = shape
  tokens = 9
  rng = np.random.default_rng(2)
  q = rng.standard_normal(
      (rows, tokens, groups, per_group, dim)).astype(np.float32)
  _, k, v, _, _ = _inputs(rows, groups, per_group, dim, slots, dtype)
  # Row 0: the prompt follows 250 earlier slots (or fills the cache from
  # 0); row 1: left padding (its first 3 tokens attend nothing), then
  # positions from 0 after a gap of unwritten slots; row 2: a prompt of
  # padding only.
  start = min(slots - tokens, 250)
  kv_pos = np.full((rows, slots), -1, np.int32)
  q_pos = np.full((rows, tokens), -1, np.int32)
  kv_pos[0, :start + tokens] = np.arange(start + tokens)
  q_pos[0] = np.arange(start, start + tokens)
  if rows > 1:
    kv_pos[1, 4:10] = np.arange(6)  # 6 earlier tokens
    kv_pos[1, 20:20 + tokens - 3] = np.arange(6, 6 + tokens - 3)
    q_pos[1, 3:] = np.arange(6, 6 + tokens - 3)
  heads = np.asarray(ops.prompt_attention(
      jnp.asarray(q), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
      jnp.asarray(q_pos), jnp.asarray(kv_pos), jnp.int32(window), softcap))
  assert heads.shape == q.shape
  for t in range(tokens):
    want = _reference(q[:, t], k, v, q_pos[:, t], kv_pos, window, softcap)
    np.testing.assert_allclose(heads[:, t], want, atol=2e-5, rtol=2e-5,
                               err_msg=f"token {t}")
  if rows > 1:
    assert not heads[1, :3].any()  # padding tokens: zeros
  if rows > 2:
    assert not heads[2].any()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cached_attention_matches_penzai_on_every_family(name):
  config = CONFIGS[name].replace(use_layer_stack=False)
  cached = KVCachingTransformerLM.from_uncached(
      build_transformer(config, seed=1), 24, {"batch": 3})
  fast = with_cpu_kernels(cached)
  assert pz.select(fast).at_instances_of(KernelCachedAttention).count() == (
      config.num_layers)
  rng = np.random.default_rng(0)
  prompt = rng.integers(1, 97, (3, 7)).astype(np.int32)
  prompt[1, :3] = 0  # left padding
  tokens = [prompt] + [rng.integers(1, 97, (3, 1)).astype(np.int32)
                       for _ in range(12)]  # past Mistral's window of 4
  want, _ = cached_calls(cached, tokens)
  got, hlo = cached_calls(fast, tokens, hlo=True)
  assert hlo.count("pzlm_decode_attention") == config.num_layers
  _, prompt_hlo = cached_calls(fast, tokens[:1], hlo=True)
  assert prompt_hlo.count("pzlm_prompt_attention") == config.num_layers
  assert "pzlm_decode_attention" not in prompt_hlo
  # The prompt: at its padding tokens (which attend to nothing) the kernel
  # gives zeros where penzai's chain averages the whole cache; neither is
  # read by anything after.
  real = prompt != 0
  assert np.isfinite(got[0]).all()
  np.testing.assert_allclose(got[0][real], want[0][real], atol=2e-5, rtol=0)
  for w, g in zip(want[1:], got[1:]):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=0)


def test_a_changed_chain_keeps_penzai_layers():
  cached = KVCachingTransformerLM.from_uncached(
      build_transformer(CONFIGS["llama_gqa"].replace(use_layer_stack=False),
                        seed=1), 16, {"batch": 1})
  layers = pz.select(cached).at_instances_of(InPlaceKVCachingAttention)
  assert all(plain_chain(l) is not None for l in layers.get_sequence())
  # Something inserted after the attention pattern (an edit, a capture).
  edited = (pz.select(cached).at_instances_of(pz.nn.Softmax)
            .insert_after(pz.nn.Identity()))
  assert pz.select(with_cpu_kernels(edited)).at_instances_of(
      KernelCachedAttention).count() == 0
  # A mask that does not mask out (replaced values would count).
  soft = (pz.select(cached).at_instances_of(pz.nn.ApplyCausalAttentionMask)
          .apply(lambda m: dataclasses.replace(
              m, masked_out_value=jnp.array(-1.0))))
  assert pz.select(with_cpu_kernels(soft)).at_instances_of(
      KernelCachedAttention).count() == 0


def test_the_engine_decodes_on_the_kernel_without_copying_caches():
  config = CONFIGS["llama_gqa"].replace(use_layer_stack=False)
  model = build_transformer(config, seed=3)
  engine = Engine()
  tokens = [int(t) for t in np.random.default_rng(1).integers(1, 97, 9)]
  fast = engine.generate(model, [tokens], max_new_tokens=6, temperature=0.0)
  (_, program), = engine.programs.items("decode")
  hlo = program.as_text()
  assert hlo.count("pzlm_decode_attention") == config.num_layers
  # No copy of anything cache-sized inside the program: a reshape between
  # the in-place cache write and the kernel used to copy every cache.
  cache_elems = config.num_kv_heads * config.head_dim * 16
  for line in hlo.splitlines():
    if " copy(" in line:
      dims = line.split("= ", 1)[1].split("[", 1)[1].split("]", 1)[0]
      size = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
      assert size < cache_elems, line
  # Without a cache, penzai's attention runs over the whole sequence.
  slow = engine.generate(model, [tokens], max_new_tokens=6, temperature=0.0,
                         use_cache=False)
  assert fast.tokens == slow.tokens
