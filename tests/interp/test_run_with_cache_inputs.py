"""What run_with_cache does with its inputs: prompts padded to a few
lengths (few compiles, values as unpadded), prompts past the context
refused like generate refuses them, repeated names captured once."""

import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

import penzai_lm
from penzai_lm import interp
from penzai_lm.generation import Engine
from penzai_lm.interp.activation_cache import padded_length
from tests.model.configs import config

NAMES = ["embed", "blocks.1.resid_post", "blocks.0.attn.pattern"]


def _model(name="llama_gqa", stacked=True, **changes):
  return penzai_lm.build_transformer(
      config(name, stacked).replace(**changes), seed=3)


def _np(x):
  return np.asarray(x.unwrap(*sorted(x.named_shape)))


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 97, n).tolist() for n in lengths]


def _alone(model, ids, name):
  """A point's value for one row run unpadded, at its own length."""
  tokens = pz.nx.wrap(jnp.asarray([ids])).tag("batch", "seq")
  return interp.run_with_cache(model, tokens, names=[name]).row(0, name)


def test_ragged_batches_of_many_lengths_share_a_few_programs():
  model, engine = _model(), Engine()
  for longest in (3, 5, 8, 9, 13, 16):  # Buckets of 8 and 16 tokens.
    prompts = _prompts([longest, 2], seed=longest)
    cache = interp.run_with_cache(model, prompts, names=NAMES,
                                  engine=engine)
    # Cut back to the longest prompt: the shapes an unbucketed run had.
    assert cache["embed"].named_shape["seq"] == longest
    assert cache.logits.named_shape["seq"] == longest
    assert cache["blocks.0.attn.pattern"].named_shape["kv_seq"] == longest
  assert engine.compilations == 2
  for r, ids in enumerate(prompts):  # The values of each row alone.
    np.testing.assert_allclose(
        _np(cache.row(r, "blocks.1.resid_post")),
        _np(_alone(model, ids, "blocks.1.resid_post")), rtol=1e-5,
        atol=1e-5)


def test_padded_lengths():
  """Powers of two up to 256 tokens, then multiples of 256 (a long prompt
  never runs at twice its length), never past the context."""
  big = config("llama_gqa")  # 8,192 positions.
  got = {n: padded_length(big, n) for n in (1, 5, 8, 9, 200, 256, 257, 1100,
                                           8000, 8192)}
  assert got == {1: 8, 5: 8, 8: 8, 9: 16, 200: 256, 256: 256, 257: 512,
                 1100: 1280, 8000: 8192, 8192: 8192}
  small = big.replace(max_position_embeddings=12)
  assert [padded_length(small, n) for n in (5, 9, 12)] == [8, 12, 12]


def test_bucket_stops_at_the_learned_positions():
  """GPT-2 style: 64 learned positions; 40 tokens pad to 64, not 128,
  and 64 tokens run as they are."""
  model, engine = _model("gpt2"), Engine()
  for lengths in ([40, 3], [64, 5]):
    prompts = _prompts(lengths)
    cache = interp.run_with_cache(model, prompts, names=["embed"],
                                  engine=engine)
    np.testing.assert_allclose(
        _np(cache.row(0, "embed")), _np(_alone(model, prompts[0], "embed")),
        rtol=1e-5, atol=1e-5)
  assert engine.compilations == 1


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2"])
def test_prompt_past_the_context_is_refused_like_generate(name):
  model = _model(name, max_position_embeddings=16)
  too_long = _prompts([17, 4])
  with pytest.raises(ValueError, match=r"context of 16 tokens \(config"
                     r"\.max_position_embeddings\)"):
    penzai_lm.generate(model, too_long, max_new_tokens=1)
  with pytest.raises(ValueError, match=r"prompt 0 has 17 tokens: more than"
                     r" the model's context of 16 tokens \(config"
                     r"\.max_position_embeddings\)"):
    interp.run_with_cache(model, too_long, names=["embed"])
  with pytest.raises(ValueError, match="prompt 0 has 17 tokens"):
    interp.token_losses(model, too_long)
  tokens = pz.nx.wrap(jnp.asarray(too_long[:1])).tag("batch", "seq")
  with pytest.raises(ValueError, match="context of 16 tokens"):
    interp.run_with_cache(model, tokens, names=["embed"])
  # The context itself is fine.
  cache = interp.run_with_cache(model, _prompts([16, 4]), names=["embed"])
  assert cache.lengths == [16, 4]


@pytest.mark.parametrize("stacked", [True, False])
def test_a_name_given_twice_is_captured_once(stacked):
  model = _model(stacked=stacked)
  prompts = _prompts([6, 4])
  names = ["embed", "blocks.1.resid_post", "embed", "blocks.1.resid_post"]
  cache = interp.run_with_cache(model, prompts, names=names)
  assert list(cache.keys()) == ["embed", "blocks.1.resid_post"]
  want = interp.run_with_cache(model, prompts, names=names[:2])
  for name in names[:2]:
    np.testing.assert_array_equal(_np(cache[name]), _np(want[name]))
  with pytest.raises(TypeError, match="names must be point names"):
    interp.run_with_cache(model, prompts, names=["embed", 3])


def test_embed_point_is_the_scaled_lookup():
  """`embed` returns the raw table rows; the ``embed`` point holds them
  scaled (Gemma); `logits_from_embeddings` takes the raw rows."""
  model = _model("gemma3")
  ids = _prompts([5])
  tokens = pz.nx.wrap(jnp.asarray(ids)).tag("batch", "seq")
  raw = interp.embed(model, tokens)
  cache = interp.run_with_cache(model, tokens, names=["embed"])
  scale = model.config.embedding_scale
  assert scale and scale != 1
  np.testing.assert_allclose(_np(cache["embed"]), _np(raw) * scale,
                             rtol=1e-6)
  np.testing.assert_allclose(
      _np(interp.logits_from_embeddings(model, raw)), _np(cache.logits),
      rtol=1e-5, atol=1e-5)
