"""`attribute` on a mesh: 8 simulated CPU devices in one process, and two
processes joined by ``jax.distributed.initialize``, give the graph of one
device, with the target batches split over the ``data`` axis.

XLA simulates several CPU devices only when told before JAX starts, so the
mesh runs are subprocesses (`graph_arrays` in each); the one-device graph
is computed in the test's own process.
"""

import dataclasses
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import penzai_lm
from penzai_lm import circuits
from penzai_lm.circuits.placement import target_placement
from tests.circuits.test_attribute import PROMPT
from tests.circuits.test_attribute import _model
from tests.circuits.test_attribute import _transcoders
from tests.two_processes import REPOSITORY
from tests.two_processes import run_two_processes

# Heads (4), key/value heads (2) and neurons (48) divide by 2; the 97-token
# vocabulary does not, so it stays whole.
RULES = {"vocabulary": None}


def graph_arrays(shape=None) -> dict:
  """The graph's arrays (a capped graph: its re-ranking runs too) on one
  device (``shape`` None) or on a ``("data", "model")`` mesh of
  ``shape`` over `jax.devices()`, and how many ways each batch is
  split."""
  model = _model()
  if shape is not None:
    mesh = jax.make_mesh(tuple(shape), ("data", "model"))
    model = penzai_lm.shard(model, mesh, RULES)
  graph = circuits.attribute(model, list(_transcoders()), PROMPT,
                             batch_size=6, zero_positions=0,
                             max_feature_nodes=40, update_interval=1)
  placement = target_placement(model)
  out = {f.name: getattr(graph, f.name)
         for f in dataclasses.fields(graph)}
  out["ways"] = 1 if placement is None else placement.ways
  return out


@pytest.fixture(scope="module")
def one_device():
  return graph_arrays()


def _assert_same_graph(got: dict, want: dict) -> None:
  for name, value in want.items():
    if name == "ways":
      continue
    if np.asarray(value).dtype.kind in "iuU":  # Ints, labels: exact.
      np.testing.assert_array_equal(got[name], value, err_msg=name)
    else:
      np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5,
                                 err_msg=name)


def test_eight_devices_give_the_one_device_graph(one_device, tmp_path):
  code = (
      "import sys, numpy as np, tests.circuits.test_mesh as t\n"
      "for i, shape in enumerate([(8, 1), (4, 2)]):\n"
      "  np.savez(sys.argv[1] + f'/{i}.npz', **t.graph_arrays(shape))\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8")
  done = subprocess.run([sys.executable, "-c", code, str(tmp_path)],
                        env=env, cwd=REPOSITORY, capture_output=True,
                        text=True, timeout=600, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  for i, ways in enumerate((8, 4)):
    with np.load(tmp_path / f"{i}.npz", allow_pickle=False) as arrays:
      got = {name: arrays[name] for name in arrays.files}
    assert int(got["ways"]) == ways  # Batches of 6 padded to 8 (4 x 2).
    _assert_same_graph(got, one_device)


@pytest.mark.parametrize("shape", [[2, 1], [1, 2]])
def test_two_processes_give_the_one_device_graph(one_device, shape,
                                                 tmp_path):
  """``[2, 1]``: each process's device pulls back half of every batch;
  ``[1, 2]``: the weights are split across the processes."""
  for got in run_two_processes("tests.circuits.test_mesh:graph_arrays",
                               kwargs={"shape": shape},
                               devices_per_process=1, workdir=tmp_path,
                               timeout_s=300):
    assert int(got["ways"]) == shape[0]
    _assert_same_graph(got, one_device)
