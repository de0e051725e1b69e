"""Random autoencoders of every SAELens architecture, for the format tests.

Weights are scaled like trained ones (unit-variance inputs give pre-
activations of order one, a fraction of them above the thresholds), and
every bias and threshold is random, so that a transposed or dropped tensor
changes the numbers.
"""

import numpy as np

from penzai_lm.sae import SAEConfig
from penzai_lm.sae import SparseAutoencoder

# SAELens architecture -> (activation, transcoder, skip connection)
ARCHITECTURES = {
    "standard": ("relu", False, False),
    "jumprelu": ("jumprelu", False, False),
    "topk": ("topk", False, False),
    "transcoder": ("relu", True, False),
    "skip_transcoder": ("relu", True, True),
    "jumprelu_transcoder": ("jumprelu", True, False),
    "jumprelu_skip_transcoder": ("jumprelu", True, True),
}
K = 8


def random_arrays(d_in, d_sae, d_out, *, seed=0, threshold=False,
                  skip=False) -> dict[str, np.ndarray]:
  """Flat arrays in `SparseAutoencoder.from_arrays`'s layout."""
  rng = np.random.default_rng(seed)
  out = {
      "w_enc": rng.standard_normal((d_in, d_sae)) / np.sqrt(d_in),
      "b_enc": 0.1 * rng.standard_normal(d_sae),
      "w_dec": rng.standard_normal((d_sae, d_out)) / np.sqrt(d_sae),
      "b_dec": 0.1 * rng.standard_normal(d_out),
  }
  if threshold:
    out["threshold"] = rng.uniform(0.0, 0.3, d_sae)
  if skip:
    out["w_skip"] = rng.standard_normal((d_in, d_out)) / np.sqrt(d_in)
  return {k: v.astype(np.float32) for k, v in out.items()}


def random_sae(arch: str, *, d_in=16, d_sae=64, norm="none", b_dec_in=None,
               rescale=False, seed=0, layer=1, input_axes=None,
               point=None, dtype=np.float32) -> SparseAutoencoder:
  """A random `SparseAutoencoder` of SAELens architecture ``arch``.

  SAEs read ``blocks.{layer}.resid_post`` (or ``point``), transcoders
  ``blocks.{layer}.mlp_in`` and write its ``mlp_out``; ``b_dec_in``
  defaults to True for SAEs (SAELens's default) and is False for
  transcoders.
  """
  activation, transcoder, skip = ARCHITECTURES[arch]
  axes = tuple(input_axes or (("embedding", d_in),))
  d_in = int(np.prod([n for _, n in axes]))
  out_axes = (("embedding", d_in),) if transcoder else axes
  if b_dec_in is None:
    b_dec_in = not transcoder
  default_point = f"blocks.{layer}.{'mlp_in' if transcoder else 'resid_post'}"
  config = SAEConfig(
      activation=activation, num_features=d_sae, input_axes=axes,
      output_axes=out_axes, k=K if activation == "topk" else None,
      apply_b_dec_to_input=b_dec_in, normalize_activations=norm,
      rescale_acts_by_decoder_norm=rescale,
      hook_point=point or default_point,
      output_point=f"blocks.{layer}.mlp_out" if transcoder else None)
  arrays = random_arrays(d_in, d_sae, d_in, seed=seed,
                         threshold=activation == "jumprelu", skip=skip)
  return SparseAutoencoder.from_arrays(config, dtype=dtype, **arrays)
