"""Sharding over a device mesh: `penzai_lm.shard` and SPMD generation.

The mesh checks need 8 devices, which XLA simulates on CPU only when
``--xla_force_host_platform_device_count=8`` is set before JAX starts, so
they run in one subprocess (`mesh_checks`, printing JSON) that does the
single-device run and the 2x4 and 8x1 ("data", "model") runs on one engine;
the tests compare the results. Compilation dominates, so each mesh runs one
forward pass, one patched generate (per-row steering, per-row head
ablation, captures, top log-probs) and a two-turn `Session`, compiled with
XLA's cheaper backend options (the same for every mesh; partitioning is
what is tested). Validation runs in-process on a mesh over the one CPU
device.
"""

import functools
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from penzai import pz

import penzai_lm
from penzai_lm import sharding
from penzai_lm.model import TransformerConfig

# Head groups, query heads, neurons and vocabulary divide by 4 and 8.
CONFIG = TransformerConfig(
    family="llama", vocab_size=128, hidden_size=32, num_layers=1,
    num_heads=16, num_kv_heads=8, head_dim=4, mlp_hidden_size=64,
    eos_token_ids=(2,))
# Quantized: every contracted size a multiple of 32 blocks per device
# (attention output: 256 values = 8 blocks; MLP down: 256), a tied table.
QUANTIZED_CONFIG = TransformerConfig(
    family="llama", vocab_size=128, hidden_size=64, num_layers=2,
    num_heads=16, num_kv_heads=8, head_dim=16, mlp_hidden_size=256,
    eos_token_ids=(2,), tie_embeddings=True)
MESHES = {"2x4": (2, 4), "8x1": (8, 1)}
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
GREEDY = dict(temperature=0.0, stop_tokens=[])
CAPTURE = ["blocks.0.attn.pattern", "blocks.0.mlp.neurons"]


def _fast_compile(program, shape):
  del program, shape
  return {"xla_backend_optimization_level": 0,
          "xla_llvm_disable_expensive_passes": True}


def _arrays(tree):
  """Named arrays and numbers as nested lists (JSON)."""
  return jax.tree_util.tree_map(
      lambda x: np.asarray(x.unwrap(*x.named_shape) if isinstance(
          x, pz.nx.NamedArrayBase) else x, np.float64).tolist(),
      tree, is_leaf=pz.nx.is_namedarray)


def _run(model, engine) -> dict:
  """Everything compared between one device and a mesh."""
  from penzai_lm import interp  # pylint: disable=g-import-not-at-top
  tokens = pz.nx.wrap(np.asarray([PROMPTS[0][:3] * 2, PROMPTS[1] * 2],
                                 np.int32)).tag("batch", "seq")
  logits = jax.jit(lambda m, t: m(t))(model, tokens)
  patched = interp.insert_at(
      model, "blocks.0.resid_post",
      interp.AddVector.build(np.linspace(-1, 1, 32), strength=[0.0, 4.0]))
  patched = interp.insert_at(
      patched, "blocks.0.attn.head_out",
      interp.Ablate.heads(CONFIG, [[0], [5, 6]]))
  run = engine.start(patched, PROMPTS, max_new_tokens=6, capture=CAPTURE,
                     logprobs_top_n=3, **GREEDY)
  steered = run.run_to_end()
  cache = run.carry.model_state[0].sharding  # Layer 0's keys.
  session = penzai_lm.Session(model, min_cache_len=32, engine=engine)
  turns = [session.generate(ids, max_new_tokens=5, **GREEDY)
           for ids in ([3, 4, 5], [6, 7])]
  return dict(
      logits=_arrays(logits.unwrap("batch", "seq", "vocabulary")),
      tokens=steered.tokens, logprobs=steered.logprobs,
      top_logprobs=[[[lp for _, lp in top] for top in row]
                    for row in steered.top_logprobs],
      captures=_arrays(steered.captures),
      session_tokens=[t.tokens for t in turns],
      session_logprobs=[t.logprobs for t in turns],
      cache_spec=list(getattr(cache, "spec", ())),
      compilations=engine.compilations)


def mesh_checks() -> dict:
  """Runs in the 8-device subprocess; returns the results by mesh."""
  model = penzai_lm.build_transformer(CONFIG, seed=5)
  # Shared: no program may cross meshes.
  engine = penzai_lm.Engine(compiler_options=_fast_compile)
  out = {"single": _run(model, engine)}
  for name, shape in MESHES.items():
    mesh = jax.make_mesh(shape, ("data", "model"))
    out[name] = _run(penzai_lm.shard(model, mesh), engine)
  three = jax.sharding.Mesh(np.asarray(jax.devices()[:3]), ("model",))
  try:
    penzai_lm.shard(model, three)
  except ValueError as e:
    out["not_dividing"] = str(e)
  out["load"] = _load_checks(jax.make_mesh(MESHES["2x4"], ("data", "model")))
  out["quantized"] = _quantized_checks(engine)
  return out


def _quantized_checks(engine) -> dict:
  """Quantized models (4-bit blocks, a tied table looked up from them) on
  each mesh against one device, and the errors of splits they cannot
  take."""
  model = penzai_lm.quantize(
      penzai_lm.build_transformer(QUANTIZED_CONFIG, seed=2), "q4_1")
  tokens = pz.nx.wrap(np.asarray([PROMPTS[0] + PROMPTS[1]], np.int32)).tag(
      "batch", "seq")
  forward = jax.jit(lambda m, t: m(t).unwrap("batch", "seq", "vocabulary"))

  def run(m):
    result = engine.generate(m, PROMPTS, max_new_tokens=6, **GREEDY)
    return dict(logits=np.asarray(forward(m, tokens)).tolist(),
                tokens=result.tokens, logprobs=result.logprobs)

  out = {"single": run(model)}
  for name, shape in MESHES.items():
    sharded = penzai_lm.shard(model, jax.make_mesh(shape, ("data", "model")))
    out[name] = run(sharded)
    out[name]["specs"] = {
        p.label.split("/", 1)[1]: list(p.value.data_array.sharding.spec)
        for p in pz.select(sharded).at_instances_of(pz.ParameterValue)
        .get_sequence()}
  mesh = jax.make_mesh(MESHES["2x4"], ("data", "model"))
  errors = {}
  for key, rules in (("later_axis", {"projection": "model"}),
                     ("groups", {"embedding": "model",
                                 "vocabulary": None})):
    try:
      penzai_lm.shard(model, mesh, rules)
    except ValueError as e:
      errors[key] = str(e)
  out["errors"] = errors
  return out


def _load_checks(mesh) -> dict:
  """`load(..., mesh=)` puts each tensor on its shards as it reads it: the
  same model as loading, then `shard`."""
  import tempfile  # pylint: disable=g-import-not-at-top

  from tests.loading.synthetic_checkpoints import write_random_llama  # pylint: disable=g-import-not-at-top

  with tempfile.TemporaryDirectory() as tmp:
    path = write_random_llama(tmp, dict(
        vocab_size=128, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4),
        kind="F32", shards=1)
    out = {}
    for quantize in (None, "int8"):
      direct = penzai_lm.load_model(path, mesh=mesh, quantize=quantize)
      after = penzai_lm.shard(penzai_lm.load_model(path, quantize=quantize),
                              mesh)
      out[str(quantize)] = _compare_placed(direct, after)
    # q4_1 of the MLP down projection: 64 neurons are 2 scale groups, which
    # 4 devices cannot split. Said at its first layer, before the rest of
    # the checkpoint is quantized.
    from penzai_lm import quantization  # pylint: disable=g-import-not-at-top
    real, quantized = quantization.quantize_array, []
    quantization.quantize_array = lambda *a: (quantized.append(a[-1]),
                                              real(*a))[1]
    try:
      penzai_lm.load_model(path, mesh=mesh, quantize="q4_1")
    except ValueError as e:
      out["q4_1_error"] = dict(message=str(e), quantized=quantized)
    finally:
      quantization.quantize_array = real
  return out


def _compare_placed(direct, after) -> dict:
  values = lambda m: (pz.select(m).at_instances_of(pz.ParameterValue)  # noqa: E731
                      .get_sequence())
  pairs = list(zip(values(direct), values(after)))
  return dict(
      count=len(pairs),
      same_labels=all(a.label == b.label for a, b in pairs),
      same_shardings=all(a.value.data_array.sharding.is_equivalent_to(
          b.value.data_array.sharding, a.value.data_array.ndim)
                         for a, b in pairs),
      split=sum(len(a.value.data_array.sharding.device_set) == 8
                and not a.value.data_array.sharding.is_fully_replicated
                for a, _ in pairs),
      max_diff=max(float(np.abs(np.asarray(a.value.data_array)
                                - np.asarray(b.value.data_array)).max())
                   for a, b in pairs))


@pytest.fixture(scope="module")
def results():
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
      os.environ.get("XLA_FLAGS", "")
      + " --xla_force_host_platform_device_count=8"))
  code = ("import json, tests.test_sharding as t;"
          " print('RESULT' + json.dumps(t.mesh_checks()))")
  done = subprocess.run([sys.executable, "-c", code], env=env, text=True,
                        capture_output=True, timeout=600,
                        cwd=os.path.dirname(os.path.dirname(__file__)))
  assert done.returncode == 0, done.stderr[-3000:]
  line, = [l for l in done.stdout.splitlines() if l.startswith("RESULT")]
  return json.loads(line[len("RESULT"):])


def _max_diff(a, b) -> float:
  return max((float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
              for x, y in zip(jax.tree_util.tree_leaves(a),
                              jax.tree_util.tree_leaves(b))), default=0.0)


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_sharded_generation_equals_one_device(results, mesh):
  single, sharded = results["single"], results[mesh]
  assert sharded["tokens"] == single["tokens"]
  assert sharded["session_tokens"] == single["session_tokens"]
  for key in ("logits", "logprobs", "top_logprobs", "captures",
              "session_logprobs"):
    assert _max_diff(sharded[key], single[key]) < 1e-5, key
  # The steering and ablation act per row.
  assert single["tokens"][0] != single["tokens"][1]


def test_state_follows_the_mesh_and_nothing_recompiles(results):
  # Layer 0's keys (batch, kv slots, head_groups, projection): heads over
  # "model", the batch of 2 over "data" only where it divides.
  assert results["single"]["cache_spec"] == []
  assert results["2x4"]["cache_spec"][:3] == ["data", None, "model"]
  # (JAX reports a split over the 1-device "model" axis as none.)
  assert "data" not in results["8x1"]["cache_spec"]
  per_run = results["single"]["compilations"]
  assert results["2x4"]["compilations"] == 2 * per_run
  assert results["8x1"]["compilations"] == 3 * per_run


def test_a_mesh_axis_that_does_not_divide_is_named(results):
  message = results["not_dividing"]  # 128 tokens over 3 devices.
  assert "'transformer/embedder.embeddings'" in message
  assert "'vocabulary' of size 128" in message and "3 devices" in message
  assert "rules={'vocabulary': None}" in message


@pytest.mark.parametrize("quantize", ["None", "int8"])
def test_load_places_each_tensor_on_its_shards(results, quantize):
  load = results["load"][quantize]
  assert load["count"] > 0 and load["same_labels"] and load["same_shardings"]
  assert load["split"] > 0  # Some weights are split, not all replicated.
  assert load["max_diff"] == 0.0


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_quantized_models_shard_and_generate_as_on_one_device(results, mesh):
  single, sharded = results["quantized"]["single"], results["quantized"][mesh]
  assert sharded["tokens"] == single["tokens"]
  assert _max_diff(sharded["logits"], single["logits"]) < 1e-5
  assert _max_diff(sharded["logprobs"], single["logprobs"]) < 1e-5
  # Outputs split like their leading axis, inputs (and their scale groups)
  # like theirs; the tied table's rows over the vocabulary.
  specs = sharded["specs"]
  assert specs["blocks/attention/query.qs"][:2] == [None, "model"]
  assert specs["blocks/attention/output.qs"] == [None, None, "model"]
  assert specs["blocks/attention/output.scale"] == [None, None, "model"]
  assert specs["blocks/mlp/out_linear.qs"] == [None, None, "model"]
  assert specs["embedder/decode.qs"] == ["model", None]


def test_quantized_splits_that_cannot_be_made_are_named(results):
  errors = results["quantized"]["errors"]
  assert "'transformer/blocks/attention/query.qs'" in errors["later_axis"]
  assert "splits only along 'head_groups', not 'projection'" in errors[
      "later_axis"]
  # The tied table's 64 embedding values are 2 blocks: not 4 devices' worth.
  assert "2 scale groups along 'embedding' do not divide over 4 devices" in (
      errors["groups"])


def test_load_names_a_quantized_split_it_cannot_make_early(results):
  error = results["load"]["q4_1_error"]
  assert "shard transformer/blocks/mlp/out_linear.weights:" in error["message"]
  assert "2 scale groups along 'neurons' do not divide over 4 devices" in (
      error["message"])
  # Raised before that weight was quantized, in the stack's first layer
  # (a layer stack is quantized one layer at a time: no label twice).
  assert "transformer/blocks/mlp/out_linear.weights" not in error["quantized"]
  assert len(set(error["quantized"])) == len(error["quantized"]) > 0


def test_load_checks_mesh_and_rules_before_reading(tmp_path):
  # Nothing is read: the path does not even have to hold a checkpoint.
  with pytest.raises(ValueError, match="rules= needs mesh="):
    penzai_lm.load_model(tmp_path, rules={"vocabulary": None})
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
    penzai_lm.load_model(tmp_path, mesh=("data", "model"))


# In-process: rules and validation on a mesh over the one CPU device.


@functools.cache
def _model(freeze=True):
  return penzai_lm.build_transformer(
      CONFIG.replace(use_layer_stack=False), seed=1, freeze=freeze)


def _mesh(names=("data", "model")):
  return jax.make_mesh((1,) * len(names), names,
                       devices=jax.devices()[:1])


def _specs(model) -> dict:
  return {p.label.split("/", 1)[1]: tuple(p.value.data_array.sharding.spec)
          for p in pz.select(model).at_instances_of(
              (pz.Parameter, pz.ParameterValue)).get_sequence()}


@pytest.mark.parametrize("freeze", [True, False])
def test_shard_places_every_parameter_by_its_axes(freeze):
  model = _model(freeze)
  sharded = penzai_lm.shard(model, _mesh())
  kind = pz.ParameterValue if freeze else pz.Parameter
  assert pz.select(sharded).at_instances_of(kind).count() == pz.select(
      model).at_instances_of(kind).count()
  specs = _specs(sharded)
  assert specs["embedder.embeddings"] == ("model", None)
  assert specs["block_0/attention/key.weights"] == (None, "model", None)
  assert specs["block_0/mlp/out_linear.weights"] == ("model", None)
  assert specs["lm_head.weights"] == (None, "model")
  assert specs["final_norm/scale.weights"] == (None,)
  # Explicit-axis meshes (jax.make_mesh's default) are used as Auto ones.
  def first(m):
    return pz.select(m).at_instances_of(kind).get_sequence()[
        0].value.data_array.sharding
  assert set(first(sharded).mesh.axis_types) == {
      jax.sharding.AxisType.Auto}
  assert isinstance(first(model), jax.sharding.SingleDeviceSharding)


def test_rules_are_typed_data_and_can_be_overridden():
  rules = sharding.DEFAULT_RULES
  assert rules.mesh_axes("head_groups") == ("model",)
  assert rules.mesh_axes("batch") == ("data",)
  assert rules.mesh_axes("embedding") == ()
  assert rules.override(vocabulary=None).mesh_axes("vocabulary") == ()
  assert hash(rules) == hash(sharding.ShardingRules.of(rules.as_dict()))
  specs = _specs(penzai_lm.shard(_model(), _mesh(), {"vocabulary": None}))
  assert specs["embedder.embeddings"] == (None, None)
  assert specs["block_0/mlp/out_linear.weights"] == ("model", None)
  only = sharding.ShardingRules.of({"neurons": "model"})  # Complete rules.
  specs = _specs(penzai_lm.shard(_model(), _mesh(), only))
  assert specs["embedder.embeddings"] == (None, None)
  # For loaders: one tensor at a time, axes in the data's order.
  placed = sharding.parameter_sharding(
      {"neurons": 64, "embedding": 32}, _mesh(), label="w")
  assert tuple(placed.spec) == ("model", None)
  # A mesh with only a "model" axis: tensor parallel, no data axis needed.
  assert _specs(penzai_lm.shard(_model(), _mesh(("model",))))[
      "embedder.embeddings"] == ("model", None)


@pytest.mark.parametrize("mesh, rules, error, message", [
    ("not a mesh", None, TypeError, "mesh must be a jax.sharding.Mesh"),
    (None, {"neurons": "tensor"}, ValueError,
     "names mesh axis 'tensor', but the mesh has axes"),
    (None, {"neuron": "model"}, ValueError,
     "axis 'neuron' \\(did you mean 'neurons'\\?\\), which the model does"),
    (None, {"neurons": 3}, TypeError, "rule for axis 'neurons' must be"),
    (None, ["neurons"], TypeError, "rules must be None, a mapping"),
    (None, {"head_groups": "model", "query_heads": "model"}, ValueError,
     "query.weights'.*would reuse mesh axes \\['model'\\]"),
    ("other", None, ValueError, "default sharding rules use mesh axes"),
])
def test_bad_meshes_and_rules_say_what_to_fix(mesh, rules, error, message):
  if mesh is None:
    mesh = _mesh()
  elif mesh == "other":
    mesh = _mesh(("x", "y"))
  with pytest.raises(error, match=message):
    penzai_lm.shard(_model(), mesh, rules)
