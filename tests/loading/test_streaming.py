"""Streaming loads: same model as the eager path, host memory ~ the weights.

`penzai_lm.load` reads, converts and places one tensor at a time
(`penzai_lm.loading.parameters`). Checked here:

* bitwise the same parameters (labels, axes, dtypes, values) as the eager
  path it replaced (`read_checkpoint` in float32, every tensor cast and
  stacked with numpy: `_eager_model`), for every family, both layouts,
  float32 and bfloat16, from float32, bfloat16 and float16 safetensors and
  from quantized GGUF files;
* peak RSS (VmHWM) of a load, in a fresh process, of a generated
  1.1B-parameter bfloat16 Llama: within 1.3x of the checkpoint's bytes (as
  bfloat16) and of the float32 model's bytes (as float32);
* corrupt files fail through the loader with the readers' errors;
* the placement hook sees every finished parameter; the progress bar's
  decision.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import types

import jax
import ml_dtypes
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from penzai import pz
from safetensors.numpy import save_file

from penzai_lm.checkpoints import SPECS
from penzai_lm.checkpoints import expected_tensor_shapes
from penzai_lm.checkpoints import normalize_config
from penzai_lm.checkpoints import open_checkpoint
from penzai_lm.checkpoints import read_checkpoint
from penzai_lm.checkpoints import gguf_tensors
from penzai_lm.checkpoints.architectures import spec_for
from penzai_lm.checkpoints.checkpoint import to_dtype
from penzai_lm.checkpoints.tensor_io import aligned_empty
from penzai_lm.checkpoints.tensor_io import all_finite
from penzai_lm.checkpoints.tensor_io import copy_into
from penzai_lm.loading import config_from_checkpoint
from penzai_lm.loading import load_model
from penzai_lm.loading import parameters_from_checkpoint
from penzai_lm.loading.families import ADAPTERS
from penzai_lm.loading.families import adapter_for
from penzai_lm.loading.load import _load
from penzai_lm.loading.load import _resolve_dtype
from penzai_lm.loading.parameters import Taken
from penzai_lm.loading.parameters import place_on_default_device
from penzai_lm.loading.parameters import stream_parameters
from penzai_lm.loading.progress import progress_bar
from penzai_lm.loading.progress import show_progress
from penzai_lm.model import build_transformer
from tests.checkpoints.checkpoint_test_utils import write_gguf
from tests.checkpoints.test_corrupt_files import CASES
from tests.loading.synthetic_checkpoints import checkpoint_bytes
from tests.loading.synthetic_checkpoints import write_random_llama

_TINY = dict(
    vocab_size=101, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)
# One tiny config per family (several features for Llama, tied embeddings).
FAMILIES = {
    "llama": dict(_TINY, head_dim=12, attention_bias=True, mlp_bias=True),
    "llama_tied": dict(_TINY, num_key_value_heads=1, tie_word_embeddings=True),
    "mistral": dict(_TINY, sliding_window=5),
    "qwen2": dict(_TINY, tie_word_embeddings=False),
    "qwen3": dict(_TINY, head_dim=12, attention_bias=True),
    "phi3": dict(_TINY, sliding_window=6),
    "gemma2": dict(_TINY, head_dim=16, query_pre_attn_scalar=12),
    "gemma3": dict(
        _TINY, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=5, layer_types=["sliding_attention", "full_attention",
                                       "sliding_attention"],
    ),
    "gpt2": dict(vocab_size=101, n_embd=32, n_layer=3, n_head=4, n_positions=64,
                 tie_word_embeddings=False),
}
_STORED = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}


def _old_eager_parameters(checkpoint, config, name="transformer"):
  """The loader's parameters before streaming, verbatim: every tensor cast
  with numpy, blocks stacked with ``np.stack``, wrapped with ``pz.nx.wrap``."""
  adapter = adapter_for(checkpoint.architecture, ADAPTERS)
  t = checkpoint.tensors
  dtype = np.dtype(config.parameter_dtype)
  layers = [adapter.layer_tensors(config, t, i)
            for i in range(config.num_layers)]

  def make(label, data, axes):
    data = np.ascontiguousarray(np.asarray(data).astype(dtype))
    return pz.Parameter(value=pz.nx.wrap(data).tag(*axes),
                        label=f"{name}/{label}")

  params = [make(k, *v) for k, v in adapter.global_tensors(config, t).items()]
  if config.use_layer_stack:
    for key, (_, axes) in layers[0].items():
      stacked = np.stack([layer[key][0] for layer in layers])
      params.append(make(f"blocks/{key}", stacked, ("blocks", *axes)))
  else:
    for i, layer in enumerate(layers):
      params.extend(make(f"block_{i}/{k}", *v) for k, v in layer.items())
  return params


def _eager_model(path, dtype, stacked):
  """`load_model` as it was: read everything in float32, then convert."""
  checkpoint = read_checkpoint(path, dtype=np.float32)
  config = config_from_checkpoint(
      checkpoint, dtype=_resolve_dtype(dtype), use_layer_stack=stacked)
  model = build_transformer(config)
  model = pz.bind_variables(model, _old_eager_parameters(checkpoint, config))
  return pz.freeze_params(model)


def _assert_identical(got, want):
  """Same tree (labels, axes, config), same leaves' dtypes, shapes, bits."""
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  labels = lambda m: [p.label for p in pz.select(m).at_instances_of(
      pz.ParameterValue).get_sequence()]
  assert labels(got) == labels(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    a, b = np.asarray(a), np.asarray(b)
    assert (a.dtype, a.shape) == (b.dtype, b.shape)
    bits = np.dtype(f"u{a.dtype.itemsize}")
    np.testing.assert_array_equal(a.view(bits), b.view(bits))


def _write_family(path, family, stored, seed=0):
  arch = family.split("_")[0]
  spec = spec_for(arch)
  shapes = expected_tensor_shapes(arch, FAMILIES[family])
  rng = np.random.default_rng(seed)
  tensors = {
      n: (rng.standard_normal(s) * 0.3).astype(_STORED[stored])
      for n, s in shapes.items()
  }
  path.mkdir(parents=True, exist_ok=True)
  save_file(tensors, str(path / "model.safetensors"))
  (path / "config.json").write_text(json.dumps({
      "architectures": [spec.hf_class], "model_type": spec.model_type,
      **FAMILIES[family]}))
  return path


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("families")
  return {
      (f, s): _write_family(root / f"{f}-{s}", f, s)
      for f in FAMILIES for s in ("F32", "BF16")
  }


def test_every_family_is_covered():
  assert {f.split("_")[0] for f in FAMILIES} == {s.name for s in SPECS}


@pytest.mark.parametrize("stored", ["F32", "BF16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_streaming_equals_eager_hf(family_dirs, family, stored):
  path = family_dirs[family, stored]
  for dtype in ("float32", "bfloat16"):
    for stacked in (True, False):
      got = load_model(path, dtype=dtype, use_layer_stack=stacked)
      _assert_identical(got, _eager_model(path, dtype, stacked))


def test_float16_safetensors_stream_like_eager(tmp_path):
  path = _write_family(tmp_path / "gemma3", "gemma3", "F16")
  for dtype in ("float32", "bfloat16"):
    _assert_identical(load_model(path, dtype=dtype),
                      _eager_model(path, dtype, True))


def test_projections_keep_the_checkpoints_output_major_order(family_dirs):
  # Loading copies each projection as it lies: HF's (out, in) data, with
  # the output axes first (what the CPU kernels read fastest).
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  path = family_dirs["llama", "F32"]
  hf = load_file(str(path / "model.safetensors"))
  model = load_model(path, dtype="float32", use_layer_stack=False)
  weights = {p.label.split("/", 1)[1]: p.value for p in pz.select(model)
             .at_instances_of(pz.ParameterValue).get_sequence()}
  for label, name in (("attention/query", "self_attn.q_proj"),
                      ("attention/output", "self_attn.o_proj"),
                      ("mlp/gating_linear", "mlp.gate_proj"),
                      ("mlp/out_linear", "mlp.down_proj")):
    w = weights[f"block_1/{label}.weights"]
    want = hf[f"model.layers.1.{name}.weight"]
    np.testing.assert_array_equal(
        np.asarray(w.data_array).reshape(want.shape), want)
  assert list(weights["lm_head.weights"].named_axes) == [
      "vocabulary", "embedding"]


def test_public_parameters_from_checkpoint_is_unchanged(family_dirs):
  for family in ("gemma3", "phi3", "gpt2"):
    checkpoint = read_checkpoint(family_dirs[family, "F32"])
    for dtype in (np.float32, ml_dtypes.bfloat16):
      config = config_from_checkpoint(checkpoint, dtype=dtype)
      model = build_transformer(config)
      got = pz.bind_variables(model, parameters_from_checkpoint(
          checkpoint, config))
      want = pz.bind_variables(model, _old_eager_parameters(
          checkpoint, config))
      _assert_identical(pz.freeze_params(got), pz.freeze_params(want))


# ---- GGUF --------------------------------------------------------------

_GGUF_COMMON = dict(
    vocab_size=100, hidden_size=64, intermediate_size=96, num_attention_heads=4,
    max_position_embeddings=256, rope_theta=1e4, bos_token_id=1,
    eos_token_id=2,
)
GGUF_CONFIGS = {
    "llama": dict(_GGUF_COMMON, num_hidden_layers=2, num_key_value_heads=2,
                  head_dim=16, rms_norm_eps=1e-5),
    "gemma3": dict(_GGUF_COMMON, num_hidden_layers=3, num_key_value_heads=1,
                   head_dim=32, rms_norm_eps=1e-6, sliding_window=16),
}
_QTYPES = {"q_proj": Q.Q8_0, "k_proj": Q.Q4_0, "v_proj": Q.F16,
           "o_proj": Q.Q4_1, "gate_proj": Q.Q5_0, "up_proj": Q.Q5_1,
           "down_proj": Q.Q8_0, "embed_tokens": Q.Q4_0, "lm_head": Q.F16}


def _qtype(name, arr):
  if arr.ndim == 1:
    return Q.F32
  return next((q for k, q in _QTYPES.items() if k in name), Q.F32)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
  root = tmp_path_factory.mktemp("gguf")
  rng = np.random.default_rng(1)
  files = {}
  for arch, config in GGUF_CONFIGS.items():
    c = normalize_config(arch, config)
    sd = {n: rng.standard_normal(s).astype(np.float32) * 0.5
          for n, s in expected_tensor_shapes(arch, c).items()}
    sd.pop("lm_head.weight", None)  # tied, as the real small models are
    files[arch] = write_gguf(root / f"{arch}.gguf", arch, sd, config, _qtype)
  return files


@pytest.mark.parametrize("arch", sorted(GGUF_CONFIGS))
def test_streaming_equals_eager_gguf(gguf_files, arch):
  for dtype in ("float32", "bfloat16"):
    for stacked in (True, False):
      got = load_model(gguf_files[arch], dtype=dtype, use_layer_stack=stacked)
      _assert_identical(got, _eager_model(gguf_files[arch], dtype, stacked))


@pytest.mark.parametrize("arch", sorted(GGUF_CONFIGS))
def test_chunked_gguf_reads_equal_whole_tensor_dequantization(
    gguf_files, arch, monkeypatch
):
  """Reading in chunks of a few rows gives the old whole-tensor values."""
  monkeypatch.setattr(gguf_tensors, "_CHUNK_VALUES", 96)
  lazy = open_checkpoint(gguf_files[arch])
  by_name = {t.name: t for t in lazy.gguf_reader.tensors}
  spec = spec_for(arch)
  heads = lazy.config["num_attention_heads"]
  kv_heads = lazy.config["num_key_value_heads"]
  gguf_names = {gguf_tensors.hf_tensor_name(spec, g): g for g in by_name}
  for name in lazy.shapes:
    g = gguf_names[name]
    old = gguf_tensors.to_hf_values(
        spec, g, name, gguf_tensors.dequantize(by_name[g], lazy.source),
        heads, kv_heads)
    for dtype in (np.float32, ml_dtypes.bfloat16):
      got = lazy.read(name, dtype)
      want = to_dtype(old, np.dtype(dtype))
      assert got.dtype == want.dtype, name
      np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


# ---- Errors, the hook, the progress bar --------------------------------


@pytest.mark.parametrize("build,error,message", CASES,
                         ids=[c[0].__name__ for c in CASES])
def test_corrupt_files_fail_through_the_loader(tmp_path, build, error, message):
  path = build(tmp_path)
  with pytest.raises(error, match=message):
    load_model(path, dtype="bfloat16")


def test_placement_hook_sees_each_finished_parameter(family_dirs):
  seen = []

  def place(label, axes, array):
    seen.append((label, axes, array.dtype, array.flags.c_contiguous))
    return place_on_default_device(label, axes, array)

  model, _ = _load(family_dirs["llama", "BF16"], "bfloat16", True, SPECS,
                   ADAPTERS, with_tokenizer=False, freeze=True, place=place)
  params = {p.label: p for p in pz.select(model).at_instances_of(
      pz.ParameterValue).get_sequence()}
  assert sorted(s[0] for s in seen) == sorted(params)  # each once
  for label, axes, dtype, contiguous in seen:
    assert axes == tuple(params[label].value.named_axes), label
    assert dtype == np.dtype(ml_dtypes.bfloat16) and contiguous


@pytest.mark.parametrize("stack", [True, False])
def test_taken_parameters_come_one_layer_at_a_time(family_dirs, stack):
  """What ``load(..., quantize="int8")`` rests on: a taken weight is handed
  over layer by layer (no float stack is ever whole) and not kept."""
  path = family_dirs["llama", "BF16"]
  checkpoint = open_checkpoint(path)
  config = config_from_checkpoint(checkpoint, dtype="bfloat16",
                                  use_layer_stack=stack)
  taken = []
  params = stream_parameters(checkpoint, config, taken=Taken(
      wants=lambda label: label.endswith("mlp/out_linear.weights"),
      take=lambda label, axes, array: taken.append((label, axes, array))))
  assert len(taken) == config.num_layers
  for label, axes, array in taken:
    assert "blocks" not in axes and array.shape == tuple(
        config.hidden_size if a == "embedding" else config.mlp_hidden_size
        for a in axes), (label, axes, array.shape)
    assert array.dtype == np.dtype(ml_dtypes.bfloat16)
  want = {p.label: p for p in stream_parameters(checkpoint, config)}
  for p in params:
    if p.label.endswith("mlp/out_linear.weights"):
      assert isinstance(p.value.data_array, jax.ShapeDtypeStruct)
      assert p.value.named_shape == want[p.label].value.named_shape
    else:
      assert not isinstance(p.value.data_array, jax.ShapeDtypeStruct)
  # What was taken is what would have been kept.
  first = want[taken[0][0]].value
  if stack:
    first = first[{"blocks": 0}]
  np.testing.assert_array_equal(
      np.asarray(first.order_as(*taken[0][1]).data_array), taken[0][2])


def test_default_placement_aliases_aligned_buffers_on_cpu():
  """What the memory budget rests on (jax 0.10): ``device_put`` of a
  64-byte-aligned array aliases it on CPU, and `aligned_empty` gives one."""
  if jax.devices()[0].platform != "cpu":
    pytest.skip("CPU only")
  for shape in ((7,), (1024, 1024)):  # a numpy and a mapped allocation
    array = aligned_empty(shape, ml_dtypes.bfloat16)
    array[...] = 1
    placed = place_on_default_device("x", ("a",), array)
    assert placed.unsafe_buffer_pointer() == array.ctypes.data


def test_copy_into_equals_copyto():
  rng = np.random.default_rng(0)
  src = rng.standard_normal((300, 4, 5, 260)).astype(np.float32)
  for view in (src, src.T, np.moveaxis(src, -1, 0), src[:, 1, :, ::2].T):
    for dtype in (np.float32, ml_dtypes.bfloat16):
      want = np.empty(view.shape, dtype)
      np.copyto(want, view, casting="unsafe")
      got = np.empty(view.shape, dtype)
      copy_into(got, view)
      np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_all_finite_matches_isfinite():
  bits = np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16)
  for value in bits[::257]:
    array = np.ones(70_000, ml_dtypes.bfloat16)
    array[69_999] = value
    assert all_finite(array) == bool(np.isfinite(np.float32(value)))
  assert all_finite(np.ones((3, 0), np.float32))
  assert not all_finite(np.array([1.0, np.nan], np.float32))


def test_progress_bar_only_on_a_terminal_unless_asked():
  tty = types.SimpleNamespace(isatty=lambda: True)
  pipe = types.SimpleNamespace(isatty=lambda: False)
  assert show_progress(None, tty, {})
  assert not show_progress(None, pipe, {})
  assert not show_progress(None, object(), {})  # no isatty at all
  assert not show_progress(None, tty, {"PENZAI_LM_PROGRESS": "0"})
  assert show_progress(None, pipe, {"PENZAI_LM_PROGRESS": "1"})
  assert not show_progress(False, tty, {"PENZAI_LM_PROGRESS": "1"})
  assert show_progress(True, pipe, {"PENZAI_LM_PROGRESS": "0"})
  with progress_bar(10, "x", enabled=False) as bar:
    bar.update(10)
    assert bar.disable


def test_loads_with_the_progress_bar_forced_on(family_dirs, capsys):
  model = load_model(family_dirs["gpt2", "F32"], progress=True)
  assert model.config.num_layers == 3
  # A load shorter than DELAY_S prints nothing, even when forced on.
  assert "Loading" not in capsys.readouterr().err


# ---- Peak host memory of a 1.1B-parameter load --------------------------

# The child's peak RSS is VmHWM, its own address space's high-water mark.
# ``ru_maxrss`` is not used: the kernel carries the address space that
# ``exec`` replaces into it, and subprocess spawns with vfork, so a child of
# a 3 GB pytest process reports ru_maxrss = 2.96 GB before doing anything
# (VmHWM: 0.01 GB); after the real-model tests, this load reported 8.98 GB.
_MEASURE = textwrap.dedent("""
    import json, sys
    import jax, penzai_lm
    from penzai import pz
    model = penzai_lm.load_model(sys.argv[1], dtype=sys.argv[2])
    params = {p.label: p for p in pz.select(model).at_instances_of(
        pz.ParameterValue).get_sequence()}.values()  # tied: one entry
    jax.block_until_ready([p.value.data_array for p in params])
    with open("/proc/self/status") as f:
      peak = next(int(l.split()[1]) * 1024 for l in f
                  if l.startswith("VmHWM:"))
    print(json.dumps(dict(
        peak=peak, weights=sum(p.value.data_array.nbytes for p in params))))
""")


@pytest.fixture(scope="module")
def llama_1b(tmp_path_factory):
  path = write_random_llama(tmp_path_factory.mktemp("llama1b"), shards=2)
  yield path
  shutil.rmtree(path)  # 2.2 GB: not left for pytest's tmp_path retention


def _peak_load(path, dtype):
  out = subprocess.run(
      [sys.executable, "-c", _MEASURE, str(path), dtype], capture_output=True,
      text=True, check=False, env={**os.environ, "PENZAI_LM_PROGRESS": "0"},
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_bfloat16_load_peak_rss_is_near_the_checkpoint(llama_1b):
  size = checkpoint_bytes(llama_1b)
  assert size > 2.0e9  # ~1.1B bfloat16 parameters
  r = _peak_load(llama_1b, "bfloat16")
  assert r["weights"] == pytest.approx(size, rel=1e-3)
  assert r["peak"] < 1.3 * size, (r["peak"] / 1e9, size / 1e9)


def test_float32_load_of_bfloat16_peak_rss_is_near_the_model(llama_1b):
  r = _peak_load(llama_1b, "float32")
  assert r["weights"] == pytest.approx(2 * checkpoint_bytes(llama_1b), rel=1e-3)
  assert r["peak"] < 1.3 * r["weights"], (r["peak"] / 1e9, r["weights"] / 1e9)
