"""Shared helpers of the autoencoder-file tests: inputs, running an
autoencoder on numpy arrays, and writing files in each format by hand."""

import json

import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.sae.formats.tensor_files import write_safetensors
from tests.sae.random_saes import random_arrays

D, F = 16, 64


def inputs(shape, seed=1):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def named(x, *axes):
  return pz.nx.wrap(jnp.asarray(x)).tag(*axes)


def forward(sae, x):
  names = ("batch", "seq", *sae.input_names)
  return np.asarray(sae.forward(named(x, *names)).unwrap(
      "batch", "seq", *sae.output_names))


def encode(sae, x):
  names = ("batch", "seq", *sae.input_names)
  return np.asarray(sae.encode(named(x, *names)).unwrap(
      "batch", "seq", "features"))


def jumprelu(pre, threshold):
  return np.maximum(pre, 0) * (pre > threshold)


def write_saelens(directory, cfg, tensors):
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "cfg.json").write_text(json.dumps(cfg))
  write_safetensors(directory / "sae_weights.safetensors",
                    {k: np.asarray(v) for k, v in tensors.items()})


def saelens_dir(directory, d=D, **cfg_changes):
  """A valid JumpReLU SAELens directory of width ``d`` (``cfg.json``
  fields overridden by ``cfg_changes``)."""
  arrays = random_arrays(d, F, d, threshold=True)
  cfg = {"architecture": "jumprelu", "d_in": d, "d_sae": F,
         "dtype": "float32",
         "metadata": {"sae_lens_version": "6.0.0",
                      "hook_name": "blocks.0.hook_resid_post"}}
  cfg.update(cfg_changes)
  write_saelens(directory, cfg, saelens_tensors(arrays))
  return directory


def saelens_tensors(arrays):
  out = {"W_enc": arrays["w_enc"], "b_enc": arrays["b_enc"],
         "W_dec": arrays["w_dec"], "b_dec": arrays["b_dec"]}
  if "threshold" in arrays:
    out["threshold"] = arrays["threshold"]
  if "w_skip" in arrays:
    out["W_skip"] = arrays["w_skip"].T.copy()
  return out


def ct_layer(path, seed, *, jumprelu=True, skip=True):
  a = random_arrays(D, F, D, seed=seed, threshold=jumprelu, skip=skip)
  tensors = {"W_enc": a["w_enc"].T.copy(), "W_dec": a["w_dec"],
             "b_enc": a["b_enc"], "b_dec": a["b_dec"]}
  if jumprelu:
    tensors["activation_function.threshold"] = a["threshold"]
  if skip:
    tensors["W_skip"] = a["w_skip"].T.copy()
  write_safetensors(path, tensors)
  return a
