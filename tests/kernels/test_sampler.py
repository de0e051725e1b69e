"""The CPU sampling kernel (`sampler.cc`) against the JAX sampler.

Both get the same logits, settings, penalty statistics, bans and Gumbel
noise, so they must choose the same tokens: every filter and path of
`penzai_lm.sampling.sample_next` is covered, on 17 tokens (fewer than the
candidates), 1,000, and SmolLM2's 49,152 (the two-level draw's chunking,
candidates that do not hold the nucleus). Their distributions are tested
against the reference and HF's warpers in ``tests/sampling``
(``kernel=True`` cases). The decode loop on CPU uses the kernel: its
program calls it and holds far fewer XLA kernels.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from penzai_lm.generation import Engine
from penzai_lm.kernels import ops
from penzai_lm.model import TransformerConfig
from penzai_lm.model import build_transformer
from penzai_lm.sampling import SamplingSettings
from penzai_lm.sampling import init_sampler_state
from penzai_lm.sampling import sample_next
from penzai_lm.sampling import update_sampler_state
from penzai_lm.sampling.settings import FIELDS
from penzai_lm.sampling.settings import KERNEL_PARAMS

pytestmark = pytest.mark.skipif(not ops.available(),
                                reason="no C++ compiler for the kernels")

_JAX = jax.jit(sample_next)
_KERNEL = jax.jit(functools.partial(sample_next, kernel=True))

CASES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_k": dict(temperature=1.0, top_k=5),
    "top_p": dict(temperature=1.0, top_p=0.9),
    "top_p_past_candidates": dict(temperature=1.5, top_p=0.99,
                                  top_k_cap=16),
    "min_p": dict(temperature=1.0, min_p=0.1),
    "combined": dict(temperature=0.7, top_k=40, top_p=0.8, min_p=0.05),
    "typical": dict(temperature=1.0, typical_p=0.5),
    "epsilon": dict(temperature=1.0, epsilon_cutoff=1e-3),
    "eta": dict(temperature=1.0, eta_cutoff=1e-3),
    "top_p_and_typical": dict(temperature=1.0, top_p=0.9, typical_p=0.7),
    "everything": dict(temperature=1.2, top_k=30, top_p=0.95, min_p=0.01,
                       typical_p=0.9, epsilon_cutoff=1e-4, eta_cutoff=1e-3),
    "penalties": dict(temperature=1.0, repetition_penalty=1.3,
                      presence_penalty=0.5, frequency_penalty=0.3),
    "greedy_penalties": dict(temperature=0.0, repetition_penalty=1.5),
    "bias_and_bans": dict(temperature=0.9, logit_bias={5: 8.0, 7: -3.0},
                          banned_tokens=[1, 2, 3]),
    # XTC over the vocabulary, over top-k candidates, after typical and a
    # nucleus past the candidates (low thresholds: these rows are flat).
    "xtc": dict(temperature=0.5, xtc_probability=0.8, xtc_threshold=0.01),
    "xtc_top_k": dict(temperature=0.5, top_k=20, xtc_probability=1.0,
                      xtc_threshold=0.02),
    "xtc_typical": dict(temperature=0.7, typical_p=0.8, xtc_probability=1.0,
                        xtc_threshold=0.005),
    "xtc_top_p_past_candidates": dict(temperature=0.5, top_p=0.99,
                                      top_k_cap=16, xtc_probability=1.0,
                                      xtc_threshold=0.001),
    "xtc_everything": dict(temperature=0.6, top_k=30, top_p=0.95,
                           min_p=0.01, typical_p=0.9, eta_cutoff=1e-3,
                           repetition_penalty=1.2, xtc_probability=0.6,
                           xtc_threshold=0.01),
}


def _inputs(rng, batch, vocab, trial, **kwargs):
  logits = (rng.standard_normal((batch, vocab))
            * rng.uniform(0.5, 3)).astype(np.float32)
  settings = SamplingSettings.make(
      batch, vocab, seed=list(range(batch * trial, batch * (trial + 1))),
      **kwargs)
  state = init_sampler_state(rng.integers(0, vocab, (batch, 20)),
                             vocab_size=vocab)
  state = update_sampler_state(state, jnp.asarray(rng.integers(0, vocab,
                                                               batch)))
  bans = np.zeros((batch, vocab), bool)
  bans[0, int(np.argmax(logits[0]))] = trial % 2 == 1  # An early stop.
  return logits, settings, state, bans


# 17: fewer tokens than candidates (the exhaustive path) and a last chunk
# of the two-level draw shorter than the kernel's 16-lane vectors.
@pytest.mark.parametrize("vocab", [17, 1000, 49152])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_chooses_what_the_jax_sampler_chooses(name, vocab):
  rng = np.random.default_rng(len(name) + vocab)
  batch = 4
  for trial in range(3):
    logits, settings, state, bans = _inputs(rng, batch, vocab, trial,
                                            **CASES[name])
    want, want_logprob = _JAX(logits, settings, state, trial,
                              extra_bans=bans)
    got, got_logprob = _KERNEL(logits, settings, state, trial,
                               extra_bans=bans)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(np.asarray(got_logprob),
                               np.asarray(want_logprob), atol=2e-5)


def test_rows_do_not_depend_on_their_neighbours():
  """A row's choice is the same alone and among rows of other settings
  (rows run on the kernels' worker threads)."""
  rng = np.random.default_rng(3)
  vocab, batch = 2000, 8
  logits = rng.standard_normal((batch, vocab)).astype(np.float32)
  kinds = [dict(temperature=0.0), dict(top_k=7), dict(top_p=0.8),
           dict(typical_p=0.6), dict(min_p=0.2), dict(eta_cutoff=1e-3),
           dict(temperature=0.3, xtc_probability=1.0, xtc_threshold=0.01),
           dict(repetition_penalty=1.2)]
  defaults = {f.name: f.neutral for f in FIELDS}
  per_row = {k: [kind.get(k, defaults[k]) for kind in kinds]
             for k in {k for kind in kinds for k in kind}}
  settings = SamplingSettings.make(batch, vocab, seed=list(range(batch)),
                                   **per_row)
  state = init_sampler_state(rng.integers(0, vocab, (batch, 5)),
                             vocab_size=vocab)
  together, _ = _KERNEL(logits, settings, state, 4)
  for r, kind in enumerate(kinds):
    alone_settings = SamplingSettings.make(1, vocab, seed=[r], **kind)
    alone_state = jax.tree_util.tree_map(lambda x, r=r: x[r:r + 1], state)
    alone, _ = _KERNEL(logits[r:r + 1], alone_settings, alone_state, 4)
    assert int(alone[0]) == int(together[r]), kind


def test_the_built_kernel_reads_the_tables_parameters():
  """`sampler.cc`'s PZLM_SAMPLE_PARAMS, as the library reports it, is
  `KERNEL_PARAMS`: the kernel settings of `FIELDS`, in order; other
  names are refused."""
  assert ops.kernel_sample_params() == KERNEL_PARAMS
  assert "xtc_probability" in KERNEL_PARAMS
  batch, vocab = 1, 8
  names = KERNEL_PARAMS[:-1]
  with pytest.raises(ValueError, match="PZLM_SAMPLE_PARAMS"):
    ops.sample(jnp.zeros((batch, vocab)), jnp.ones((batch, len(names))),
               jnp.zeros(batch, jnp.int32),
               jnp.zeros((batch, vocab), jnp.int32),
               jnp.zeros((batch, vocab), bool), None, None,
               jnp.zeros((batch, 64)), jnp.zeros(batch), param_names=names,
               num=4, chunk=4)


def test_a_row_of_nan_or_banned_logits_does_not_crash():
  vocab = 300
  logits = np.zeros((3, vocab), np.float32)
  logits[0] = np.nan
  bans = np.zeros((3, vocab), bool)
  bans[1] = True  # Everything banned at this step.
  settings = SamplingSettings.make(3, vocab, top_p=0.5, typical_p=0.5,
                                   xtc_probability=1.0)
  state = init_sampler_state(np.zeros((3, 1), np.int32), vocab_size=vocab)
  token, _ = _KERNEL(logits, settings, state, 0, extra_bans=bans)
  assert np.all((np.asarray(token) >= 0) & (np.asarray(token) < vocab))


def test_the_decode_loop_on_cpu_samples_with_the_kernel():
  """One custom call instead of the JAX sampler's vocabulary-wide steps:
  the decode program holds a fraction of the XLA kernels it held."""
  config = TransformerConfig(
      family="llama", vocab_size=4096, hidden_size=32, num_layers=2,
      num_heads=4, num_kv_heads=2, head_dim=16, mlp_hidden_size=48,
      max_position_embeddings=256, use_layer_stack=False)
  model = build_transformer(config, seed=0)
  engine = Engine()
  out = engine.generate(model, [[1, 2, 3, 4]], max_new_tokens=4,
                        temperature=0.9, top_p=0.9, stop_tokens=[])
  assert len(out.tokens[0]) == 4
  (_, program), = engine.programs.items("decode")
  hlo = program.as_text()
  assert "pzlm_sample" in hlo
  kernels = hlo.count(" fusion(")
  # The JAX sampler's step alone compiles to about 170 fusions (116 distinct).
  jax_step = jax.jit(sample_next).lower(
      jnp.zeros((1, 4096)), SamplingSettings.make(1, 4096),
      init_sampler_state(jnp.zeros((1, 1), jnp.int32), vocab_size=4096),
      0).compile().as_text().count(" fusion(")
  assert kernels < jax_step, (kernels, jax_step)
