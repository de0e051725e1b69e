"""`token_losses`: the next-token loss of every token of ragged prompts.

One compiled forward pass (`run_with_cache` with ``return_loss=True`` and
no captures or logits kept): the program returns only the losses, never
the ``(tokens, vocabulary)`` logits.
"""

from __future__ import annotations

from typing import Any

from penzai_lm.interp.activation_cache import run_with_cache


def token_losses(model, prompts, *, engine=None, eager: bool = False,
                 **side_inputs) -> list[Any]:
  """Per-token negative log-likelihood of each prompt, row-aligned.

  Args:
    model: An uncached `TransformerLM` (patched or not).
    prompts: One list of ids, a list of (ragged) lists of ids, or a
      ``pz.nx.NamedArray`` of ids with a ``seq`` axis, as `run_with_cache`
      takes them.
    engine: The `penzai_lm.Engine` whose program cache is used.
    eager: Run op by op instead of compiled.
    **side_inputs: Forwarded to the model.

  Returns:
    One float32 array per row, ``len(row) - 1`` long: entry ``t`` is
    ``-log p(row[t + 1] | row[0..t])`` (natural log), as a cross-entropy
    over the model's logits at position ``t`` (after any final soft-cap).
    The mean over all entries of all rows is Hugging Face's
    ``model(ids, labels=ids).loss``.

  Raises:
    ValueError / TypeError: as `run_with_cache` (e.g. a prompt longer than
      the model's context).
  """
  return run_with_cache(model, prompts, names=[], logits=False,
                        return_loss=True, eager=eager, engine=engine,
                        **side_inputs).losses
