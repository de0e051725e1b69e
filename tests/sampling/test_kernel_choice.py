"""Which settings the CPU sampling kernel implements, and what
``sample_next(kernel=True)`` does when one is missing.

Settings are traced values, so the choice between the kernel and the JAX
sampler is static: it comes from `FIELDS` (each `SamplingField`'s
``kernel``). The kernel's per-row parameters are parsed here from
``sampler.cc``'s source (no compiler needed) and compared with the table.
"""

import dataclasses
import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from penzai_lm.kernels import ops
from penzai_lm.sampling import FIELDS
from penzai_lm.sampling import SamplingSettings
from penzai_lm.sampling import init_sampler_state
from penzai_lm.sampling import sample_next
from penzai_lm.sampling.sample import uses_kernel
from penzai_lm.sampling.settings import KERNEL_BUFFERS
from penzai_lm.sampling.settings import KERNEL_PARAMS
from penzai_lm.sampling.settings import kernel_implements_all
from penzai_lm.sampling.settings import kernel_params

_SAMPLER_CC = pathlib.Path(ops.__file__).with_name("sampler.cc")


def _source_params() -> tuple[str, ...]:
  """The names in sampler.cc's PZLM_SAMPLE_PARAMS X-macro, in order."""
  source = _SAMPLER_CC.read_text()
  block = re.search(r"#define PZLM_SAMPLE_PARAMS\(X\)(.*?)\n\n", source,
                    re.S)
  assert block, "sampler.cc defines no PZLM_SAMPLE_PARAMS list"
  return tuple(re.findall(r'X\(k\w+,\s*"(\w+)"\)', block.group(1)))


def test_the_kernels_parameters_are_the_tables_kernel_settings():
  assert _source_params() == KERNEL_PARAMS
  assert KERNEL_PARAMS == kernel_params(FIELDS)
  by_name = {f.name: f for f in FIELDS}
  for name in KERNEL_PARAMS:  # One float32 column per row each.
    assert by_name[name].kind in ("float", "int"), name
  for name in KERNEL_BUFFERS:  # Passed in buffers of their own.
    assert by_name[name].kernel, name


def test_every_field_is_implemented_by_the_kernel_today():
  missing = [f.name for f in FIELDS if not f.kernel]
  assert not missing and kernel_implements_all()
  assert uses_kernel(True) and not uses_kernel(False)


def _without_kernel(name):
  return tuple(dataclasses.replace(f, kernel=False) if f.name == name else f
               for f in FIELDS)


@pytest.mark.parametrize("name", ["xtc_threshold", "top_k", "min_p"])
def test_a_field_the_kernel_lacks_makes_the_cpu_path_use_jax(name):
  table = _without_kernel(name)
  assert not kernel_implements_all(table)
  assert not uses_kernel(True, table)
  assert name not in kernel_params(table)
  # A new setting appended without kernel support.
  extra = (*FIELDS, dataclasses.replace(FIELDS[-1], name="new_control",
                                        kernel=False))
  assert not uses_kernel(True, extra)
  assert "new_control" not in kernel_params(extra)


@pytest.mark.skipif(not ops.available(),
                    reason="no C++ compiler for the kernels")
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU lowering")
@pytest.mark.parametrize("kernel", [False, True])
def test_sample_next_calls_the_kernel_exactly_when_uses_kernel_says(kernel):
  batch, vocab = 2, 64
  hlo = jax.jit(sample_next, static_argnames="kernel").lower(
      jnp.zeros((batch, vocab)), SamplingSettings.make(batch, vocab),
      init_sampler_state(jnp.zeros((batch, 1), jnp.int32), vocab_size=vocab),
      0, kernel=kernel).as_text()
  assert ("pzlm_sample" in hlo) == uses_kernel(kernel)


@pytest.mark.skipif(not ops.available(), reason="no C++ compiler for the kernels")
def test_greedy_rows_beside_sampled_ones_change_nothing_on_the_kernel():
  """The kernel path draws noise only when some row samples: a sampled row
  picks the same tokens beside greedy rows as in a batch of sampled rows,
  and the same as the JAX sampler; greedy rows take the argmax."""
  vocab, steps = 300, 12
  logits = jax.random.normal(jax.random.key(3), (3, vocab)) * 2.0
  state = init_sampler_state(jnp.zeros((3, 1), jnp.int32),
                             jnp.zeros((3, 1), bool), vocab_size=vocab)
  kernel = jax.jit(functools.partial(sample_next, kernel=True))
  plain = jax.jit(sample_next)

  def tokens(sampler, temperature):
    settings = SamplingSettings.make(3, vocab, temperature=temperature,
                                     top_k=[0, 5, 0], seed=[11, 12, 13])
    return np.stack([np.asarray(sampler(logits, settings, state, step)[0])
                     for step in range(steps)])

  mixed = tokens(kernel, [0.0, 1.0, 0.0])
  sampled = tokens(kernel, [1.0, 1.0, 1.0])
  greedy = tokens(kernel, [0.0, 0.0, 0.0])
  np.testing.assert_array_equal(mixed[:, 1], sampled[:, 1])
  np.testing.assert_array_equal(mixed, tokens(plain, [0.0, 1.0, 0.0]))
  np.testing.assert_array_equal(greedy, np.broadcast_to(
      np.argmax(np.asarray(logits), axis=-1), greedy.shape))
  np.testing.assert_array_equal(mixed[:, [0, 2]], greedy[:, [0, 2]])
  assert len(set(sampled[:, 1].tolist())) > 1  # it does sample
