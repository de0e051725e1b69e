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
* `train_sae(model, point, tokens, TrainConfig(...))`
  (`penzai_lm.sae.training`): trains a ReLU, TopK or JumpReLU SAE on
  activations streamed from the model, in compiled steps; returns it with a
  `TrainingReport`. `evaluate_sae` gives any SAE's `SAEMetrics` (L0,
  explained variance, CE loss recovered when spliced) on held-out tokens.
* `load_sae(path)` / `save_sae(sae, directory)` (`penzai_lm.sae.formats`):
  SAELens directories, Gemma Scope 1 and 2 files, circuit-tracer layer
  files; `load_transcoders(path)` for circuit-tracer ``config.yaml`` sets
  (`TranscoderSet`) and cross-layer transcoders (`CrossLayerTranscoder`).
* `dashboard(model, sae, prompts, features=[...])`
  (`penzai_lm.sae.dashboard`): each feature's top activating tokens in
  context, firing frequency, activation histogram and the logits its
  decoder direction promotes; shown in a notebook, saved as one HTML file.
"""

from penzai_lm.sae.attribution import FeatureAttribution
from penzai_lm.sae.attribution import feature_attribution
from penzai_lm.sae.autoencoder import SparseAutoencoder
from penzai_lm.sae.dashboard import Dashboard
from penzai_lm.sae.dashboard import dashboard
from penzai_lm.sae.dashboard import FeatureCard
from penzai_lm.sae.edits import FeatureEdit
from penzai_lm.sae.evaluation import SAEMetrics
from penzai_lm.sae.evaluation import evaluate_sae
from penzai_lm.sae.formats import CrossLayerTranscoder
from penzai_lm.sae.formats import SAEFormatError
from penzai_lm.sae.formats import TranscoderSet
from penzai_lm.sae.formats import load_sae
from penzai_lm.sae.formats import load_transcoders
from penzai_lm.sae.formats import save_sae
from penzai_lm.sae.sae_config import SAEConfig
from penzai_lm.sae.splice import FeaturePoint
from penzai_lm.sae.splice import Splice
from penzai_lm.sae.splice import splice
from penzai_lm.sae.train_config import TrainConfig
from penzai_lm.sae.training import LogEntry
from penzai_lm.sae.training import TrainingReport
from penzai_lm.sae.training import train_sae
from penzai_lm.sae.training import train_sae_on_activations

__all__ = [
    "CrossLayerTranscoder",
    "Dashboard",
    "FeatureCard",
    "FeatureAttribution",
    "FeatureEdit",
    "FeaturePoint",
    "LogEntry",
    "SAEConfig",
    "SAEFormatError",
    "SAEMetrics",
    "Splice",
    "SparseAutoencoder",
    "TrainConfig",
    "TrainingReport",
    "TranscoderSet",
    "dashboard",
    "evaluate_sae",
    "feature_attribution",
    "load_sae",
    "load_transcoders",
    "save_sae",
    "splice",
    "train_sae",
    "train_sae_on_activations",
]
