"""`ZeroHeads.build` / `Ablate.heads` with one head list per row: a row's
list may be empty (a "no ablation" control row in the same batch)."""

import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

import penzai_lm
from penzai_lm import interp
from tests.model.configs import config

POINT = "blocks.1.attn.head_out"
IDS = [3, 14, 15, 92, 65]


def _logits(model, rows):
  tokens = pz.nx.wrap(jnp.asarray(rows)).tag("batch", "seq")
  return np.asarray(model(tokens).unwrap("batch", "seq", "vocabulary"))


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("build", [interp.ZeroHeads.build,
                                   interp.Ablate.heads])
def test_an_empty_row_is_left_alone(stacked, build):
  model = penzai_lm.build_transformer(config("llama_gqa", stacked), seed=3)
  patched = interp.insert_at(model, POINT,
                             build(model.config, [[0, 2], [], [1]]))
  got = _logits(patched, [IDS] * 3)
  np.testing.assert_allclose(got[1], _logits(model, [IDS])[0], atol=1e-5)
  for row, heads in ((0, [0, 2]), (2, [1])):
    alone = interp.insert_at(model, POINT, build(model.config, heads))
    np.testing.assert_allclose(got[row], _logits(alone, [IDS])[0],
                               atol=1e-5)
  assert not np.allclose(got[0], got[1], atol=1e-3)  # Row 0 did change.


def test_no_heads_at_all_is_refused():
  model_config = config("llama_gqa")
  with pytest.raises(ValueError, match="heads is empty"):
    interp.ZeroHeads.build(model_config, [])
  # Every row empty is a batch of control rows: allowed.
  mask = interp.ZeroHeads.build(model_config, [[], []]).mask
  assert mask.named_shape["batch"] == 2 and not np.asarray(
      mask.data_array).any()
