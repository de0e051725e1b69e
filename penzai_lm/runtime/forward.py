"""Forward passes compiled through a `Runtime`'s program cache.

A call ``model(tokens)`` of an uncached `TransformerLM` at the top level
(concrete arrays, outside any ``jax.jit`` / ``jax.grad`` / ``vmap`` trace)
runs as one compiled program of the default runtime (`compiled_forward`);
`penzai_lm.interp.run_with_cache` does the same. The program is
``jit(model(tokens, ...))`` with everything that varies between calls of
one shape as an argument: the model's arrays (weights and patch values),
the values of its variables, the token ids, positions, a padding mask and
array side inputs. So a new prompt, a new steering strength or a re-bound
parameter reuses the program; a new shape, model structure or a non-array
side input (part of the program's key) compiles another, cached in the
runtime's bounded LRU (``runtime.compilations`` counts them; the default
`penzai_lm.Engine` shares the default runtime).

Semantics are those of the eager call: state variables (penzai's
``SaveIntermediate``, `run_with_cache`'s captures) hold their new values
afterwards. What differs is what any compiled JAX code does differently:
Python side effects in a layer (a ``print``, appending to a list) run
while the program is traced, not on every call, and values are computed
by XLA's fused kernels (equal to the eager ones up to float rounding).

Escape hatch: inside ``with penzai_lm.eager():`` (or with
``run_with_cache(..., eager=True)``) every call runs op by op as penzai
layers do, e.g. to step through a layer in a debugger or to see its prints.
Calls inside a JAX trace are traced as part of it, unchanged: ``jax.jit``,
``jax.grad``, ``vmap`` or ``lax.scan`` of a function that calls the model
see the plain layer call.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from penzai import pz

from penzai_lm.model.transformer import positions_from_padding
from penzai_lm.runtime.compiler_options import count_parameters


def _split_side_inputs(side_inputs: dict):
  """``(arrays, static)``: array leaves are arguments of the program, the
  rest (and the structure) part of its key; None if that is unhashable."""
  leaves, treedef = jax.tree_util.tree_flatten(side_inputs)
  is_array = tuple(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)
  others = tuple(x for x, a in zip(leaves, is_array) if not a)
  static = (treedef, is_array, others)
  try:
    hash(static)
  except TypeError:
    return None
  return [x for x, a in zip(leaves, is_array) if a], static


def _rebuild_side_inputs(static, arrays) -> dict:
  treedef, is_array, others = static
  arrays, others = iter(arrays), iter(others)
  leaves = [next(arrays) if a else next(others) for a in is_array]
  return jax.tree_util.tree_unflatten(treedef, leaves)


def forward_program(static, model, variables, tokens, token_positions,
                    padding, side_arrays):
  """The compiled forward pass.

  Args:
    static: ``(the side inputs' structure and non-array values, whether to
      return the logits)``.
    model: The model with its variables unbound (slots), or as it is.
    variables: Frozen values of its variables (parameters and state).
    tokens: Named token ids.
    token_positions: Named positions, or None.
    padding: Named padding mask (True: padding) to compute the positions
      from where ``token_positions`` is None, or None (0, 1, 2, ...).
    side_arrays: The array leaves of the side inputs.

  Returns:
    ``(logits or None, new values of the state variables, in order)``.
  """
  static, return_logits = static
  side_inputs = _rebuild_side_inputs(static, side_arrays)
  bound = [v.unfreeze_as_copy() for v in variables]
  if bound:
    model = pz.bind_variables(model, bound)
  if token_positions is None and padding is not None:
    token_positions = positions_from_padding(padding)
  logits = model(tokens, token_positions=token_positions, **side_inputs)
  return (logits if return_logits else None,
          [v.value for v in bound if isinstance(v, pz.StateVariable)])


def compiled_forward(runtime, model, tokens, *, token_positions=None,
                     padding=None, return_logits: bool = True,
                     **side_inputs) -> Any:
  """``model(tokens, ...)`` as a compiled program of ``runtime``; see the
  module docstring.

  Args:
    runtime: The `Runtime` whose program cache holds the program.
    model: An uncached `TransformerLM` (patched or not), on concrete arrays.
    tokens: Named token ids (checked by the caller).
    token_positions: As in `TransformerLM.__call__`.
    padding: A named padding mask: positions are computed from it inside
      the program (`positions_from_padding`) unless ``token_positions`` is
      given.
    return_logits: False: the program returns None for the logits, so XLA
      drops what only they need (state variables still get their values).
    **side_inputs: Forwarded to the model.

  Returns:
    The logits (None without ``return_logits``), or NotImplemented where
    the call cannot be compiled (an unhashable non-array side input): the
    caller then runs it eagerly.
  """
  split = _split_side_inputs(side_inputs)
  if split is None:
    return NotImplemented
  side_arrays, static = split
  variables = []
  if any(isinstance(x, pz.AbstractVariable)
         for x in jax.tree_util.tree_leaves(model)):
    model, variables = pz.unbind_variables(model)
  args = (model, [v.freeze() for v in variables], tokens, token_positions,
          padding, side_arrays)
  program, _ = runtime.program(
      "forward", forward_program, (static, bool(return_logits)), args,
      shape=dict(tokens.named_shape),
      parameters=count_parameters(jax.tree_util.tree_leaves(model)))
  logits, new_state = program(*args)
  for var, value in zip(
      (v for v in variables if isinstance(v, pz.StateVariable)), new_state):
    var.value = value
  return logits
