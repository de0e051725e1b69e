"""Programs kept on disk (`ProgramStore`): a new process reads them back
instead of tracing, gets the same tokens, and never a wrong program."""

import collections
import dataclasses
import enum
import hashlib
import json
import os
import pathlib
import pickle
import stat
import subprocess
import sys
import textwrap
import warnings

import jax
import numpy as np
import pytest
from penzai import pz
from penzai.nn import layer_stack

from penzai_lm import interp
from penzai_lm.generation import Engine
from penzai_lm.runtime import program_trees
from penzai_lm.runtime.program_keys import describe
from penzai_lm.runtime.program_keys import Unnamed
from penzai_lm.runtime.program_store import ProgramStore
from penzai_lm.runtime.program_store import UnsafeDirectory
from tests.generation.conftest import tiny_model
from tests.model.configs import config

PROMPTS = [[5, 6, 7], [9, 3, 4, 8, 1]]
OPTIONS = dict(max_new_tokens=6, temperature=0.7, top_k=20, seed=[1, 2],
               stop_tokens=[])
REPO = pathlib.Path(__file__).resolve().parents[2]


def _run(engine, model=None):
  result = engine.generate(model or tiny_model(), PROMPTS, **OPTIONS)
  return result.tokens, np.asarray(result.logprobs[0])


def test_new_engine_reads_programs_back_with_the_same_results(tmp_path):
  expected = _run(Engine(program_store=None))
  first = Engine(program_store=tmp_path)
  assert _run(first)[0] == expected[0]
  assert first.program_store().stats.saved == 2  # prefill and decode
  assert len(list(tmp_path.glob("*.pzlm-program"))) == 2

  second = Engine(program_store=tmp_path)
  tokens, logprobs = _run(second)
  stats = second.program_store().stats
  assert (stats.loaded, stats.saved) == (2, 0)
  assert second.compilations == 2
  assert tokens == expected[0]
  np.testing.assert_allclose(logprobs, expected[1], rtol=1e-6)


def test_a_new_process_reads_the_programs_back(tmp_path):
  """The key is the same in another process (no ids or addresses in it)."""
  script = textwrap.dedent(f"""
      import json
      from penzai_lm.generation import Engine
      from tests.generation.conftest import tiny_model
      engine = Engine(program_store={str(tmp_path)!r})
      r = engine.generate(tiny_model(), {PROMPTS!r}, **{OPTIONS!r})
      s = engine.program_store().stats
      print(json.dumps([s.loaded, s.saved, r.tokens]))
  """)
  runs = []
  for _ in range(2):
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO,
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    runs.append(out.stdout.strip().splitlines()[-1])
  import json  # pylint: disable=g-import-not-at-top
  (loaded1, saved1, tokens1), (loaded2, saved2, tokens2) = map(json.loads,
                                                               runs)
  assert (loaded1, saved1) == (0, 2)
  assert (loaded2, saved2) == (2, 0)
  assert tokens1 == tokens2 == _run(Engine(program_store=None))[0]


def test_a_changed_model_is_a_new_program(tmp_path):
  """A static change (a patch, another config) never reuses a program."""
  store = ProgramStore(tmp_path)
  _run(Engine(program_store=store))
  steer = interp.AddVector.build(np.ones(32, np.float32), 2.0)
  patched = interp.insert_at(tiny_model(), "blocks.1.resid_post", steer)
  engine = Engine(program_store=store)
  patched_tokens = _run(engine, patched)[0]
  assert store.stats.saved == 4 and store.stats.loaded == 0
  assert patched_tokens == _run(Engine(program_store=None), patched)[0]
  assert patched_tokens != _run(Engine(program_store=None))[0]


@pz.pytree_dataclass
class _Doubler(pz.nn.Layer):
  """A layer defined outside penzai and penzai_lm: its code is not pinned
  by any version, so its programs are never stored."""

  def __call__(self, x, **side_inputs):
    return x * 2


def test_unknown_code_is_traced_not_stored(tmp_path):
  store = ProgramStore(tmp_path)
  model = interp.insert_at(tiny_model(), "blocks.0.resid_post", _Doubler())
  tokens = _run(Engine(program_store=store), model)[0]
  assert store.stats.unnamed == 2 and store.stats.saved == 0
  assert not list(tmp_path.iterdir())
  assert tokens == _run(Engine(program_store=None), model)[0]


def _flip_a_bit(path):
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x10  # Inside the exported StableHLO.
  path.write_bytes(data)


def _truncate(path):
  path.write_bytes(path.read_bytes()[:path.stat().st_size // 3])


def _directory(path):
  path.unlink()
  path.mkdir()


# Each round damages the two programs (prefill, decode) of one run.
_DAMAGE_ROUNDS = [
    (_flip_a_bit, _truncate),
    (lambda path: path.write_bytes(b"not a program"),
     lambda path: path.write_bytes(b"")),
    (_directory, _flip_a_bit),
]


def test_a_damaged_stored_program_is_named_and_replaced(tmp_path):
  """A flipped bit once failed every later run ("Failed to deserialize
  StableHLO"), never replaced and not named. Now each damaged file is
  named in a warning, traced again and written over."""
  expected = _run(Engine(program_store=tmp_path))[0]
  files = sorted(tmp_path.glob("*.pzlm-program"))
  assert len(files) == 2
  for damage in _DAMAGE_ROUNDS:
    for path, damage_one in zip(files, damage):
      damage_one(path)
    engine = Engine(program_store=tmp_path)
    with pytest.warns(UserWarning, match="damaged stored program") as record:
      assert _run(engine)[0] == expected
    messages = " ".join(str(w.message) for w in record)
    assert all(str(path) in messages for path in files), messages
    stats = engine.program_store().stats
    assert (stats.damaged, stats.saved, stats.loaded) == (2, 2, 0)
  # Replaced: a new engine reads both back, without a warning.
  again = Engine(program_store=tmp_path)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert _run(again)[0] == expected
  assert (again.program_store().stats.loaded,
          again.program_store().stats.damaged) == (2, 0)


def test_auto_store_follows_the_jax_cache_dir(tmp_path):
  engine = Engine()
  previous = jax.config.jax_compilation_cache_dir
  try:
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    assert engine.program_store().directory == tmp_path / "penzai_lm_programs"
    jax.config.update("jax_compilation_cache_dir", None)
    assert engine.program_store() is None
  finally:
    jax.config.update("jax_compilation_cache_dir", previous)


def test_bad_store_argument():
  with pytest.raises(TypeError, match="program_store must be"):
    Engine(program_store=3)
  with pytest.raises(ValueError, match="needs a directory"):
    Engine(program_store="")


def test_describe_tells_values_apart():
  assert describe(0.1) != describe(float(np.nextafter(0.1, 1.0)))
  assert describe(1) != describe(True) != describe(1.0)
  assert describe(1.0) != describe(np.float64(1.0))  # weak vs strong type
  assert describe((1, 2)) != describe([1, 2])
  cfg = config("llama_gqa")
  assert describe(cfg) == describe(dataclasses.replace(cfg))
  assert describe(cfg) != describe(dataclasses.replace(cfg, norm_eps=1e-6))
  assert describe(np.float32(1)) != describe(np.float64(1))
  assert describe(jax.nn.silu) != describe(jax.nn.gelu)
  assert describe(jax.tree_util.tree_structure({"a": 1, "b": (2, 3)})) != (
      describe(jax.tree_util.tree_structure({"a": (1, 2), "b": 3})))


@pytest.mark.parametrize("value", [
    lambda x: x,                       # no importable name
    np.zeros(3),                       # data baked into a program
    _Doubler,                          # a class outside the known packages
    object(),
])
def test_describe_refuses_what_it_cannot_name(value):
  with pytest.raises(Unnamed):
    describe(value)


def test_programs_are_exported_for_the_platform_jax_lowers_for():
  """A GPU device says platform "gpu", but jax.export lowers for "cuda" or
  "rocm": exported for "gpu", every stored program failed to load on an
  H200. (Checked on a GPU in docs/gpu.md; here on stand-in devices.)"""
  # pylint: disable-next=g-import-not-at-top
  from penzai_lm.runtime.program_store import _lowering_platform

  def device(platform, version=""):
    client = type("Client", (), {"platform_version": version})()
    return type("Device", (), {"platform": platform, "client": client})()

  assert _lowering_platform(device("gpu", "CUDA 12.8")) == "cuda"
  assert _lowering_platform(device("gpu", "rocm 6.2")) == "rocm"
  assert _lowering_platform(device("tpu")) == "tpu"
  cpu = jax.devices("cpu")[0]
  assert _lowering_platform(cpu) == "cpu"
  assert _lowering_platform(cpu) in jax.export.export(
      jax.jit(lambda x: x + 1), platforms=[_lowering_platform(cpu)])(
          np.float32(1)).platforms


class _Marker:
  """Unpickled, creates a file: a stand-in for code a pickle runs."""

  def __init__(self, path):
    self.path = path

  def __reduce__(self):
    return (open, (str(self.path), "w"))


def _header(fmt: int, payload: bytes) -> bytes:
  return b"PZLM-PROGRAM %d %d %s\n" % (
      fmt, len(payload), hashlib.sha256(payload).hexdigest().encode())


def test_a_pickle_is_never_unpickled(tmp_path):
  """Format 2 files were pickles, which run code when read. A pickle in a
  store file, under the old header or the current one with a matching
  hash, is discarded as damaged and never unpickled."""
  store_dir = tmp_path / "programs"
  expected = _run(Engine(program_store=store_dir))[0]
  files = sorted(store_dir.glob("*.pzlm-program"))
  assert len(files) == 2
  live = tmp_path / "live"
  pickle.loads(pickle.dumps(_Marker(live))).close()
  assert live.exists()  # The payload below does run code if unpickled.
  marker = tmp_path / "marker"
  payload = pickle.dumps(_Marker(marker))
  files[0].write_bytes(_header(2, payload) + payload)
  files[1].write_bytes(_header(3, payload) + payload)
  engine = Engine(program_store=store_dir)
  with pytest.warns(UserWarning, match="damaged stored program") as record:
    assert _run(engine)[0] == expected
  messages = " ".join(str(w.message) for w in record)
  assert "its format is b'2', expected 3" in messages
  assert "does not deserialize" in messages
  assert engine.program_store().stats.damaged == 2
  assert not marker.exists()


def test_output_structures_round_trip_through_json():
  named = pz.nx.wrap(np.zeros((2, 3))).tag("x", "y")
  trees = [
      {"a": (1, None), "b": [named], "c": collections.OrderedDict(z=1)},
      named.untag("x"),  # A NamedArrayView.
      (),
      PROMPTS,
      np.linalg.svd(np.eye(2)),  # A namedtuple.
  ]
  for tree in trees:
    treedef = jax.tree_util.tree_structure(tree)
    text = json.dumps(program_trees.encode_tree(treedef))
    assert "\n" not in text
    assert program_trees.decode_tree(json.loads(text)) == treedef
  metadata = [None, True, 1, -0.0, 0.1, float("nan"), "s", (1, [2]),
              {"b": 1, 2: "a"}, collections.OrderedDict(z=(), a=None),
              np.dtype("bfloat16"), jax.numpy.float32, pz.nx.NamedArray,
              enum.Enum, list(layer_stack.LayerStackVarBehavior)[-1]]
  decoded = program_trees._decode_value(
      json.loads(json.dumps(program_trees._encode_value(metadata))))
  assert describe(decoded) == describe(metadata)
  for unknown in (_Doubler, 1j, np.float32(1), {1, 2}, b"bytes", object()):
    with pytest.raises(Unnamed):
      program_trees._encode_value(unknown)


@pytest.mark.parametrize("data", [
    ["posix:system", None, []],                    # not a known package
    ["builtins:eval", None, ["*"]],                # not a type
    ["builtins:type", None, ["*"]],                # not a pytree node
    ["builtins:tuple", None, ["*", "*", {}]],       # not a tree
    ["builtins:dict", {"list": ["a"]}, ["*", "*"]],  # metadata that misfits
    ["builtins:tuple", {"metadata": ["builtins:open", []]}, []],
    ["builtins:tuple", {"type": "jax.experimental.jax2tf:Something"}, []],
    ["builtins:tuple", {"type": "builtins:object.__subclasses__"}, []],
])
def test_decoding_refuses_what_it_never_writes(data):
  """Only types of loaded modules of known packages are named; nothing is
  imported or called."""
  with pytest.raises(ValueError):
    program_trees.decode_tree(data)
  assert "jax.experimental.jax2tf" not in sys.modules


def _plus(static, x):
  return x + static


def _lower(store, key):
  return store.lower(key, _plus, 1.0, (np.zeros(4, np.float32),), ())


def test_least_recently_used_programs_are_evicted(tmp_path):
  keys = [c * 64 for c in "abc"]
  paths = [tmp_path / f"{key}.pzlm-program" for key in keys]
  store = ProgramStore(tmp_path)
  _lower(store, keys[0])
  _lower(store, keys[1])
  size = paths[0].stat().st_size
  assert paths[1].stat().st_size == size
  os.utime(paths[0], (1000, 1000))  # The older one ...
  os.utime(paths[1], (2000, 2000))
  stale = tmp_path / f".{keys[2]}.x.tmp"  # Left by a killed writer.
  stale.write_bytes(b"partial")
  os.utime(stale, (1000, 1000))

  store = ProgramStore(tmp_path, max_bytes=2 * size + size // 2)
  program = _lower(store, keys[0])  # ... is loaded: now the newer one.
  assert store.stats.loaded == 1
  assert paths[0].stat().st_mtime > paths[1].stat().st_mtime
  np.testing.assert_array_equal(
      program.compile()(np.ones(4, np.float32)), np.full(4, 2.0))
  _lower(store, keys[2])
  assert (store.stats.saved, store.stats.evicted) == (1, 1)
  assert sorted(tmp_path.iterdir()) == [paths[0], paths[2]]
  assert sum(p.stat().st_size for p in paths if p.exists()) <= (
      store.max_bytes)


def test_the_program_just_written_is_kept(tmp_path):
  """A bound below one program's size keeps the newest program alone."""
  store = ProgramStore(tmp_path, max_bytes=1)
  for key in ("d" * 64, "e" * 64):
    _lower(store, key)
  assert [p.name for p in tmp_path.iterdir()] == ["e" * 64 + ".pzlm-program"]
  assert (store.stats.saved, store.stats.evicted) == (2, 1)


@pytest.mark.parametrize("max_bytes", [0, -1, 1.5, True, "1G", None])
def test_bad_max_bytes(tmp_path, max_bytes):
  with pytest.raises(ValueError, match="max_bytes must be a positive"):
    ProgramStore(tmp_path, max_bytes=max_bytes)


def test_the_directory_is_made_private(tmp_path):
  store_dir = tmp_path / "new" / "programs"
  store = ProgramStore(store_dir)
  _lower(store, "f" * 64)
  assert stat.S_IMODE(store_dir.stat().st_mode) == 0o700
  (path,) = store_dir.iterdir()
  assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o1777])
def test_a_directory_others_can_write_is_refused(tmp_path, mode):
  shared = tmp_path / "shared"
  shared.mkdir()
  shared.chmod(mode)
  with pytest.raises(UnsafeDirectory, match="chmod 700") as error:
    ProgramStore(shared)
  assert str(shared) in str(error.value)
  with pytest.raises(UnsafeDirectory, match="writable by"):
    Engine(program_store=shared)
  # One made unsafe after the store was made is refused when used.
  shared.chmod(0o700)
  store = ProgramStore(shared)
  shared.chmod(mode)
  with pytest.raises(UnsafeDirectory):
    _lower(store, "a" * 64)
  assert not list(shared.iterdir())


def test_a_directory_of_another_user_is_refused(tmp_path, monkeypatch):
  store = ProgramStore(tmp_path)
  monkeypatch.setattr(os, "getuid", lambda: tmp_path.stat().st_uid + 1)
  with pytest.raises(UnsafeDirectory, match="owned by user id"):
    ProgramStore(tmp_path)
  with pytest.raises(UnsafeDirectory, match="choose another directory"):
    _lower(store, "a" * 64)


def test_a_file_is_not_a_store_directory(tmp_path):
  path = tmp_path / "file"
  path.write_text("")
  with pytest.raises(UnsafeDirectory, match="not a directory"):
    ProgramStore(path)


def _defaultdict_of(static, x):
  return collections.defaultdict(list, y=x + static)


def test_an_output_structure_json_cannot_hold_is_served_not_written(
    tmp_path):
  store = ProgramStore(tmp_path)
  with pytest.warns(UserWarning, match="could not be written"):
    lowered = store.lower("a" * 64, _defaultdict_of, 1.0,
                          (np.zeros(4, np.float32),), ())
  out = lowered.compile()(np.zeros(4, np.float32))
  np.testing.assert_array_equal(out["y"], np.ones(4))
  assert store.stats.saved == 0
  assert not list(tmp_path.iterdir())
