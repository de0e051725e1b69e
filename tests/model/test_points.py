"""Named points, insert_at, run_with_cache and the lenses on tiny models of
every family, on both layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

import penzai_lm
from penzai_lm import interp
from penzai_lm.model.hooks import BLOCK_POINTS
from penzai_lm.runtime.unstack import unstack_layers
from tests.model.configs import config

FAMILIES = ["llama_gqa", "gemma3", "gpt2"]
IDS = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]


def _models(name):
  """The same weights as a layer stack and as per-layer blocks."""
  stacked = penzai_lm.build_transformer(config(name, True), seed=3)
  return stacked, unstack_layers(stacked)


def _np(x, like):
  return np.asarray(x.unwrap(*like.named_shape))


def _logits(model, ids):
  tokens = pz.nx.wrap(jnp.asarray(ids)).tag("batch", "seq")
  return np.asarray(model(tokens).unwrap("batch", "seq", "vocabulary"))


@pytest.mark.parametrize("name", FAMILIES)
def test_every_point_is_captured_alike_on_both_layouts(name):
  stacked, unstacked = _models(name)
  names = interp.point_names(stacked)
  assert len(names) == 2 + len(BLOCK_POINTS) * stacked.config.num_layers
  a = interp.run_with_cache(stacked, IDS, names=names)
  b = interp.run_with_cache(unstacked, IDS, names=names)
  for n in names:
    np.testing.assert_allclose(_np(a[n], a[n]), _np(b[n], a[n]),
                               rtol=1e-5, atol=1e-5, err_msg=n)
  np.testing.assert_allclose(_np(a.logits, a.logits),
                             _np(b.logits, a.logits), rtol=1e-5, atol=1e-5)
  # The points are where they say: the residual stream leaving block i
  # enters block i + 1; attention weights sum to one over the keys.
  np.testing.assert_array_equal(_np(a["blocks.0.resid_post"], a["embed"]),
                                _np(a["blocks.1.resid_pre"], a["embed"]))
  pattern = a["blocks.1.attn.pattern"]
  real = pattern[{"batch": 0}]
  sums = pz.nx.nmap(jnp.sum)(real.untag("kv_seq"))
  np.testing.assert_allclose(np.asarray(sums.unwrap(*sums.named_shape)), 1.0,
                             rtol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_ragged_rows_equal_solo_runs_and_the_lens_closes(name):
  stacked, _ = _models(name)
  last = f"blocks.{stacked.config.num_layers - 1}.resid_post"
  batch = interp.run_with_cache(stacked, IDS, names=[last, "final_norm"])
  solo = interp.run_with_cache(stacked, [IDS[1]], names=[last])
  np.testing.assert_allclose(
      np.asarray(batch.row(1, last).unwrap("seq", "embedding")),
      np.asarray(solo[last].unwrap("batch", "seq", "embedding"))[0],
      rtol=1e-5, atol=1e-5)
  assert batch.lengths == [6, 3]
  lens = interp.unembed(stacked, batch[last])
  np.testing.assert_allclose(_np(lens, batch.logits),
                             _np(batch.logits, batch.logits), atol=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_insert_at_one_block_acts_there_only_on_both_layouts(name):
  stacked, unstacked = _models(name)
  vector = np.random.default_rng(0).normal(size=32).astype(np.float32)
  steer = interp.AddVector.build(vector, 3.0)
  outs = []
  for model in (stacked, unstacked):
    patched = interp.insert_at(model, "blocks.1.resid_post", steer)
    cache = interp.run_with_cache(
        patched, [IDS[0]], names=["blocks.0.resid_post", "blocks.1.resid_mid",
                                  "blocks.1.resid_post"])
    plain = interp.run_with_cache(
        model, [IDS[0]], names=["blocks.0.resid_post", "blocks.1.resid_post"])
    ref = plain["blocks.0.resid_post"]
    np.testing.assert_allclose(_np(cache["blocks.0.resid_post"], ref),
                               _np(ref, ref), rtol=1e-5,
                               atol=1e-5)  # Block 0 untouched.
    np.testing.assert_allclose(
        _np(cache["blocks.1.resid_post"], ref),
        _np(plain["blocks.1.resid_post"], ref) + 3.0 * vector, rtol=1e-5,
        atol=1e-5)  # Captured after the steering (inserted first).
    outs.append(_logits(patched, [IDS[0]]))
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)
  assert np.abs(outs[0] - _logits(stacked, [IDS[0]])).max() > 1e-3


def test_moving_a_stacked_intervention_is_data_not_structure():
  stacked, _ = _models("llama_gqa")
  steer = interp.AddVector.build(np.ones(32, np.float32), 2.0)
  at_0 = interp.insert_at(stacked, "blocks.0.resid_post", steer)
  at_2 = interp.insert_at(stacked, "blocks.2.resid_post", steer)
  both = interp.insert_at(stacked, ["blocks.0.resid_post",
                                    "blocks.2.resid_post"], steer)
  structure = lambda m: jax.tree_util.tree_structure(pz.freeze_params(m))  # noqa: E731
  assert structure(at_0) == structure(at_2) == structure(both)
  assert not np.allclose(_logits(at_0, [IDS[0]]), _logits(at_2, [IDS[0]]))


def test_zero_heads_uses_hugging_face_head_order():
  stacked, _ = _models("llama_gqa")  # 4 query heads in 2 groups of 2.
  cfg = stacked.config
  assert interp.head_coordinates(cfg, 3) == {"head_groups": 1,
                                             "query_heads": 1}
  patched = interp.insert_at(stacked, "blocks.0.attn.head_out",
                             interp.ZeroHeads.build(cfg, [3]))
  cache = interp.run_with_cache(patched, [IDS[0]],
                                names=["blocks.0.attn.head_out"])
  heads = np.asarray(cache["blocks.0.attn.head_out"].unwrap(
      "batch", "seq", "head_groups", "query_heads", "projection"))
  assert not heads[:, :, 1, 1].any()
  assert heads[:, :, 0].any() and heads[:, :, 1, 0].any()


@pytest.mark.parametrize("bad, message", [
    ("blocks.3.resid_post", r"the model has 3 blocks \(blocks.0 to blocks.2\)"),
    ("blocks.-1.resid_post", "the model has 3 blocks"),
    ("blocks.1.resid_pots", r"did you mean 'resid_post'"),
    ("resid_post", "unknown point 'resid_post'"),
    ("embedding", r"did you mean 'embed'"),
])
def test_points_that_do_not_exist_are_errors(bad, message):
  stacked, unstacked = _models("llama_gqa")
  steer = interp.AddVector.build(np.ones(32, np.float32))
  for model in (stacked, unstacked):
    with pytest.raises(ValueError, match=message):
      interp.insert_at(model, bad, steer)
    with pytest.raises(ValueError, match=message):
      interp.run_with_cache(model, [IDS[0]], names=[bad])


def test_intervention_errors_name_the_problem():
  stacked, _ = _models("llama_gqa")
  with pytest.raises(ValueError, match="vector must be 1-D"):
    interp.AddVector.build(np.ones((2, 32)))
  with pytest.raises(ValueError, match=r"head 4 does not exist: the model"
                     r" has 4 query heads"):
    interp.ZeroHeads.build(stacked.config, [4])
  # Axes the point lacks: refused by insert_at, before the model runs.
  with pytest.raises(ValueError, match=r"ZeroHeads.mask has axis"
                     r" 'head_groups', but the value at blocks.0.resid_post"
                     r" has unit axes \{'embedding': 32\}"):
    interp.insert_at(stacked, "blocks.0.resid_post",
                     interp.ZeroHeads.build(stacked.config, [0]))
  cached = penzai_lm.KVCachingTransformerLM.from_uncached(
      stacked, 8, {"batch": 1})
  with pytest.raises(TypeError, match="needs the uncached TransformerLM"):
    interp.run_with_cache(cached, [IDS[0]], names=["embed"])
  cache = interp.run_with_cache(stacked, [IDS[0]], names=["embed"])
  with pytest.raises(KeyError, match="'final_norm' was not captured"):
    cache["final_norm"]  # pylint: disable=pointless-statement


def test_saliency_gradient_through_the_embeddings():
  stacked, _ = _models("gemma3")  # Scaled embeddings.
  frozen = pz.freeze_params(stacked)
  tokens = pz.nx.wrap(jnp.asarray([IDS[0]])).tag("batch", "seq")
  emb = interp.embed(frozen, tokens)
  logits = interp.logits_from_embeddings(frozen, emb)
  np.testing.assert_allclose(_np(logits, logits),
                             _logits(stacked, [IDS[0]]), rtol=1e-5, atol=1e-5)

  def top_logit(data):
    out = interp.logits_from_embeddings(
        frozen, pz.nx.wrap(data).tag("batch", "seq", "embedding"))
    return out.unwrap("batch", "seq", "vocabulary")[0, 2, 5]

  data = emb.unwrap("batch", "seq", "embedding")
  grad = jax.jit(jax.grad(top_logit))(data)
  eps = 1e-2
  bumped = data.at[0, 1, 7].add(eps)
  numeric = (top_logit(bumped) - top_logit(data)) / eps
  np.testing.assert_allclose(grad[0, 1, 7], numeric, rtol=5e-2, atol=1e-3)
  assert np.asarray(grad[0, :3]).any()
  assert not np.asarray(grad[0, 3:]).any()  # Causal: later tokens no effect.


# Probes of issue 28: mistakes that failed only when the model ran (with
# penzai's "Inconsistent named axes in nmap(add)"), or with a
# functools.partial error, are refused by insert_at with what to do.


@pytest.mark.parametrize("layout", ["stacked", "unstacked"])
def test_wrong_size_steering_vector_fails_at_insert_at(layout):
  model = dict(zip(["stacked", "unstacked"], _models("llama_gqa")))[layout]
  with pytest.raises(ValueError, match=r"AddVector.vector has axis"
                     r" 'embedding' of size 16, but the value at"
                     r" blocks.1.resid_post has 'embedding' of size 32"):
    interp.insert_at(model, "blocks.1.resid_post",
                     interp.AddVector.build(np.ones(16, np.float32)))
  with pytest.raises(ValueError, match=r"Ablate.value has axis 'neurons' of"
                     r" size 40, .* blocks.2.mlp.neurons has 'neurons' of"
                     r" size 48"):
    interp.insert_at(model, "blocks.2.mlp.neurons", interp.Ablate.neurons(
        model.config, [1], mean=pz.nx.zeros({"neurons": 40})))
  # Right sizes (and a per-row batch axis, which is not checked) pass,
  # and the check does not change what runs.
  vector = np.arange(32, dtype=np.float32) / 32
  steered = interp.insert_at(model, "blocks.1.resid_post",
                             interp.AddVector.build(vector, [1.0, 2.0]))
  plain = interp.run_with_cache(model, IDS, names=["blocks.1.resid_post"])
  got = interp.run_with_cache(steered, IDS, names=["blocks.1.resid_post"])
  a = plain["blocks.1.resid_post"]
  moved = _np(got["blocks.1.resid_post"], a) - _np(a, a)
  np.testing.assert_allclose(moved[0, -1], vector, atol=1e-5)
  np.testing.assert_allclose(moved[1, -1], 2 * vector, atol=1e-5)


def test_blocks_axis_needs_a_layer_stack_of_that_many_blocks():
  stacked, unstacked = _models("llama_gqa")
  per_block = pz.nx.zeros({"blocks": 3, "embedding": 32})
  interp.insert_at(stacked, "blocks.1.resid_post",
                   interp.AddVector.build(per_block))
  with pytest.raises(ValueError, match=r"AddVector.vector has a 'blocks'"
                     r" axis, but blocks.1.resid_post is not in a layer"
                     r" stack"):
    interp.insert_at(unstacked, "blocks.1.resid_post",
                     interp.AddVector.build(per_block))
  with pytest.raises(ValueError, match=r"has 4 'blocks' but the model has"
                     r" 3"):
    interp.insert_at(stacked, "blocks.1.resid_post", interp.AddVector.build(
        pz.nx.zeros({"blocks": 4, "embedding": 32})))


def test_insert_at_a_plain_function_is_a_type_error():
  stacked, _ = _models("llama_gqa")

  def double(x):
    return x * 2

  with pytest.raises(TypeError, match=r"insert_at needs a pz.nn.Layer, got"
                     r" 'double' \(function\). Wrap a function in a layer:"
                     r" an elementwise one as pz.nn.Elementwise\(fn\)"):
    interp.insert_at(stacked, "blocks.1.resid_post", double)
  # The suggested wrapping works.
  wrapped = interp.insert_at(stacked, "blocks.1.resid_post",
                             pz.nn.Elementwise(double))
  plain = interp.run_with_cache(stacked, [IDS[0]],
                                names=["blocks.1.resid_post"])
  got = interp.run_with_cache(wrapped, [IDS[0]],
                              names=["blocks.1.resid_post"])
  a = plain["blocks.1.resid_post"]
  np.testing.assert_allclose(_np(got["blocks.1.resid_post"], a),
                             2 * _np(a, a), rtol=1e-6)
