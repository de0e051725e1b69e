"""Run a cached model through a series of calls, as a compiled program."""

import functools

import jax
import numpy as np
from penzai import pz

from penzai_lm.runtime.compiler_options import small_model_options


# Small test models: compiled as the engine compiles theirs (LLVM -O0).
@functools.partial(jax.jit, compiler_options=small_model_options())
def _step(model, state, tokens):
  # One jitted function for every caller: models of one structure and call
  # shapes share its programs across tests (a lambda per call compiled
  # each anew).
  return model.stateless_call(state, tokens)


def cached_calls(cached, calls, *, hlo: bool = False):
  """Logits ``[batch, seq, vocabulary]`` (float32) of each call in
  ``calls`` (``[batch, seq]`` token arrays, e.g. a prompt then one-token
  steps) to a `KVCachingTransformerLM`, jitted.

  Returns:
    ``(logits, text)``: ``text`` is the HLO of the last call where ``hlo``,
    else None (lowering it again costs a trace).
  """
  model, state = pz.unbind_state_vars(cached, freeze=True)
  logits = []
  for tokens in calls:
    out, state = _step(model, state, pz.nx.wrap(tokens).tag("batch", "seq"))
    logits.append(np.array(out.order_as("batch", "seq", "vocabulary")
                           .data_array, np.float32))
  text = None
  if hlo:
    text = _step.lower(model, state, pz.nx.wrap(calls[-1]).tag(
        "batch", "seq")).as_text()
  return logits, text
