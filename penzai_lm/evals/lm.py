"""An lm-evaluation-harness model (``penzai_lm``) for models in memory.

``LM(model, tokenizer)`` wraps any `TransformerLM` — patched, spliced,
steered, quantized or sharded — so that ``lm_eval.simple_evaluate(model=
LM(...), tasks=[...])`` scores it; ``python -m penzai_lm.evals --model
penzai_lm --model_args model=smollm2-135m-instruct,dtype=float32 --tasks
...`` is lm-eval's own command line with this model registered (lm-eval
finds models only in its own package or once a module registers them).

Requests are answered as lm-eval's ``hf`` model answers them, so scores
compare: the same context/continuation split (trailing spaces of the
context move to the continuation), the same prefix token for an empty
context (BOS, else EOS), left truncation to ``max_length + 1`` tokens,
rolling windows for ``loglikelihood_rolling``, and for ``generate_until``
greedy decoding (or the sampling in ``gen_kwargs``) up to ``max_gen_toks``
tokens, cut at the first ``until`` string. Scoring runs as compiled
batches of ``batch_size`` rows, longest first, padded to generation's
length buckets: a few programs for a whole task.
"""

from __future__ import annotations

import numbers
from typing import Any

import lm_eval.models  # noqa: F401  pylint: disable=unused-import
from lm_eval import utils as lm_utils
from lm_eval.api.model import LM as _LMBase
from lm_eval.api.registry import register_model

from penzai_lm.evals.requests import encode_pair
from penzai_lm.evals.requests import generation_options
from penzai_lm.evals.requests import load_from_args
from penzai_lm.evals.scoring import score_next
from penzai_lm.evals.scoring import score_rows
from penzai_lm.generation.text import generate_text
from penzai_lm.model import TransformerLM


# lm-eval fills its registry with its own models only while it is empty, so
# they are registered (lazily, by name) before this one is added.
@register_model("penzai_lm")
class LM(_LMBase):
  """lm-eval's model interface over a penzai_lm model (module docstring).

  Args:
    model: An uncached `TransformerLM`.
    tokenizer: Its `penzai_lm.Tokenizer`.
    batch_size: Rows per compiled call.
    max_length: The longest row scored (default: the model's context).
    max_gen_toks: Tokens generated per request when ``gen_kwargs`` gives
      no ``max_gen_toks`` (lm-eval's default, 256).
    add_bos_token: Whether texts start with BOS (default: the tokenizer's
      own choice, as lm-eval's ``hf`` model with Gemma).
    engine: The `penzai_lm.Engine` to run on (default: the default one).
  """

  def __init__(self, model, tokenizer, *, batch_size: int = 16,
               max_length: int | None = None, max_gen_toks: int = 256,
               add_bos_token: bool | None = None, engine=None):
    super().__init__()
    if not isinstance(model, TransformerLM):
      raise TypeError(f"LM needs an uncached TransformerLM, got"
                      f" {type(model).__name__}.")
    context = model.config.max_position_embeddings
    for name, value, top in (("batch_size", batch_size, None),
                             ("max_length", max_length or context, context),
                             ("max_gen_toks", max_gen_toks, None)):
      if (not isinstance(value, numbers.Integral) or isinstance(value, bool)
          or value < 1 or (top is not None and value > top)):
        bound = f" and at most the model's context {top}" if top else ""
        raise ValueError(f"{name} must be an int >= 1{bound}, got"
                         f" {value!r}.")
    self.model, self.tokenizer, self.engine = model, tokenizer, engine
    self.batch_size = int(batch_size)
    self.max_length = int(max_length or context)
    self.max_gen_toks = int(max_gen_toks)
    self.add_bos = (tokenizer.add_bos if add_bos_token is None
                    else bool(add_bos_token))

  @classmethod
  def create_from_arg_string(cls, arg_string: str,
                             additional_config: dict | None = None) -> LM:
    """``lm_eval --model_args`` (``model=NAME_OR_PATH,dtype=...``; see
    `penzai_lm.evals.requests.load_from_args`)."""
    args = lm_utils.simple_parse_args_string(arg_string)
    extra = {k: v for k, v in (additional_config or {}).items()
             if v is not None and k == "batch_size"}
    if isinstance(extra.get("batch_size"), str):
      extra["batch_size"] = int(extra["batch_size"])  # Not "auto".
    model, tokenizer, options = load_from_args({**args, **extra})
    return cls(model, tokenizer, **options)

  # ------------------------------------------------------------ tokens

  @property
  def prefix_token_id(self) -> int:
    """What an empty context is (lm-eval ``hf``: BOS, else EOS)."""
    bos = self.tokenizer.bos_id
    return bos if bos is not None else self.tokenizer.eos_id

  def tok_encode(self, text: str) -> list[int]:
    """``text``'s ids, with BOS first when the model adds it and the text
    does not already spell it (as lm-eval's ``hf`` model)."""
    bos = self.tokenizer.bos_id
    spelled = bos is not None and text.startswith(
        self.tokenizer.decode([bos]))
    return self.tokenizer.encode(text, add_bos=self.add_bos and not spelled)

  # ----------------------------------------------------------- scoring

  def _score(self, pairs: list[tuple[list[int], list[int]]]
             ) -> list[tuple[float, bool]]:
    """(sum log-prob, all greedy) of each continuation after its context.

    Requests whose rows differ only in their last token (the choices of a
    multiple-choice question, when each is one token after a shared
    prefix) share one pass over the common part, their last tokens scored
    together as candidates (as lm-eval's ``hf`` model caches the logits of
    one-token continuations); the others are scored whole. Rows go in
    batches of similar length."""
    rows = [(ctx + cont)[-(self.max_length + 1):] for ctx, cont in pairs]
    out: list[Any] = [None] * len(rows)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, row in enumerate(rows):
      groups.setdefault(tuple(row[:-1]), []).append(i)
    whole = [m[0] for k, m in groups.items()
             if len(m) == 1 and len(pairs[m[0]][1]) > 1]
    shared = [k for k, m in groups.items()
              if not (len(m) == 1 and len(pairs[m[0]][1]) > 1)]
    for chunk in self._batches(whole, lambda i: len(rows[i])):
      batch = [rows[i] for i in chunk]
      for i, (logprobs, greedy) in zip(chunk, score_rows(
          self.model, self._fill(batch), engine=self.engine)):
        n = len(pairs[i][1])
        out[i] = (float(logprobs[-n:].sum()), bool(greedy[-n:].all()))
    for chunk in self._batches(range(len(shared)), lambda c: len(shared[c])):
      members = [groups[shared[c]] for c in chunk]
      scored = score_next(
          self.model, self._fill([list(shared[c]) for c in chunk]),
          self._fill([[rows[i][-1] for i in m] for m in members]),
          engine=self.engine)
      for m, (logprobs, greedy, picked, top) in zip(members, scored):
        for i, last in zip(m, picked):
          head = len(pairs[i][1]) - 1  # Continuation tokens in the prefix.
          before = logprobs[len(logprobs) - head:] if head else logprobs[:0]
          flags = greedy[len(greedy) - head:] if head else greedy[:0]
          out[i] = (float(before.sum() + last),
                    bool(flags.all()) and top == rows[i][-1])
    return out

  def _batches(self, items, length):
    """``items`` longest first, in batches of ``batch_size``."""
    order = sorted(items, key=lambda i: -length(i))
    return [order[s:s + self.batch_size]
            for s in range(0, len(order), self.batch_size)]

  def _fill(self, batch: list) -> list:
    """``batch`` padded with copies of its last entry to ``batch_size``
    (one program shape)."""
    return batch + [batch[-1]] * (self.batch_size - len(batch))

  def encode_request(self, context: str, continuation: str
                     ) -> tuple[list[int], list[int]]:
    """``(context ids, continuation ids)`` of a loglikelihood request, as
    lm-eval's own models split them."""
    if context == "":  # The prefix token is the context, unless the
      # continuation starts with it already.
      ids = self.tokenizer.encode(continuation, add_bos=False)
      prefix = self.prefix_token_id
      return (([prefix], ids) if not ids or ids[0] != prefix
              else (ids[:1], ids[1:]))
    return encode_pair(self.tok_encode, context, continuation)

  def loglikelihood(self, requests, disable_tqdm: bool = False):
    del disable_tqdm
    return self._score([self.encode_request(*r.args) for r in requests])

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
    del disable_tqdm
    totals = []
    for (text,) in (r.args for r in requests):
      windows = [lm_utils.make_disjoint_window(w) for w in
                 lm_utils.get_rolling_token_windows(
                     token_list=self.tok_encode(text),
                     prefix_token=self.prefix_token_id,
                     max_seq_len=self.max_length, context_len=1)]
      totals.append(sum(s for s, _ in self._score(windows)))
    return totals

  # -------------------------------------------------------- generation

  def generate_until(self, requests, disable_tqdm: bool = False):
    del disable_tqdm
    groups: dict[tuple, list[int]] = {}
    prepared = []
    for i, (context, gen_kwargs) in enumerate(r.args for r in requests):
      until, new, sampling = generation_options(
          gen_kwargs, self.tokenizer, self.max_gen_toks)
      ids = self.tok_encode(context)[-(self.max_length - new):]
      prepared.append((ids, until))
      key = (tuple(until), new, tuple(sorted(sampling.items())))
      groups.setdefault(key, []).append(i)
    out: list[Any] = [None] * len(requests)
    for (until, new, sampling), members in groups.items():
      for start in range(0, len(members), self.batch_size):
        chunk = members[start:start + self.batch_size]
        result = generate_text(
            self.model, self.tokenizer, [prepared[i][0] for i in chunk],
            stop_strings=list(until), skip_special_tokens=True,
            max_new_tokens=new, engine=self.engine, **dict(sampling))
        for i, text in zip(chunk, result.texts):
          for stop in until:
            text = text.split(stop)[0]
          out[i] = text
    return out
