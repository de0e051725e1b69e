"""Direct logit attribution: the residual stream as a sum of what wrote it.

The residual stream entering block ``L`` is exactly the sum of the
embeddings and every earlier block's attention and MLP outputs.
`decompose_resid` returns those terms as one stack (TransformerLens's
``decompose_resid``; with ``per_head=True`` each head's term, its
``stack_head_results``), `apply_final_norm` passes each term through the
final norm as the run froze it (its ``apply_ln_to_stack``), and
`logit_attribution` reads each term's direct effect on a logit or a logit
difference. Terms, in order (labels):

* ``embed``: token embeddings (scaled as the model scales them), and
  ``pos_embed``: learned positions (GPT-2), on their own;
* per block ``i`` before ``L``: ``blocks.{i}.attn_out`` (or, per head,
  ``blocks.{i}.attn.head{h}`` in Hugging Face head order, then
  ``blocks.{i}.attn.b_O`` where the projection has a bias) and
  ``blocks.{i}.mlp_out``;
* after `apply_final_norm`, ``ln_final.b`` where the final norm has a
  shift.

Arrays: ``components`` has axes ``component``, ``batch``, ``seq`` and
``embedding`` (rows left-padded as `run_with_cache` pads them; a padding
position's terms are not meaningful). The terms sum to ``resid`` to float
rounding (the identity the tests hold for every family).

Per head, through Gemma's post-attention norm: a norm is not linear, so
each head's term is its output scaled by the norm's weight over the
denominator the whole attention output had in the run (frozen, as
TransformerLens freezes the final norm's scale); the heads then sum to the
block's attention output. Logits are attributed before any final soft cap
(Gemma 2), which is not linear either.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.interp.activation_cache import run_with_cache
from penzai_lm.interp.weights import WeightTable
from penzai_lm.interp.weights import weights
from penzai_lm.model.hooks import head_coordinates

AXES = ("component", "batch", "seq", "embedding")


@dataclasses.dataclass(frozen=True)
class ResidStack:
  """Terms that sum to a residual stream (see the module docstring).

  Attributes:
    components: ``(component, batch, seq, embedding)`` float32 terms.
    labels: One label per component.
    resid: ``(batch, seq, embedding)``: the value they sum to (the
      residual stream, or after `apply_final_norm` the final norm's output).
    lengths: Real tokens of each row (rows are left-padded).
    layer: The block whose input the stack decomposes (``num_layers``: the
      stream entering the final norm).
    normed: Whether `apply_final_norm` was applied.
  """

  components: pz.nx.NamedArray
  labels: tuple[str, ...]
  resid: pz.nx.NamedArray
  lengths: tuple[int, ...]
  layer: int
  normed: bool = False

  def __getitem__(self, label: str) -> pz.nx.NamedArray:
    """One term, ``(batch, seq, embedding)``."""
    if label not in self.labels:
      raise KeyError(f"no term {label!r}; terms: {list(self.labels)}")
    return self.components[{"component": self.labels.index(label)}]


def _array(value, *axes) -> jnp.ndarray:
  return value.unwrap(*axes).astype(jnp.float32)


def _frozen_norm(config, scale, shift_free_full, terms):
  """``terms`` ``[..., embedding]`` through a norm of ``config.norm_kind``
  whose denominator is the one ``shift_free_full`` (the norm's whole
  input, ``[batch, seq, embedding]``) had, times ``scale``."""
  full = shift_free_full
  if config.norm_kind == "layer":
    terms = terms - terms.mean(-1, keepdims=True)
    denominator = jnp.sqrt(full.var(-1) + config.norm_eps)
  else:
    denominator = jnp.sqrt(jnp.mean(full * full, -1) + config.norm_eps)
  return terms / denominator[..., None] * scale


def _head_terms(model, table, cache, block: int):
  """(labels, ``[heads (+ bias), batch, seq, embedding]``) of a block's
  attention, through Gemma's post norm when the model has one."""
  config = model.config
  z = cache[f"blocks.{block}.attn.head_out"]
  w_o = table[f"blocks.{block}.attn.W_O"]
  per_head = pz.nx.nmap(jnp.dot)(z.untag("projection").astype(jnp.float32),
                                 w_o.untag("projection", "embedding")
                                 ).tag("embedding")
  heads = [per_head[head_coordinates(config, h)]
           for h in range(config.num_heads)]
  terms = [_array(h, "batch", "seq", "embedding") for h in heads]
  labels = [f"blocks.{block}.attn.head{h}" for h in range(config.num_heads)]
  if f"blocks.{block}.attn.b_O" in table:
    bias = _array(table[f"blocks.{block}.attn.b_O"], "embedding")
    terms.append(jnp.broadcast_to(bias, terms[0].shape))
    labels.append(f"blocks.{block}.attn.b_O")
  terms = jnp.stack(terms)
  if f"blocks.{block}.ln1_post.w" in table:
    scale = _array(table[f"blocks.{block}.ln1_post.w"], "embedding")
    terms = _frozen_norm(config, scale, terms.sum(0), terms)
  return labels, terms


def _embed_terms(table, cache, lengths):
  """(labels, terms) of the embeddings: tokens, and learned positions
  apart when the model has them."""
  embed = _array(cache["embed"], "batch", "seq", "embedding")
  if "pos_embed.W_pos" not in table:
    return ["embed"], [embed]
  positions_table = _array(table["pos_embed.W_pos"], "positions",
                           "embedding")
  seq = embed.shape[1]
  positions = np.arange(seq)[None, :] - (seq - np.asarray(lengths))[:, None]
  pos = jnp.where(positions[..., None] >= 0,
                  positions_table[np.maximum(positions, 0)], 0.0)
  return ["embed", "pos_embed"], [embed - pos, pos]


def decompose_resid(model, tokens, *, layer: int | None = None,
                    per_head: bool = False) -> ResidStack:
  """The residual stream entering block ``layer`` as the sum of its terms.

  One forward pass (`run_with_cache`, compiled) records the embeddings and
  each block's attention (per head: its heads' outputs) and MLP outputs.

  Args:
    model: A `TransformerLM` (float or quantized weights).
    tokens: One list of token ids or a (ragged) list of lists, as for
      `run_with_cache`.
    layer: Decompose the stream entering this block; None (or
      ``num_layers``): the stream leaving the last block, which the final
      norm reads.
    per_head: One term per attention head (and the output bias) instead of
      one per attention layer.

  Returns:
    A `ResidStack`.

  Raises:
    ValueError: for a layer outside ``0..num_layers``.
  """
  num_layers = model.config.num_layers
  layer = num_layers if layer is None else layer
  if (not isinstance(layer, int) or isinstance(layer, bool)
      or not 0 <= layer <= num_layers):
    raise ValueError(
        f"layer must be an int in 0..{num_layers} (the block whose input"
        f" is decomposed; {num_layers} or None: the final residual stream),"
        f" got {layer!r}.")
  attn = "attn.head_out" if per_head else "attn_out"
  resid = (f"blocks.{layer}.resid_pre" if layer < num_layers
           else f"blocks.{num_layers - 1}.resid_post")
  names = ["embed", resid, *(f"blocks.{i}.{p}" for i in range(layer)
                             for p in (attn, "mlp_out"))]
  cache = run_with_cache(model, tokens, names=names, logits=False)
  table = WeightTable(model)
  labels, terms = _embed_terms(table, cache, cache.lengths)
  terms = [t[None] for t in terms]
  for i in range(layer):
    if per_head:
      head_labels, head_terms = _head_terms(model, table, cache, i)
      labels += head_labels
      terms.append(head_terms)
    else:
      labels.append(f"blocks.{i}.attn_out")
      terms.append(_array(cache[f"blocks.{i}.attn_out"], "batch", "seq",
                          "embedding")[None])
    labels.append(f"blocks.{i}.mlp_out")
    terms.append(_array(cache[f"blocks.{i}.mlp_out"], "batch", "seq",
                        "embedding")[None])
  return ResidStack(
      components=pz.nx.wrap(jnp.concatenate(terms)).tag(*AXES),
      labels=tuple(labels),
      resid=pz.nx.wrap(_array(cache[resid], "batch", "seq", "embedding")
                       ).tag("batch", "seq", "embedding"),
      lengths=tuple(cache.lengths), layer=layer)


def apply_final_norm(model, stack: ResidStack) -> ResidStack:
  """Each term of the final residual stream through the final norm, with
  the denominator the whole stream had in the run (TransformerLens's
  ``apply_ln_to_stack``): centred first for a LayerNorm, then divided by
  it and multiplied by the norm's scale; a LayerNorm's shift becomes a
  term of its own (``ln_final.b``), so the terms sum to the final norm's
  output.

  Raises:
    ValueError: if ``stack`` is not of the final stream
      (``decompose_resid(..., layer=None)``) or is normed already.
  """
  config = model.config
  if stack.layer != config.num_layers or stack.normed:
    raise ValueError(
        "apply_final_norm needs the stream the final norm reads, not yet"
        " normed: decompose_resid(model, tokens) (layer=None); got a stack"
        f" of layer {stack.layer}" + (", already normed." if stack.normed
                                       else "."))
  full = _array(stack.resid, "batch", "seq", "embedding")
  terms = _array(stack.components, *AXES)
  table = WeightTable(model)
  scale = _array(table["ln_final.w"], "embedding")
  normed = _frozen_norm(config, scale, full, jnp.concatenate(
      [terms, full[None]]))
  terms, resid, labels = normed[:-1], normed[-1], stack.labels
  if "ln_final.b" in table:
    shift = _array(table["ln_final.b"], "embedding")
    terms = jnp.concatenate([terms, jnp.broadcast_to(shift, resid.shape)[None]])
    resid, labels = resid + shift, (*labels, "ln_final.b")
  return dataclasses.replace(
      stack, components=pz.nx.wrap(terms).tag(*AXES), labels=labels,
      resid=pz.nx.wrap(resid).tag("batch", "seq", "embedding"), normed=True)


def _per_row(ids, rows: int, vocab: int, what: str) -> np.ndarray:
  values = np.asarray(ids)
  if values.ndim == 0:
    values = np.full((rows,), values)
  if (values.shape != (rows,) or not np.issubdtype(values.dtype, np.integer)
      or (values < 0).any() or (values >= vocab).any()):
    raise ValueError(
        f"{what} must be one token id or one per row ({rows} rows), each in"
        f" [0, {vocab}); got {ids!r}.")
  return values


def logit_attribution(model, stack: ResidStack, answers, wrong=None, *,
                      position: int = -1) -> pz.nx.NamedArray:
  """Each term's direct effect on ``logit[answer]`` (minus
  ``logit[wrong]``) at one position.

  Args:
    model: The model the stack came from (for its unembedding).
    stack: A stack through the final norm (`apply_final_norm`).
    answers: A token id, or one per row.
    wrong: None, or a token id (one per row) whose logit is subtracted.
    position: The position (an index into ``seq``; -1, the last, is every
      row's last token, rows being left-padded).

  Returns:
    ``(component, batch)`` float32: the terms' effects, which sum to the
    model's (pre soft-cap) logit difference at that position.

  Raises:
    ValueError: for a stack not through the final norm, token ids outside
      the vocabulary, or a position outside the stack.
  """
  if not stack.normed:
    raise ValueError("logit_attribution needs the terms through the final"
                     " norm: logit_attribution(model, apply_final_norm(model,"
                     " stack), ...).")
  rows = stack.components.named_shape["batch"]
  seq = stack.components.named_shape["seq"]
  if (not isinstance(position, int) or isinstance(position, bool)
      or not -seq <= position < seq):
    raise ValueError(f"position must be an int in [{-seq}, {seq}) (the"
                     f" stack's {seq} positions), got {position!r}.")
  vocab = model.config.vocab_size
  answers = _per_row(answers, rows, vocab, "answers")
  w_u = _array(weights(model, "unembed.W_U"), "embedding", "vocabulary")
  direction = w_u[:, answers]
  if wrong is not None:
    direction = direction - w_u[:, _per_row(wrong, rows, vocab, "wrong")]
  terms = _array(stack.components, *AXES)[:, :, position, :]
  effect = jnp.einsum("cbe,eb->cb", terms, direction)
  return pz.nx.wrap(effect).tag("component", "batch")
