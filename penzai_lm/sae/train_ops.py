"""Products and activations with hand-written gradients, for SAE training.

* `take_pre` / `sparse_decode`: TopK's sparse path. The top ``k``
  pre-activations are read from the dense (gradient-free) encoder output,
  and their gradients go back into the encoder and decoder rows of the
  chosen features only (a gather forward, a scatter-add backward): a step
  costs one dense ``[tokens, d] x [d, F]`` product instead of the five of a
  dense forward and backward pass.
* `dense_pre`: the encoder, whose ``b_dec`` gradient (``b_dec`` is
  subtracted from the input) is one vector-matrix product; autodiff would
  form the ``[tokens, d]`` input gradient with a full product first.
* `jumprelu` / `step`: JumpReLU and the Heaviside step with SAELens's (and
  Gemma Scope's) straight-through estimators: the threshold's gradient
  uses a rectangle kernel of width ``bandwidth``; the input gets the plain
  gradient (JumpReLU) or none (step), DeepMind's choice
  (``jumprelu_ste_to_input=False``).

Parameters are flat: ``w_enc_t`` ``[F, d]`` (one encoder row per feature),
``b_enc`` ``[F]``, ``w_dec`` ``[F, d]``, ``b_dec`` ``[d]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def take_pre(x, b_dec, w_enc_t, b_enc, ids, pre):
  """``((x - b_dec) @ w_enc_t.T + b_enc)[ids]``, read from ``pre`` (that
  product, computed without gradient); the gradient reaches the ``ids``
  rows only. ``x`` (data) gets none."""
  del x, b_dec, w_enc_t, b_enc
  return jnp.take_along_axis(pre, ids, axis=-1)


def _take_pre_fwd(x, b_dec, w_enc_t, b_enc, ids, pre):
  return (jnp.take_along_axis(pre, ids, axis=-1),
          (x, b_dec, w_enc_t, ids))


def _take_pre_bwd(res, grad):
  x, b_dec, w_enc_t, ids = res
  features, d = w_enc_t.shape
  flat_ids = ids.reshape(-1)
  d_b_enc = jnp.zeros(features, grad.dtype).at[flat_ids].add(grad.reshape(-1))
  updates = (grad[..., None] * (x - b_dec)[:, None, :]).reshape(-1, d)
  d_w_enc_t = jnp.zeros_like(w_enc_t).at[flat_ids].add(updates)
  # d/d b_dec of sum_bk g_bk (x_b - b_dec) . w_ids: minus the per-feature
  # summed gradient times the encoder rows.
  d_b_dec = -(d_b_enc @ w_enc_t)
  return (None, d_b_dec, d_w_enc_t, d_b_enc, None, None)


take_pre.defvjp(_take_pre_fwd, _take_pre_bwd)


@jax.custom_vjp
def sparse_decode(values, ids, w_dec):
  """``sum_j values[:, j] * w_dec[ids[:, j]]`` (no bias)."""
  return jnp.einsum("bk,bkd->bd", values, w_dec[ids])


def _sparse_decode_fwd(values, ids, w_dec):
  # The gathered rows are gathered again backward rather than kept:
  # [tokens, k, d] is the largest array of a step.
  return sparse_decode(values, ids, w_dec), (values, ids, w_dec)


def _sparse_decode_bwd(res, grad):
  values, ids, w_dec = res
  d_values = jnp.einsum("bd,bkd->bk", grad, w_dec[ids])
  updates = (values[..., None] * grad[:, None, :]).reshape(-1, w_dec.shape[1])
  d_w_dec = jnp.zeros_like(w_dec).at[ids.reshape(-1)].add(updates)
  return d_values, None, d_w_dec


sparse_decode.defvjp(_sparse_decode_fwd, _sparse_decode_bwd)


@jax.custom_vjp
def dense_pre(x, b_dec, w_enc_t, b_enc):
  """``(x - b_dec) @ w_enc_t.T + b_enc``; ``x`` (data) gets no gradient."""
  return (x - b_dec) @ w_enc_t.T + b_enc


def _dense_pre_fwd(x, b_dec, w_enc_t, b_enc):
  return dense_pre(x, b_dec, w_enc_t, b_enc), (x, b_dec, w_enc_t)


def _dense_pre_bwd(res, grad):
  x, b_dec, w_enc_t = res
  d_b_enc = grad.sum(0)
  return (None, -(d_b_enc @ w_enc_t), grad.T @ (x - b_dec), d_b_enc)


dense_pre.defvjp(_dense_pre_fwd, _dense_pre_bwd)


def _rectangle(z):
  return ((z > -0.5) & (z < 0.5)).astype(z.dtype)


@jax.custom_vjp
def jumprelu(pre, threshold, bandwidth):
  """``pre * (pre > threshold)``."""
  del bandwidth
  return pre * (pre > threshold)


def _jumprelu_fwd(pre, threshold, bandwidth):
  return jumprelu(pre, threshold, bandwidth), (pre, threshold, bandwidth)


def _jumprelu_bwd(res, grad):
  pre, threshold, bandwidth = res
  ste = (threshold / bandwidth) * _rectangle((pre - threshold) / bandwidth)
  return ((pre > threshold) * grad, -(ste * grad).sum(0),
          jnp.zeros_like(bandwidth))


jumprelu.defvjp(_jumprelu_fwd, _jumprelu_bwd)


@jax.custom_vjp
def step(pre, threshold, bandwidth):
  """``1.0 * (pre > threshold)``."""
  del bandwidth
  return (pre > threshold).astype(pre.dtype)


def _step_fwd(pre, threshold, bandwidth):
  return step(pre, threshold, bandwidth), (pre, threshold, bandwidth)


def _step_bwd(res, grad):
  pre, threshold, bandwidth = res
  ste = _rectangle((pre - threshold) / bandwidth) / bandwidth
  return (jnp.zeros_like(pre), -(ste * grad).sum(0),
          jnp.zeros_like(bandwidth))


step.defvjp(_step_fwd, _step_bwd)
