"""penzai_lm.evals.strength_sweep.sweep: several strengths of one
intervention as rows of one batch equal one `LM` run per strength (a
steering vector, and a clamped autoencoder feature), new strengths reuse
the compiled program, and bad arguments are clear errors."""

import dataclasses

import numpy as np
import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # pylint: disable=g-import-not-at-top

import penzai_lm  # pylint: disable=g-import-not-at-top
from penzai_lm import generation  # pylint: disable=g-import-not-at-top
from penzai_lm import interp  # pylint: disable=g-import-not-at-top
from penzai_lm import sae as sae_lib  # pylint: disable=g-import-not-at-top
from penzai_lm.evals import LM  # pylint: disable=g-import-not-at-top
from penzai_lm.evals.strength_sweep import sweep  # pylint: disable=g-import-not-at-top
from penzai_lm.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
from tests.model.configs import config  # pylint: disable=g-import-not-at-top
from tests.sae.random_saes import random_arrays  # pylint: disable=g-import-not-at-top
from tests.tokenizer.conftest import write_tiny_bpe_gguf  # pylint: disable=g-import-not-at-top

PAIRS = [("hello", " world"), ("the cat", " sat on"), ("", "hello"),
         ("zz", "y"), ("a", "b")]
STRENGTHS = [0.0, 2.0, -3.0]


@pytest.fixture(name="tok")
def _tok(tmp_path, monkeypatch):
  monkeypatch.setenv("PENZAI_LM_CACHE", str(tmp_path / "cache"))
  return Tokenizer.from_gguf(write_tiny_bpe_gguf(tmp_path / "t.gguf"))


def _model():
  return penzai_lm.build_transformer(
      dataclasses.replace(config("llama_gqa", True), vocab_size=268), seed=3)


def _steer(model, strength):
  vector = np.random.default_rng(0).standard_normal(
      model.config.hidden_size).astype(np.float32)
  return interp.insert_at(model, "blocks.1.resid_post",
                          interp.AddVector.build(vector, strength))


def _clamp(model, value):
  width, features = model.config.hidden_size, 64
  cfg = sae_lib.SAEConfig(activation="jumprelu", num_features=features,
                          input_axes=(("embedding", width),),
                          output_axes=(("embedding", width),),
                          hook_point="blocks.1.resid_post")
  sae = sae_lib.SparseAutoencoder.from_arrays(
      cfg, **random_arrays(width, features, width, seed=2, threshold=True))
  return interp.insert_at(sae_lib.splice(model, sae),
                          "blocks.1.resid_post.sae.features",
                          sae_lib.FeatureEdit.clamp(sae, [7], value))


def _requests(pairs):
  return [Instance(request_type="loglikelihood", doc={}, arguments=a, idx=i)
          for i, a in enumerate(pairs)]


@pytest.mark.parametrize("intervene", [_steer, _clamp])
def test_rows_of_one_batch_equal_one_run_per_strength(tok, intervene):
  model, engine = _model(), generation.Engine()
  lm = LM(model, tok, batch_size=6, engine=engine)
  result = sweep(lm, PAIRS, STRENGTHS, intervene)
  assert result.loglikelihoods.shape == (3, len(PAIRS))
  for k, strength in enumerate(STRENGTHS):
    alone = LM(intervene(model, strength), tok, batch_size=4).loglikelihood(
        _requests(PAIRS))
    np.testing.assert_allclose(result.loglikelihoods[k],
                               [s for s, _ in alone], rtol=1e-5, atol=1e-5)
    assert list(result.greedy[k]) == [g for _, g in alone]
  spread = np.ptp(result.loglikelihoods, axis=0)
  assert spread.max() > 1e-2  # The strengths matter.
  # New strengths, the same program; Instances work as pairs.
  compiled = engine.compilations
  again = sweep(lm, _requests(PAIRS), [1.0, 0.0, 5.0], intervene)
  assert engine.compilations == compiled
  np.testing.assert_allclose(again.loglikelihoods[1],
                             result.loglikelihoods[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args, message", [
    (dict(strengths=[]), "strengths must be one or more finite numbers"),
    (dict(strengths=[1.0, float("nan")]), "finite numbers"),
    (dict(strengths=2.0), "strengths must be a list of numbers"),
    (dict(pairs=[]), "pairs is empty"),
    (dict(pairs=[("a",)]), r"pairs must be \(context, continuation\)"),
    (dict(intervene=3), "intervene must be callable"),
])
def test_bad_arguments_are_clear_errors(tok, args, message):
  kwargs = dict(pairs=PAIRS, strengths=STRENGTHS, intervene=_steer)
  kwargs.update(args)
  with pytest.raises(ValueError, match=message):
    sweep(LM(_model(), tok), **kwargs)
