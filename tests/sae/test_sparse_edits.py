"""Feature edits on a splice that nothing records from compute only the
edited features (their encoder columns and decoder rows): the values equal
the dense path's for every activation, normalization, decoder-norm
rescaling, transcoders, overlapping and per-row edits and token rules; the
width of the SAE does not appear in the program; a splice with no edit is
the model itself."""

import dataclasses

import jax
import numpy as np
import pytest
from penzai import pz

from penzai_lm import interp
from penzai_lm import sae as sae_lib
from penzai_lm.model.captures import insert_captures
from penzai_lm.runtime.unstack import unstack_layers
from penzai_lm.sae.splice import Splice
from tests.sae.test_splice import _logits
from tests.sae.test_splice import _model
from tests.sae.test_splice import _np
from tests.sae.test_splice import _sae
from tests.sae.test_splice import FEATURES
from tests.sae.test_splice import POINT
from tests.sae.test_splice import PROMPTS

WIDTH = 7  # x hidden: a feature count no other array of the model has.


def _splice_layer(model) -> Splice:
  return pz.select(model).at_instances_of(Splice).get_sequence()[0]


def _edited(spliced, edits, dense: bool):
  for edit in edits:
    if dense:
      edit = dataclasses.replace(edit, ids=None)
    spliced = interp.insert_at(spliced, FEATURES, edit)
  return spliced


def _edits(sae):
  return [
      sae_lib.FeatureEdit.clamp(sae, [3, 7], [0.0, 5.0]),
      # Per row, overlapping the first edit, on some tokens only.
      sae_lib.FeatureEdit.scaled(sae, [[7, 1], [2]], 3.0,
                                 where=interp.TokenRule.positions(1, 4)),
      sae_lib.FeatureEdit.add(sae, [3, 3, 9], -2.0),
  ]


@pytest.mark.parametrize("activation,options", [
    ("relu", {}),
    ("jumprelu", dict(apply_b_dec_to_input=True,
                      normalize_activations="layer_norm")),
    ("topk", dict(rescale_acts_by_decoder_norm=True,
                  normalize_activations="constant_norm_rescale")),
])
def test_sparse_edits_equal_dense_edits(activation, options):
  model = _model(stacked=False)
  sae = _sae(model, activation, width=WIDTH, **options)
  spliced = sae_lib.splice(model, sae)
  sparse = _edited(spliced, _edits(sae), dense=False)
  dense = _edited(spliced, _edits(sae), dense=True)
  assert len(_splice_layer(sparse)._edits_only()) == 3  # pylint: disable=protected-access
  assert _splice_layer(dense)._edits_only() is None  # pylint: disable=protected-access
  got = interp.run_with_cache(sparse, PROMPTS, names=[POINT])
  want = interp.run_with_cache(dense, PROMPTS, names=[POINT])
  base = interp.run_with_cache(spliced, PROMPTS, names=[POINT])
  np.testing.assert_allclose(_np(got[POINT], "batch", "seq", "embedding"),
                             _np(want[POINT], "batch", "seq", "embedding"),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(_logits(got), _logits(want), rtol=1e-5,
                             atol=1e-5)
  assert np.abs(_logits(got) - _logits(base)).max() > 1e-3  # It steers.


def test_recording_the_features_takes_the_dense_path():
  model = _model(stacked=False)
  sae = _sae(model)
  steered = _edited(sae_lib.splice(model, sae), _edits(sae)[:1], dense=False)
  recorded = insert_captures(steered, [f"{POINT}.sae.top_ids"],
                                    {"batch": 2, "seq": 5})[0]
  assert _splice_layer(recorded)._edits_only() is None  # pylint: disable=protected-access
  cached = interp.run_with_cache(steered, PROMPTS, names=[FEATURES])
  features = _np(cached[FEATURES], "batch", "seq", "features")
  np.testing.assert_array_equal(features[0][:, [3, 7]], 0.0)
  np.testing.assert_array_equal(features[1, 2:][:, [3, 7]], 5.0)  # Unpadded.


def test_transcoder_edits_equal_dense_edits():
  model = _model("gemma3", stacked=False)
  hidden = model.config.hidden_size
  cfg = sae_lib.SAEConfig(
      activation="jumprelu", num_features=WIDTH * hidden,
      input_axes=(("embedding", hidden),),
      output_axes=(("embedding", hidden),),
      hook_point="blocks.2.mlp_in", output_point="blocks.2.mlp_out")
  transcoder = sae_lib.SparseAutoencoder.random(cfg, 2, skip=True)
  spliced = sae_lib.splice(model, transcoder)
  features = "blocks.2.mlp_in.transcoder.features"
  edit = sae_lib.FeatureEdit.clamp(transcoder, [4, 11], 6.0)
  runs = [interp.run_with_cache(
      interp.insert_at(spliced, features, e), PROMPTS,
      names=["blocks.2.mlp_out"])
          for e in (edit, dataclasses.replace(edit, ids=None))]
  np.testing.assert_allclose(_logits(runs[0]), _logits(runs[1]), rtol=1e-5,
                             atol=1e-5)
  plain = interp.run_with_cache(model, PROMPTS, names=["blocks.2.mlp_out"])
  assert np.abs(_logits(runs[0]) - _logits(plain)).max() > 1e-3


@pytest.mark.parametrize("activation", ["relu", "jumprelu"])
def test_steering_does_not_compute_every_feature(activation):
  model = _model(stacked=False)
  sae = _sae(model, activation, width=WIDTH)
  width = sae.config.num_features
  edit = sae_lib.FeatureEdit.clamp(sae, [5], 2.0)
  sparse, dense = (_splice_layer(_edited(sae_lib.splice(model, sae), [edit],
                                         dense=d)) for d in (False, True))
  x = pz.nx.wrap(np.ones((2, 3, model.config.hidden_size), np.float32)
                 ).tag("batch", "seq", "embedding")

  def shapes(fn):
    positions = pz.nx.wrap(np.zeros((2, 3), np.int32)).tag("batch", "seq")
    jaxpr = jax.make_jaxpr(
        lambda v: fn(v, token_positions=positions).data_array)(x)
    return [tuple(v.aval.shape) for e in jaxpr.eqns for v in e.outvars]

  assert not [s for s in shapes(sparse) if width in s]
  assert [s for s in shapes(dense) if width in s]  # The check can fail.


def test_a_splice_nothing_edits_or_records_is_the_model():
  model = _model()
  spliced = sae_lib.splice(model, _sae(model))
  got = interp.run_with_cache(spliced, PROMPTS, names=[POINT])
  want = interp.run_with_cache(unstack_layers(model), PROMPTS, names=[POINT])
  np.testing.assert_array_equal(_logits(got), _logits(want))
