"""TransformerConfig validation."""

import pytest

from penzai_lm.model import TransformerConfig

BASE = dict(
    family="llama", vocab_size=10, hidden_size=8, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=4, mlp_hidden_size=8,
)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(family="bert"), "Unknown family"),
        (dict(num_kv_heads=3), "must divide num_heads"),
        (dict(head_dim=3), "even head_dim"),
        (dict(hidden_size=0), "hidden_size must be a positive integer"),
        (dict(activation="relu"), "Unknown activation"),
        (dict(layer_types=("global",)), "has 1 entries but the model has 2"),
        (dict(layer_types=("local", "global")), "no sliding_window"),
        (dict(layer_types=("local", "nope"), sliding_window=2), "must be 'global'"),
        (dict(sliding_window=0), "sliding_window must be a positive"),
    ],
)
def test_bad_config_is_rejected(changes, message):
  with pytest.raises(ValueError, match=message):
    TransformerConfig(**{**BASE, **changes})


def test_layer_types_default_from_sliding_window():
  assert TransformerConfig(**BASE).resolved_layer_types == ("global", "global")
  mistral = TransformerConfig(**BASE, sliding_window=3)
  assert mistral.resolved_layer_types == ("local", "local")
  assert TransformerConfig(**BASE, query_pre_attn_scalar=16).query_scale == 0.25
