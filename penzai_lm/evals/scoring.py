"""Scoring token sequences in one compiled pass: for every token, its
log-probability given the tokens before it and whether it was the model's
top choice (what lm-eval's ``loglikelihood`` requests need).

`TokenScores` sits after the model's logits (like
`penzai_lm.interp.loss_layer.TokenLosses`) and records both into state;
the program returns only them, never the ``(tokens, vocabulary)`` logits.
`NextTokenScores` scores several candidate next tokens after each row's
last token (`score_next`): the one pass a multiple-choice question with
one-token answers needs, instead of one pass per answer.
Rows are left-padded to generation's length buckets
(`penzai_lm.interp.activation_cache.padded_length`), so batches of many
lengths share a few programs.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.generation.engine import resolve_engine
from penzai_lm.interp.activation_cache import check_context
from penzai_lm.interp.activation_cache import token_batch
from penzai_lm.interp.loss_layer import next_token_targets


@pz.pytree_dataclass
class TokenScores(pz.nn.Layer):
  """Records each position's log-probability of the next token and
  whether that token is the argmax.

  Attributes:
    targets: The next token of every position (tokens' axes).
    logprobs: State: float32 log-probabilities (tokens' axes).
    greedy: State: bool, the target is the argmax (tokens' axes).
  """

  targets: pz.nx.NamedArray
  logprobs: pz.StateVariable
  greedy: pz.StateVariable

  def __call__(self, logits, /, **side_inputs):
    del side_inputs
    scores = logits.astype(jnp.float32).untag("vocabulary")
    picked = pz.nx.nmap(lambda row, t: row[t])(scores, self.targets)
    normalizer = pz.nx.nmap(jax.nn.logsumexp)(scores)
    top = pz.nx.nmap(jnp.argmax)(scores)
    self.logprobs.value = pz.nx.order_like(picked - normalizer,
                                           self.logprobs.value)
    self.greedy.value = pz.nx.order_like(top == self.targets,
                                         self.greedy.value)
    return logits


@pz.pytree_dataclass
class NextTokenScores(pz.nn.Layer):
  """Records, at each row's last position, the log-probability of each of
  its candidate next tokens and the argmax.

  Attributes:
    candidates: Candidate ids, the batch axes and ``choices``.
    logprobs: State: float32, the batch axes and ``choices``.
    top: State: int32 argmax, the batch axes.
  """

  candidates: pz.nx.NamedArray
  logprobs: pz.StateVariable
  top: pz.StateVariable

  def __call__(self, logits, /, **side_inputs):
    del side_inputs
    scores = logits[{"seq": -1}].astype(jnp.float32).untag("vocabulary")
    normalizer = pz.nx.nmap(jax.nn.logsumexp)(scores)
    picked = pz.nx.nmap(lambda row, ids: row[ids])(
        scores, self.candidates.untag("choices")).tag("choices")
    self.logprobs.value = pz.nx.order_like(picked - normalizer,
                                           self.logprobs.value)
    self.top.value = pz.nx.order_like(
        pz.nx.nmap(jnp.argmax)(scores).astype(jnp.int32), self.top.value)
    return logits


def _with_scores(model, tokens):
  shape = dict(tokens.named_shape)
  layer = TokenScores(
      targets=next_token_targets(tokens),
      logprobs=pz.StateVariable(pz.nx.zeros(shape, jnp.float32),
                                label="eval_logprobs"),
      greedy=pz.StateVariable(pz.nx.zeros(shape, bool), label="eval_greedy"))
  body = pz.nn.Sequential([*model.body.sublayers, layer])
  return dataclasses.replace(model, body=body), layer


def score_rows(model, rows: list[list[int]], *, engine=None
               ) -> list[tuple[np.ndarray, np.ndarray]]:
  """Scores each row's tokens after its first.

  Args:
    model: An uncached `TransformerLM` (patched, spliced, quantized, ...).
    rows: Token id lists, at least 2 tokens each, each at most the model's
      context.
    engine: The `penzai_lm.Engine` whose program cache is used.

  Returns:
    Per row ``(logprobs, greedy)``, each ``len(row) - 1`` long: entry ``t``
    is ``log p(row[t + 1] | row[:t + 1])`` and whether ``row[t + 1]`` was
    the argmax.
  """
  ids, padding, lengths = token_batch(model, rows, bucketed=True)
  check_context(model.config, lengths)
  patched, layer = _with_scores(model, ids)
  resolve_engine(engine).forward(patched, ids, padding=padding,
                                 return_logits=False)
  logprobs = np.asarray(layer.logprobs.value.unwrap("batch", "seq"))
  greedy = np.asarray(layer.greedy.value.unwrap("batch", "seq"))
  seq = logprobs.shape[1]
  return [(logprobs[r, seq - n:seq - 1], greedy[r, seq - n:seq - 1])
          for r, n in enumerate(lengths)]


def _bucket(n: int) -> int:
  """Candidates per row padded to a power of two (at least 4)."""
  return max(4, 1 << (n - 1).bit_length())


def score_next(model, rows: list[list[int]], candidates: list[list[int]],
               *, engine=None
               ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
  """Scores each row's tokens after its first, and candidate next tokens
  after its last, in one pass.

  Args:
    model: An uncached `TransformerLM`.
    rows: Token id lists (at least one token each, at most the context).
    candidates: Per row, the ids whose log-probabilities are wanted after
      its last token.
    engine: The `penzai_lm.Engine` whose program cache is used.

  Returns:
    Per row ``(logprobs, greedy, candidate logprobs, argmax id)``: the first
    two as `score_rows` returns them, then the log-probability of each
    candidate after the row and the most likely next token.
  """
  ids, padding, lengths = token_batch(model, rows, bucketed=True)
  check_context(model.config, lengths)
  width = _bucket(max(len(c) for c in candidates))
  table = np.zeros((len(rows), width), np.int32)
  for r, row in enumerate(candidates):
    table[r, :len(row)] = row
  batch = {"batch": len(rows)}
  patched, tokens = _with_scores(model, ids)
  nexts = NextTokenScores(
      candidates=pz.nx.wrap(jnp.asarray(table)).tag("batch", "choices"),
      logprobs=pz.StateVariable(pz.nx.zeros({**batch, "choices": width},
                                            jnp.float32),
                                label="eval_next_logprobs"),
      top=pz.StateVariable(pz.nx.zeros(batch, jnp.int32), label="eval_top"))
  body = pz.nn.Sequential([*patched.body.sublayers, nexts])
  resolve_engine(engine).forward(dataclasses.replace(patched, body=body), ids,
                                 padding=padding, return_logits=False)
  logprobs = np.asarray(tokens.logprobs.value.unwrap("batch", "seq"))
  greedy = np.asarray(tokens.greedy.value.unwrap("batch", "seq"))
  picked = np.asarray(nexts.logprobs.value.unwrap("batch", "choices"))
  top = np.asarray(nexts.top.value.unwrap("batch"))
  seq = logprobs.shape[1]
  return [(logprobs[r, seq - n:seq - 1], greedy[r, seq - n:seq - 1],
           picked[r, :len(candidates[r])], int(top[r]))
          for r, n in enumerate(lengths)]
