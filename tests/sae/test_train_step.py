"""The compiled training step against SAELens, term for term.

Same weights and batch in both: SAELens's ``TrainingSAE.training_forward_pass``
(standard + L1, TopK + AuxK with decoder-norm rescaling, JumpReLU with the
step and tanh L0 losses) and `penzai_lm.sae.train_step.loss_terms` give
the same losses and the same gradients for every parameter (TopK's through
the sparse gather / scatter path, JumpReLU's threshold through the
straight-through estimators). Then: `fold` keeps the function and unit-norm
decoder rows, `resample` moves dead features to badly reconstructed inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
from penzai import pz
import pytest

from penzai_lm.sae import SAEConfig
from penzai_lm.sae import SparseAutoencoder
from penzai_lm.sae import TrainConfig
from penzai_lm.sae import train_step as step_lib

D, F, B, K = 16, 64, 48, 6
TOL = dict(rtol=2e-4, atol=2e-5)

CASES = {
    "standard": dict(activation="relu", l1_coefficient=0.7),
    "topk": dict(activation="topk", k=K, aux_k_coefficient=0.5),
    "topk_no_rescale": dict(activation="topk", k=K,
                            rescale_acts_by_decoder_norm=False),
    "jumprelu_step": dict(activation="jumprelu", l0_coefficient=0.3,
                          jumprelu_bandwidth=0.2),
    "jumprelu_tanh": dict(activation="jumprelu", l0_coefficient=0.3,
                          jumprelu_sparsity_loss="tanh",
                          jumprelu_bandwidth=0.2),
}


def _params(seed=0, jumprelu=False):
  """Random weights with decoder rows of varied norms, pre-activations of
  order one and thresholds near them (so the estimators' windows see
  tokens)."""
  rng = np.random.default_rng(seed)
  w_dec = rng.standard_normal((F, D)) * rng.uniform(0.3, 2.0, (F, 1)) / 4
  params = {"w_enc_t": rng.standard_normal((F, D)) / np.sqrt(D),
            "b_enc": 0.1 * rng.standard_normal(F), "w_dec": w_dec,
            "b_dec": 0.1 * rng.standard_normal(D)}
  if jumprelu:
    params["threshold"] = rng.uniform(0.0, 0.6, F)
  return {k: v.astype(np.float32) for k, v in params.items()}


def _batch(seed=1):
  return np.random.default_rng(seed).standard_normal((B, D)).astype(
      np.float32)


def _theirs(case, params, x, dead):
  """SAELens's losses and gradients (parameter name -> gradient in our
  layout)."""
  torch = pytest.importorskip("torch")
  saes = pytest.importorskip("sae_lens.saes")
  sae_mod = pytest.importorskip("sae_lens.saes.sae")
  kw = CASES[case]
  common = dict(d_in=D, d_sae=F, apply_b_dec_to_input=True,
                normalize_activations="none")
  if kw["activation"] == "relu":
    sae = saes.StandardTrainingSAE(saes.StandardTrainingSAEConfig(
        **common, l1_coefficient=kw["l1_coefficient"]))
    coefficients = {"l1": kw["l1_coefficient"]}
  elif kw["activation"] == "topk":
    sae = saes.TopKTrainingSAE(saes.TopKTrainingSAEConfig(
        **common, k=K, aux_loss_coefficient=kw.get("aux_k_coefficient", 1.0),
        rescale_acts_by_decoder_norm=kw.get("rescale_acts_by_decoder_norm",
                                            True)))
    coefficients = {}
  else:
    sae = saes.JumpReLUTrainingSAE(saes.JumpReLUTrainingSAEConfig(
        **common, l0_coefficient=kw["l0_coefficient"],
        jumprelu_bandwidth=kw["jumprelu_bandwidth"],
        jumprelu_sparsity_loss_mode=kw.get("jumprelu_sparsity_loss", "step")))
    coefficients = {"l0": kw["l0_coefficient"]}
  with torch.no_grad():
    sae.W_enc.copy_(torch.from_numpy(params["w_enc_t"].T.copy()))
    sae.W_dec.copy_(torch.from_numpy(params["w_dec"]))
    sae.b_enc.copy_(torch.from_numpy(params["b_enc"]))
    sae.b_dec.copy_(torch.from_numpy(params["b_dec"]))
    if "threshold" in params:
      sae.threshold.copy_(torch.from_numpy(params["threshold"]))
  out = sae.training_forward_pass(sae_mod.TrainStepInput(
      sae_in=torch.from_numpy(x), coefficients=coefficients,
      dead_neuron_mask=torch.from_numpy(dead), n_training_steps=0,
      is_logging_step=False))
  out.loss.backward()
  grads = {"w_enc_t": sae.W_enc.grad.T, "b_enc": sae.b_enc.grad,
           "w_dec": sae.W_dec.grad, "b_dec": sae.b_dec.grad}
  if "threshold" in params:
    grads["threshold"] = sae.threshold.grad
  losses = {k: float(v.detach()) for k, v in out.losses.items()}
  return float(out.loss.detach()), losses, {k: v.numpy()
                                            for k, v in grads.items()}


def _ours(case, params, x, dead):
  cfg = TrainConfig(steps=1, **CASES[case])
  h = step_lib.hyper(cfg, 1)
  prog = step_lib.Program.of(cfg)

  @jax.jit
  def run(p, x, dead):
    return jax.value_and_grad(step_lib.loss_terms, has_aux=True)(
        p, x, prog, h, dead, 1.0)

  (total, out), grads = run({k: jnp.asarray(v) for k, v in params.items()},
                            jnp.asarray(x), jnp.asarray(dead))
  return float(total), out["terms"], {k: np.asarray(v)
                                      for k, v in grads.items()}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("with_dead", [False, True])
def test_losses_and_gradients_equal_saelens(case, with_dead):
  params = _params(jumprelu=case.startswith("jumprelu"))
  x = _batch()
  dead = np.zeros(F, bool)
  if with_dead:
    dead[::3] = True  # AuxK's input (TopK); the others ignore it.
  total, terms, grads = _ours(case, params, x, dead)
  their_total, their_terms, their_grads = _theirs(case, params, x, dead)
  np.testing.assert_allclose(total, their_total, **TOL)
  np.testing.assert_allclose(float(terms["mse"]), their_terms["mse_loss"],
                             **TOL)
  if case.startswith("topk"):
    aux = their_terms["auxiliary_reconstruction_loss"]
    assert (aux > 0) == with_dead
    np.testing.assert_allclose(float(terms["aux_loss"]), aux, **TOL)
  assert set(grads) == set(their_grads)
  for name, grad in grads.items():
    assert np.abs(their_grads[name]).max() > 0, name
    np.testing.assert_allclose(grad, their_grads[name], err_msg=name, **TOL)


@pytest.mark.parametrize("case", ["standard", "topk", "topk_no_rescale",
                                  "jumprelu_step"])
def test_fold_keeps_the_function_on_unscaled_inputs(case):
  """The folded autoencoder on x equals the trained one on s * x, over s;
  its decoder rows have unit norm (unless TopK chose by raw pre-activations,
  which folding would change)."""
  cfg = TrainConfig(steps=1, **CASES[case])
  prog = step_lib.Program.of(cfg)
  params = _params(jumprelu=cfg.activation == "jumprelu")
  x = 3.0 * _batch(2)
  scale = 0.37
  _, out = step_lib.loss_terms(
      {k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(x * scale),
      prog, step_lib.hyper(cfg, 1), jnp.zeros(F, bool), 1.0)
  fold_norms = case != "topk_no_rescale"
  flat = step_lib.fold(params, jnp.float32(scale), fold_norms=fold_norms)
  sae = SparseAutoencoder.from_arrays(
      SAEConfig(activation=cfg.activation, num_features=F,
                input_axes=(("embedding", D),), output_axes=(("embedding", D),),
                k=K if cfg.activation == "topk" else None,
                apply_b_dec_to_input=True), **flat)
  named = pz.nx.wrap(jnp.asarray(x)).tag("tokens", "embedding")
  recon = np.asarray(sae.forward(named).unwrap("tokens", "embedding"))
  np.testing.assert_allclose(recon, np.asarray(out["recon"]) / scale,
                             rtol=1e-4, atol=1e-4)
  norms = np.linalg.norm(np.asarray(flat["w_dec"]), axis=1)
  if fold_norms:
    np.testing.assert_allclose(norms, 1.0, rtol=1e-5)
  else:
    np.testing.assert_allclose(norms, np.linalg.norm(params["w_dec"], axis=1),
                               rtol=1e-6)


def test_resampling_moves_dead_features_to_the_worst_input():
  """Only one input is reconstructed badly: every dead feature's decoder
  row becomes that input minus b_dec at unit norm, its encoder row the same
  direction at 0.2 x the live rows' mean norm, its bias and moments zero;
  live features keep everything."""
  cfg = TrainConfig(steps=1, activation="relu", dead_feature_window=5)
  prog, h = step_lib.Program.of(cfg), step_lib.hyper(cfg, 1)
  params = {k: jnp.asarray(v) for k, v in _params().items()}
  x = np.zeros((B, D), np.float32) + np.asarray(params["b_dec"])
  x[7] += 5.0 * np.eye(D, dtype=np.float32)[3]  # The one bad input.
  # Negative biases: every input but x[7] (= b_dec) has no feature active
  # and is reconstructed exactly.
  recon_params = dict(params, b_enc=-jnp.ones(F))
  before = {k: np.asarray(v) for k, v in recon_params.items()}  # Donated.
  state = step_lib.TrainState(
      recon_params, jax.tree.map(jnp.ones_like, recon_params),
      jax.tree.map(jnp.ones_like, recon_params), jnp.int32(10),
      jnp.asarray(np.where(np.arange(F) % 4 == 0, 9, 1), jnp.int32))
  dead = np.arange(F) % 4 == 0
  new, count = step_lib.resample(state, jnp.asarray(x), jnp.float32(1.0),
                                 jax.random.key(0), h, prog=prog)
  assert int(count) == dead.sum()
  w_dec = np.asarray(new.params["w_dec"])
  np.testing.assert_allclose(w_dec[dead], np.eye(D)[3][None].repeat(
      dead.sum(), 0), atol=1e-6)
  np.testing.assert_array_equal(w_dec[~dead], before["w_dec"][~dead])
  live_norm = np.linalg.norm(before["w_enc_t"][~dead], axis=1).mean()
  np.testing.assert_allclose(np.asarray(new.params["w_enc_t"])[dead],
                             0.2 * live_norm * w_dec[dead], rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(new.params["w_enc_t"])[~dead],
                                before["w_enc_t"][~dead])
  b_enc = np.asarray(new.params["b_enc"])
  assert (b_enc[dead] == 0).all() and (b_enc[~dead] == -1).all()
  for moments in (new.mu, new.nu):
    assert (np.asarray(moments["w_dec"])[dead] == 0).all()
    assert (np.asarray(moments["w_dec"])[~dead] == 1).all()
  np.testing.assert_array_equal(np.asarray(new.since_fired)[dead], 0)
