"""Hostile config.json files: each fails with a CheckpointError naming the file
and the key, never a library traceback (TypeError, KeyError, RecursionError).

Every case starts from the tiny valid Hugging Face directory of
``corrupt_file_builders`` and breaks its config.json in one way. Each must
fail the same way in `read_checkpoint` and in `penzai_lm.load_model` (whose
config mapping runs after the reader's checks).
"""

from __future__ import annotations

import json
import math

import pytest

import penzai_lm
from penzai_lm.checkpoints import CheckpointError
from penzai_lm.checkpoints import normalize_config
from penzai_lm.checkpoints import read_checkpoint
from tests.checkpoints.corrupt_file_builders import valid_hf

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0}


def _raw_config(tmp_path, edit):
  """A valid directory whose config.json text is ``edit(text)``."""
  d = valid_hf(tmp_path)
  f = d / "config.json"
  f.write_text(edit(f.read_text()))
  return d


def _with_key(key, json_text):
  return lambda text: text[:-1] + f', "{key}": {json_text}}}'


# (probe, config.json overrides or a text edit, key named, what is said)
CASES = [
    ("null_num_hidden_layers", {"num_hidden_layers": None},
     "num_hidden_layers", r"\(null\) must be set"),
    ("null_rms_norm_eps", {"rms_norm_eps": None}, "rms_norm_eps",
     r"\(null\) must be set"),
    ("null_rope_theta", {"rope_theta": None}, "rope_theta",
     r"\(null\) must be set"),
    ("null_num_attention_heads", {"num_attention_heads": None},
     "num_attention_heads", r"\(null\) must be set"),
    ("null_max_position_embeddings", {"max_position_embeddings": None},
     "max_position_embeddings", r"\(null\) must be set"),
    ("llama3_rope_scaling_missing_keys",
     {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling",
     r"lacks 'low_freq_factor', 'high_freq_factor', which rope_type"
     r" 'llama3' needs"),
    ("rope_scaling_is_a_string", {"rope_scaling": "linear"}, "rope_scaling",
     r"must be an object such as"),
    ("rope_parameters_is_a_list", {"rope_parameters": [1, 2]},
     "rope_parameters", r"must be an object such as"),
    ("rope_type_is_a_number",
     {"rope_scaling": {"rope_type": 3, "factor": 2.0}},
     "rope_scaling.rope_type", r"must be a string"),
    ("architectures_is_a_string", {"architectures": "LlamaForCausalLM"},
     "architectures", r"must be a list of class names"),
    ("architectures_holds_a_list", {"architectures": [["LlamaForCausalLM"]]},
     "architectures", r"must be a list of class names"),
    ("model_type_is_a_list", {"architectures": [], "model_type": ["llama"]},
     "model_type", r"must be a string"),
    ("text_config_is_a_string",
     {"architectures": ["Gemma3ForConditionalGeneration"],
      "text_config": "x"}, "text_config", r"must be an object"),
    ("eos_token_id_is_a_string", {"eos_token_id": "2"}, "eos_token_id",
     r"must be a token id \(an integer\) or a list of them"),
    ("bos_token_id_is_a_float", {"bos_token_id": 1.5}, "bos_token_id",
     r"must be a token id"),
    ("tie_word_embeddings_is_a_string", {"tie_word_embeddings": "no"},
     "tie_word_embeddings", r"must be true or false"),
    ("layer_types_is_a_string", {"layer_types": "full"}, "layer_types",
     r"must be a list with one string per layer"),
    ("size_past_int32", {"max_position_embeddings": 2**40},
     "max_position_embeddings", r"is larger than any model size"),
    ("eps_overflows_float32", {"rms_norm_eps": 1e300}, "rms_norm_eps",
     r"in float32's range"),
    ("rope_theta_underflows_float32", {"rope_theta": 1e-300}, "rope_theta",
     r"in float32's range"),
    ("5000_digit_int", _with_key("vocab_size", "9" * 5000), None,
     r"holds an integer of more than \d+ digits"),
    ("4000_digit_int", _with_key("vocab_size", "9" * 4000), "vocab_size",
     r"<an integer of more than 80 digits> is larger than any model size"),
    ("deeply_nested_json", _with_key("x", "[" * 100_000 + "]" * 100_000),
     None, r"nests JSON arrays or objects too deeply"),
    ("nested_past_64_levels", _with_key("x", "[" * 500 + "]" * 500), None,
     r"nests JSON arrays or objects more than 64 levels deep"),
]


def _build(tmp_path, change):
  if callable(change):
    return _raw_config(tmp_path, change)
  return valid_hf(tmp_path, change)


@pytest.mark.parametrize(
    "change,key,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
@pytest.mark.parametrize("entry", ["read_checkpoint", "load_model"])
def test_hostile_config_names_file_and_key(tmp_path, entry, change, key,
                                           message):
  d = _build(tmp_path, change)
  call = read_checkpoint if entry == "read_checkpoint" else penzai_lm.load_model
  with pytest.raises(CheckpointError, match=message) as e:
    call(d)
  text = str(e.value)
  assert str(d / "config.json") in text
  if key is not None:
    assert f"key {key!r}" in text
  assert len(text) < 400  # No 5000-digit number, no whole nested value.


@pytest.mark.parametrize("probe", ["5000_digit_int", "deeply_nested_json"])
def test_json_errors_are_chained(tmp_path, probe):
  change = dict((c[0], c[1]) for c in CASES)[probe]
  with pytest.raises(CheckpointError) as e:
    read_checkpoint(_build(tmp_path, change))
  assert isinstance(e.value.__cause__, (ValueError, RecursionError))


def test_unsupported_rope_type_names_the_config_file(tmp_path):
  d = valid_hf(tmp_path, {"rope_scaling": {"rope_type": "bogus",
                                           "factor": 2.0}})
  read_checkpoint(d)  # A valid config: the model just lacks the option.
  with pytest.raises(CheckpointError,
                     match=r"config.json: .*RoPE scaling of type 'bogus'"):
    penzai_lm.load_model(d)


def test_broken_index_json_names_the_file(tmp_path):
  d = valid_hf(tmp_path)
  (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
  index = d / "model.safetensors.index.json"
  for text in ('{"weight_map": "x"}', "[" * 100_000, '{"weight_map": ' +
               "[" * 300 + "]" * 300 + "}"):
    index.write_text(text)
    with pytest.raises(CheckpointError, match="index.json"):
      read_checkpoint(d)


def test_valid_nulls_still_load(tmp_path):
  """Null where it means "derive" or "off", as real configs have it."""
  d = valid_hf(tmp_path, {"head_dim": None, "num_key_value_heads": 1,
                          "bos_token_id": None, "pad_token_id": None,
                          "rope_scaling": None, "sliding_window": None})
  assert read_checkpoint(d).config["head_dim"] == 8


def test_llama3_scaling_without_original_context_matches_transformers():
  transformers = pytest.importorskip("transformers")
  theirs = transformers.LlamaConfig(
      rope_scaling=dict(LLAMA3), max_position_embeddings=4096,
      rope_theta=500000.0)
  ours = normalize_config("llama", {"rope_scaling": dict(LLAMA3),
                                    "max_position_embeddings": 4096,
                                    "rope_theta": 500000.0})
  assert ours["rope_parameters"] == {
      k: v for k, v in theirs.rope_parameters.items()}
  assert ours["rope_parameters"]["original_max_position_embeddings"] == 4096


def test_nan_inside_rope_parameters_is_named():
  with pytest.raises(CheckpointError,
                     match=r"key 'rope_parameters.rope_theta' = nan"):
    normalize_config("llama", {"rope_parameters": {"rope_type": "default",
                                                   "rope_theta": math.nan}})
  with pytest.raises(CheckpointError,
                     match=r"'rope_parameters.full_attention' = 'x' must be"):
    normalize_config("gemma3", {"rope_parameters": {"full_attention": "x"}})
  assert json.dumps(normalize_config("gemma3", {
      "rope_parameters": {"full_attention": None,
                          "sliding_attention": {"rope_type": "default"}}}))
