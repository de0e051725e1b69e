"""The computing part of `penzai_lm.circuits.qk`: one head's query and key
vectors in the prompt's frozen model, and each source's part of them.

`HeadPaths` holds block ``layer``'s pre-attention norm and query / key
paths (norms frozen, as in `penzai_lm.circuits.replacement`) for one head;
`head_vectors` runs the `LinearizedModel` and reads ``resid_pre`` of that
block through them. `source_terms` lays out the terms and their source
vectors; `term_vectors` gets each source's part of the query and key
vectors from one reverse-mode pass per output coordinate. Array
conventions are `qk`'s.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.circuits.feature_weights import feature_edges
from penzai_lm.circuits.feature_weights import feature_sources
from penzai_lm.circuits.features import PromptFeatures
from penzai_lm.circuits.qk_terms import QKTerms
from penzai_lm.circuits.replacement import LinearizedModel
from penzai_lm.model.hooks import head_coordinates
from penzai_lm.model.transformer import TransformerBlock
from penzai_lm.model.transformer import eager

_CHUNK = 256  # Feature sources read out per step.


@pz.pytree_dataclass
class HeadPaths(pz.Struct):
  """One head's query and key paths at block ``layer``. A pytree.

  Attributes:
    query, key: The block's pre-attention norm then its query (key) path,
      norms frozen.
    query_head, key_head: ``((axis, index), ...)`` of the head in the query
      and key outputs.
    layer: The block.
  """

  query: pz.nn.Layer
  key: pz.nn.Layer
  query_head: tuple = dataclasses.field(metadata={"pytree_node": False})
  key_head: tuple = dataclasses.field(metadata={"pytree_node": False})
  layer: int = dataclasses.field(metadata={"pytree_node": False})

  def __call__(self, resid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``([T, d], [T, d])``: the head's query and key vectors at every
    position of the residual stream ``resid`` (``[T, D]``)."""
    x = pz.nx.wrap(resid).tag("seq", "embedding")
    side = {"token_positions": pz.nx.arange("seq", resid.shape[0])}
    with eager():
      q = self.query(x, **side)[dict(self.query_head)]
      k = self.key(x, **side)[dict(self.key_head)]
    return (q.unwrap("seq", "projection").astype(jnp.float32),
            k.unwrap("seq", "projection").astype(jnp.float32))


def head_paths(linear: LinearizedModel, config, layer: int,
               head: int) -> HeadPaths:
  """The `HeadPaths` of ``head`` at block ``layer`` of the frozen model."""
  block = pz.select(linear.stateless).at_instances_of(
      TransformerBlock).get_sequence()[layer]
  norm, attention = _attention_input(block)
  coords = head_coordinates(config, head)
  common = config.head_axes[0]
  return HeadPaths(
      query=pz.nn.Sequential([norm, attention.input_to_query]),
      key=pz.nn.Sequential([norm, attention.input_to_key]),
      query_head=tuple(coords.items()),
      key_head=tuple((a, i) for a, i in coords.items() if a in common),
      layer=layer)


def _attention_input(block) -> tuple[pz.nn.Layer, pz.nn.Attention]:
  """``(pre-attention norm, attention)`` of a block: the attention layer
  of its residual branch (inside the replacement model's rematerializing
  wrapper) and the layer before it."""
  for branch in block.sublayers:
    layers = getattr(getattr(branch, "delta", None), "sublayers", ())
    for i, layer in enumerate(layers):
      inner = getattr(layer, "inner", layer)
      if isinstance(inner, pz.nn.Attention) and i > 0:
        return layers[i - 1], inner
  raise ValueError("qk_attribution found no pre-attention norm followed by"
                   " an attention layer in the block: it needs the block"
                   " layout build_transformer makes.")


@jax.jit
def forward(linear: LinearizedModel) -> dict:
  """`LinearizedModel.run` at zero deltas."""
  return linear.run(*linear.zero_deltas())


def _terms(feats: PromptFeatures, keep: np.ndarray, layer: int,
           query: int) -> QKTerms:
  """The term table: features ``keep``, then the errors and tokens up to
  position ``query`` and the ``b_dec`` of the blocks before ``layer``,
  then the bias."""
  err_layers, err_positions = np.divmod(np.arange(layer * (query + 1)),
                                        query + 1)
  n_feat, n_err, n_tok = int(keep.sum()), len(err_layers), query + 1

  def ints(*parts):
    return np.concatenate(parts).astype(np.int32)

  def none(n):
    return np.full(n, -1)

  return QKTerms(
      kinds=np.array(["feature"] * n_feat + ["error"] * n_err
                     + ["token"] * n_tok + ["b_dec"] * layer + ["bias"]),
      layers=ints(feats.layers[keep], err_layers, none(n_tok),
                  np.arange(layer), none(1)),
      positions=ints(feats.positions[keep], err_positions, np.arange(n_tok),
                     none(layer + 1)),
      feature_ids=ints(feats.ids[keep], none(n_err + n_tok + layer + 1)))


def source_terms(feats: PromptFeatures, embed: np.ndarray, layer: int,
             query: int, zero_positions: int) -> tuple[QKTerms, dict]:
  """The terms, and the source vectors of all but the bias: the features,
  errors and tokens that can reach the query position of block ``layer``
  (earlier blocks, positions up to ``query``), and the ``b_dec`` rows."""
  keep = (feats.layers < layer) & (feats.positions <= query)
  terms = _terms(feats, keep, layer, query)
  seq = embed.shape[0]
  n_feat, n_tok = int(keep.sum()), query + 1
  is_error = terms.kinds == "error"
  error_cells = terms.layers[is_error] * seq + terms.positions[is_error]
  pad = -n_feat % _CHUNK if n_feat else _CHUNK
  features = feature_sources(
      feats.weights, feats.layers[keep], feats.positions[keep],
      feats.ids[keep], feats.coefficients[keep], n_feat + pad, jnp.asarray)
  sources = {
      "error_cells": error_cells,
      "errors": feats.errors.reshape(-1, embed.shape[1])[error_cells],
      "embed": embed[:n_tok],
      "b_dec": feats.biases[:layer],
      "b_dec_mask": (np.arange(seq) >= zero_positions).astype(np.float32),
  }
  return terms, {**features,
                 **{k: jnp.asarray(v) for k, v in sources.items()}}


def term_vectors(linear: LinearizedModel, paths: HeadPaths,
                 sources: dict, positions: np.ndarray,
             n_features: int, head_dim: int, batch_size: int
             ) -> tuple[np.ndarray, np.ndarray]:
  """``(vectors [1 + K, n - 1, d], primal [1 + K, d])``: each source's part
  of the query (row 0) and key vectors (every term but the bias), and those
  vectors, from one reverse-mode pass per coordinate, ``batch_size`` at a
  time."""
  n_out = len(positions)
  basis = np.eye(n_out * head_dim, dtype=np.float32).reshape(
      -1, n_out, head_dim)
  size = min(batch_size, len(basis))
  rows, primal = [], None
  for start in range(0, len(basis), size):
    batch = basis[start:start + size]
    padded = np.concatenate(
        [batch, np.zeros((size - len(batch), n_out, head_dim), np.float32)])
    primal, out = _batch_rows(linear, paths, sources,
                              jnp.asarray(positions), jnp.asarray(padded))
    rows.append(np.asarray(out)[:len(batch)])
  vectors = np.concatenate(rows).reshape(n_out, head_dim, -1).transpose(
      0, 2, 1)
  padded_features = len(sources["layers"])
  vectors = np.concatenate([vectors[:, :n_features],
                            vectors[:, padded_features:]], axis=1)
  return vectors, np.asarray(primal, np.float32)


@jax.jit
def _batch_rows(linear: LinearizedModel, paths: HeadPaths, sources: dict,
                positions, cotangents):
  """``(primal [1 + K, d], rows [B, n_sources])``: the query vector at
  ``positions[0]`` and the key vectors at ``positions[1:]``, and for each
  cotangent (``[B, 1 + K, d]``) its pullback read out against every
  source's vector (padded features first)."""

  def heads(embed_delta, mlp_delta):
    resid = linear.run(embed_delta, mlp_delta)["resid_pre"][paths.layer]
    q, k = paths(resid)
    return jnp.concatenate([q[positions[:1]], k[positions[1:]]])

  primal, pullback = jax.vjp(heads, *linear.zero_deltas())
  grad_embed, grad_mlp = jax.vmap(pullback)(cotangents)
  grad_mlp = jnp.stack(grad_mlp, axis=1)
  return primal, _read_out(grad_embed, grad_mlp, sources)


def _read_out(grad_embed, grad_mlp, sources) -> jax.Array:
  """``[B, padded features + errors + tokens + b_dec]`` from the batch's
  gradients (``[B, T, D]`` at the embeddings, ``[B, L, T, D]`` at the MLP
  outputs), features ``_CHUNK`` at a time."""
  batch, _, _, width = grad_mlp.shape
  flat = grad_mlp.reshape(batch, -1, width)
  feature_part = feature_edges(grad_mlp, sources, _CHUNK)
  errors = jnp.einsum("bnd,nd->bn", flat[:, sources["error_cells"]],
                      sources["errors"])
  n_tok = sources["embed"].shape[0]
  tokens = jnp.einsum("btd,td->bt", grad_embed[:, :n_tok], sources["embed"])
  n_dec = sources["b_dec"].shape[0]
  b_dec = jnp.einsum("bltd,ld,t->bl", grad_mlp[:, :n_dec], sources["b_dec"],
                     sources["b_dec_mask"])
  return jnp.concatenate([feature_part, errors, tokens, b_dec], axis=1)
