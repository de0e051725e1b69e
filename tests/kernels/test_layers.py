"""Kernel layers compute what penzai's layers compute, and the engine
decodes on them on CPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

from penzai_lm.generation import Engine
from penzai_lm.kernels import KernelEmbeddingDecode
from penzai_lm.kernels import KernelEmbeddingLookup
from penzai_lm.kernels import KernelLinear
from penzai_lm.kernels import build
from penzai_lm.kernels import layers
from penzai_lm.kernels import on_one_cpu
from penzai_lm.kernels import ops
from penzai_lm.kernels import with_cpu_kernels
from penzai_lm.model import TransformerConfig
from penzai_lm.model import build_transformer

pytestmark = pytest.mark.skipif(not ops.available(),
                                reason="no C++ compiler for the kernels")


def _model(family, dtype, stack=True):
  config = TransformerConfig(
      family=family, vocab_size=97, hidden_size=64, num_layers=2,
      num_heads=4, num_kv_heads=2, head_dim=16, mlp_hidden_size=96,
      tie_embeddings=family == "gemma3", parameter_dtype=dtype,
      # float16 weights, float32 activations (Gemma's mask value is past
      # float16's range).
      activation_dtype="float32" if dtype == "float16" else dtype,
      use_layer_stack=stack,
      max_position_embeddings=256)
  return build_transformer(config, seed=0)


def _logits(model, rows, seq):
  tokens = pz.nx.wrap(np.random.default_rng(0).integers(
      1, 97, (rows, seq)).astype(np.int32)).tag("batch", "seq")
  fn = jax.jit(lambda m, t: m(t).data_array)
  return fn(model, tokens), fn.lower(model, tokens).as_text()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_kernel_model_matches_penzai_layers(family, dtype):
  model = _model(family, dtype)
  fast = with_cpu_kernels(model)
  linears = pz.select(model).at_instances_of(pz.nn.Linear).where(
      lambda l: l.in_axis_names).count()
  assert pz.select(fast).at_instances_of(KernelLinear).count() == (
      pz.select(model).at_instances_of(pz.nn.Linear).count())
  assert pz.select(fast).at_instances_of(KernelEmbeddingDecode).count() == (
      1 if family == "gemma3" else 0)
  assert pz.select(fast).at_instances_of(KernelEmbeddingLookup).count() == 1
  want, _ = _logits(model, 2, 3)
  got, hlo = _logits(fast, 2, 3)  # 6 rows: the kernels
  # Every projection and the unembedding went to a kernel (norm scales are
  # Linear layers too, with nothing to contract: they stay penzai's).
  assert hlo.count("pzlm_matvec") >= linears
  want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
  scale = np.abs(want).max()
  # penzai's layers round each 16-bit product to 16 bits; float32 differs
  # only in the order of the sums.
  tol = 1e-5 if dtype == "float32" else 3e-2
  np.testing.assert_allclose(got, want, atol=tol * scale, rtol=0)
  assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9


@pytest.mark.parametrize("dtype,rows,seq", [
    ("float16", 2, 9),  # 18 rows > MAX_ROWS: XLA's GEMM
    ("float32", 3, 7),  # 21 rows
])
def test_other_products_stay_with_xla(dtype, rows, seq):
  model = _model("llama", dtype)
  want, _ = _logits(model, rows, seq)
  got, hlo = _logits(with_cpu_kernels(model), rows, seq)
  assert "pzlm_matvec" not in hlo
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("in_float32", [False, True])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_wide_bfloat16_products_are_dots_with_float32_results(
    family, in_float32, monkeypatch):
  """18 rows: XLA's GEMM, on the bf16 operands where the CPU has bf16
  instructions, else on float32 copies of both; the same values."""
  monkeypatch.setattr(layers, "wide_bf16_in_float32", lambda: in_float32)
  model = _model(family, "bfloat16")
  want, _ = _logits(model, 2, 9)
  got, hlo = _logits(with_cpu_kernels(model), 2, 9)
  assert "pzlm_matvec" not in hlo
  dots = {t: re.findall(rf"stablehlo.dot_general.*tensor<18x\d+x{t}>.*"
                        r"-> tensor<18x\d+xf32>", hlo)
          for t in ("bf16", "f32")}
  linears = pz.select(model).at_instances_of(pz.nn.Linear).where(
      lambda l: l.in_axis_names).count()
  on, off = ("f32", "bf16") if in_float32 else ("bf16", "f32")
  assert len(dots[on]) >= linears and not dots[off]
  want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
  # Both round each product to bfloat16 once; sums run in another order.
  np.testing.assert_allclose(got, want, atol=3e-2 * np.abs(want).max(),
                             rtol=0)
  assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9


@pytest.mark.parametrize("flags,in_float32", [
    ("flags\t\t: fpu sse2 avx2 fma f16c", True),
    ("flags\t\t: avx2 avx512f avx512_bf16", False),
    ("flags\t\t: avx2 avx512f amx_bf16 amx_tile", False),
    ("", False),  # flags unknown (another system): XLA's bf16 dot
])
def test_wide_bf16_in_float32_where_the_cpu_has_no_bf16_dot(
    flags, in_float32, monkeypatch):
  monkeypatch.setattr(build, "_cpu_fingerprint", lambda: flags)
  layers.wide_bf16_in_float32.cache_clear()
  try:
    assert layers.wide_bf16_in_float32() is in_float32
  finally:
    layers.wide_bf16_in_float32.cache_clear()


def test_engine_decodes_on_the_kernels_with_the_same_tokens():
  model = _model("llama", "bfloat16", stack=False)
  prompt = [5, 17, 3, 44]
  engine = Engine()
  result = engine.generate(model, [prompt], max_new_tokens=6,
                           temperature=0.0, stop_tokens=[])
  (_, program), = engine.programs.items("decode")
  assert "pzlm_matvec" in program.as_text()
  # The same greedy tokens from full forward passes of the plain model.
  tokens = list(prompt)
  for _ in range(6):
    logits = model(pz.nx.wrap(jnp.asarray([tokens], jnp.int32)).tag(
        "batch", "seq"))
    tokens.append(int(jnp.argmax(
        logits.untag("seq", "vocabulary").data_array[0, -1])))
  assert list(np.asarray(result.tokens[0])[:6]) == tokens[len(prompt):]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_lookup_copies_the_rows_penzai_indexes(dtype):
  table = pz.nn.EmbeddingTable(
      embeddings=pz.ParameterValue(value=pz.nx.wrap(jnp.asarray(
          np.random.default_rng(0).normal(size=(11, 3, 4)), dtype)).tag(
              "vocabulary", "heads", "embedding"), label="t"),
      vocabulary_axis="vocabulary")
  # Negative ids wrap and ids past the end clamp, as penzai's indexing.
  ids = pz.nx.wrap(jnp.asarray([[0, 10, -1], [5, 11, -12]], jnp.int32)).tag(
      "batch", "seq")
  want = pz.nn.EmbeddingLookup(table)(ids)
  got = jax.jit(lambda i: KernelEmbeddingLookup(table)(i))(ids)
  assert dict(got.named_shape) == dict(want.named_shape)
  order = ("batch", "seq", "heads", "embedding")
  np.testing.assert_array_equal(np.asarray(got.unwrap(*order), np.float32),
                                np.asarray(want.unwrap(*order), np.float32))


def test_bf16_decode_never_converts_the_embedding_table():
  # XLA:CPU gathers from a bf16 table by converting all of it to float32,
  # hoisted out of the decode loop: a whole-table copy per decode call.
  model = _model("llama", "bfloat16")
  engine = Engine()
  engine.generate(model, [[5, 17, 3]], max_new_tokens=3, temperature=0.0)
  (_, program), = engine.programs.items("decode")
  text = program.as_text()
  assert "pzlm_rows" in text
  assert "f32[97,64]" not in text and "f32[64,97]" not in text


def test_on_one_cpu():
  model = _model("llama", "float32")
  assert on_one_cpu(model)
  assert not jax.jit(lambda m: jnp.asarray(on_one_cpu(m)))(model)
