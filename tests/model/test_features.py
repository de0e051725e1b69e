"""Feature fields of TransformerConfig: presets, validation, and the model.

The mixed-feature config combines features no real family combines (LayerNorm
with q/k norms and post norms, learned positions with sliding windows, a
gated MLP with biases, soft-capping), so a feature that leans on another one
shows up against the numpy reference.
"""

import ast
import dataclasses
import functools
import math
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model import TransformerConfig
from penzai_lm.model.config import FAMILY_PRESETS
from penzai_lm.model.config import PRESET_FEATURES
from penzai_lm.model.layers import SoftCap
from tests.model.conftest import perturbed_model
from tests.model.conftest import random_tokens
from tests.model.conftest import run_cached
from tests.model.conftest import uncached_logits
from tests.model.reference import reference_logits

SIZES = dict(
    vocab_size=97, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
    head_dim=8, mlp_hidden_size=48,
)
EXPLICIT = dict(
    norm_kind="rms", position_embedding="rope", mlp_kind="gated",
    qkv_bias=False, attention_output_bias=False, mlp_bias=False,
    qk_norm=False, post_norms=False,
)
MIXED = TransformerConfig(
    family="mixed", **SIZES, norm_kind="layer", position_embedding="learned",
    mlp_kind="gated", qkv_bias=True, attention_output_bias=True, mlp_bias=True,
    qk_norm=True, post_norms=True, embedding_scale=2.0,
    attn_logit_softcap=0.7, final_logit_softcap=1.5,
    activation="gelu_tanh", sliding_window=4,
    layer_types=("local", "global", "local"), max_position_embeddings=32,
)


@functools.cache
def _mixed(stacked):
  return perturbed_model(MIXED.replace(use_layer_stack=stacked))


def test_presets_fill_unset_features():
  llama = TransformerConfig(family="llama", **SIZES)
  assert {f: getattr(llama, f) for f in PRESET_FEATURES} == FAMILY_PRESETS["llama"]
  gemma = TransformerConfig(family="gemma3", **SIZES)
  assert gemma.qk_norm and gemma.post_norms
  assert gemma.embedding_scale == pytest.approx(math.sqrt(32))
  gpt2 = TransformerConfig(family="gpt2", **SIZES)
  assert (gpt2.norm_kind, gpt2.position_embedding, gpt2.mlp_kind) == (
      "layer", "learned", "plain")
  assert gpt2.qkv_bias and gpt2.attention_output_bias and gpt2.mlp_bias


def test_explicit_features_override_the_preset_and_survive_replace():
  config = TransformerConfig(family="gpt2", **SIZES, qkv_bias=False)
  assert config.qkv_bias is False and config.mlp_bias is True
  assert config.replace(num_layers=2).qkv_bias is False
  gemma = TransformerConfig(family="gemma3", **SIZES, embedding_scale=1.0)
  assert gemma.embedding_scale == 1.0


def test_a_new_family_needs_every_feature():
  config = TransformerConfig(
      family="qwen3", **SIZES, **{**EXPLICIT, "qk_norm": True}
  )
  assert config.family == "qwen3" and config.qk_norm
  assert config.embedding_scale is None
  with pytest.raises(ValueError, match="Unknown family 'qwen3'.*mlp_kind"):
    TransformerConfig(
        family="qwen3", **SIZES, **{**EXPLICIT, "mlp_kind": None}
    )
  with pytest.raises(ValueError, match="Unknown family 'custom'"):
    TransformerConfig(**SIZES)


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(family=""), "family must be a non-empty string"),
        (dict(norm_kind="batch"), "Unknown norm_kind 'batch'"),
        (dict(position_embedding="alibi"), "Unknown position_embedding"),
        (dict(mlp_kind="moe"), "Unknown mlp_kind 'moe'"),
        (dict(qk_norm=1), "qk_norm must be True or False"),
        (dict(post_norms="yes"), "post_norms must be True or False"),
        (dict(mlp_bias=np.bool_(True)), "mlp_bias must be True or False"),
        (dict(embedding_scale=0.0), "embedding_scale must be a positive"),
        (dict(embedding_scale=True), "embedding_scale must be a positive"),
        (dict(attn_logit_softcap=-1.0), "attn_logit_softcap must be a positive"),
        (dict(final_logit_softcap=math.inf), "final_logit_softcap must be a"),
        (dict(final_logit_softcap="30"), "final_logit_softcap must be a"),
        (dict(head_dim=7), "RoPE needs an even head_dim"),
    ],
)
def test_bad_feature_is_rejected(changes, message):
  with pytest.raises(ValueError, match=message):
    TransformerConfig(**{"family": "llama", **SIZES, **changes})


def test_learned_positions_allow_an_odd_head_dim():
  config = TransformerConfig(family="gpt2", **{**SIZES, "head_dim": 7})
  assert config.head_dim == 7


def test_max_cache_len():
  assert TransformerConfig(family="llama", **SIZES).max_cache_len is None
  gpt2 = TransformerConfig(family="gpt2", **SIZES, max_position_embeddings=20)
  assert gpt2.max_cache_len == 20
  learned = TransformerConfig(
      family="llama", **SIZES, position_embedding="learned",
      max_position_embeddings=12,
  )
  assert learned.max_cache_len == 12


def test_max_cache_len_bounds_the_model_and_its_cache():
  model = _mixed(True)
  tokens = pz.nx.wrap(jnp.zeros((33,), jnp.int32)).tag("seq")
  with pytest.raises(ValueError, match="only 32 learned positions"):
    model(tokens)
  with pytest.raises(ValueError, match="cache_len 33 exceeds"):
    KVCachingTransformerLM.from_uncached(model, 33, {"batch": 1})
  KVCachingTransformerLM.from_uncached(model, 32, {"batch": 1})


def test_softcap_layer_matches_numpy():
  x = np.linspace(-20, 20, 41, dtype=np.float32)
  got = SoftCap(cap=5.0)(pz.nx.wrap(jnp.asarray(x)).tag("v"))
  np.testing.assert_allclose(
      np.asarray(got.unwrap("v")), np.tanh(x / 5.0) * 5.0, rtol=1e-6, atol=1e-6
  )


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "unstacked"])
def test_mixed_features_match_reference(stacked):
  model = _mixed(stacked)
  tokens = random_tokens((11,))
  logits = uncached_logits(model, tokens, "seq")
  np.testing.assert_allclose(logits, reference_logits(model, tokens), atol=2e-4)
  assert np.abs(logits).max() < MIXED.final_logit_softcap
  attention_layers = 1 if stacked else MIXED.num_layers
  assert pz.select(model).at_instances_of(SoftCap).count() == attention_layers + 1


def test_softcaps_change_the_logits():
  model = _mixed(True)
  tokens = random_tokens((9,))
  uncapped = dataclasses.replace(
      model,
      config=MIXED.replace(attn_logit_softcap=None, final_logit_softcap=None),
  )
  uncapped = pz.select(uncapped).at_instances_of(SoftCap).remove_from_parent()
  expected = reference_logits(uncapped, tokens)
  np.testing.assert_allclose(
      uncached_logits(uncapped, tokens, "seq"), expected, atol=2e-4
  )
  assert not np.allclose(uncached_logits(model, tokens, "seq"), expected, atol=1e-2)


def test_mixed_features_cached_equals_uncached():
  model = _mixed(True)
  tokens = random_tokens((2, 12), seed=4)
  expected = uncached_logits(model, tokens, "batch", "seq")
  cached = KVCachingTransformerLM.from_uncached(model, 16, {"batch": 2})
  got, _ = run_cached(cached, tokens, prefill=5)
  np.testing.assert_allclose(got, expected, atol=1e-5)


_PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "penzai_lm"


def _names(node, names):
  """Whether ``node`` is a variable or attribute called one of ``names``."""
  return (isinstance(node, ast.Name) and node.id in names) or (
      isinstance(node, ast.Attribute) and node.attr in names
  )


def _is_string_literal(node):
  if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
    return all(_is_string_literal(e) for e in node.elts)
  return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _family_branches(tree):
  """Comparisons of a family name, or of an architecture with a literal."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Compare):
      operands = [node.left, *node.comparators]
      if any(_names(o, ("family",)) for o in operands) or (
          any(_names(o, ("arch", "architecture")) for o in operands)
          and any(_is_string_literal(o) for o in operands)
      ):
        yield node.lineno
    elif isinstance(node, ast.Match) and _names(node.subject, ("family",)):
      yield node.lineno


@pytest.mark.parametrize("package", ["model", "loading"])
def test_no_family_branches(package):
  """The model and the loaders read feature fields, never the family name."""
  offenders = []
  for path in sorted((_PACKAGE / package).rglob("*.py")):
    source = path.read_text()
    lines = source.splitlines()
    for number in _family_branches(ast.parse(source)):
      offenders.append(
          f"{path.relative_to(_PACKAGE)}:{number}: {lines[number - 1].strip()}"
      )
  assert not offenders, "family branches:\n" + "\n".join(offenders)


def test_the_branch_detector_sees_branches():
  tree = ast.parse(
      "if config.family == 'gpt2': pass\n"
      "x = family in ('a', 'b')\n"
      "y = arch == 'qwen2'\n"
      "z = architecture in ADAPTERS\n"
  )
  assert list(_family_branches(tree)) == [1, 2, 3]
