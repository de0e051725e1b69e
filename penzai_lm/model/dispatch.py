"""How a top-level `TransformerLM` call runs: the compiled forward pass.

A model call on concrete arrays outside any JAX trace runs as one compiled
program (`TransformerLM.__call__`). Compiling and caching programs is the
job of the floor above this package (`penzai_lm.runtime`), which this
package may not import; so the runtime hands its compiled forward pass to
`use_compiled_forward` when it is imported, and `compiled_forward` calls
it. Until then (only ``penzai_lm.model`` imported) calls run op by op.

The one value held here is that function: set once, read on every call.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

ForwardFn = Callable[..., Any]


@dataclasses.dataclass
class _Dispatch:
  forward: ForwardFn | None = None


_DISPATCH = _Dispatch()


def use_compiled_forward(forward: ForwardFn) -> None:
  """Makes ``forward(model, tokens, *, token_positions, **side_inputs)``
  run top-level model calls; it returns the logits, or NotImplemented for
  a call it cannot compile (the model then runs eagerly)."""
  if not callable(forward):
    raise TypeError(f"forward must be callable, got {forward!r}.")
  _DISPATCH.forward = forward


def compiled_forward(model, tokens, **kwargs) -> Any:
  """The registered compiled forward pass of ``model(tokens, **kwargs)``,
  or NotImplemented when none is registered."""
  if _DISPATCH.forward is None:
    return NotImplemented
  return _DISPATCH.forward(model, tokens, **kwargs)

