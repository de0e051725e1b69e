"""Sparse autoencoders and transcoders: load, read, steer and train them.

* `SparseAutoencoder` (`penzai_lm.sae.autoencoder`): encode a point's value
  into sparse ``features`` and decode back (ReLU, JumpReLU, TopK; an
  optional affine skip; SAELens's input normalizations). Transcoders read
  one point and write another.
* `splice(model, sae)` (`penzai_lm.sae.splice`): the autoencoder in the
  model, its features as points (``blocks.6.resid_post.sae.features``,
  ``...top_ids`` / ``...top_values``, ``...error``) that `run_with_cache` and
  ``generate(capture=...)`` record and interventions edit; with the error
  term kept the model's output is unchanged until features are edited.
* `FeatureEdit` (`penzai_lm.sae.edits`): clamp, scale or add to features,
  per row and per token rule, with traced values.
* `feature_attribution(model, tokens, point, metric)`: activations,
  gradients and ``activation * gradient`` of every feature at every token,
  one compiled forward and backward pass.
* `load_sae(path)` / `save_sae(sae, directory)` (`penzai_lm.sae.formats`):
  SAELens directories, Gemma Scope 1 and 2 files, circuit-tracer layer
  files; `load_transcoders(path)` for circuit-tracer ``config.yaml`` sets
  (`TranscoderSet`) and cross-layer transcoders (`CrossLayerTranscoder`).
"""

from penzai_lm.sae.attribution import FeatureAttribution
from penzai_lm.sae.attribution import feature_attribution
from penzai_lm.sae.autoencoder import SAEConfig
from penzai_lm.sae.autoencoder import SparseAutoencoder
from penzai_lm.sae.edits import FeatureEdit
from penzai_lm.sae.formats import CrossLayerTranscoder
from penzai_lm.sae.formats import SAEFormatError
from penzai_lm.sae.formats import TranscoderSet
from penzai_lm.sae.formats import load_sae
from penzai_lm.sae.formats import load_transcoders
from penzai_lm.sae.formats import save_sae
from penzai_lm.sae.splice import FeaturePoint
from penzai_lm.sae.splice import Splice
from penzai_lm.sae.splice import splice

__all__ = [
    "CrossLayerTranscoder",
    "FeatureAttribution",
    "FeatureEdit",
    "FeaturePoint",
    "SAEConfig",
    "SAEFormatError",
    "Splice",
    "SparseAutoencoder",
    "TranscoderSet",
    "feature_attribution",
    "load_sae",
    "load_transcoders",
    "save_sae",
    "splice",
]
