"""`FusedPromptAttention` (prompts as one `jax.nn.dot_product_attention`)
against penzai's chain of attention layers, on every family, and in the
engine. The tests run the "xla" implementation; "cudnn" is the same call
on a GPU (benchmarks/gpu_decode.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

from penzai_lm.generation import Engine
from penzai_lm.generation.prepare import prepare_model
from penzai_lm.generation.session import Session
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model import build_transformer
from penzai_lm.model.prompt_attention import FusedPromptAttention
from penzai_lm.model.prompt_attention import on_gpus
from penzai_lm.model.prompt_attention import on_one_gpu
from penzai_lm.model.prompt_attention import with_fused_prompt_attention
from tests.model.cached_calls import cached_calls
from tests.model.configs import CONFIGS

GREEDY = dict(temperature=0.0, stop_tokens=[])


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_prompts_match_the_chain_on_every_family(name, padded):
  """With left padding (a mask array) and without it (a causal layer's
  first prompt takes the causal-flag branch), then a second prompt after
  the first and decode steps."""
  config = CONFIGS[name].replace(use_layer_stack=False)
  cached = KVCachingTransformerLM.from_uncached(
      build_transformer(config, seed=1), 32, {"batch": 3})
  fused = with_fused_prompt_attention(cached, "xla")
  swapped = pz.select(fused).at_instances_of(FusedPromptAttention).count()
  # Gemma 2 caps its scores (SoftCap), which the fused call cannot.
  assert swapped == (0 if config.attn_logit_softcap else config.num_layers)
  rng = np.random.default_rng(0)
  prompt = rng.integers(1, 97, (3, 9)).astype(np.int32)
  if padded:
    prompt[1, :4] = 0  # left padding
  calls = [prompt,
           rng.integers(1, 97, (3, 6)).astype(np.int32),  # a second prompt
           *(rng.integers(1, 97, (3, 1)).astype(np.int32) for _ in range(3))]
  (want, _), (got, _) = (cached_calls(cached, calls),
                          cached_calls(fused, calls))
  for i, (w, g) in enumerate(zip(want, got)):
    assert np.isfinite(g).all()
    if i == 0 and padded:  # padding positions' logits mean nothing
      w[1, :4] = g[1, :4] = 0
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=0)


def test_a_changed_chain_keeps_penzai_layers():
  cached = KVCachingTransformerLM.from_uncached(
      build_transformer(CONFIGS["llama_gqa"].replace(use_layer_stack=False),
                        seed=1), 16, {"batch": 1})
  # Something inserted after the attention pattern (an edit, a capture).
  edited = (pz.select(cached).at_instances_of(pz.nn.Softmax)
            .insert_after(pz.nn.Identity()))
  assert pz.select(with_fused_prompt_attention(edited, "xla")).at_instances_of(
      FusedPromptAttention).count() == 0
  with pytest.raises(ValueError, match="'xla' or 'cudnn'"):
    with_fused_prompt_attention(cached, "flash")


def _prepared_layers(model, prompt_attention):
  prepared = prepare_model(model, cached_model=False, use_cache=True,
                           batch_axis="batch", batch=1, cache_len=16,
                           prompt_attention=prompt_attention)
  runnable = jax.tree_util.tree_unflatten(prepared.treedef,
                                          prepared.model_leaves)
  return pz.select(runnable).at_instances_of(FusedPromptAttention).count()


def test_the_engine_chooses_the_prompt_attention():
  built = build_transformer(
      CONFIGS["llama_gqa"].replace(use_layer_stack=False), seed=2)
  # On CPU, "auto" keeps penzai's chain; cuDNN needs a GPU. (On a GPU
  # machine the model is built there, and moved to the CPU for this.)
  model = jax.device_put(built, jax.devices("cpu")[0])
  assert not on_gpus(model) and not on_one_gpu(model)
  assert _prepared_layers(model, "auto") == 0
  assert _prepared_layers(model, None) == 0
  assert _prepared_layers(model, "xla") == model.config.num_layers
  engine = Engine(prompt_attention="cudnn")
  with pytest.raises(ValueError, match="needs a model on GPUs"):
    engine.generate(model, [1, 2], max_new_tokens=2)  # With the request,
  assert engine.compilations == 0  # before anything is prepared.
  assert len(engine._prepared) == 0  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="prompt_attention must be one of"):
    Engine(prompt_attention="flash")
  if on_one_gpu(built):  # On one GPU, "auto" fuses prompts with cuDNN.
    assert _prepared_layers(built, "auto") == built.config.num_layers


def test_generate_and_sessions_match_with_fused_prompts():
  model = build_transformer(CONFIGS["gemma3"], seed=4)  # sliding windows
  chain, fused = Engine(prompt_attention=None), Engine(prompt_attention="xla")
  rng = np.random.default_rng(3)
  prompts = [[int(t) for t in rng.integers(1, 97, n)] for n in (8, 3, 6)]
  want = chain.generate(model, prompts, max_new_tokens=6, **GREEDY)
  got = fused.generate(model, prompts, max_new_tokens=6, **GREEDY)
  assert got.tokens == want.tokens
  np.testing.assert_allclose(np.array(got.logprobs), np.array(want.logprobs),
                             atol=2e-5)
  # A session's second turn is a prompt written after the first.
  sessions = Session(model, engine=chain), Session(model, engine=fused)
  for turn in prompts[:2]:
    want, got = (s.generate(turn, max_new_tokens=4, **GREEDY)
                 for s in sessions)
    assert got.tokens == want.tokens
    np.testing.assert_allclose(got.logprobs[0], want.logprobs[0], atol=2e-5)


@pytest.mark.skipif(jax.devices()[0].platform != "gpu",
                    reason="cuDNN's flash attention needs a GPU")
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("name", ["llama_mqa_scaled", "gemma3", "qwen2_bias"])
def test_cudnn_matches_the_chain_on_a_gpu(name, padded):
  """The "cudnn" implementation in bfloat16 (the device machine runs it)."""
  config = CONFIGS[name].replace(
      use_layer_stack=False, parameter_dtype=jnp.bfloat16,
      activation_dtype=jnp.bfloat16)
  cached = KVCachingTransformerLM.from_uncached(
      build_transformer(config, seed=1), 32, {"batch": 3})
  fused = with_fused_prompt_attention(cached, "cudnn")
  rng = np.random.default_rng(0)
  prompt = rng.integers(1, 97, (3, 16)).astype(np.int32)
  if padded:
    prompt[1, :4] = 0
  calls = [prompt, rng.integers(1, 97, (3, 8)).astype(np.int32)]
  (want, _), (got, _) = (cached_calls(cached, calls),
                          cached_calls(fused, calls))
  for i, (w, g) in enumerate(zip(want, got)):
    if i == 0 and padded:
      w[1, :4] = g[1, :4] = 0
    np.testing.assert_allclose(g, w, atol=3e-2 * np.abs(w).max(), rtol=0)
  model, state = pz.unbind_state_vars(fused, freeze=True)
  hlo = jax.jit(lambda m, s, t: m.stateless_call(s, t)).lower(
      model, state, pz.nx.wrap(prompt).tag("batch", "seq")).compile().as_text()
  assert "__cudnn$fmha" in hlo  # cuDNN ran it, not a fallback
