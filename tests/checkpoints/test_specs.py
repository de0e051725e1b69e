"""Architecture specs: the one place that names architectures.

The readers of `penzai_lm.checkpoints` hold no architecture names: they read
the fields of an `ArchitectureSpec`. A new architecture can be declared, read
and loaded at run time, without editing the package: here Qwen3 (a Qwen2 with
per-head q/k norms) is declared again, against the built-in specs without it,
and must behave as the built-in `specs.QWEN3`.
"""

import ast
import dataclasses
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

from penzai_lm.checkpoints import CheckpointError
from penzai_lm.checkpoints import SPECS
from penzai_lm.checkpoints import expected_tensor_shapes
from penzai_lm.checkpoints import normalize_config
from penzai_lm.checkpoints import read_checkpoint
from penzai_lm.checkpoints import read_hf_dir
from penzai_lm.checkpoints import specs
from penzai_lm.checkpoints.architectures import spec_for
from penzai_lm.checkpoints.spec_types import Conv1DLayout
from penzai_lm.checkpoints.spec_types import DecoderLayout
from penzai_lm.checkpoints.spec_types import HFSpec
from penzai_lm.loading import load_model
from penzai_lm.loading.families import ADAPTERS
from penzai_lm.loading.families import FamilyAdapter
from penzai_lm.loading.families import common
from penzai_lm.loading.families import llama

_CHECKPOINTS = (
    pathlib.Path(__file__).resolve().parents[2] / "penzai_lm" / "checkpoints"
)
# Modules allowed to name architectures: the declarations.
_DECLARATIONS = ("specs.py",)
# Variables whose comparison with a string literal is an architecture switch.
_ARCH_VARIABLES = (
    "arch", "architecture", "model_type", "hf_class", "cls", "family",
)


def _architecture_strings(all_specs=SPECS):
  """Every string that names an architecture: names, classes, model types."""
  out = set()
  for spec in all_specs:
    out.add(spec.name)
    out.update(spec.hf.all_classes, spec.hf.all_model_types)
    if spec.gguf is not None:
      out.add(spec.gguf.architecture)
  return out


def _names(node, names):
  return (isinstance(node, ast.Name) and node.id in names) or (
      isinstance(node, ast.Attribute) and node.attr in names
  )


def _is_string_literal(node):
  if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
    return bool(node.elts) and all(_is_string_literal(e) for e in node.elts)
  return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _architecture_switches(tree, arch_strings):
  """Lines that compare an architecture with a literal, or name one."""
  docstrings = {
      id(node.value)
      for node in ast.walk(tree)
      if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
  }
  for node in ast.walk(tree):
    if isinstance(node, ast.Compare):
      operands = [node.left, *node.comparators]
      if any(_names(o, _ARCH_VARIABLES) for o in operands) and any(
          _is_string_literal(o) for o in operands
      ):
        yield node.lineno
    elif isinstance(node, ast.Match) and _names(node.subject, _ARCH_VARIABLES):
      yield node.lineno
    elif (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in arch_strings
        and id(node) not in docstrings
    ):
      yield node.lineno


def _reader_modules():
  return [
      p
      for p in sorted(_CHECKPOINTS.glob("*.py"))
      if p.name not in _DECLARATIONS
  ]


def test_readers_hold_no_architecture_names():
  """Readers switch on spec fields, never on an architecture's name."""
  arch_strings = _architecture_strings()
  offenders = []
  modules = _reader_modules()
  assert {"layout.py", "hf_reader.py", "gguf_reader.py"} <= {
      p.name for p in modules
  }
  for path in modules:
    source = path.read_text()
    lines = source.splitlines()
    found = _architecture_switches(ast.parse(source), arch_strings)
    for number in sorted(set(found)):
      offenders.append(f"{path.name}:{number}: {lines[number - 1].strip()}")
  assert not offenders, "architecture names:\n" + "\n".join(offenders)


def test_the_switch_detector_sees_switches():
  tree = ast.parse(
      '"""Docstrings may say gpt2."""\n'
      "if architecture == 'gpt2': pass\n"
      "x = arch in ('llama', 'mistral')\n"
      "y = {'qwen2': 1}\n"
      "z = spec.model_type == config.get('model_type')\n"
      "match arch:\n  case _: pass\n"
      "w = hf_class == 'Gemma3ForConditionalGeneration'\n"
  )
  assert sorted(set(_architecture_switches(tree, _architecture_strings()))) == [
      2, 3, 4, 6, 8
  ]


def test_checkpoints_do_not_import_loading():
  """checkpoints is the lower layer: loading may import it, not vice versa."""
  offenders = []
  for path in sorted(_CHECKPOINTS.glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom):
        modules = [node.module or ""]
      elif isinstance(node, ast.Import):
        modules = [a.name for a in node.names]
      else:
        continue
      offenders += [
          f"{path.name}: {m}"
          for m in modules
          if m.split(".")[:2] in (["penzai_lm", "loading"],
                                  ["penzai_lm", "model"])
      ]
  assert not offenders


def test_specs_are_consistent_and_frozen():
  names = [s.name for s in SPECS]
  assert len(set(names)) == len(names)
  for field in ("all_classes", "all_model_types"):
    values = [v for s in SPECS for v in getattr(s.hf, field)]
    assert len(set(values)) == len(values), field
  for spec in SPECS:
    assert spec_for(spec.name) is spec
    if isinstance(spec.layout, DecoderLayout):
      assert spec.rope is not None, spec.name
      for flag in (spec.layout.qkv_bias, spec.layout.output_bias,
                   spec.layout.mlp_bias):
        assert not isinstance(flag, str) or flag in spec.config_defaults
    else:
      assert isinstance(spec.layout, Conv1DLayout)
  with pytest.raises(dataclasses.FrozenInstanceError):
    specs.LLAMA.name = "x"
  with pytest.raises(TypeError):
    specs.LLAMA.config_defaults["vocab_size"] = 1
  with pytest.raises(TypeError):
    specs.LLAMA.gguf.block_names["attn_q"] = "x"


def test_unknown_architecture_lists_the_supported_ones():
  with pytest.raises(ValueError, match="'bert'. Supported: llama, mistral"):
    normalize_config("bert", {})
  with pytest.raises(ValueError, match="'bert'.*gemma3, gpt2"):
    expected_tensor_shapes("bert", {})


# ---- A new architecture, declared at run time -----------------------------

# The built-in specs as they were before Qwen3 was added.
WITHOUT_QWEN3 = tuple(s for s in SPECS if s.name != "qwen3")

# Qwen3: Qwen2's config, no biases (unless attention_bias), per-head q/k
# RMSNorms, head_dim 128 by default.
QWEN3 = dataclasses.replace(
    specs.QWEN2,
    name="qwen3",
    hf=HFSpec(classes=("Qwen3ForCausalLM",), model_types=("qwen3",)),
    config_defaults={
        **specs.QWEN2.config_defaults, "head_dim": 128, "attention_bias": False,
    },
    layout=DecoderLayout(
        qkv_bias="attention_bias", output_bias="attention_bias", qk_norm=True
    ),
)
WITH_QWEN3 = (*WITHOUT_QWEN3, QWEN3)


def _qwen3_adapter():
  """Llama's adapter plus q/k norms (`common.llama_like_layer` reads them)."""

  def config_fields(arch, c):
    return {**llama.LLAMA.config_fields(arch, c), "family": "qwen3",
            "qk_norm": True}

  return FamilyAdapter(
      config_fields, common.llama_like_globals, common.llama_like_layer
  )


def test_runtime_spec_normalizes_like_transformers():
  transformers = pytest.importorskip("transformers")
  hf = transformers.Qwen3Config(num_hidden_layers=3).to_dict()
  ours = normalize_config(QWEN3, {})
  ours3 = normalize_config("qwen3", {"num_hidden_layers": 3}, WITH_QWEN3)
  assert ours["model_type"] == "qwen3" and ours["head_dim"] == 128
  for key in ("head_dim", "attention_bias", "sliding_window", "layer_types",
              "rope_parameters", "num_key_value_heads", "max_window_layers"):
    assert ours3[key] == hf[key], key
  assert "model.layers.0.self_attn.q_norm.weight" in expected_tensor_shapes(
      QWEN3, {"num_hidden_layers": 1}
  )
  # The built-in spec agrees.
  assert normalize_config("qwen3", {"num_hidden_layers": 3}) == ours3
  assert expected_tensor_shapes(QWEN3, {}) == expected_tensor_shapes(
      "qwen3", {}
  )


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
  transformers = pytest.importorskip("transformers")
  pytest.importorskip("torch")
  from tests.loading.hf_models import save_perturbed  # pylint: disable=g-import-not-at-top

  config = transformers.Qwen3Config(
      vocab_size=101, hidden_size=32, intermediate_size=40,
      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
      head_dim=12, max_position_embeddings=128, rope_theta=5e4,
  )
  path = tmp_path_factory.mktemp("qwen3")
  return path, save_perturbed(transformers.Qwen3ForCausalLM, config, path)


def test_runtime_spec_reads_a_new_architecture(qwen3_dir):
  path, hf_model = qwen3_dir
  with pytest.raises(CheckpointError, match="Qwen3ForCausalLM.*Supported"):
    read_hf_dir(path, specs=WITHOUT_QWEN3)
  ckpt = read_checkpoint(path, specs=WITH_QWEN3)
  assert ckpt.architecture == "qwen3"
  sd = hf_model.state_dict()
  assert set(ckpt.tensors) == set(sd)
  for name, t in sd.items():
    np.testing.assert_array_equal(ckpt.tensors[name], t.numpy(), err_msg=name)


def test_runtime_spec_loads_with_transformers_logits(qwen3_dir):
  from tests.loading.hf_models import hf_logits  # pylint: disable=g-import-not-at-top
  from tests.loading.hf_models import logits  # pylint: disable=g-import-not-at-top

  path, hf_model = qwen3_dir
  model = load_model(
      path, specs=WITH_QWEN3,
      adapters={**ADAPTERS, QWEN3.name: _qwen3_adapter()},
  )
  ids = list(np.random.RandomState(1).randint(0, 101, size=12))
  got = logits(pz.freeze_params(model), pz.nx.wrap(jnp.array(ids)).tag("seq"))
  np.testing.assert_allclose(
      np.asarray(got.unwrap("seq", "vocabulary")), hf_logits(hf_model, ids),
      atol=1e-4,
  )
