"""The compiled pieces of SAE training: losses, one Adam step, resampling.

Everything here works on flat float32 matrices (the named `SparseAutoencoder`
is built once training ends: `fold`), in the space of the *scaled*
activations ``s * x`` (``s`` makes their mean norm ``sqrt(d_in)``, SAELens's
``expected_average_only_in``; 1 when not normalizing), with the parameters
of `penzai_lm.sae.train_ops` (plus ``threshold`` ``[F]`` for JumpReLU).

The losses are SAELens's (v6), term for term:

* "relu": ``sum((x_hat - x)^2) + l1 * sum(f * |w_dec rows|)`` per token,
  averaged over the batch;
* "topk": the MSE plus AuxK when features are dead (the ``d/2`` largest dead
  pre-activations reconstruct the residual ``x - x_hat``, scaled by
  ``min(dead / (d/2), 1)``); pre-activations are scaled by the decoder
  rows' norms and features divided by them before decoding
  (``rescale_acts_by_decoder_norm``);
* "jumprelu": the MSE plus ``l0 * sum(step(pre - threshold))`` ("step",
  DeepMind's, Gemma Scope) or ``l0 * sum(tanh(c * f * |w_dec rows|))``
  ("tanh", Anthropic's).

Gradients are clipped to a global norm (1, as SAELens) before Adam.

What a program computes is static (`Program`: the activation, ``k``, ...);
every number that only changes values (coefficients, learning rate and
schedule, the dead-feature window, the step count) is traced (`hyper`), so
a new seed, length or coefficient compiles nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from penzai_lm.sae import train_ops as ops

Params = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Program:
  """The static part of a training configuration."""

  activation: str
  k: int
  rescale: bool
  sparsity_loss: str
  aux_k: bool

  @classmethod
  def of(cls, cfg) -> Program:
    return cls(activation=cfg.activation, k=cfg.k,
               rescale=(cfg.activation == "topk"
                        and cfg.rescale_acts_by_decoder_norm),
               sparsity_loss=cfg.jumprelu_sparsity_loss,
               aux_k=cfg.activation == "topk" and cfg.aux_k_coefficient > 0)


def hyper(cfg, total_steps: int) -> dict[str, jax.Array]:
  """The traced numbers of a configuration."""
  values = {
      "l1": cfg.l1_coefficient, "l0": cfg.l0_coefficient,
      "aux_k": cfg.aux_k_coefficient, "bandwidth": cfg.jumprelu_bandwidth,
      "tanh_scale": cfg.jumprelu_tanh_scale,
      "init_threshold": cfg.jumprelu_init_threshold,
      "lr": cfg.learning_rate, "beta1": cfg.adam_beta1,
      "beta2": cfg.adam_beta2, "warmup": cfg.warmup_steps,
      "decay": cfg.decay_steps, "sparsity_warmup": cfg.sparsity_warmup_steps,
      "clip": cfg.grad_clip_norm or float("inf"),
      "dead_window": cfg.dead_feature_window, "total_steps": total_steps,
  }
  return {k: jnp.asarray(v, jnp.float32) for k, v in values.items()}


class TrainState(NamedTuple):
  """Everything a training step carries (a pytree).

  Attributes:
    params: The flat parameters.
    mu: Adam's first moments, like ``params``.
    nu: Adam's second moments.
    step: Steps taken (int32 scalar).
    since_fired: Per feature, steps since it last fired (int32 ``[F]``).
  """

  params: Params
  mu: Params
  nu: Params
  step: jax.Array
  since_fired: jax.Array


@functools.partial(jax.jit, static_argnames=("features", "jumprelu"))
def init_state(b_dec: jax.Array, seed, init_threshold, *, features: int,
               jumprelu: bool) -> TrainState:
  """SAELens's initialization: decoder rows in random directions with norm
  0.1 (``decoder_init_norm``), the encoder their transpose, zero ``b_enc``,
  thresholds at ``init_threshold``; ``b_dec`` as given (the geometric median
  or mean of a first batch); zero Adam moments."""
  d = b_dec.shape[0]
  w_dec = jax.random.normal(jax.random.key(seed), (features, d), jnp.float32)
  w_dec = 0.1 * w_dec / jnp.linalg.norm(w_dec, axis=1, keepdims=True)
  params = {"w_enc_t": w_dec, "b_enc": jnp.zeros(features), "w_dec": w_dec,
            "b_dec": b_dec.astype(jnp.float32)}
  if jumprelu:
    params["threshold"] = jnp.full(features, init_threshold, jnp.float32)
  zeros = jax.tree.map(jnp.zeros_like, params)
  return TrainState(params, zeros, zeros, jnp.zeros((), jnp.int32),
                    jnp.zeros(features, jnp.int32))


@functools.partial(jax.jit, static_argnames=("iterations",))
def geometric_median(points: jax.Array, iterations: int = 100) -> jax.Array:
  """Weiszfeld's iterations from the mean (the point minimizing the sum of
  distances: robust to the few huge activations a mean follows)."""
  def body(_, guess):
    weights = 1.0 / jnp.maximum(
        jnp.linalg.norm(points - guess, axis=-1), 1e-8)
    return (weights[:, None] * points).sum(0) / weights.sum()
  return jax.lax.fori_loop(0, iterations, body, points.mean(0))


# -- losses --------------------------------------------------------------------


def _norms(params):
  return jnp.linalg.norm(params["w_dec"], axis=1)


def loss_terms(params: Params, x, prog: Program, h, dead, sparsity_scale
               ) -> tuple[jax.Array, dict[str, Any]]:
  """Total loss and ``{"terms", "recon", "active"}`` for one batch;
  ``active`` is ``(ids, values)`` for TopK, the dense features otherwise."""
  p = params
  norms = _norms(p)
  zero = jnp.zeros((), jnp.float32)
  sparsity, aux = zero, zero
  if prog.activation == "topk":
    pre = jax.lax.stop_gradient(
        ops.dense_pre(x, p["b_dec"], p["w_enc_t"], p["b_enc"]))
    scaled = pre * jax.lax.stop_gradient(norms) if prog.rescale else pre
    _, ids = jax.lax.top_k(scaled, prog.k)
    values = ops.take_pre(x, p["b_dec"], p["w_enc_t"], p["b_enc"], ids, pre)
    n = norms[ids] if prog.rescale else 1.0
    values = jax.nn.relu(values * n)
    recon = ops.sparse_decode(values / n, ids, p["w_dec"]) + p["b_dec"]
    active = (ids, values)
    if prog.aux_k:
      aux = h["aux_k"] * jax.lax.cond(
          dead.any(), lambda: _aux_k(p, x, recon, scaled, dead, prog),
          lambda: zero)
  else:
    pre = ops.dense_pre(x, p["b_dec"], p["w_enc_t"], p["b_enc"])
    if prog.activation == "relu":
      f = jax.nn.relu(pre)
      sparsity = h["l1"] * (f * norms).sum(-1).mean()
    else:
      f = ops.jumprelu(pre, p["threshold"], h["bandwidth"])
      if prog.sparsity_loss == "step":
        l0 = ops.step(pre, p["threshold"], h["bandwidth"]).sum(-1)
      else:
        l0 = jnp.tanh(h["tanh_scale"] * f * norms).sum(-1)
      sparsity = h["l0"] * l0.mean()
    recon = f @ p["w_dec"] + p["b_dec"]
    active = f
  mse = jnp.square(recon - x).sum(-1).mean()
  sparsity = sparsity * sparsity_scale
  total = mse + sparsity + aux
  return total, {"terms": {"mse": mse, "sparsity_loss": sparsity,
                           "aux_loss": aux},
                 "recon": recon, "active": active}


def _aux_k(p, x, recon, scaled_pre, dead, prog):
  """AuxK (Gao et al.; SAELens): the top ``d/2`` dead pre-activations
  reconstruct the residual, scaled down when few features are dead."""
  k_aux = min(x.shape[-1] // 2, dead.shape[0])
  residual = jax.lax.stop_gradient(x - recon)
  _, ids = jax.lax.top_k(jnp.where(dead, scaled_pre, -jnp.inf), k_aux)
  pre = ops.dense_pre(x, p["b_dec"], p["w_enc_t"], p["b_enc"])
  norms = _norms(p)
  if prog.rescale:
    pre = pre * norms
  # Dense on purpose: k_aux * d exceeds F, so gathered rows would take more
  # memory than [tokens, F] features (and this runs only while features
  # are dead). SAELens keeps these raw values (no relu).
  rows = jnp.arange(x.shape[0])[:, None]
  values = jnp.where(dead[ids], jnp.take_along_axis(pre, ids, -1), 0.0)
  acts = jnp.zeros_like(pre).at[rows, ids].set(values)
  if prog.rescale:
    acts = acts / norms
  loss = jnp.square(acts @ p["w_dec"] - residual).sum(-1).mean()
  return jnp.minimum(dead.sum() / k_aux, 1.0) * loss


# -- one step ------------------------------------------------------------------


def schedule(h, step):
  """(learning rate, sparsity-coefficient scale) at ``step``: linear warm-up
  from ``lr / warmup`` (SAELens's LinearLR), constant, then a linear decay
  to 0 over the last ``decay`` steps; the L1 / L0 coefficient ramps up from
  0 over ``sparsity_warmup`` steps."""
  step = step.astype(jnp.float32)
  lr = h["lr"] * jnp.minimum(1.0, (step + 1) / jnp.maximum(h["warmup"], 1))
  lr = lr * jnp.clip((h["total_steps"] - step) / jnp.maximum(h["decay"], 1),
                     0.0, 1.0)
  sparsity = jnp.where(h["sparsity_warmup"] > 0,
                       jnp.minimum(1.0, step / h["sparsity_warmup"]), 1.0)
  return lr, sparsity


def _fired(prog, active, features):
  """Per feature, the tokens of the batch it fired on."""
  if prog.activation == "topk":
    ids, values = active
    return jnp.zeros(features, jnp.float32).at[ids.reshape(-1)].add(
        (values > 0).reshape(-1).astype(jnp.float32))
  return (active > 0).sum(0).astype(jnp.float32)


def _dead(state: TrainState, h):
  return state.since_fired >= h["dead_window"]


@functools.partial(jax.jit, static_argnames=("prog",), donate_argnums=(0,))
def train_step(state: TrainState, x: jax.Array, scale: jax.Array, h, *,
               prog: Program) -> tuple[TrainState, dict[str, jax.Array]]:
  """One Adam step on a batch ``x`` ``[tokens, d]`` of activations times
  ``scale``; the metrics' ``finite`` is False when the step's loss or any
  new parameter is NaN or inf."""
  x = x.astype(jnp.float32) * scale
  p = state.params
  lr, sparsity_scale = schedule(h, state.step)
  (total, out), grads = jax.value_and_grad(loss_terms, has_aux=True)(
      p, x, prog, h, _dead(state, h), sparsity_scale)
  norm = jnp.sqrt(sum(jnp.vdot(g, g) for g in jax.tree.leaves(grads)))
  factor = jnp.minimum(1.0, h["clip"] / (norm + 1e-6))
  b1, b2 = h["beta1"], h["beta2"]
  t = (state.step + 1).astype(jnp.float32)
  mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g * factor, state.mu,
                    grads)
  nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g * factor),
                    state.nu, grads)
  params = jax.tree.map(
      lambda w, m, v: w - lr * (m / (1 - b1 ** t)) / (
          jnp.sqrt(v / (1 - b2 ** t)) + 1e-8), p, mu, nu)
  if "threshold" in params:  # A negative threshold would pass pre < 0.
    params["threshold"] = jnp.maximum(params["threshold"], 0.0)
  fired = _fired(prog, out["active"], p["b_enc"].shape[0])
  since = jnp.where(fired > 0, 0, state.since_fired + 1)
  new = TrainState(params, mu, nu, state.step + 1, since)
  finite = jnp.isfinite(total)
  for w in jax.tree.leaves(params):
    finite = finite & jnp.isfinite(w).all()
  metrics = dict(out["terms"], loss=total, lr=lr,
                 dead_fraction=_dead(new, h).mean(), finite=finite,
                 **batch_metrics(x, out["recon"], fired))
  return new, metrics


def batch_metrics(x, recon, fired) -> dict[str, jax.Array]:
  """L0 (mean active features per token) and the explained variance
  ``1 - sum |x - x_hat|^2 / sum |x - mean x|^2`` of a batch."""
  error = jnp.square(x - recon).sum()
  spread = jnp.square(x - x.mean(0)).sum()
  return {"l0": fired.sum() / x.shape[0],
          "explained_variance": 1.0 - error / jnp.maximum(spread, 1e-12)}


# -- resampling dead features (Anthropic, "Towards Monosemanticity") ---------


@functools.partial(jax.jit, static_argnames=("prog",), donate_argnums=(0,))
def resample(state: TrainState, x: jax.Array, scale: jax.Array,
             key: jax.Array, h, *, prog: Program
             ) -> tuple[TrainState, jax.Array]:
  """Reinitializes dead features toward inputs reconstructed badly.

  Each dead feature draws an input ``x_i`` (of ``x * scale``) with
  probability proportional to its squared loss squared; its decoder row
  becomes ``x_i - b_dec`` at unit norm, its encoder row the same direction
  at 0.2 times the mean norm of the live encoder rows, its bias 0 (its
  threshold the initial one), its Adam moments 0.

  Returns:
    The new state and the number of features resampled.
  """
  x = x.astype(jnp.float32) * scale
  p = state.params
  dead = _dead(state, h)
  _, out = loss_terms(p, x, prog, h, dead, 1.0)
  loss = jnp.square(out["recon"] - x).sum(-1)
  choice = jax.random.categorical(
      key, 2.0 * jnp.log(jnp.maximum(loss, 1e-30)), shape=dead.shape)
  direction = x[choice] - p["b_dec"]
  direction = direction / jnp.maximum(
      jnp.linalg.norm(direction, axis=-1, keepdims=True), 1e-8)
  live = ~dead
  enc_norms = jnp.linalg.norm(p["w_enc_t"], axis=1)
  live_norm = jnp.where(live.any(), (enc_norms * live).sum() /
                        jnp.maximum(live.sum(), 1), 0.1)
  fresh = {"w_dec": direction, "w_enc_t": 0.2 * live_norm * direction,
           "b_enc": jnp.zeros_like(p["b_enc"])}
  if "threshold" in p:
    fresh["threshold"] = jnp.full_like(p["threshold"], h["init_threshold"])

  def swap(tree, new):
    out = dict(tree)
    for name, value in new.items():
      mask = dead if value.ndim == 1 else dead[:, None]
      out[name] = jnp.where(mask, value, tree[name])
    return out

  zeros = {n: jnp.zeros_like(v) for n, v in fresh.items()}
  new = state._replace(params=swap(p, fresh), mu=swap(state.mu, zeros),
                       nu=swap(state.nu, zeros),
                       since_fired=jnp.where(dead, 0, state.since_fired))
  return new, dead.sum()


# -- the trained autoencoder ---------------------------------------------------


@functools.partial(jax.jit, static_argnames=("fold_norms",))
def fold(params: Params, scale, *, fold_norms: bool) -> dict[str, jax.Array]:
  """Flat arrays of the trained autoencoder on the *unscaled* activations,
  in `SparseAutoencoder.from_arrays`'s layout.

  With ``fold_norms`` (not for a TopK trained without decoder-norm
  rescaling, whose choice of features depends on the norms), the decoder
  rows' norms move into the encoder (``w_enc``, ``b_enc``, the threshold
  times the norm, the decoder divided by it): the reconstruction is
  unchanged and the decoder rows have unit norm. Then the input scale ``s``
  is undone: with ``x' = s x`` and activations positively homogeneous,
  ``b_enc``, ``b_dec`` and the threshold divide by ``s``, and the features
  come out divided by ``s`` too.
  """
  w_enc_t, b_enc = params["w_enc_t"], params["b_enc"]
  w_dec, threshold = params["w_dec"], params.get("threshold")
  if fold_norms:
    norms = jnp.linalg.norm(w_dec, axis=1)
    safe = jnp.where(norms > 0, norms, 1.0)
    w_enc_t, b_enc = w_enc_t * safe[:, None], b_enc * safe
    w_dec = w_dec / safe[:, None]
    if threshold is not None:
      threshold = threshold * safe
  out = {"w_enc": w_enc_t.T, "b_enc": b_enc / scale, "w_dec": w_dec,
         "b_dec": params["b_dec"] / scale}
  if threshold is not None:
    out["threshold"] = threshold / scale
  return out
