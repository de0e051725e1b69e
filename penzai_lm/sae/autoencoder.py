"""`SparseAutoencoder`: encode an activation into sparse features, decode back.

One family covers sparse autoencoders (SAEs: read and write the same point)
and transcoders (read one point, write another, e.g. the MLP's input and
output). Axis conventions:

* ``input_axes``: the axes of the value read, e.g. ``{"embedding": 576}``
  for the residual stream, or the query head axes and ``projection`` for an
  SAE on ``attn.head_out`` (SAELens ``hook_z``); the batch axes and ``seq``
  are whatever the value carries, untouched.
* ``features``: the dictionary, ``num_features`` wide.
* ``output_axes``: the axes of the value written (the input axes for an
  SAE).

Weights use the input and output axis names themselves: ``w_enc`` is
``(input axes, features)``, ``w_dec`` ``(features, output axes)``, and an
affine skip connection ``w_skip`` is ``(input axes with an "_in" suffix,
output axes)`` so that an SAE's skip matrix can name both sides.

The computation is SAELens's (v6), so its weights load unchanged::

    x' = normalize(x) - b_dec * apply_b_dec_to_input
    pre = x' @ w_enc + b_enc                (* |w_dec| rows if rescaling)
    f = relu(pre)                           "relu"
      = relu(pre) * (pre > threshold)       "jumprelu"
      = relu(top-k of pre, 0 elsewhere)     "topk"
    out = denormalize(f @ w_dec + b_dec)    (f / |w_dec| rows if rescaling)
          + x @ w_skip                      (when there is a skip)

``normalize`` is SAELens's ``normalize_activations``: "none",
"constant_norm_rescale" (``x * sqrt(d_in) / |x|``, undone on the output)
or "layer_norm" (centre, divide by the unbiased std + 1e-5; the output is
multiplied back by the std and shifted by the mean).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.model import memory
from penzai_lm.sae.sae_config import FEATURES
from penzai_lm.sae.sae_config import SAEConfig

@dataclasses.dataclass(frozen=True)
class NormStats:
  """How to undo the input normalization on the output: ``y * scale +
  shift`` (named arrays over the value's batch axes and ``seq``)."""

  scale: pz.nx.NamedArray | None
  shift: pz.nx.NamedArray | None


def contract(x: pz.nx.NamedArray, w: pz.nx.NamedArray,
             axes: tuple[str, ...]) -> pz.nx.NamedArray:
  """Sums ``x * w`` over ``axes`` (a named matrix product).

  float32 means float32: outside any ``jax.default_matmul_precision``
  scope (a model's forward pass sets its ``matmul_precision``), the product
  runs at full precision, where GPUs would otherwise use TF32 (a direct
  ``sae.encode`` then differed from the spliced one by ~1e-3 on an H200).
  """
  precision = (None if jax.config.jax_default_matmul_precision
               else jax.lax.Precision.HIGHEST)
  return pz.nx.nmap(lambda a, b: jnp.tensordot(
      a, b, axes=len(axes), precision=precision))(
          x.untag(*axes), w.untag(*axes))


def row_norms(w_dec: pz.nx.NamedArray,
              output_names: tuple[str, ...]) -> pz.nx.NamedArray:
  """The norm of each decoder row: ``w_dec``'s output axes summed over."""
  total = pz.nx.nmap(jnp.square)(w_dec)
  for axis in output_names:
    total = total.untag(axis).sum()
  return pz.nx.nmap(jnp.sqrt)(total)


@pz.pytree_dataclass
class SparseAutoencoder(pz.Struct):
  """A sparse autoencoder or transcoder (see the module docstring).

  Attributes:
    config: What it computes (static).
    w_enc: ``(input axes, features)``.
    b_enc: ``(features,)``.
    w_dec: ``(features, output axes)``.
    b_dec: ``(output axes)``.
    threshold: ``(features,)`` for "jumprelu", else None.
    w_skip: ``(input axes + "_in", output axes)`` or None.
  """

  config: SAEConfig = dataclasses.field(metadata={"pytree_node": False})
  w_enc: pz.nx.NamedArray
  b_enc: pz.nx.NamedArray
  w_dec: pz.nx.NamedArray
  b_dec: pz.nx.NamedArray
  threshold: pz.nx.NamedArray | None = None
  w_skip: pz.nx.NamedArray | None = None

  # -- construction ---------------------------------------------------------

  @classmethod
  def from_arrays(cls, config: SAEConfig, *, w_enc, b_enc, w_dec, b_dec,
                  threshold=None, w_skip=None, dtype=None
                  ) -> SparseAutoencoder:
    """From flat matrices in SAELens's layout: ``w_enc`` ``[d_in, d_sae]``,
    ``w_dec`` ``[d_sae, d_out]``, ``b_enc`` ``[d_sae]``, ``b_dec``
    ``[d_out]``, ``threshold`` ``[d_sae]``, ``w_skip`` ``[d_in, d_out]``
    (input-major; SAELens stores its transpose). ``d_in`` is flattened in
    the order of ``config.input_axes`` (SAELens's ``(n_heads d_head)``).

    Raises:
      ValueError: naming the array whose shape does not match the config,
        or one holding NaN or inf (as loading such a file is refused).
    """
    c = config
    d_in, d_out, d_sae = c.input_size, c.output_size, c.num_features
    ins = [n for _, n in c.input_axes]
    outs = [n for _, n in c.output_axes]
    in_names = [a for a, _ in c.input_axes]
    out_names = [a for a, _ in c.output_axes]
    specs = {
        "w_enc": (w_enc, (d_in, d_sae), (*ins, d_sae),
                  (*in_names, FEATURES)),
        "b_enc": (b_enc, (d_sae,), (d_sae,), (FEATURES,)),
        "w_dec": (w_dec, (d_sae, d_out), (d_sae, *outs),
                  (FEATURES, *out_names)),
        "b_dec": (b_dec, (d_out,), tuple(outs), tuple(out_names)),
        "threshold": (threshold, (d_sae,), (d_sae,), (FEATURES,)),
        "w_skip": (w_skip, (d_in, d_out), (*ins, *outs),
                   (*(f"{a}_in" for a in in_names), *out_names)),
    }
    named = {}
    for name, (value, flat, shape, axes) in specs.items():
      if value is None:
        named[name] = None
        continue
      array = jnp.asarray(value, dtype)
      if tuple(array.shape) != flat:
        raise ValueError(f"{name} has shape {tuple(array.shape)}, expected"
                         f" {flat} for this config (d_in={d_in},"
                         f" d_sae={d_sae}, d_out={d_out}).")
      _check_finite(name, array)
      named[name] = pz.nx.wrap(array.reshape(shape)).tag(*axes)
    return cls(config=config, **named).check()

  @classmethod
  def random(cls, config: SAEConfig, seed: int = 0, *, dtype=jnp.float32,
             skip: bool = False) -> SparseAutoencoder:
    """Random weights (for tests and as a training start): decoder rows of
    norm 0.1 in random directions, the encoder their transpose (as
    SAELens's and Anthropic's initializations), zero biases, thresholds
    0.01, a zero skip matrix if ``skip``."""
    c = config
    memory.check_fits(
        f"an autoencoder of {c.num_features:,} features",
        c.num_features * (c.input_size + c.output_size + 2)
        * np.dtype(dtype).itemsize,
        "Lower SAEConfig.num_features.")
    key = jax.random.key(seed)
    w_dec = jax.random.normal(key, (c.num_features, c.output_size), dtype)
    w_dec = 0.1 * w_dec / jnp.linalg.norm(w_dec, axis=-1, keepdims=True)
    if c.input_size == c.output_size:
      w_enc = w_dec.T
    else:
      w_enc = jax.random.normal(jax.random.fold_in(key, 1),
                                (c.input_size, c.num_features), dtype)
      w_enc = 0.1 * w_enc / jnp.linalg.norm(w_enc, axis=0, keepdims=True)
    return cls.from_arrays(
        c, w_enc=w_enc, b_enc=jnp.zeros((c.num_features,), dtype),
        w_dec=w_dec, b_dec=jnp.zeros((c.output_size,), dtype),
        threshold=(jnp.full((c.num_features,), 0.01, dtype)
                   if c.activation == "jumprelu" else None),
        w_skip=(jnp.zeros((c.input_size, c.output_size), dtype) if skip
                else None))

  def flat(self) -> dict[str, jax.Array]:
    """The weights as flat matrices in `from_arrays`'s layout."""
    c = self.config
    d_in, d_out = c.input_size, c.output_size
    out = {
        "w_enc": self.w_enc.unwrap(*self.input_names, FEATURES).reshape(
            d_in, c.num_features),
        "b_enc": self.b_enc.unwrap(FEATURES),
        "w_dec": self.w_dec.unwrap(FEATURES, *self.output_names).reshape(
            c.num_features, d_out),
        "b_dec": self.b_dec.unwrap(*self.output_names).reshape(d_out),
    }
    if self.threshold is not None:
      out["threshold"] = self.threshold.unwrap(FEATURES)
    if self.w_skip is not None:
      out["w_skip"] = self.w_skip.unwrap(
          *(f"{a}_in" for a in self.input_names),
          *self.output_names).reshape(d_in, d_out)
    return out

  # -- shapes ---------------------------------------------------------------

  @property
  def input_names(self) -> tuple[str, ...]:
    return tuple(a for a, _ in self.config.input_axes)

  @property
  def output_names(self) -> tuple[str, ...]:
    return tuple(a for a, _ in self.config.output_axes)

  @property
  def dtype(self):
    return self.w_enc.dtype

  def check(self) -> SparseAutoencoder:
    """Checks every weight's axes against the config.

    Raises:
      ValueError: naming the weight, its axes and the expected ones.
    """
    c = self.config
    inputs, outputs = dict(c.input_axes), dict(c.output_axes)
    features = {FEATURES: c.num_features}
    expected = {
        "w_enc": {**inputs, **features}, "b_enc": features,
        "w_dec": {**features, **outputs}, "b_dec": outputs,
        "threshold": features if c.activation == "jumprelu" else None,
    }
    if self.w_skip is not None:
      expected["w_skip"] = {**{f"{a}_in": n for a, n in c.input_axes},
                            **outputs}
    for name, want in expected.items():
      value = getattr(self, name)
      if want is None:
        continue
      if value is None:
        raise ValueError(f"{name} is missing: a {c.activation} autoencoder"
                         f" needs it with axes {want}.")
      if not isinstance(value, pz.nx.NamedArrayBase) or value.positional_shape:
        raise ValueError(f"{name} must be a named array with axes {want}.")
      if dict(value.named_shape) != want:
        raise ValueError(f"{name} has axes {dict(value.named_shape)}, but this"
                         f" autoencoder's config needs {want}.")
    if c.activation == "jumprelu" or self.threshold is None:
      return self
    raise ValueError(f"threshold is set but the activation is"
                     f" {c.activation!r}; use activation='jumprelu'.")

  # -- the computation ------------------------------------------------------

  def _decoder_norms(self) -> pz.nx.NamedArray:
    return row_norms(self.w_dec, self.output_names)

  def normalize(self, x: pz.nx.NamedArray) -> tuple[pz.nx.NamedArray,
                                                    NormStats]:
    """The input as the encoder sees it, and how to undo it on outputs."""
    x = x.astype(self.dtype)
    kind = self.config.normalize_activations
    if kind == "none":
      return x, NormStats(None, None)
    names = self.input_names
    flat = x.untag(*names)
    size = self.config.input_size

    def reduce(fn, value):
      return pz.nx.nmap(lambda v: fn(v.reshape(-1)))(value)

    if kind == "constant_norm_rescale":
      norm = reduce(jnp.linalg.norm, flat)
      coeff = math.sqrt(size) / norm
      return x * coeff, NormStats(1.0 / coeff, None)
    mean = reduce(jnp.mean, flat)
    centred = x - mean
    std = reduce(lambda v: jnp.std(v, ddof=1), centred.untag(*names))
    return centred / (std + 1e-5), NormStats(std, mean)

  def pre_activations(self, x: pz.nx.NamedArray) -> pz.nx.NamedArray:
    """``normalize(x) - b_dec? @ w_enc + b_enc`` over ``features``."""
    normalized, _ = self.normalize(x)
    return self._pre(normalized)

  def _pre(self, normalized):
    if self.config.apply_b_dec_to_input:
      normalized = normalized - self.b_dec
    pre = contract(normalized, self.w_enc, self.input_names) + self.b_enc
    if self.config.rescale_acts_by_decoder_norm:
      pre = pre * self._decoder_norms()
    return pre

  def activate(self, pre: pz.nx.NamedArray) -> pz.nx.NamedArray:
    """Feature activations from pre-activations."""
    kind = self.config.activation
    relu = pz.nx.nmap(jax.nn.relu)(pre)
    if kind == "relu":
      return relu
    if kind == "jumprelu":
      keep = pre > self.threshold
      return pz.nx.nmap(jnp.where)(keep, relu, jnp.zeros((), relu.dtype))
    top_k = functools.partial(_top_k_dense, k=self.config.k)
    return pz.nx.nmap(top_k)(pre.untag(FEATURES)).tag(FEATURES)

  def encode_with_stats(self, x: pz.nx.NamedArray
                        ) -> tuple[pz.nx.NamedArray, NormStats]:
    """Features and the normalization statistics of the input."""
    normalized, stats = self.normalize(x)
    return self.activate(self._pre(normalized)), stats

  def encode(self, x: pz.nx.NamedArray) -> pz.nx.NamedArray:
    """Feature activations of ``x``: its batch axes and ``seq``, plus
    ``features``."""
    return self.encode_with_stats(x)[0]

  def decode_linear(self, features: pz.nx.NamedArray) -> pz.nx.NamedArray:
    """``features @ w_dec`` (after the decoder-norm rescaling): the part of
    the decoder that is linear in the features (no bias, no
    denormalization)."""
    features = features.astype(self.dtype)
    if self.config.rescale_acts_by_decoder_norm:
      features = features / self._decoder_norms()
    return contract(features, self.w_dec, (FEATURES,))

  def denormalize(self, y: pz.nx.NamedArray, stats: NormStats, *,
                  shift: bool = True) -> pz.nx.NamedArray:
    if stats.scale is not None:
      y = y * stats.scale
    if shift and stats.shift is not None:
      y = y + stats.shift
    return y

  def skip(self, x: pz.nx.NamedArray) -> pz.nx.NamedArray | None:
    """The affine skip connection's output, or None."""
    if self.w_skip is None:
      return None
    renamed = x.astype(self.dtype).untag(*self.input_names).tag(
        *(f"{a}_in" for a in self.input_names))
    return contract(renamed, self.w_skip,
                    tuple(f"{a}_in" for a in self.input_names))

  def decode(self, features: pz.nx.NamedArray,
             stats: NormStats | None = None) -> pz.nx.NamedArray:
    """``denormalize(features @ w_dec + b_dec)`` (no skip connection: see
    `forward`)."""
    y = self.decode_linear(features) + self.b_dec
    return y if stats is None else self.denormalize(y, stats)

  def forward(self, x: pz.nx.NamedArray) -> pz.nx.NamedArray:
    """The reconstruction (an SAE) or prediction (a transcoder) of ``x``,
    skip connection included."""
    features, stats = self.encode_with_stats(x)
    out = self.decode(features, stats)
    skip = self.skip(x)
    return out if skip is None else out + skip

  # -- reading --------------------------------------------------------------

  def direction(self, feature: int) -> pz.nx.NamedArray:
    """Decoder row ``feature``: its direction in the output space (for
    `penzai_lm.interp.AddVector`)."""
    if not (isinstance(feature, int) and 0 <= feature
            < self.config.num_features):
      raise ValueError(f"feature {feature!r} does not exist: the autoencoder"
                       f" has {self.config.num_features} features.")
    return self.w_dec[{FEATURES: feature}]


def _check_finite(name: str, array: jax.Array) -> None:
  """Raises if a concrete ``array`` holds NaN or inf (a traced one, inside
  ``jax.jit``, cannot be read)."""
  if isinstance(array, jax.core.Tracer) or not jnp.issubdtype(
      array.dtype, jnp.inexact) or bool(jnp.isfinite(array).all()):
    return
  nan = int(jnp.isnan(array).sum())
  raise ValueError(
      f"SparseAutoencoder.from_arrays: {name} holds {nan} NaN and"
      f" {int(jnp.isinf(array).sum())} infinite value(s) of {array.size};"
      " the weights are corrupt (or from a diverged run).")


def _top_k_dense(pre: jax.Array, k: int) -> jax.Array:
  """relu of the ``k`` largest entries of a vector, zeros elsewhere."""
  values, ids = jax.lax.top_k(pre, k)
  return jnp.zeros_like(pre).at[ids].set(jax.nn.relu(values))
