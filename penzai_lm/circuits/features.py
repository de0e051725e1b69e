"""The transcoders on one prompt: active features, their vectors, errors.

Per-layer transcoders (circuit-tracer's ``TranscoderSet``): block ``l``'s
transcoder reads ``blocks.{l}.mlp_in`` and predicts ``blocks.{l}.mlp_out``.
On the prompt, each block's MLP output is split exactly as::

    mlp_out[l, p] = sum_f a[l, p, f] * w_dec[l][f] + b_dec[l]
                    + skip[l](mlp_in[l, p]) + error[l, p]

Active features are listed sorted by ``(layer, position, feature id)``
(circuit-tracer's coalesced sparse order). Features at the first
``zero_positions`` positions are dropped and the errors there set to zero,
as circuit-tracer does for the BOS token (its default is 1 position). Their
encoder and decoder vectors are not stored: they are gathered from the
transcoders' weights when needed (`penzai_lm.circuits.feature_weights`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from penzai import pz

from penzai_lm.circuits import cross_layer
from penzai_lm.circuits.feature_weights import FeatureWeights
from penzai_lm.model.transformer import TransformerLM
from penzai_lm.sae.autoencoder import FEATURES
from penzai_lm.sae.autoencoder import SparseAutoencoder
from penzai_lm.sae.formats.circuit_tracer import TranscoderSet


@dataclasses.dataclass(frozen=True)
class PromptFeatures:
  """What the transcoders read and write on one prompt (``N`` active
  features, ``L`` blocks, ``T`` positions, ``D`` residual width).

  Attributes:
    layers, positions, ids: ``[N]`` int32 coordinates of the active
      features, sorted by ``(layer, position, id)``.
    activations: ``[N]`` float32.
    coefficients: ``[N]`` float32: what each feature's raw decoder row is
      multiplied by (`FeatureWeights.coefficients`).
    weights: The transcoders' weights the vectors are gathered from.
    errors: ``[L, T, D]``: the MLP output the transcoder misses.
    biases: ``[L, D]``: each block's ``b_dec``.
  """

  layers: np.ndarray
  positions: np.ndarray
  ids: np.ndarray
  activations: np.ndarray
  coefficients: np.ndarray
  weights: FeatureWeights
  errors: np.ndarray
  biases: np.ndarray

  def encoder_rows(self, index: np.ndarray) -> np.ndarray:
    """``[n, D]`` float32: features ``index``'s encoder vectors (a
    feature's pre-activation is its vector dotted with ``mlp_in[layer,
    position]``, plus a constant: ``b_enc``, and ``-b_dec . w_enc`` for
    SAEs that subtract ``b_dec``)."""
    return self.weights.encoder_rows(self.layers[index], self.ids[index])


def check_transcoders(model, transcoders
                      ) -> (tuple[SparseAutoencoder, ...]
                            | tuple[cross_layer.CrossLayerBlock, ...]):
  """The per-layer transcoders of ``transcoders`` (a `TranscoderSet` or a
  sequence of `SparseAutoencoder`, one per block), checked against
  ``model``; for a `CrossLayerTranscoder` (or what this returned for one),
  its blocks (`penzai_lm.circuits.cross_layer.check_clt`).

  Raises:
    TypeError: for another type.
    ValueError: naming the layer whose transcoder does not fit.
  """
  clt = cross_layer.as_clt(transcoders)
  if clt is not None:
    return cross_layer.check_clt(model, clt)
  if isinstance(transcoders, TranscoderSet):
    transcoders = transcoders.transcoders
  if not isinstance(transcoders, (list, tuple)) or not all(
      isinstance(t, SparseAutoencoder) for t in transcoders):
    raise TypeError("transcoders must be a TranscoderSet or a list of"
                    " SparseAutoencoder, one per block; got"
                    f" {type(transcoders).__name__}.")
  config = model.config
  if len(transcoders) != config.num_layers:
    raise ValueError(f"got {len(transcoders)} transcoders for a model with"
                     f" {config.num_layers} blocks: pass one per block.")
  axes = (("embedding", config.hidden_size),)
  for layer, t in enumerate(transcoders):
    c = t.config
    want = (f"blocks.{layer}.mlp_in", f"blocks.{layer}.mlp_out")
    if (c.hook_point, c.output_point) != want:
      raise ValueError(
          f"transcoder {layer} reads {c.hook_point!r} and writes"
          f" {c.output_point!r}; block {layer}'s must read {want[0]!r} and"
          f" write {want[1]!r}.")
    if c.input_axes != axes or c.output_axes != axes:
      raise ValueError(f"transcoder {layer} has axes {c.input_axes} ->"
                       f" {c.output_axes}; the model's residual is {axes}.")
    if c.normalize_activations != "none":
      raise ValueError(
          f"transcoder {layer} normalizes its input"
          f" ({c.normalize_activations!r}), so its pre-activations are not"
          " linear in it; only normalize_activations='none' is supported.")
  return tuple(transcoders)


def prompt_features(transcoders, mlp_in: np.ndarray, mlp_out: np.ndarray,
                    zero_positions: int = 1) -> PromptFeatures:
  """Encodes the prompt's MLP inputs (``[L, T, D]``) with the transcoders
  and splits the MLP outputs into features and errors (module
  docstring); for a CLT's blocks, `cross_layer.prompt_arrays`'s."""
  clt = cross_layer.as_clt(transcoders)
  if clt is not None:
    return PromptFeatures(**cross_layer.prompt_arrays(
        clt, mlp_in, mlp_out, zero_positions))
  found, errors, biases, encoders, decoders, norms = [], [], [], [], [], []
  for layer, t in enumerate(transcoders):
    x = pz.nx.wrap(jnp.asarray(mlp_in[layer], t.dtype)).tag("seq",
                                                             "embedding")
    acts = np.array(t.encode(x).unwrap("seq", FEATURES), np.float32)
    acts[:zero_positions] = 0.0
    recon = _reconstruction(t, x, acts)
    error = np.asarray(mlp_out[layer], np.float32) - recon
    error[:zero_positions] = 0.0
    errors.append(error)
    flat = t.flat()
    biases.append(np.asarray(flat["b_dec"], np.float32))
    encoders.append(flat["w_enc"])
    decoders.append(flat["w_dec"])
    norms.append(np.linalg.norm(np.asarray(flat["w_dec"], np.float32),
                                axis=1)
                 if t.config.rescale_acts_by_decoder_norm
                 else np.ones(t.config.num_features, np.float32))
    positions, ids = np.nonzero(acts)
    found.append((np.full(len(ids), layer), positions, ids,
                  acts[positions, ids]))
  layers, positions, ids, values = (np.concatenate(c) for c in zip(*found))
  rescaled = any(t.config.rescale_acts_by_decoder_norm
                 for t in transcoders)
  weights = FeatureWeights(tuple(encoders), tuple(decoders),
                           scales=tuple(norms) if rescaled else None)
  layers, ids = layers.astype(np.int32), ids.astype(np.int32)
  return PromptFeatures(
      layers=layers, positions=positions.astype(np.int32), ids=ids,
      activations=values.astype(np.float32),
      coefficients=weights.coefficients(layers, ids, values),
      weights=weights, errors=np.stack(errors), biases=np.stack(biases))


def _reconstruction(t: SparseAutoencoder, x, acts: np.ndarray) -> np.ndarray:
  """The transcoder's output for activations ``acts`` (``[T, F]``) and
  input ``x``, skip connection included: ``[T, D]`` float32."""
  features = pz.nx.wrap(jnp.asarray(acts, t.dtype)).tag("seq", FEATURES)
  out = t.decode(features)
  skip = t.skip(x)
  if skip is not None:
    out = out + skip
  return np.asarray(out.unwrap("seq", "embedding"), np.float32)


def check_prompt(model, prompt, caller: str) -> np.ndarray:
  """``prompt`` as int32 token ids, after checking it and that ``model``
  is an uncached `TransformerLM` (``caller`` names the function in the
  errors).

  Raises:
    TypeError: for another model type, or a str prompt.
    ValueError: for a prompt that is not a non-empty 1-D integer array of
      ids in the vocabulary.
  """
  if not isinstance(model, TransformerLM):
    raise TypeError(f"{caller} needs an uncached penzai_lm TransformerLM,"
                    f" got {type(model).__name__}.")
  if isinstance(prompt, str):
    raise TypeError("prompt must be token ids (tokenize the text first),"
                    " got a str.")
  ids = np.asarray(prompt)
  if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype,
                                                         np.integer):
    raise ValueError("prompt must be a non-empty 1-D list or array of"
                     f" integer token ids, got shape {ids.shape} dtype"
                     f" {ids.dtype}.")
  vocab = model.config.vocab_size
  bad = ids[(ids < 0) | (ids >= vocab)]
  if bad.size:
    raise ValueError(f"prompt has token id {int(bad[0])} outside the"
                     f" vocabulary [0, {vocab}).")
  return ids.astype(np.int32)
