"""The ``penzai_loop`` engine of generate_vs_peers.py: Penzai's own sampler.

``simple_decoding_loop.temperature_sample_pyloop`` on Penzai 0.2.5's llama
model, converted from the transformers model and wrapped in
``KVCachingTransformerLM.from_uncached``. The loop has no greedy mode, so it
runs at `LOOP_TEMPERATURE` with a fixed key; a wrapper around the model call
timestamps the first token.
"""

from __future__ import annotations

import time

import numpy as np

from peers.common import run_record
from peers.transformers_engine import load_hf

LOOP_TEMPERATURE = 1e-4


def penzai_llama(hf_model):
  """Penzai 0.2.5's own llama model converted from the transformers one."""
  from penzai.models.transformer.variants import llamalike_common  # pylint: disable=g-import-not-at-top

  config = hf_model.config
  rope = getattr(config, "rope_parameters", None) or {}
  assert rope.get("rope_type", "default") == "default", rope
  assert not config.attention_bias and not config.mlp_bias
  assert config.hidden_act == "silu"
  assert getattr(config, "sliding_window", None) is None
  if not hasattr(config, "rope_theta"):
    config.rope_theta = rope["rope_theta"]
  return llamalike_common.llamalike_from_huggingface_model(hf_model)


class _TimedLM:
  """Wraps a KVCachingTransformerLM to timestamp Penzai's Python loop.

  The second model call happens right after the first token was sampled:
  blocking on its input there gives the time to first token.
  """

  def __init__(self, lm):
    self._lm = lm
    self.calls = 0
    self.first_token_time = None

  def __getattr__(self, name):
    return getattr(self._lm, name)

  def __call__(self, tokens, **kwargs):
    import jax  # pylint: disable=g-import-not-at-top

    self.calls += 1
    if self.calls == 2:
      jax.block_until_ready(tokens)
      self.first_token_time = time.perf_counter()
    return self._lm(tokens, **kwargs)


def _pyloop_once(model, prompt_ids, new):
  """One call of temperature_sample_pyloop on a fresh KV cache."""
  import jax  # pylint: disable=g-import-not-at-top
  from penzai import pz  # pylint: disable=g-import-not-at-top
  from penzai.models.transformer import sampling_mode  # pylint: disable=g-import-not-at-top
  from penzai.models.transformer import simple_decoding_loop  # pylint: disable=g-import-not-at-top

  lm = _TimedLM(sampling_mode.KVCachingTransformerLM.from_uncached(
      model, cache_len=len(prompt_ids) + new, batch_axes={"batch": 1}))
  prompt = pz.nx.wrap(np.asarray([prompt_ids], np.int32)).tag("batch", "seq")
  start = time.perf_counter()
  out = simple_decoding_loop.temperature_sample_pyloop(
      lm, prompt, jax.random.key(0), temperature=LOOP_TEMPERATURE,
      max_sampling_steps=new)
  tokens = np.asarray(out.unwrap("batch", "seq"))
  end = time.perf_counter()
  first = lm.first_token_time or end
  record = run_record(1, len(prompt_ids), first - start, tokens.shape[1] - 1,
                      end - first, end - start)
  return record, tokens[0].tolist()


def run(spec: dict) -> dict:
  """Penzai's temperature_sample_pyloop on Penzai's llama, as shipped."""
  start = time.perf_counter()
  model = penzai_llama(load_hf(spec["threads"]))
  out = dict(load_s=time.perf_counter() - start, runs=[],
             temperature=LOOP_TEMPERATURE)
  prompt, new = spec["prompts"][0], spec["new"]
  start = time.perf_counter()
  _pyloop_once(model, prompt, new)
  out["warmup_s"] = time.perf_counter() - start
  for _ in range(spec["repeats"]):
    record, tokens = _pyloop_once(model, prompt, new)
    out["runs"].append(record)
  out["tokens"] = [tokens]
  return out
