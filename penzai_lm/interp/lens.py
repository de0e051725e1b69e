"""The model's two ends as functions: embed tokens, unembed a residual.

* `unembed(model, resid)`: the final norm and the output projection (and
  soft-capping) applied to a residual-stream value: logits. With
  `run_with_cache` this is the logit lens::

      cache = run_with_cache(model, ids, names=[f"blocks.{i}.resid_post"
                                                 for i in range(n)])
      logits_3 = unembed(model, cache["blocks.3.resid_post"])

* `embed(model, tokens)` and `logits_from_embeddings(model, embeddings)`
  split the forward pass after the embedding lookup, so gradients can be
  taken with respect to the input embeddings (saliency)::

      emb = embed(model, ids)
      f = lambda m, e: logits_from_embeddings(m, e)[...]
      grad = jax.jit(jax.grad(f, argnums=1))(model, emb)

  Loaded models hold frozen weights, so JAX transformations take them as
  is (a model loaded with ``freeze=False`` needs `pz.freeze_params`
  first). Pass the model as an argument, not in a closure: a closed-over
  model's weights become constants of the compiled program, which then
  compiles many times slower.
"""

from __future__ import annotations

import jax
from penzai import pz

from penzai_lm.model import TransformerLM
from penzai_lm.model.hooks import HookPoint


def _body(model) -> list[pz.nn.Layer]:
  if not isinstance(model, TransformerLM) or not isinstance(
      model.body, pz.nn.Sequential):
    raise TypeError(
        "expected an uncached penzai_lm TransformerLM, got"
        f" {type(model).__name__}.")
  return list(model.body.sublayers)


def _index_of_point(layers, point: str) -> int:
  for i, layer in enumerate(layers):
    if isinstance(layer, HookPoint) and layer.point == point:
      return i
  raise ValueError(
      f"the model has no top-level {point!r} hook point; models from"
      " penzai_lm.build_transformer and penzai_lm.load have one.")


def unembed(model, resid: pz.nx.NamedArray, **side_inputs
            ) -> pz.nx.NamedArray:
  """Logits from a residual-stream value (``embedding`` axis): the model's
  final norm, output projection and soft-cap."""
  layers = _body(model)
  start = _index_of_point(layers, "final_norm")
  # The final norm sits right before its hook point.
  x = resid
  with jax.default_matmul_precision(model.config.matmul_precision):
    for layer in layers[start - 1:]:
      x = layer(x, **side_inputs)
  return x


def embed(model, tokens: pz.nx.NamedArray) -> pz.nx.NamedArray:
  """The embedding-table rows of ``tokens``: the model's first layer only.

  These are raw rows (in the parameter dtype), before the cast to the
  activation dtype, the embedding scale (Gemma's ``sqrt(hidden_size)``)
  and learned positions: not the value at the ``embed`` point of
  `run_with_cache`. `logits_from_embeddings` applies those and the rest.
  """
  layers = _body(model)
  if not isinstance(layers[0], pz.nn.EmbeddingLookup):
    raise ValueError("the model's first layer is not an embedding lookup.")
  return layers[0](tokens)


def logits_from_embeddings(model, embeddings: pz.nx.NamedArray, *,
                           token_positions=None, **side_inputs
                           ) -> pz.nx.NamedArray:
  """Logits from `embed`'s raw rows: the forward pass after the lookup.

  It applies every layer after the embedding lookup, the cast, embedding
  scale and learned positions included, so ``logits_from_embeddings(model,
  embed(model, ids))`` equals ``model(ids)``. It does not take the value of
  the ``embed`` point (which is already scaled).

  Args:
    model: The `TransformerLM` (frozen under ``jax.grad`` / ``jax.jit``).
    embeddings: Named array with a ``seq`` and an ``embedding`` axis.
    token_positions: As in `TransformerLM.__call__` (default 0, 1, ...).
    **side_inputs: Forwarded to the layers.
  """
  layers = _body(model)
  if token_positions is None:
    token_positions = pz.nx.arange("seq", embeddings.named_shape["seq"])
  x = embeddings
  with jax.default_matmul_precision(model.config.matmul_precision):
    for layer in layers[1:]:
      x = layer(x, token_positions=token_positions, **side_inputs)
  return x
