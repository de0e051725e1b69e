"""Activations recorded during generation (``generate(..., capture=[...])``).

The engine inserts `penzai_lm.interp.Capture` layers after the requested
points (`penzai_lm.generation.prepare`). Each keeps a buffer over the cache
slots, ``(batch, seq=C, feature axes)``, written like a KV cache: the
prefill writes the prompt's slots, every decode step the slot of the token
it feeds, and with captures a row that finishes feeds its last token once
more so that token's values are recorded too (its cache has a slot for it).

On the host, a row's values are its real slots in order (cache positions
>= 0: left padding and the steps after the row finished hold nothing),
i.e. one value per token of ``prompt + generated tokens``, aligned with
``result.prompt_lengths[r]`` and ``result.tokens[r]``. Attention weights
(``attn.pattern``) have the cache slots as keys; they are cut the same way,
so ``kv_seq`` counts the row's tokens too. On a mesh spanning several
processes (hosts), the buffers' rows and features may be split across them:
every process gathers the whole buffers (a collective, reached by every
process in the same order, as SPMD host code is).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from penzai import pz

from penzai_lm.runtime.host import to_host


@dataclasses.dataclass(frozen=True)
class CaptureBuffers:
  """The capture buffers of a run, on the host.

  Attributes:
    real: ``(B, C)`` bool: slots holding a real token, per row.
    values: ``{name: (data (B, C, ...), feature axis names)}``.
  """

  real: np.ndarray
  values: dict[str, tuple[np.ndarray, tuple[str, ...]]]

  @classmethod
  def read(cls, specs, state: dict, positions: pz.nx.NamedArray,
           batch_axis: str) -> CaptureBuffers:
    """From the model's state values (by label) and cache positions."""
    real = to_host(positions.unwrap(batch_axis, "seq")) >= 0
    values = {}
    for spec in specs:
      value = spec.take(state[spec.label])
      features = tuple(a for a in value.named_shape
                       if a not in (batch_axis, "seq"))
      values[spec.name] = (to_host(value.unwrap(batch_axis, "seq",
                                                 *features)), features)
    return cls(real, values)

  def row(self, row: int, start: int, stop: int
          ) -> dict[str, pz.nx.NamedArray]:
    """Values of the row's real tokens ``start <= i < stop`` (counting the
    row's real slots from its first), with a ``seq`` axis."""
    real = np.flatnonzero(self.real[row])
    slots = real[start:stop]
    out = {}
    for name, (data, features) in self.values.items():
      value = data[row, slots]
      if "kv_seq" in features:  # Attention weights: keys are slots too.
        value = np.take(value, real[:stop], axis=1 + features.index(
            "kv_seq"))
      out[name] = pz.nx.wrap(value).tag("seq", *features)
    return out

  def count(self, row: int) -> int:
    """Real tokens recorded for a row."""
    return int(self.real[row].sum())
