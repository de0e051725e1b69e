"""`IdentityCache.get` without a maker: found, or None (nothing made)."""

import numpy as np
from penzai import pz

from penzai_lm.runtime.identity_cache import IdentityCache


def _model():
  weights = pz.nx.wrap(np.ones((3, 2), np.float32)).tag("in", "out")
  return pz.nn.Linear(weights=pz.Parameter(value=weights, label="w"),
                      in_axis_names=("in",), out_axis_names=("out",))


def test_get_without_a_maker_finds_or_returns_none():
  cache, model = IdentityCache(2), _model()
  assert cache.get(model, "key", None) is None
  assert cache.made == 0 and len(cache) == 0  # Nothing made, nothing held.
  assert cache.get_or_make(model, "key", lambda: "prepared") == "prepared"
  assert cache.get(model, "key", None).value == "prepared"
  assert cache.get(model, "another key", None) is None
  # Another model of the same structure, other weights: not found.
  assert cache.get(_model(), "key", None) is None
  assert cache.made == 1
