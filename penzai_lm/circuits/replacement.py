"""The local replacement model of one prompt (circuit-tracer's).

`LinearizedModel` is the model with, in every block:

* the attention patterns frozen (``stop_gradient`` after the softmax);
* the norms' denominators frozen (RMSNorm's ``rsqrt(mean(x^2) + eps)``,
  LayerNorm's ``rsqrt(var + eps)``: ``stop_gradient``);
* the MLP's output frozen (no gradient reaches its input), except a
  transcoder's affine skip connection, which stays a linear path;

and a zero-valued additive input ("delta") at the ``embed`` point and at
every block's ``mlp_out`` point. As a function of the deltas it is affine,
and its value at zero is the model's own forward pass on the prompt, so its
Jacobian is the linear map of the replacement model: a source placed at a
point (a feature's ``a * w_dec``, an error vector, a token embedding) moves
the targets (the MLP inputs the transcoders read, the logits) by the
Jacobian applied to it.

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
from penzai_lm.model.captures import Capture
from penzai_lm.model.hooks import HookPoint
from penzai_lm.model.stateless import stateless_call
from penzai_lm.model.transformer import TransformerFeedForward
from penzai_lm.model.transformer import TransformerLM
from penzai_lm.model.transformer import eager
from penzai_lm.runtime.unstack import unstack_layers
from penzai_lm.sae.autoencoder import contract

EMBED_DELTA = "circuits_embed_delta"
MLP_DELTA = "circuits_mlp_delta"
_LAYERS = "circuit_layers"
_LABEL = "circuits"


def _stop(x):
  return pz.nx.nmap(jax.lax.stop_gradient)(x)


@pz.pytree_dataclass
class _StopGradient(pz.nn.Layer):
  """Identity forward, zero gradient (freezes attention patterns)."""

  def __call__(self, x, /, **_side_inputs):
    return _stop(x)


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
class _FrozenMLP(pz.nn.Layer):
  """The MLP's output with no gradient to its input, but through the
  transcoder's skip connection ``w_skip`` (if any): ``sg(y - skip(x)) +
  skip(x)``.

  Attributes:
    mlp: The MLP.
    w_skip: The skip matrix, axes ``embedding_in`` and ``embedding``, or
      None.
  """

  mlp: pz.nn.Layer
  w_skip: pz.nx.NamedArray | None

  def __call__(self, x, /, **side_inputs):
    y = self.mlp(x, **side_inputs)
    if self.w_skip is None:
      return _stop(y)
    renamed = x.astype(self.w_skip.dtype).untag("embedding").tag(
        "embedding_in")
    skip = contract(renamed, self.w_skip, ("embedding_in",)).astype(y.dtype)
    return _stop(y - skip) + skip


@pz.pytree_dataclass
class _AddDelta(pz.nn.Layer):
  """Adds the embed delta (``layer`` None) or block ``layer``'s MLP delta
  (side inputs)."""

  layer: int | None = dataclasses.field(metadata={"pytree_node": False})

  def __call__(self, x, /, **side_inputs):
    if self.layer is None:
      delta = side_inputs[EMBED_DELTA]
    else:
      delta = side_inputs[MLP_DELTA][{_LAYERS: self.layer}]
    return x + delta.astype(x.dtype)


def _norms(norm) -> dict:
  across = norm.across
  return {"across": (across,) if isinstance(across, str) else tuple(across),
          "epsilon": norm.epsilon}


def _patched(model: TransformerLM, transcoders, seq_len: int):
  """The unstacked model with the freezes, deltas and captures."""
  body = unstack_layers(model)
  body = pz.select(body).at_instances_of(pz.nn.RMSStandardize).apply(
      lambda n: _FrozenRMSStandardize(**_norms(n)))
  body = pz.select(body).at_instances_of(pz.nn.Standardize).apply(
      lambda n: _FrozenStandardize(**_norms(n)))
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
    if h.point == "mlp_out":
      return pz.nn.Sequential([h, capture(f"mlp_out.{layer}"),
                               _AddDelta(layer)])
    return h

  body = pz.select(body).at_instances_of(HookPoint).apply(at_hook)
  blocks = iter(transcoders)  # The MLPs are selected in block order.
  body = pz.select(body).at_instances_of(TransformerFeedForward).apply(
      lambda mlp: _FrozenMLP(mlp, next(blocks).w_skip))
  return body


@pz.pytree_dataclass
class LinearizedModel(pz.Struct):
  """The prompt's replacement model as an affine function of the deltas
  (see the module docstring). A pytree: pass it into ``jax.jit``.

  Attributes:
    stateless: The patched model with its capture variables unbound.
    variables: Their (frozen) initial values.
    tokens: The prompt, a named array over ``seq``.
    num_layers: Blocks (``L``).
    width: The residual width (``D``).
  """

  stateless: pz.nn.Layer
  variables: tuple
  tokens: pz.nx.NamedArray
  num_layers: int = dataclasses.field(metadata={"pytree_node": False})
  width: int = dataclasses.field(metadata={"pytree_node": False})

  def run(self, embed_delta: jax.Array, mlp_delta: jax.Array) -> dict:
    """The patched forward pass: ``{"embed": [T, D], "mlp_in": [L, T, D],
    "mlp_out": [L, T, D], "logits": [T, V]}`` (float32), each point's value
    before its delta is added."""
    deltas = {
        EMBED_DELTA: pz.nx.wrap(embed_delta).tag("seq", "embedding"),
        MLP_DELTA: pz.nx.wrap(mlp_delta).tag(_LAYERS, "seq", "embedding"),
    }
    with eager():  # Traced by the caller's jit (or run op by op).
      logits, values = stateless_call(self.stateless, self.variables,
                                      self.tokens, **deltas)
    by_label = {v.label: v.value.unwrap("seq", "embedding")
                for v in values}
    layers = range(self.num_layers)

    def stacked(name):
      return jnp.stack([by_label[f"{_LABEL}/{name}.{i}"] for i in layers])

    return {"embed": by_label[f"{_LABEL}/embed"],
            "mlp_in": stacked("mlp_in"), "mlp_out": stacked("mlp_out"),
            "logits": logits.unwrap("seq", "vocabulary").astype(jnp.float32)}

  def targets(self, embed_delta: jax.Array, mlp_delta: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
    """``(mlp_in [L, T, D], logits at the last position [V])``: what the
    graph's targets read (feature pre-activations are ``w_enc`` columns
    dotted with ``mlp_in``)."""
    out = self.run(embed_delta, mlp_delta)
    return out["mlp_in"], out["logits"][-1]


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
  return LinearizedModel(stateless=stateless, variables=tuple(values),
                         tokens=named, num_layers=model.config.num_layers,
                         width=model.config.hidden_size)
