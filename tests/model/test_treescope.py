"""Both model modes render legibly in treescope."""

import treescope

from penzai_lm.model import KVCachingTransformerLM
from tests.model.conftest import _model


def test_treescope_shows_layers_axes_and_labels():
  model = _model("llama_gqa", False)
  text = treescope.render_to_text(model)
  for expected in (
      "TransformerLM", "TransformerBlock", "transformer/block_2/attention/query",
      "head_groups", "query_heads", "projection", "embedding", "neurons",
      "vocabulary", "ApplyRotaryEmbedding",
  ):
    assert expected in text, expected
  cached = KVCachingTransformerLM.from_uncached(model, 8, {"batch": 1})
  cached_text = treescope.render_to_text(cached)
  for expected in (
      "KVCachingTransformerLM", "KVCachingAttention", "sampler/cache_0",
      "sampler/kv_positions", "transformer/block_2/attention/query",
  ):
    assert expected in cached_text, expected


def test_treescope_shows_stacked_labels():
  text = treescope.render_to_text(_model("gemma3", True))
  assert "transformer/blocks/attention/query" in text
  assert "blocks" in text and "LayerStack" in text
