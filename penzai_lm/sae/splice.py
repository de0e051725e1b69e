"""Splicing an autoencoder into a model, with its features as named points.

`splice(model, sae)` puts a `Splice` layer where the autoencoder reads:

* an SAE (reads and writes ``blocks.{i}.P``) goes right before that point's
  hook point, so whatever records ``blocks.{i}.P`` sees its output;
* a transcoder (reads ``blocks.{i}.A``, writes ``blocks.{i}.B``, e.g.
  ``mlp_in`` -> ``mlp_out``) wraps the layers between the two points: it
  runs them, and adds its own edit to their output.

The splice adds points of its own, named after the point read and the
splice's ``name`` (default "sae" / "transcoder"):

=====================================  =====================================
``blocks.{i}.P.sae.features``          feature activations (``features``);
                                       interventions inserted here (e.g.
                                       `FeatureEdit`) change the model
``blocks.{i}.P.sae.top_values``        the ``top_k`` largest activations
``blocks.{i}.P.sae.top_ids``           ... and their feature ids (int32):
                                       a sparse capture, ``top_k`` wide
``blocks.{i}.P.sae.error``             the value minus the autoencoder's
                                       reconstruction (prediction)
=====================================  =====================================

The last three are read-only: capture them (``run_with_cache``,
``generate(capture=...)``); they are computed only when recorded.

By default (``mode="error"``) the error term is kept: the output is the
model's own value plus the decoded *change* of the features,
``x + (f_edited - f) @ w_dec``, which is exactly ``x`` when nothing edits
the features: splicing alone changes no value at the point, bit for bit,
and no logit (bit for bit op by op, ``penzai_lm.eager()``; a compiled
forward pass may fuse the blocks after it differently, which moves gemma3's
logits by ~1e-6). "Unchanged" is against the model with per-layer blocks:
a layer stack is unstacked by the splice, and its own compiled scan rounds
differently (logits equal to about 1e-5 relative, not bit for bit).
``mode="replace"`` outputs the reconstruction itself (for "loss when
spliced" metrics).

When nothing records the splice's points and its features are only edited
by `FeatureEdit`s (steering), the change is computed from the edited
features alone: their encoder columns and decoder rows, not the whole
dictionary (`_sparse_change`), so steering costs about what an
`AddVector` does (`benchmarks/sae_overhead.py` compares them). With no
edit at all, the splice returns the value as it came.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from penzai import pz

from penzai_lm.model import points as points_lib
from penzai_lm.model.hooks import BLOCK_POINTS
from penzai_lm.model.hooks import HookPoint
from penzai_lm.runtime.unstack import unstack_layers
from penzai_lm.sae.autoencoder import contract
from penzai_lm.sae.autoencoder import FEATURES
from penzai_lm.sae.autoencoder import row_norms
from penzai_lm.sae.autoencoder import SparseAutoencoder
from penzai_lm.sae.edits import EDITED
from penzai_lm.sae.edits import FeatureEdit
from penzai_lm.sae.edits import take_features

TOP = "top_k"
SUB_POINTS = ("features", "top_values", "top_ids", "error")


@pz.pytree_dataclass(has_implicitly_inherited_fields=True)  # pytype: disable=wrong-keyword-args
class FeaturePoint(HookPoint):
  """A hook point added by a splice, which knows its value's axes (captures
  allocate their buffers from them).

  Attributes:
    value_axes: ``((name, size), ...)`` besides the batch axes and ``seq``.
    value_dtype: The value's dtype name (captures keep it).
  """

  value_axes: tuple[tuple[str, int], ...] = dataclasses.field(
      default=(), metadata={"pytree_node": False})
  value_dtype: str = dataclasses.field(
      default="float32", metadata={"pytree_node": False})


@pz.pytree_dataclass
class Splice(pz.nn.Layer):
  """An autoencoder spliced in at a point (see the module docstring).

  Attributes:
    sae: The autoencoder.
    inner: For a transcoder, the model's layers between the point read and
      the point written; None for an SAE.
    features: Where the features pass (a `FeaturePoint` in a Sequential:
      interventions are inserted before it).
    top_values: Read-only point: the ``top_k`` largest activations.
    top_ids: Read-only point: their feature ids.
    error: Read-only point: value minus reconstruction.
    mode: "error" (keep the error term) or "replace".
    top_k: Width of the sparse capture.
  """

  sae: SparseAutoencoder
  inner: pz.nn.Layer | None
  features: pz.nn.Sequential
  top_values: pz.nn.Sequential
  top_ids: pz.nn.Sequential
  error: pz.nn.Sequential
  mode: Literal["error", "replace"] = dataclasses.field(
      default="error", metadata={"pytree_node": False})
  top_k: int = dataclasses.field(default=32, metadata={"pytree_node": False})

  def __call__(self, x, /, **side_inputs):
    sae = self.sae
    target = x if self.inner is None else self.inner(x, **side_inputs)
    edits = self._edits_only()
    if edits is not None:
      if not edits:
        return target
      change = _sparse_change(sae, x, edits, side_inputs)
      return pz.nx.order_like(target + change.astype(target.dtype), target)
    clean, stats = sae.encode_with_stats(x)
    edited = self.features(clean, **side_inputs)
    top = pz.nx.nmap(lambda f: jax.lax.top_k(f, self.top_k))(
        edited.untag(FEATURES))
    self.top_values(top[0].tag(TOP), **side_inputs)
    self.top_ids(top[1].tag(TOP), **side_inputs)
    skip = sae.skip(x)
    prediction = sae.decode(clean, stats)
    if skip is not None:
      prediction = prediction + skip
    self.error(target.astype(sae.dtype) - prediction, **side_inputs)
    if self.mode == "replace":
      out = sae.decode(edited, stats)
      out = out if skip is None else out + skip
      return pz.nx.order_like(out.astype(target.dtype), target)
    change = sae.denormalize(sae.decode_linear(edited - clean), stats,
                             shift=False)
    return pz.nx.order_like(target + change.astype(target.dtype), target)

  def _edits_only(self) -> list[FeatureEdit] | None:
    """The `FeatureEdit`s at the features point, when they are all the
    splice's points do in error mode (nothing records a value, every edit
    keeps its ids and has no per-feature values); else None."""
    if self.mode != "error" or any(
        len(seq.sublayers) != 1
        for seq in (self.top_values, self.top_ids, self.error)):
      return None
    *edits, last = self.features.sublayers
    if not isinstance(last, FeaturePoint) or not all(
        type(e) is FeatureEdit and e.ids is not None
        and FEATURES not in e.scale.named_shape
        and FEATURES not in e.offset.named_shape for e in edits):
      return None
    return edits


def _sparse_change(sae: SparseAutoencoder, x, edits, side_inputs):
  """What the edits add to the point's value, ``(f_edited - f) @ w_dec``,
  from the edited features alone: their encoder columns and decoder rows
  are gathered, so the cost does not grow with the SAE's width (TopK still
  encodes every feature: membership needs them all). Equal to the dense
  form up to float rounding (the sum's order)."""
  ids = pz.nx.nmap(lambda *a: jnp.concatenate(a))(
      *(e.ids.untag(EDITED) for e in edits)).tag(EDITED)
  # Padding (-1) and repeats (a feature two edits name) add nothing.
  counted = pz.nx.nmap(_first_valid)(ids.untag(EDITED)).tag(EDITED)
  ids = pz.nx.nmap(jnp.maximum)(ids, 0)
  normalized, stats = sae.normalize(x)
  w_dec = take_features(sae.w_dec, ids)
  c = sae.config
  norms = (row_norms(w_dec, sae.output_names)
           if c.rescale_acts_by_decoder_norm else None)
  if c.activation == "topk":
    clean = take_features(sae.activate(sae.pre_activations(x)), ids)
  else:
    if c.apply_b_dec_to_input:
      normalized = normalized - sae.b_dec
    w_enc = take_features(sae.w_enc, ids)
    pre = contract(normalized, w_enc, sae.input_names)
    pre = pre + take_features(sae.b_enc, ids)
    if norms is not None:
      pre = pre * norms
    clean = pz.nx.nmap(jax.nn.relu)(pre)
    if c.activation == "jumprelu":
      keep = pre > take_features(sae.threshold, ids)
      clean = pz.nx.nmap(jnp.where)(keep, clean, jnp.zeros((), clean.dtype))
  edited = clean
  for edit in edits:
    edited = edit.on_ids(edited, ids, **side_inputs)
  delta = pz.nx.nmap(jnp.where)(counted, edited - clean,
                                jnp.zeros((), clean.dtype))
  if norms is not None:
    delta = delta / norms
  change = contract(delta.astype(sae.dtype), w_dec, (EDITED,))
  return sae.denormalize(change, stats, shift=False)


def _first_valid(ids: jax.Array) -> jax.Array:
  """Whether each id is a feature (not -1) seen first at its slot."""
  earlier = jnp.tril(ids[:, None] == ids[None, :], k=-1).any(axis=1)
  return (ids >= 0) & ~earlier


def _default_name(sae: SparseAutoencoder) -> str:
  return "transcoder" if sae.config.is_transcoder else "sae"


def _value_axes(model, point: points_lib.Point) -> dict[str, int]:
  """Axes of a block point's value besides the token axes."""
  return points_lib.point_value_axes(model.config, point.point, 0)


def _check_axes(model, point: points_lib.Point, axes, what: str) -> None:
  have = _value_axes(model, point)
  if point.point == "attn.pattern" or dict(axes) != have:
    raise ValueError(
        f"the autoencoder's {what} axes {dict(axes)} do not match the value"
        f" at {point.name!r}, which has {have}. Splice it at a point of that"
        " shape (SAELens 'hook_z' SAEs read attn.head_out; transcoders read"
        " mlp_in).")


def _model_point(model, name: str, what: str) -> points_lib.Point:
  """``name`` parsed, refused if a splice added it (an autoencoder's
  features, error, ...: the point is already spliced)."""
  parsed = points_lib.parse_point(model, name)
  if parsed.layer is not None and parsed.point not in BLOCK_POINTS:
    base = next((p for p in sorted(BLOCK_POINTS, key=len, reverse=True)
                 if parsed.point.startswith(f"{p}.")), parsed.point)
    raise ValueError(
        f"{what} {name!r} is already spliced: it is a point of the"
        f" autoencoder spliced at 'blocks.{parsed.layer}.{base}', not of the"
        " model. Splice at a model point (e.g. that one, with another"
        " name=).")
  return parsed


def _unstacked(model):
  if pz.select(model).at_instances_of(pz.nn.LayerStack).count():
    return unstack_layers(model)
  return model


def splice(model, sae: SparseAutoencoder, point: str | None = None, *,
           output_point: str | None = None, name: str | None = None,
           mode: str = "error", top_k: int = 32):
  """Splices ``sae`` into ``model`` (see the module docstring).

  Args:
    model: A `TransformerLM` or cached model. A layer stack is unstacked
      first (its blocks alias the stacked weights on CPU), so the
      autoencoder runs in its block only.
    sae: The autoencoder or transcoder.
    point: The point it reads, e.g. ``"blocks.6.resid_post"`` (default: the
      one its config names).
    output_point: For a transcoder, the point it writes (default: its
      config's, else ``mlp_out`` of the same block).
    name: The splice's name in its points (default "sae" or "transcoder").
    mode: "error" (keep the error term: the model is unchanged until its
      features are edited) or "replace" (the reconstruction replaces the
      value).
    top_k: Width of the sparse ``top_ids`` / ``top_values`` capture.

  Returns:
    The patched model.

  Raises:
    ValueError: for a point the model does not have, shapes that do not
      match, a splice name already used there, a point a splice added
      (already spliced), or bad options.
  """
  if not isinstance(sae, SparseAutoencoder):
    raise TypeError(f"sae must be a SparseAutoencoder, got"
                    f" {type(sae).__name__}.")
  sae.check()
  if mode not in ("error", "replace"):
    raise ValueError(f"mode must be 'error' or 'replace', got {mode!r}.")
  if not (isinstance(top_k, int) and not isinstance(top_k, bool)
          and top_k > 0):
    raise ValueError(f"top_k must be a positive int, got {top_k!r}.")
  point = point or sae.config.hook_point
  if point is None:
    raise ValueError("the autoencoder's config names no point: pass"
                     " point='blocks.{i}.resid_post' (or another).")
  read = _model_point(model, point, "point")
  if read.layer is None:
    raise ValueError(f"autoencoders splice at block points"
                     f" ('blocks.{{i}}.P'), got {point!r}.")
  transcoder = sae.config.is_transcoder or output_point is not None
  write = read
  if transcoder:
    output_point = (output_point or sae.config.output_point
                    or f"blocks.{read.layer}.mlp_out")
    write = _model_point(model, output_point, "output_point")
    if write.layer != read.layer:
      raise ValueError(
          f"a transcoder reads and writes in one block; {point!r} and"
          f" {output_point!r} are in different blocks.")
  _check_axes(model, read, sae.config.input_axes, "input")
  _check_axes(model, write, sae.config.output_axes, "output")
  name = name or _default_name(sae)
  if not name.isidentifier():
    raise ValueError(f"name must be an identifier, got {name!r}.")
  prefix = f"{read.point}.{name}"
  if points_lib.has_point(model, f"{prefix}.features", read.layer):
    raise ValueError(f"blocks.{read.layer}.{prefix} is already spliced in;"
                     " give this one another name=.")
  layer = _make_splice(sae, prefix, read.layer, mode,
                       min(top_k, sae.config.num_features))
  model = _unstacked(model)
  if not transcoder:
    return points_lib.insert_at(model, read.name, layer)
  return _wrap_segment(model, read, write, layer)


def _make_splice(sae, prefix, layer, mode, top_k) -> Splice:
  index = pz.nx.wrap(jnp.asarray(layer, jnp.int32))

  def point(sub, axes, dtype="float32"):
    return pz.nn.Sequential([FeaturePoint(
        point=f"{prefix}.{sub}", layer=index, value_axes=tuple(axes),
        value_dtype=dtype)])

  c = sae.config
  return Splice(
      sae=sae, inner=None,
      features=point("features", [(FEATURES, c.num_features)]),
      top_values=point("top_values", [(TOP, top_k)]),
      top_ids=point("top_ids", [(TOP, top_k)], "int32"),
      error=point("error", c.output_axes),
      mode=mode, top_k=top_k)


def _is_hook(node, point: points_lib.Point) -> bool:
  return (type(node) is HookPoint and node.point == point.point
          and node.layer is not None and not node.layer.named_shape
          and int(node.layer.data_array) == point.layer)


def _wrap_segment(model, read, write, layer: Splice):
  """Wraps the layers between ``read`` and ``write`` in ``layer``."""
  found = []

  def wrap(seq: pz.nn.Sequential):
    items = list(seq.sublayers)
    end = next(i for i, n in enumerate(items) if _is_hook(n, write))
    starts = [i + 1 for i, n in enumerate(items[:end]) if _is_hook(n, read)]
    start = starts[-1] if starts else 0
    found.append(starts)
    inner = pz.nn.Sequential(items[start:end])
    return dataclasses.replace(
        seq, sublayers=[*items[:start],
                        dataclasses.replace(layer, inner=inner),
                        *items[end:]])

  def holds_write(node) -> bool:
    return isinstance(node, pz.nn.Sequential) and any(
        _is_hook(n, write) for n in node.sublayers)

  selection = pz.select(model).at_subtrees_where(holds_write)
  patched = selection.apply(wrap)
  if not found:
    raise ValueError(f"{write.name!r} was not found in the model.")
  if not found[0]:
    # The segment is a whole residual branch: it must read the point right
    # before that branch (resid_mid for the MLP, resid_pre for attention).
    branch_inputs = {"mlp_out": "resid_mid", "attn_out": "resid_pre"}
    if branch_inputs.get(write.point) != read.point:
      raise ValueError(
          f"a transcoder from {read.name!r} to {write.name!r} spans more"
          " than one branch of the block; it can read the branch's input"
          f" ({branch_inputs.get(write.point, 'the point before it')}) or a"
          " point inside the branch (mlp_in).")
  return patched
