"""Several hosts, simulated: two processes joined by
`jax.distributed.initialize` generate the same tokens as one process.

`tests.two_processes` starts two processes with one CPU device each (2
global devices, CPU collectives over Gloo). Each runs `mesh_checks` on
meshes of the global ``jax.devices()``: ``"data"`` across the processes
(each holds half the batch: its KV cache, steering vectors and capture
buffers), the model read from a checkpoint straight to its shards by
`penzai_lm.load_model(path, mesh=)`, generating with per-row steering, a
head ablation and a capture; and ``"model"`` across them (each holds half
of every split weight), the model placed by `penzai_lm.shard`, generating
plainly. This process runs both on one device. One engine per process,
compiled with XLA's cheaper options (the same everywhere: partitioning is
what is tested). Also: a failing process ends the run with both outputs,
and (slow) the README's mesh block with the default model in two processes
of 3 devices each (a 2x3 mesh) gives the text one process gives.
"""

import jax
from jax.experimental import multihost_utils
import numpy as np
import pytest
from penzai import pz

import penzai_lm
from penzai_lm import interp
from tests.loading.synthetic_checkpoints import write_random_llama
from tests.two_processes import run_two_processes

CHECKPOINT = dict(vocab_size=128, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=8,
                  num_key_value_heads=4)  # Heads, neurons, vocabulary: / 4.
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
GREEDY = dict(temperature=0.0, stop_tokens=[], max_new_tokens=6)
CAPTURE = "blocks.0.mlp.neurons"
# name: (("data", "model") mesh shape over the global jax.devices(), one a
# process; how the model gets there; what is generated).
MESHES = {
    # Each process holds half the batch: its KV cache, its rows of the
    # steering vectors and of the capture buffers.
    "data_across": ((2, 1), "load", "patched"),
    # Each process holds half of every split weight.
    "model_across": ((1, 2), "shard", "plain"),
}


def _fast_compile(program, shape):
  del program, shape
  return {"xla_backend_optimization_level": 0,
          "xla_llvm_disable_expensive_passes": True}


def _plain(model, engine) -> dict:
  result = engine.generate(model, PROMPTS, **GREEDY)
  return dict(tokens=np.asarray(result.tokens),
              logprobs=np.asarray(result.logprobs))


def _patched(model, engine) -> dict:
  """Per-row steering and head ablation, and a capture (its rows one after
  the other along ``seq``)."""
  patched = interp.insert_at(
      model, "blocks.0.resid_post",
      interp.AddVector.build(np.linspace(-1, 1, 32), strength=[0.0, 4.0]))
  patched = interp.insert_at(
      patched, "blocks.0.attn.head_out",
      interp.Ablate.heads(model.config, [[0], [5, 6]]))
  result = engine.generate(patched, PROMPTS, capture=[CAPTURE], **GREEDY)
  return dict(
      tokens=np.asarray(result.tokens), logprobs=np.asarray(result.logprobs),
      capture=np.concatenate([np.asarray(row.unwrap("seq", "neurons"))
                              for row in result.captures[CAPTURE]]))


_RUNS = {"plain": _plain, "patched": _patched}


def _split_over_processes(model) -> int:
  """How many of the model's weights this process holds only part of."""
  def distinct(indices) -> int:
    return len({tuple((i.start, i.stop) for i in index)
                for index in indices.values()})
  count = 0
  for p in pz.select(model).at_instances_of(pz.ParameterValue).get_sequence():
    x = p.value.data_array
    count += (distinct(x.sharding.addressable_devices_indices_map(x.shape))
              < distinct(x.sharding.devices_indices_map(x.shape)))
  return count


def mesh_checks(checkpoint: str, meshes: list[str]) -> dict:
  """For each named mesh, its run's greedy tokens, log-probs (and capture)
  and the count of weights split over the processes, keys prefixed
  ``"<mesh>/"``; ``"none"``: both runs on one device. Also ``processes``
  and ``devices`` as this process sees them."""
  engine = penzai_lm.Engine(compiler_options=_fast_compile)
  out = dict(processes=jax.process_count(), devices=len(jax.devices()))
  for name in meshes:
    if name == "none":
      model, runs = penzai_lm.load_model(checkpoint), sorted(_RUNS)
    else:
      shape, placement, run = MESHES[name]
      mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(shape),
                               ("data", "model"))
      model = (penzai_lm.load_model(checkpoint, mesh=mesh)
               if placement == "load"
               else penzai_lm.shard(penzai_lm.load_model(checkpoint), mesh))
      runs = [run]
    out[f"{name}/split"] = _split_over_processes(model)
    for run in runs:
      out.update({f"{name}/{run}/{k}": v
                  for k, v in _RUNS[run](model, engine).items()})
  return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("two_processes")
  checkpoint = str(write_random_llama(tmp / "checkpoint", CHECKPOINT,
                                      kind="F32", shards=1))
  one = mesh_checks(checkpoint, ["none"])
  two = run_two_processes(
      "tests.test_two_processes:mesh_checks",
      kwargs=dict(checkpoint=checkpoint, meshes=sorted(MESHES)),
      devices_per_process=1, timeout_s=300, workdir=tmp / "runs")
  return one, two


def test_the_processes_share_one_runtime(results):
  one, two = results
  assert one["processes"] == 1 and one["none/split"] == 0
  for process in two:
    assert process["processes"] == 2 and process["devices"] == 2
    # "data" across: each process holds whole weights (half the batch);
    # "model" across: the split weights are split between the processes.
    assert process["data_across/split"] == 0
    assert process["model_across/split"] > 0


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_two_processes_generate_what_one_process_does(results, mesh):
  one, two = results
  run = MESHES[mesh][2]
  for process in two:
    for key, expected in one.items():
      if key.startswith(f"none/{run}/"):
        got = process[key.replace("none", mesh, 1)]
        if key.endswith("tokens"):
          np.testing.assert_array_equal(got, expected, err_msg=key)
        else:
          np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4,
                                     err_msg=key)
  # The patches act per row: the patched run differs from the plain one.
  assert not np.array_equal(one["none/plain/tokens"],
                            one["none/patched/tokens"])


def fail_in_process_one() -> dict:
  """Process 1 raises; process 0 waits for it in a collective (a hang)."""
  if jax.process_index() == 1:
    raise ValueError("process 1 fails on purpose")
  multihost_utils.sync_global_devices("waits for process 1")
  return {}


def test_a_failing_process_ends_the_run_with_both_outputs(tmp_path):
  with pytest.raises(RuntimeError) as error:
    run_two_processes("tests.test_two_processes:fail_in_process_one",
                      devices_per_process=1, timeout_s=120, grace_s=2.0,
                      workdir=tmp_path)
  message = str(error.value)
  assert "fail_in_process_one in two processes: process 1 failed" in message
  assert "ValueError: process 1 fails on purpose" in message
  assert "--- process 0 (exit code" in message  # Killed, not waited for.


def readme_recipe(sharded: bool) -> dict:
  """The README's mesh block (the default model over a 2x3 mesh of every
  process's devices, greedy text), or the same without a mesh; compiled
  with XLA's cheaper options."""
  mesh = jax.make_mesh((2, 3), ("data", "model")) if sharded else None
  model, tokenizer = penzai_lm.load(mesh=mesh)
  result = penzai_lm.generate_text(
      model, tokenizer, ["Paris is", "Rome is"], max_new_tokens=8,
      temperature=0.0, engine=penzai_lm.Engine(compiler_options=_fast_compile))
  return dict(texts=result.texts, tokens=result.tokens)


@pytest.mark.slow
def test_readme_recipe_on_two_processes_gives_one_process_text(tmp_path):
  # Each process: 3 CPU devices, SmolLM2 (float32 from its Q4_1 GGUF) read
  # straight to its shards; "data" spans the processes.
  two = run_two_processes("tests.test_two_processes:readme_recipe",
                          kwargs=dict(sharded=True), devices_per_process=3,
                          timeout_s=540, workdir=tmp_path)
  one = readme_recipe(sharded=False)
  for process in two:
    assert process["tokens"] == one["tokens"]
    assert process["texts"] == one["texts"]
  assert all(len(row) == 8 for row in one["tokens"])
