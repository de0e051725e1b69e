"""The local replacement model of one prompt (circuit-tracer's).

`LinearizedModel` is the model with, in every block:

* the attention patterns frozen (``stop_gradient`` after the softmax);
* every norm's denominator frozen (RMSNorm's ``rsqrt(mean(x^2) + eps)``,
  LayerNorm's ``rsqrt(var + eps)``: ``stop_gradient``): the pre-attention,
  pre-MLP and final norms, Gemma's post-attention and post-MLP norms, and
  the query and key norms (Gemma 3, Qwen3; these only reach the frozen
  patterns, so freezing them or not gives the same map);
* the MLP branch's output at ``mlp_out`` frozen (no gradient from it to
  ``mlp_in``): the MLP and, in Gemma, its post-MLP norm, except a
  transcoder's affine skip connection, a linear path from ``mlp_in``
  straight to ``mlp_out`` (``sg(out - skip) + skip`` at ``mlp_out``);

and a zero-valued additive input ("delta") at the ``embed`` point and at
every block's ``mlp_out`` point. As a function of the deltas it is affine,
and its value at zero is the model's own forward pass on the prompt, so its
Jacobian is the linear map of the replacement model: a source placed at a
point (a feature's ``a * w_dec``, an error vector, a token embedding) moves
the targets (the MLP inputs the transcoders read, the logits) by the
Jacobian applied to it.

This is circuit-tracer 0.5's replacement model on every family
penzai_lm builds (Llama, Qwen, Gemma 2 and 3, GPT-2): its TransformerLens
backend detaches ``hook_pattern``, every norm's ``hook_scale`` (``ln1``,
``ln2``, ``ln1_post``, ``ln2_post``, ``ln_final``) and applies
``skip + (out - skip).detach()`` at the transcoders' output hook, which for
Gemma is ``hook_mlp_out``, after the post-MLP norm (penzai_lm's
``mlp_out`` too); its nnsight backend freezes the same norms' ``rsqrt``
(the query and key norms too on Gemma 3; on Qwen3 it leaves them, which
gives the same map). A token's vector is its embedding as it enters block
0, Gemma's ``sqrt(hidden_size)`` scale included (TransformerLens folds
the scale into ``W_E``: the same vectors and edges; circuit-tracer's
nnsight backend on Gemma 3 dots the gradient at the scaled
``embed_tokens`` output with the unscaled embedding row, so its token
edges are these divided by ``sqrt(hidden_size)``).
`benchmarks/circuits_families_vs_circuit_tracer.py` compares the graphs
with circuit-tracer's on Gemma 2 and Gemma 3.

Soft-capped logits (Gemma 2's ``final_logit_softcap``): the logit targets
are the logits before the cap (``targets``), which is where circuit-tracer
injects its demeaned unembedding vectors (the final norm's output, before
the unembedding and the cap); the cap only enters the logit probabilities,
read from the model's own (capped) logits (``run``'s ``"logits"``).

Array conventions (plain float32 arrays, one prompt, no batch axis): ``L``
blocks, ``T`` positions, ``D`` the residual width, ``V`` the vocabulary:
the embed delta and embeddings are ``[T, D]``, the MLP deltas, MLP inputs
and outputs ``[L, T, D]`` (layer-major), logits ``[T, V]``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from penzai import pz

from penzai_lm.circuits.features import check_transcoders
from penzai_lm.circuits.remat import Rematerialized
from penzai_lm.model.captures import Capture
from penzai_lm.model.hooks import HookPoint
from penzai_lm.model.layers import SoftCap
from penzai_lm.model.stateless import stateless_call
from penzai_lm.model.transformer import TransformerBlock
from penzai_lm.model.transformer import TransformerLM
from penzai_lm.model.transformer import eager
from penzai_lm.runtime.unstack import unstack_layers
from penzai_lm.sae.autoencoder import contract

EMBED_DELTA = "circuits_embed_delta"
MLP_DELTA = "circuits_mlp_delta"
_LABEL = "circuits"


def _stop(x):
  return pz.nx.nmap(jax.lax.stop_gradient)(x)


@pz.pytree_dataclass
class _StopGradient(pz.nn.Layer):
  """Identity forward, zero gradient (freezes attention patterns)."""

  def __call__(self, x, /, **_side_inputs):
    return _stop(x)


@pz.pytree_dataclass
class _LastPosition(pz.nn.Layer):
  """Keeps the last position (the only one whose logits the graph
  reads): the unembedding, and its backward pass, then cost one position
  instead of ``T``."""

  def __call__(self, x, /, **_side_inputs):
    return pz.nx.nmap(lambda v: v[-1:])(x.untag("seq")).tag("seq")


@pz.pytree_dataclass
class _FrozenRMSStandardize(pz.nn.Layer):
  """`pz.nn.RMSStandardize` with its denominator frozen."""

  across: tuple[str, ...] = dataclasses.field(metadata={"pytree_node": False})
  epsilon: float | jax.Array

  def __call__(self, value, /, **_side_inputs):
    def standardize(x):
      scale = jax.lax.rsqrt(jnp.mean(jnp.square(x)) + self.epsilon)
      return x * jax.lax.stop_gradient(scale)
    return pz.nx.nmap(standardize)(value.untag(*self.across)).tag(
        *self.across)


@pz.pytree_dataclass
class _FrozenStandardize(pz.nn.Layer):
  """`pz.nn.Standardize` (LayerNorm) with its denominator frozen."""

  across: tuple[str, ...] = dataclasses.field(metadata={"pytree_node": False})
  epsilon: float | jax.Array

  def __call__(self, value, /, **_side_inputs):
    def standardize(x):
      centred = x - jnp.mean(x)
      scale = jax.lax.rsqrt(jnp.mean(jnp.square(centred)) + self.epsilon)
      return centred * jax.lax.stop_gradient(scale)
    return pz.nx.nmap(standardize)(value.untag(*self.across)).tag(
        *self.across)


@pz.pytree_dataclass
class _FrozenMLPBranch(pz.nn.Layer):
  """A block's MLP branch (``read`` up to the ``mlp_in`` point, ``mlp``:
  the MLP and any post-MLP norm, ``write`` from the ``mlp_out`` point on)
  whose output at ``mlp_out`` has no gradient to ``mlp_in`` except through
  the transcoder's skip connection ``w_skip`` (if any): ``sg(y - skip(x)) +
  skip(x)``, circuit-tracer's freeze at its output hook.

  Attributes:
    read: The pre-MLP norm and the ``mlp_in`` point.
    mlp: The MLP and the post-MLP norm (Gemma), if any.
    write: The ``mlp_out`` point.
    w_skip: The skip matrix, axes ``embedding_in`` and ``embedding``, or
      None.
  """

  read: pz.nn.Layer
  mlp: pz.nn.Layer
  write: pz.nn.Layer
  w_skip: pz.nx.NamedArray | None

  def __call__(self, h, /, **side_inputs):
    x = self.read(h, **side_inputs)
    y = self.mlp(x, **side_inputs)
    if self.w_skip is None:
      return self.write(_stop(y), **side_inputs)
    renamed = x.astype(self.w_skip.dtype).untag("embedding").tag(
        "embedding_in")
    skip = contract(renamed, self.w_skip, ("embedding_in",)).astype(y.dtype)
    return self.write(_stop(y - skip) + skip, **side_inputs)


@pz.pytree_dataclass
class _AddDelta(pz.nn.Layer):
  """Adds the embed delta (``layer`` None) or block ``layer``'s MLP delta
  (side inputs)."""

  layer: int | None = dataclasses.field(metadata={"pytree_node": False})

  def __call__(self, x, /, **side_inputs):
    if self.layer is None:
      delta = side_inputs[EMBED_DELTA]
    else:
      delta = side_inputs[MLP_DELTA][self.layer]
    return x + delta.astype(x.dtype)


def _norms(norm) -> dict:
  across = norm.across
  return {"across": (across,) if isinstance(across, str) else tuple(across),
          "epsilon": norm.epsilon}


def _point_index(layers, point: str) -> int | None:
  """The index of the one `HookPoint` for ``point`` among ``layers``, or
  None (none, or several)."""
  found = [i for i, layer in enumerate(layers)
           if isinstance(layer, HookPoint) and layer.point == point]
  return found[0] if len(found) == 1 else None


def _freeze_mlp_branches(body, transcoders, num_layers: int):
  """``body`` with each block's MLP branch (the residual branch holding the
  ``mlp_in`` point) a `_FrozenMLPBranch`, block by block."""
  branches = pz.select(body).at_instances_of(pz.nn.Residual).where(
      lambda r: isinstance(r.delta, pz.nn.Sequential)
      and _point_index(r.delta.sublayers, "mlp_in") is not None)
  if branches.count() != num_layers:
    raise ValueError(
        f"found {branches.count()} MLP branches (a residual branch holding"
        f" an mlp_in point) in a model of {num_layers} blocks: the circuits"
        " replacement model needs the block layout build_transformer"
        " makes.")
  blocks = iter(transcoders)  # Selected in block order.

  def frozen(residual):
    layers = list(residual.delta.sublayers)
    i = _point_index(layers, "mlp_in")
    j = _point_index(layers, "mlp_out")
    if j is None or j <= i:
      raise ValueError("an MLP branch has no mlp_out point after its mlp_in"
                       " point: the circuits replacement model needs the"
                       " block layout build_transformer makes.")
    return pz.nn.Residual(_FrozenMLPBranch(
        read=pz.nn.Sequential(layers[:i + 1]),
        mlp=pz.nn.Sequential(layers[i + 1:j]),
        write=pz.nn.Sequential(layers[j:]), w_skip=next(blocks).w_skip))

  return branches.apply(frozen)


def _without_final_cap(model: TransformerLM) -> TransformerLM:
  """``model`` with its final logit soft-cap (the body's last layer)
  removed, if it has one."""
  cap = model.config.final_logit_softcap
  if not cap:
    return model
  layers = getattr(model.body, "sublayers", None)
  if not layers or not isinstance(layers[-1], SoftCap):
    raise ValueError(
        f"the model's config has final_logit_softcap={cap} but its body"
        " does not end with a SoftCap layer: the circuits replacement model"
        " needs the layout build_transformer makes.")
  return dataclasses.replace(model,
                             body=pz.nn.Sequential(list(layers[:-1])))


def _patched(model: TransformerLM, transcoders, seq_len: int):
  """The unstacked model without its final soft-cap, with the freezes,
  deltas and captures."""
  body = _without_final_cap(unstack_layers(model))
  body = _freeze_mlp_branches(body, transcoders, model.config.num_layers)
  body = pz.select(body).at_instances_of(pz.nn.RMSStandardize).apply(
      lambda n: _FrozenRMSStandardize(**_norms(n)))
  body = pz.select(body).at_instances_of(pz.nn.Standardize).apply(
      lambda n: _FrozenStandardize(**_norms(n)))
  body = pz.select(body).at_instances_of(pz.nn.Attention).apply(
      Rematerialized)
  hidden = model.config.hidden_size

  def capture(name):
    return Capture(pz.StateVariable(
        pz.nx.zeros({"seq": seq_len, "embedding": hidden}, jnp.float32),
        label=f"{_LABEL}/{name}"))

  def at_hook(h: HookPoint):
    layer = None if h.layer is None else int(h.layer.data_array)
    if h.point == "attn.pattern":
      return pz.nn.Sequential([h, _StopGradient()])
    if h.point == "embed":
      return pz.nn.Sequential([h, capture("embed"), _AddDelta(None)])
    if h.point == "mlp_in":
      return pz.nn.Sequential([h, capture(f"mlp_in.{layer}")])
    if h.point == "resid_pre":
      return pz.nn.Sequential([h, capture(f"resid_pre.{layer}")])
    if h.point == "final_norm":
      return pz.nn.Sequential([h, _LastPosition()])
    if h.point == "mlp_out":
      return pz.nn.Sequential([h, capture(f"mlp_out.{layer}"),
                               _AddDelta(layer)])
    return h

  return pz.select(body).at_instances_of(HookPoint).apply(at_hook)


@pz.pytree_dataclass
class LinearizedModel(pz.Struct):
  """The prompt's replacement model as an affine function of the deltas
  (see the module docstring). A pytree: pass it into ``jax.jit``. Its
  attention layers are `Rematerialized` for reverse mode (`jax.vjp`); use
  `forward_mode` for `jax.jvp`.

  Attributes:
    stateless: The patched model with its capture variables unbound (and
      without the final logit soft-cap).
    variables: Their (frozen) initial values.
    tokens: The prompt, a named array over ``seq``.
    num_layers: Blocks (``L``).
    width: The residual width (``D``).
    logit_softcap: The model's final logit soft-cap, or None.
    cut: Whether the model stops after its first ``num_layers`` blocks
      (`first_blocks`): no logits.
  """

  stateless: pz.nn.Layer
  variables: tuple
  tokens: pz.nx.NamedArray
  num_layers: int = dataclasses.field(metadata={"pytree_node": False})
  width: int = dataclasses.field(metadata={"pytree_node": False})
  logit_softcap: float | None = dataclasses.field(
      default=None, metadata={"pytree_node": False})
  cut: bool = dataclasses.field(default=False,
                                metadata={"pytree_node": False})

  def run(self, embed_delta: jax.Array, mlp_delta) -> dict:
    """The patched forward pass: ``{"embed": [T, D], "resid_pre": [L, T,
    D], "mlp_in": [L, T, D], "mlp_out": [L, T, D], "logits": [V],
    "target_logits": [V]}`` (float32), each point's value before its delta
    is added; the logits are the last position's only. ``"logits"`` are
    the model's (soft-capped if it caps them), ``"target_logits"`` the
    logits before the cap (the same array without one).

    ``mlp_delta`` is ``[L, T, D]`` or a sequence of ``L`` ``[T, D]``
    arrays (`zero_deltas`'s form): differentiated as separate arrays, each
    block's gradient is its own ``[T, D]``, where slicing one ``[L, T, D]``
    array would give every block an ``[L, T, D]`` gradient to add up.
    """
    deltas = {
        EMBED_DELTA: pz.nx.wrap(embed_delta).tag("seq", "embedding"),
        MLP_DELTA: tuple(pz.nx.wrap(mlp_delta[i]).tag("seq", "embedding")
                         for i in range(self.num_layers)),
    }
    with eager():  # Traced by the caller's jit (or run op by op).
      raw, values = stateless_call(self.stateless, self.variables,
                                   self.tokens, **deltas)
    by_label = {v.label: v.value.unwrap("seq", "embedding")
                for v in values}
    layers = range(self.num_layers)

    def stacked(name):
      return jnp.stack([by_label[f"{_LABEL}/{name}.{i}"] for i in layers])

    if self.cut:  # No logits: a zero in their place.
      target_logits = jnp.zeros((1,), jnp.float32)
    else:
      target_logits = raw.unwrap("seq", "vocabulary")[0].astype(jnp.float32)
    logits = target_logits
    if self.logit_softcap and not self.cut:
      cap = SoftCap(cap=self.logit_softcap)(raw)
      logits = cap.unwrap("seq", "vocabulary")[0].astype(jnp.float32)
    return {"embed": by_label[f"{_LABEL}/embed"],
            "resid_pre": stacked("resid_pre"), "mlp_in": stacked("mlp_in"),
            "mlp_out": stacked("mlp_out"), "logits": logits,
            "target_logits": target_logits}

  def prefix(self, length: int) -> LinearizedModel:
    """The replacement model of the prompt's first ``length`` positions:
    the same layers (no copy of the weights), shorter tokens and
    captures. Its values there equal this model's (attention is
    causal)."""
    def cut(x):
      return pz.nx.nmap(lambda a: a[:length])(x.untag("seq")).tag("seq")
    variables = tuple(dataclasses.replace(v, value=cut(v.value))
                      for v in self.variables)
    return dataclasses.replace(self, variables=variables,
                               tokens=cut(self.tokens))

  def first_blocks(self, n: int) -> LinearizedModel:
    """The model cut after block ``n - 1``: `run` gives the first ``n``
    blocks' values (the same as this model's: a block reads none after
    it) and a zero ``[1]`` array for the logits. Same layers, no copy."""
    if n == self.num_layers:
      return self
    layers = self.stateless.body.sublayers
    at = next(i for i, layer in enumerate(layers)
              if isinstance(layer, pz.nn.Sequential) and layer.sublayers
              and isinstance(layer.sublayers[0], TransformerBlock))
    body = pz.nn.Sequential([*layers[:at], pz.nn.Sequential(
        list(layers[at].sublayers[:n]))])

    def kept(variable) -> bool:  # The captures of blocks 0..n-1.
      layer = variable.label.rpartition(".")[2]
      return not layer.isdigit() or int(layer) < n

    return dataclasses.replace(
        self, stateless=dataclasses.replace(self.stateless, body=body),
        variables=tuple(v for v in self.variables if kept(v)),
        num_layers=n, cut=True)

  def forward_mode(self) -> LinearizedModel:
    """This model with its attention layers not rematerialized, for
    `jax.jvp` (a `Rematerialized` layer has a custom VJP and no
    forward-mode rule). The same values."""
    stateless = pz.select(self.stateless).at_instances_of(
        Rematerialized).apply(lambda layer: layer.inner)
    return dataclasses.replace(self, stateless=stateless)

  def zero_deltas(self) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """``(embed delta [T, D], L MLP deltas [T, D])``, zeros: where the
    replacement model is the real model."""
    seq = self.tokens.named_shape["seq"]
    return (jnp.zeros((seq, self.width), jnp.float32),
            tuple(jnp.zeros((seq, self.width), jnp.float32)
                  for _ in range(self.num_layers)))

  def targets(self, embed_delta: jax.Array, mlp_delta
              ) -> tuple[jax.Array, jax.Array]:
    """``(mlp_in [L, T, D], logits before any soft-cap at the last position
    [V])``: what the graph's targets read (feature pre-activations are
    ``w_enc`` columns dotted with ``mlp_in``; logit nodes read these
    logits, demeaned, as circuit-tracer's do). Affine in the deltas."""
    out = self.run(embed_delta, mlp_delta)
    return out["mlp_in"], out["target_logits"]


def linearize(model: TransformerLM, transcoders, tokens) -> LinearizedModel:
  """Builds the prompt's `LinearizedModel`.

  Args:
    model: A `TransformerLM` (stacked or not).
    transcoders: Per-layer transcoders, as `penzai_lm.circuits.attribute`
      takes them.
    tokens: 1-D int array of prompt ids.

  Returns:
    The `LinearizedModel`.

  Raises:
    TypeError, ValueError: for transcoders that do not fit the model
      (`check_transcoders`).
  """
  transcoders = check_transcoders(model, transcoders)
  seq_len = int(tokens.shape[0])
  body = _patched(model, transcoders, seq_len)
  stateless, values = pz.unbind_state_vars(body, freeze=True)
  named = pz.nx.wrap(jnp.asarray(tokens, jnp.int32)).tag("seq")
  cap = model.config.final_logit_softcap
  return LinearizedModel(stateless=stateless, variables=tuple(values),
                         tokens=named, num_layers=model.config.num_layers,
                         width=model.config.hidden_size,
                         logit_softcap=float(cap) if cap else None)
