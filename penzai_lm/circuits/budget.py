"""Sizing `attribute`'s work to a memory budget (``max_memory_bytes``).

Rows are computed ``batch`` targets at a time, and within a batch the
feature edges ``chunk`` source features at a time; what a batch holds,
in float32, is about::

    per target: 3 * width              (its row, on device and on the host)
              + 2 * chunk * D          (the decoder rows of one chunk)
              + 2 * L * T * D          (its gradient at every block's
                                        mlp_out, and their stacked copy)
              + 2 * V                  (the logit cotangent)

with ``width`` the number of source nodes (features padded, errors,
tokens); XLA's buffers for SmolLM2 measured 1.1 * L * T * D floats per
target besides (``_batch_rows``'s ``memory_analysis``). What the whole call
holds besides is the graph's edges (``n_targets`` rows, features and
logits, by ``n_sources`` columns), with ``max_feature_nodes`` the rows
computed so far, over every active feature (once: ranking reads them in
place, and the edges are copied out of them a block of rows at a time),
and what the caller counts in ``other_bytes``: the sources (each active
feature's coordinates and coefficient, the errors: the features' vectors
are gathered from the transcoders' weights) and one forward pass
(about ``6 * L * T * D`` floats kept for the backward pass, and one
block's ``heads * T^2`` pattern at a time: patterns are recomputed in the
backward pass). These are estimates of the working set (the model's and
transcoders' weights, Python and JAX are not counted), not a hard
limit.

Budget or not, a chunk gathers at most `STEP_FLOATS` floats
(``batch * chunk * D``) at once: one gather of every feature's ``D``
gradient entries for the whole batch would be ``batch * features * D``
floats (gigabytes for real transcoders), and small steps are also faster.
"""

from __future__ import annotations

import dataclasses

_F32 = 4
STEP_FLOATS = 1 << 21  # Most floats one read-out step gathers (8 MiB).


@dataclasses.dataclass(frozen=True)
class Plan:
  """How `attribute` splits its work.

  Attributes:
    batch: Targets per backward batch.
    chunk: Source features per read-out step within a batch (divides the
      padded number of features).
  """

  batch: int
  chunk: int


def per_target_bytes(width: int, chunk: int, num_layers: int, seq: int,
                     hidden: int, vocab: int) -> int:
  """Estimated bytes one target of a batch holds (module docstring)."""
  return _F32 * (3 * width + 2 * chunk * hidden
                 + 2 * num_layers * seq * hidden + 2 * vocab)


def fixed_bytes(n_targets: int, n_sources: int, n_held_rows: int,
                width: int) -> int:
  """Bytes held for the whole call: the graph's edges, and the rows held
  for re-ranking when features are capped."""
  return _F32 * (n_targets * n_sources + n_held_rows * width)


def default_chunk(batch: int, padded_features: int, hidden: int) -> int:
  """The largest power of two at most ``padded_features`` whose step,
  ``batch * chunk * hidden`` floats, is at most `STEP_FLOATS` (at least
  1)."""
  fits = max(1, STEP_FLOATS // (batch * hidden))
  return min(padded_features, 1 << (fits.bit_length() - 1))


def plan(max_memory_bytes: int | None, *, batch_size: int,
         padded_features: int, width: int, n_targets: int, n_sources: int,
         n_held_rows: int, other_bytes: int = 0,
         num_layers: int, seq: int, hidden: int, vocab: int) -> Plan:
  """The largest batch (at most ``batch_size``) and chunk (a power of two,
  at most ``padded_features``, itself a power of two, and at most
  `default_chunk`; made smaller only where that lets a batch below 16
  targets grow) whose estimated memory fits ``max_memory_bytes``;
  without a budget, ``batch_size`` and `default_chunk`.

  Raises:
    ValueError: if the graph alone, or one target with one-feature chunks,
      does not fit the budget, with the sizes and what to change.
  """
  chunk = default_chunk(batch_size, padded_features, hidden)
  if max_memory_bytes is None:
    return Plan(batch_size, chunk)
  fixed = fixed_bytes(n_targets, n_sources, n_held_rows, width) + (
      other_bytes)
  if fixed >= max_memory_bytes:
    raise ValueError(
        f"max_memory_bytes={max_memory_bytes} is too small: the graph's"
        f" edges ({n_targets} targets x {n_sources} sources) and held rows"
        " alone need about"
        f" {fixed} bytes. Raise max_memory_bytes, or lower"
        " max_feature_nodes (or shorten the prompt) for a smaller graph.")
  left = max_memory_bytes - fixed

  def fitting(chunk):
    return min(batch_size, left // per_target_bytes(
        width, chunk, num_layers, seq, hidden, vocab))

  # The largest chunk whose batch reaches 16 targets (or batch_size);
  # failing that, the largest chunk with the largest batch (long prompts:
  # the gradients, not the chunk, fill a target's share).
  chunks = [chunk >> i for i in range(chunk.bit_length())]
  target = min(batch_size, 16)
  chunk = next((c for c in chunks if fitting(c) >= target),
               max(chunks, key=lambda c: (fitting(c), c)))
  batch = fitting(chunk)
  if batch < 1:
    need = fixed + per_target_bytes(width, 1, num_layers, seq, hidden, vocab)
    raise ValueError(
        f"max_memory_bytes={max_memory_bytes} is too small: one target"
        f" batch needs about {need} bytes with this graph ({n_targets}"
        f" targets, {width} sources). Raise max_memory_bytes or lower"
        " max_feature_nodes.")
  return Plan(int(batch), chunk)
