"""decompose_resid / apply_final_norm / logit_attribution / weights on tiny
random models of every family and both layouts: the terms sum to the
residual stream, through the final norm to the final_norm point, and their
effects to the model's own logit difference (the real checkpoints are
compared with transformers in test_decompose_hf.py)."""

import numpy as np
import pytest

import penzai_lm
from penzai_lm import interp
from penzai_lm.interp.decompose import AXES
from tests.model.configs import config

PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8]]
ANSWERS, WRONG = [3, 4], [5, 6]


def _np(x, *axes):
  return np.asarray(x.unwrap(*axes))


def _real(x, lengths):
  """The positions every row has (rows are left-padded)."""
  return x[..., -min(lengths):, :]


@pytest.mark.parametrize("name", ["llama_gqa", "gemma3", "gpt2"])
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("per_head", [False, True])
def test_terms_sum_to_the_stream_the_norm_and_the_logits(name, stacked,
                                                         per_head):
  model = penzai_lm.build_transformer(config(name, stacked), seed=3)
  cfg = model.config
  stack = interp.decompose_resid(model, PROMPTS, per_head=per_head)
  per_block = cfg.num_heads + (name == "gpt2") if per_head else 1
  assert len(stack.labels) == (1 + (name == "gpt2")
                               + cfg.num_layers * (per_block + 1))
  terms = _np(stack.components, *AXES)
  lengths = stack.lengths
  np.testing.assert_allclose(
      _real(terms.sum(0), lengths),
      _real(_np(stack.resid, "batch", "seq", "embedding"), lengths),
      rtol=1e-5, atol=1e-5)

  normed = interp.apply_final_norm(model, stack)
  cache = interp.run_with_cache(model, PROMPTS, names=["final_norm"])
  np.testing.assert_allclose(
      _real(_np(normed.components, *AXES).sum(0), lengths),
      _real(_np(cache["final_norm"], "batch", "seq", "embedding"), lengths),
      rtol=1e-5, atol=1e-5)

  effects = _np(interp.logit_attribution(model, normed, ANSWERS, WRONG),
                "component", "batch")
  logits = _np(cache.logits, "batch", "seq", "vocabulary")[:, -1]
  rows = np.arange(len(PROMPTS))
  np.testing.assert_allclose(
      effects.sum(0), logits[rows, ANSWERS] - logits[rows, WRONG],
      rtol=1e-5, atol=1e-5)
  single = _np(interp.logit_attribution(model, normed, 3), "component",
               "batch")
  np.testing.assert_allclose(single.sum(0), logits[:, 3], rtol=1e-5,
                             atol=1e-5)


def test_a_block_input_is_the_sum_of_the_blocks_before_it():
  model = penzai_lm.build_transformer(config("gemma3", False), seed=3)
  stack = interp.decompose_resid(model, PROMPTS, layer=2, per_head=True)
  assert stack.labels[-1] == "blocks.1.mlp_out"
  cache = interp.run_with_cache(model, PROMPTS, names=["blocks.2.resid_pre"])
  np.testing.assert_allclose(
      _real(_np(stack.components, *AXES).sum(0), stack.lengths),
      _real(_np(cache["blocks.2.resid_pre"], "batch", "seq", "embedding"),
            stack.lengths), rtol=1e-5, atol=1e-5)
  heads = [_np(stack[f"blocks.0.attn.head{h}"], "batch", "seq", "embedding")
           for h in range(model.config.num_heads)]
  np.testing.assert_allclose(
      _real(sum(heads), stack.lengths),
      _real(_np(interp.run_with_cache(model, PROMPTS,
                                      names=["blocks.0.attn_out"])
                ["blocks.0.attn_out"], "batch", "seq", "embedding"),
            stack.lengths), rtol=1e-5, atol=1e-5)


def test_weights_by_name_on_both_layouts_and_quantized():
  stacked = penzai_lm.build_transformer(config("llama_gqa", True), seed=3)
  per_layer = penzai_lm.build_transformer(config("gpt2", False), seed=3)
  w_o = interp.weights(stacked, "blocks.1.attn.W_O")
  assert dict(w_o.named_shape) == {"head_groups": 2, "query_heads": 2,
                                   "projection": 12, "embedding": 32}
  names = interp.weight_names(per_layer)
  assert {"pos_embed.W_pos", "ln_final.b", "blocks.2.attn.b_O",
          "blocks.0.mlp.W_in"} <= set(names)
  assert "blocks.0.mlp.W_gate" not in names
  for name in names:
    interp.weights(per_layer, name)
  quantized = penzai_lm.quantize(stacked, "int8")
  np.testing.assert_allclose(
      _np(interp.weights(quantized, "blocks.1.attn.W_O"), *w_o.named_shape),
      _np(w_o, *w_o.named_shape), atol=0.02 * float(np.abs(_np(
          w_o, *w_o.named_shape)).max()))


@pytest.mark.parametrize("call, message", [
    (lambda m: interp.weights(m, "blocks.1.attn.W_0"), "did you mean"),
    (lambda m: interp.weights(m, "blocks.3.attn.W_O"), "has 3 blocks"),
    (lambda m: interp.weights(m, "blocks.0.attn.b_O"), "no 'blocks.0.attn.b_O'"),
    (lambda m: interp.decompose_resid(m, PROMPTS, layer=4), "0..3"),
    (lambda m: interp.apply_final_norm(
        m, interp.decompose_resid(m, PROMPTS, layer=1)), "final norm"),
    (lambda m: interp.logit_attribution(
        m, interp.decompose_resid(m, PROMPTS), 3), "apply_final_norm"),
    (lambda m: interp.logit_attribution(m, interp.apply_final_norm(
        m, interp.decompose_resid(m, PROMPTS)), 97), r"\[0, 97\)"),
    (lambda m: interp.logit_attribution(m, interp.apply_final_norm(
        m, interp.decompose_resid(m, PROMPTS)), [1, 2, 3]), "one per row"),
    (lambda m: interp.logit_attribution(m, interp.apply_final_norm(
        m, interp.decompose_resid(m, PROMPTS)), 3, position=5), "position"),
])
def test_bad_requests_are_clear_errors(call, message):
  model = penzai_lm.build_transformer(config("llama_gqa", True), seed=3)
  with pytest.raises(ValueError, match=message):
    call(model)
