"""`TransformerConfig` built with a Hugging Face field name (``rms_norm_eps``
for ``norm_eps``...) says which name to use instead of Python's bare
"unexpected keyword argument"."""

import pytest

from penzai_lm.model import TransformerConfig
from penzai_lm.model.config import HF_FIELD_NAMES
from tests.model.configs import config

SIZES = dict(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4,
             num_kv_heads=2, head_dim=8, mlp_hidden_size=48)


@pytest.mark.parametrize("hf_name, ours", [
    ("rms_norm_eps", "norm_eps"), ("layer_norm_epsilon", "norm_eps"),
    ("num_hidden_layers", "num_layers"), ("rope_theta", "rope_base")])
def test_hugging_face_names_point_to_ours(hf_name, ours):
  assert HF_FIELD_NAMES[hf_name] == ours
  with pytest.raises(TypeError, match=rf"no field '{hf_name}' \(Hugging"
                     rf" Face's name\); it is called '{ours}' here"):
    TransformerConfig(family="llama", **{**SIZES, hf_name: 1e-6})
  with pytest.raises(TypeError, match=f"it is called '{ours}' here"):
    config("llama_gqa").replace(**{hf_name: 1e-6})


def test_our_names_and_other_errors_are_unchanged():
  got = TransformerConfig(family="llama", norm_eps=1e-6, **SIZES)
  assert got.norm_eps == 1e-6
  assert got.replace(norm_eps=1e-5).norm_eps == 1e-5
  with pytest.raises(TypeError, match="unexpected keyword argument 'foo'"):
    TransformerConfig(family="llama", foo=1, **SIZES)
