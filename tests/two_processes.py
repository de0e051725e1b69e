"""Two JAX processes on this machine joined by `jax.distributed.initialize`.

The multi-host recipe (README: "On several hosts ...") run on one machine:
two Python processes, each with ``devices_per_process`` CPU devices, join
one JAX runtime through a coordinator on a free localhost port, with CPU
collectives over Gloo. ``jax.devices()`` is then global (both processes'
devices; ``jax.local_devices()`` are each one's own), and a mesh over it
spans both processes, as it spans hosts on a real cluster.

A check is a module-level function named by ``"module:function"`` (the
module importable from the repository root). Each process calls it with
the given keyword arguments (JSON values) and it returns a flat ``dict``
of results: numpy arrays (and JAX arrays, gathered to the host with
`host_array` first) come back through an ``.npz`` file, everything else
through JSON; nothing is pickled. `run_two_processes` returns the two
processes' dicts, in process order::

    def my_check(seed: int) -> dict:          # In an importable module.
      mesh = jax.make_mesh((2, 2), ("data", "model"))   # Global devices.
      ...
      return {"tokens": result.tokens, "logits": host_array(logits)}

    first, second = run_two_processes("tests.my_tests:my_check",
                                      kwargs={"seed": 0})

A process that fails, or both running past ``timeout_s`` (a collective that
waits for a peer that died hangs), ends the run: the survivor is killed and
the error carries both processes' exit codes and the tails of their output.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import importlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Mapping

import jax
from jax.experimental import multihost_utils
import numpy as np

REPOSITORY = pathlib.Path(__file__).resolve().parent.parent
NUM_PROCESSES = 2
_TAIL = 4000  # Characters of each process's output in an error.


@dataclasses.dataclass(frozen=True)
class _Process:
  """One started process: its handle and where its output goes."""

  index: int
  popen: subprocess.Popen
  log: pathlib.Path

  def tail(self) -> str:
    text = self.log.read_text(errors="replace") if self.log.exists() else ""
    return text[-_TAIL:]


def host_array(x) -> np.ndarray:
  """``x`` as a numpy array on this host, also when it is a global array
  with shards on the other process (gathered over the processes; every
  process must call this for the same arrays, in the same order)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _check_spec(function: str) -> None:
  module, _, name = function.partition(":")
  if not module or not name.isidentifier():
    raise ValueError(
        f"function must be 'module:function' (e.g."
        f" 'tests.test_two_processes:mesh_checks'), got {function!r}.")


def _environment(devices_per_process: int) -> dict[str, str]:
  """The parent's environment (its compilation cache included), on CPU,
  without a simulated device count of its own (the worker sets it)."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if "xla_force_host_platform_device_count" not in f]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags),
             JAX_NUM_CPU_DEVICES=str(devices_per_process))
  env["PYTHONPATH"] = os.pathsep.join(
      [str(REPOSITORY)] + [p for p in env.get("PYTHONPATH", "").split(
          os.pathsep) if p])
  return env


def _start(function, kwargs, devices_per_process, out: pathlib.Path,
           timeout_s: float) -> list[_Process]:
  port = _free_port()
  processes = []
  for index in range(NUM_PROCESSES):
    log = out / f"process_{index}.log"
    command = [sys.executable, "-m", "tests.two_processes", function,
               json.dumps(dict(kwargs)), str(out), str(index), str(port),
               str(int(timeout_s))]
    with open(log, "wb") as sink:
      popen = subprocess.Popen(
          command, cwd=REPOSITORY, env=_environment(devices_per_process),
          stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT)
    processes.append(_Process(index, popen, log))
  return processes


def _wait(processes: list[_Process], timeout_s: float, grace_s: float
          ) -> str | None:
  """Waits for both; None if both succeeded, else why not (the survivors
  are killed ``grace_s`` after the first failure, or at the timeout)."""
  deadline, failed_at, problem = time.monotonic() + timeout_s, None, None
  while any(p.popen.poll() is None for p in processes):
    now = time.monotonic()
    bad = [p for p in processes if p.popen.poll() not in (None, 0)]
    if bad and failed_at is None:
      failed_at = now
      problem = f"process {bad[0].index} failed"
    if now > deadline or (failed_at is not None and now > failed_at + grace_s):
      problem = problem or f"timed out after {timeout_s:.0f} s"
      for p in processes:
        if p.popen.poll() is None:
          p.popen.kill()
          p.popen.wait()
      break
    time.sleep(0.05)
  if problem is None and any(p.popen.returncode for p in processes):
    problem = "a process failed"
  return problem


def _read(out: pathlib.Path, index: int) -> dict[str, Any]:
  values = json.loads((out / f"result_{index}.json").read_text())
  with np.load(out / f"result_{index}.npz", allow_pickle=False) as arrays:
    values.update({name: arrays[name] for name in arrays.files})
  return values


def run_two_processes(function: str, *, kwargs: Mapping[str, Any] = (),
                      devices_per_process: int = 2, timeout_s: float = 120.0,
                      grace_s: float = 10.0,
                      workdir: str | os.PathLike[str] | None = None
                      ) -> list[dict[str, Any]]:
  """Runs ``function`` in two processes joined into one JAX runtime.

  Args:
    function: ``"module:function"``; the module importable from the
      repository root, the function taking ``kwargs`` and returning a flat
      ``dict`` of JSON values and numpy / JAX arrays (see `host_array`).
    kwargs: Keyword arguments for it (JSON values).
    devices_per_process: CPU devices of each process (``jax.devices()``
      then has twice as many).
    timeout_s: For the whole run (start, initialization, the function).
    grace_s: How long the other process may still run once one failed
      (it usually waits in a collective for the failed one: a hang).
    workdir: Where the logs and results go (a fresh temporary directory
      if None; pytest's ``tmp_path`` keeps them for a failed test).

  Returns:
    Each process's results, in process order.

  Raises:
    ValueError: for a malformed ``function``.
    RuntimeError: if a process fails or the run times out, with each
      process's exit code and the end of its output.
  """
  _check_spec(function)
  if devices_per_process < 1:
    raise ValueError(
        f"devices_per_process must be at least 1, got {devices_per_process}.")
  json.dumps(dict(kwargs))  # Raises for a value JSON cannot carry.
  if workdir is None:
    workdir = tempfile.mkdtemp(prefix="two_processes_")
  out = pathlib.Path(workdir)
  out.mkdir(parents=True, exist_ok=True)
  processes = _start(function, kwargs, devices_per_process, out, timeout_s)
  try:
    problem = _wait(processes, timeout_s, grace_s)
  finally:  # Also when this process is interrupted: no orphans.
    for p in processes:
      if p.popen.poll() is None:
        p.popen.kill()
        p.popen.wait()
  if problem is not None:
    raise RuntimeError(f"{function} in two processes: {problem}.\n" + "\n".join(
        f"--- process {p.index} (exit code {p.popen.returncode}):\n{p.tail()}"
        for p in processes))
  return [_read(out, p.index) for p in processes]


def _write(out: pathlib.Path, index: int, results: dict) -> None:
  if not isinstance(results, dict):
    raise TypeError(f"the function must return a dict, got"
                    f" {type(results).__name__}.")
  arrays = {k: host_array(v) for k, v in results.items()
            if isinstance(v, (np.ndarray, jax.Array))}
  plain = {k: v for k, v in results.items() if k not in arrays}
  (out / f"result_{index}.json").write_text(json.dumps(plain))
  np.savez(out / f"result_{index}.npz", **arrays)


def _worker(function: str, kwargs: str, out: str, index: str, port: str,
            timeout_s: str) -> None:
  """One process: joins the runtime, runs the function, writes results.
  Shortly before the parent's timeout, every thread's stack goes to the
  output (where a hung process waits)."""
  faulthandler.dump_traceback_later(max(1, int(timeout_s) - 5))
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{port}", num_processes=NUM_PROCESSES,
      process_id=int(index), initialization_timeout=int(timeout_s))
  module, _, name = function.partition(":")
  try:
    run: Callable[..., dict] = getattr(importlib.import_module(module), name)
    _write(pathlib.Path(out), int(index), run(**json.loads(kwargs)))
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    sys.stderr.flush()
    # Not sys.exit: JAX's exit handler would wait (minutes) in the shutdown
    # barrier for the other process, which is still running.
    os._exit(1)  # pylint: disable=protected-access
  jax.distributed.shutdown()  # A barrier: neither leaves the other waiting.


if __name__ == "__main__":
  _worker(*sys.argv[1:])
