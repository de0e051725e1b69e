"""insert_captures: every named point captured, in one pass over the model,
on both layouts (a layer stack and per-layer blocks) with the same values."""

import numpy as np
from penzai import pz

import penzai_lm
from penzai_lm import interp
from penzai_lm.model import points as points_lib
from penzai_lm.model.captures import Capture
from penzai_lm.model.captures import insert_captures
from penzai_lm.runtime.unstack import unstack_layers
from tests.model.configs import config

PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]


def test_every_point_of_both_layouts_is_captured_once_with_equal_values():
  stacked = penzai_lm.build_transformer(config("llama_gqa", True), seed=3)
  per_layer = unstack_layers(stacked)  # The same weights, block by block.
  names = points_lib.point_names(per_layer)
  shape = {"batch": 2, "seq": 4}

  patched, out = insert_captures(per_layer, names + names[:3], shape)
  captures = pz.select(patched).at_instances_of(Capture).get_sequence()
  # One buffer per (point, block): a repeated name is captured once.
  assert len(captures) == len(names) == len(out)
  assert len({c.saved.label for c in captures}) == len(names)
  patched, out = insert_captures(stacked, names, shape)
  captures = pz.select(patched).at_instances_of(Capture).get_sequence()
  # One buffer per point for all blocks of the stack, and embed/final_norm.
  assert len(captures) == len({points_lib.parse_point(stacked, n).point
                               for n in names})
  assert out["blocks.2.resid_post"][1].layer == 2

  got = interp.run_with_cache(per_layer, PROMPTS, names=names)
  want = interp.run_with_cache(stacked, PROMPTS, names=names)
  for name in names:
    a, b = got[name], want[name]
    np.testing.assert_allclose(
        np.asarray(a.unwrap(*b.named_shape)),
        np.asarray(b.unwrap(*b.named_shape)), atol=1e-5, err_msg=name)
