"""The compiled decode loop touches each cache only where it writes.

A decode step must not copy or transpose a whole KV cache: at a 2048-slot
cache such copies made SmolLM2's decode twice as slow. The check reads the
optimized HLO of the compiled loop.
"""

import re

import numpy as np
import pytest

from penzai_lm.generation import Engine
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model import TransformerConfig
from penzai_lm.model import build_transformer

CACHE = 512
_SHAPE = re.compile(r"= f32\[([0-9,]*)\]\S* (copy|transpose|fusion)\(")


def _decode_hlo(model, rows):
  cached = KVCachingTransformerLM.from_uncached(model, CACHE, {"batch": rows})
  prompts = np.random.default_rng(0).integers(1, 97, (rows, 6)).tolist()
  engine = Engine()
  engine.generate(cached, prompts, max_new_tokens=3, temperature=0.0,
                  stop_tokens=[])
  (_, program), = engine.programs.items("decode")
  return program.as_text()


def _cache_sized_copies(hlo: str, cache_elements: int) -> list[str]:
  """Copies / transposes (standalone or as a fusion's root) of a cache."""
  found = []
  for line in hlo.splitlines():
    m = _SHAPE.search(line)
    if not m or not m.group(1):
      continue
    elements = int(np.prod([int(d) for d in m.group(1).split(",")]))
    if elements < cache_elements:
      continue
    if m.group(2) != "fusion" or re.search(r"calls=%?\S*(copy|transpose)",
                                           line):
      found.append(line.strip()[:160])
  return found


@pytest.mark.parametrize("rows", [1, 2])
def test_no_cache_copies_in_the_decode_loop(rows):
  config = TransformerConfig(
      family="llama", vocab_size=97, hidden_size=32, num_layers=2,
      num_heads=4, num_kv_heads=2, head_dim=16, mlp_hidden_size=48,
      max_position_embeddings=1024, use_layer_stack=False)
  model = build_transformer(config, seed=0)
  hlo = _decode_hlo(model, rows)
  per_layer = rows * config.num_kv_heads * config.head_dim * CACHE
  assert _cache_sized_copies(hlo, per_layer) == []
