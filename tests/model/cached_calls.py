"""Run a cached model through a series of calls, as a compiled program."""

import jax
import numpy as np
from penzai import pz


def cached_calls(cached, calls) -> tuple[list[np.ndarray], str]:
  """Logits ``[batch, seq, vocabulary]`` (float32) of each call in
  ``calls`` (``[batch, seq]`` token arrays, e.g. a prompt then one-token
  steps) to a `KVCachingTransformerLM`, jitted, and the HLO of the last
  call."""
  model, state = pz.unbind_state_vars(cached, freeze=True)
  step = jax.jit(lambda m, s, t: m.stateless_call(s, t))
  logits = []
  for tokens in calls:
    out, state = step(model, state, pz.nx.wrap(tokens).tag("batch", "seq"))
    logits.append(np.array(out.order_as("batch", "seq", "vocabulary")
                           .data_array, np.float32))
  hlo = step.lower(model, state, pz.nx.wrap(calls[-1]).tag(
      "batch", "seq")).as_text()
  return logits, hlo
