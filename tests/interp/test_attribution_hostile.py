"""attribution_patching with hostile metrics: a `LogitDiff` outside the
vocabulary or the prompts, a metric that is NaN (or has a NaN gradient),
and one that returns something other than a number are clear errors
naming the metric or its field (the traced program clamped the index, or
returned NaN scores, silently)."""

import jax.numpy as jnp
import pytest

from penzai_lm import interp
from tests.interp.test_attribution import _models
from tests.interp.test_attribution import CLEAN
from tests.interp.test_attribution import CORRUPT


def _run(metric):
  return interp.attribution_patching(_models()["unstacked"], CLEAN, CORRUPT,
                                     metric, names=["resid_pre"])


@pytest.mark.parametrize("metric,message", [
    (interp.LogitDiff(10**6, 3),
     r"LogitDiff.answer=1000000 is outside the model's vocabulary \[0, 97\)"),
    (interp.LogitDiff(3, -1),
     r"LogitDiff.wrong=-1 is outside the model's vocabulary \[0, 97\)"),
    (interp.LogitDiff(3, 4, position=6),
     r"LogitDiff.position=6 is outside the prompts' 6 tokens \(-6 to 5\)"),
])
def test_a_logit_diff_outside_the_model_is_refused(metric, message):
  with pytest.raises(ValueError, match=message):
    _run(metric)


def _mean(logits):
  return jnp.mean(logits.unwrap(*logits.named_shape))


def test_a_nan_metric_is_an_error_naming_it():
  def nan_metric(logits):
    return _mean(logits) * jnp.nan

  with pytest.raises(ValueError, match=r"the metric .*nan_metric: its value"
                     r" on the clean run is nan"):
    _run(nan_metric)


def test_a_nan_gradient_is_an_error_naming_it():
  def kinked(logits):  # Finite value, NaN gradient: sqrt at 0.
    return jnp.sqrt(jnp.abs(_mean(logits)) * 0.0)

  with pytest.raises(ValueError, match=r"kinked: its gradient at resid_pre"
                     r" holds \d+ NaN or inf value\(s\)"):
    _run(kinked)


@pytest.mark.parametrize("out", ["abc", None, [1.0]])
def test_a_metric_returning_no_number_is_a_type_error(out):
  with pytest.raises(TypeError, match=r"the metric .*<lambda> must return a"
                     r" scalar number .*got (str|NoneType|list)"):
    _run(lambda logits: out)
