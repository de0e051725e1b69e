"""lm-eval ``--model_args`` sae=,sae_feature=,sae_value=: a random Llama
(a Hugging Face directory with the tiny BPE tokenizer) and a random SAELens
JumpReLU directory on disk; the clamped model's loglikelihoods through
`LM.create_from_arg_string` equal those of the same clamp done in Python
(splice + FeatureEdit) and differ from the unclamped model's, on requests
and on a local multiple-choice task through ``lm_eval.simple_evaluate``;
partial or bad options are clear errors."""

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("lm_eval")

import lm_eval  # pylint: disable=g-import-not-at-top
from lm_eval.api.instance import Instance  # pylint: disable=g-import-not-at-top
from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top

import penzai_lm  # pylint: disable=g-import-not-at-top
from penzai_lm import interp  # pylint: disable=g-import-not-at-top
from penzai_lm import sae as sae_lib  # pylint: disable=g-import-not-at-top
from penzai_lm.evals import LM  # pylint: disable=g-import-not-at-top
from penzai_lm.evals.requests import load_from_args  # pylint: disable=g-import-not-at-top
from tests.circuits.small_graphs import write_tokenizer_dir  # pylint: disable=g-import-not-at-top
from tests.evals.test_lm_eval_parity import TASKS  # pylint: disable=g-import-not-at-top
from tests.loading.synthetic_checkpoints import write_random_llama  # pylint: disable=g-import-not-at-top
from tests.sae.format_files import saelens_dir  # pylint: disable=g-import-not-at-top

HIDDEN, FEATURE, VALUE = 16, 5, 6.0
PAIRS = [("hello", " world"), ("the cat", " sat on"), ("", "hello"),
         ("a", "b")]
QUESTIONS = [
    {"question": "the cat", "choices": [" sat", " ran", " hello"],
     "answer": 0},
    {"question": "hello", "choices": [" world", " cat"], "answer": 1},
]
TASK = TASKS["pzlm_mc"].replace("pzlm_mc", "pzlm_sae_mc")


@pytest.fixture(scope="module", name="files")
def _files(tmp_path_factory):
  """(model directory, SAELens directory reading blocks.1.resid_post)."""
  root = tmp_path_factory.mktemp("sae_args")
  tok_dir = write_tokenizer_dir(root)
  model_dir = write_random_llama(root / "model", {
      "vocab_size": 268, "hidden_size": HIDDEN, "intermediate_size": 24,
      "num_hidden_layers": 2, "num_attention_heads": 2,
      "num_key_value_heads": 1, "bos_token_id": 0, "eos_token_id": 1},
                                 kind="F32", shards=1, seed=3)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(tok_dir / name, model_dir / name)
  sae_dir = saelens_dir(root / "sae", d=HIDDEN, metadata={
      "sae_lens_version": "6.0.0", "hook_name": "blocks.1.hook_resid_post"})
  return model_dir, sae_dir


def _requests(pairs):
  return [Instance(request_type="loglikelihood", doc={}, arguments=a, idx=i)
          for i, a in enumerate(pairs)]


def _by_hand(model_dir, sae_dir):
  """The clamp in Python: load, splice, FeatureEdit at the features."""
  model, tokenizer = penzai_lm.load(str(model_dir))
  sae = sae_lib.load_sae(sae_dir, model=model)
  spliced = sae_lib.splice(model, sae)
  clamped = interp.insert_at(
      spliced, "blocks.1.resid_post.sae.features",
      sae_lib.FeatureEdit.clamp(sae, [FEATURE], VALUE))
  return model, clamped, tokenizer


def test_clamped_loglikelihoods_equal_the_clamp_in_python(files):
  model_dir, sae_dir = files
  ours = LM.create_from_arg_string(
      f"model={model_dir},sae={sae_dir},sae_feature={FEATURE},"
      f"sae_value={VALUE},batch_size=2")
  plain, clamped, tokenizer = _by_hand(model_dir, sae_dir)
  got = [s for s, _ in ours.loglikelihood(_requests(PAIRS))]
  want = [s for s, _ in LM(clamped, tokenizer, batch_size=2).loglikelihood(
      _requests(PAIRS))]
  unclamped = [s for s, _ in LM(plain, tokenizer, batch_size=2).loglikelihood(
      _requests(PAIRS))]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.abs(np.subtract(got, unclamped)).max() > 1e-2
  # The same through a local task end to end.
  data = sae_dir.parent / "questions.jsonl"
  data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
  (sae_dir.parent / "pzlm_sae_mc.yaml").write_text(TASK.format(data=data))
  manager = TaskManager(include_path=str(sae_dir.parent))
  scores = []
  for lm in (ours, LM(clamped, tokenizer, batch_size=2)):
    out = lm_eval.simple_evaluate(model=lm, tasks=["pzlm_sae_mc"],
                                  task_manager=manager, log_samples=True)
    scores.append([float(r[0][0]) for s in out["samples"]["pzlm_sae_mc"]
                   for r in s["resps"]])
  assert len(scores[0]) == 5
  np.testing.assert_allclose(scores[0], scores[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("args, message", [
    ({"sae_feature": 1, "sae_value": 2.0}, "sae_feature, sae_value needs sae="),
    ({"sae_point": "blocks.0.resid_post"}, "sae_point needs sae="),
    ({"sae": "S"}, "sae= needs sae_feature and sae_value too"),
    ({"sae": "S", "sae_feature": 1}, "sae= needs sae_value too"),
    ({"sae": "S", "sae_feature": 64, "sae_value": 1.0},
     "sae_feature must be a feature id from 0 to 63"),
    ({"sae": "S", "sae_feature": "x", "sae_value": 1.0},
     "sae_feature must be a feature id"),
    ({"sae": "S", "sae_feature": 1, "sae_value": "nan"},
     "sae_value must be a finite number, got 'nan'"),
    ({"sae": "S", "sae_feature": 1, "sae_value": "big"},
     "sae_value must be a finite number"),
    ({"sae": "S", "sae_feature": 1, "sae_value": 1.0,
      "sae_point": "blocks.7.resid_post"}, "blocks.7"),
])
def test_partial_or_bad_options_are_clear_errors(files, args, message):
  model_dir, sae_dir = files
  args = {k: (str(sae_dir) if v == "S" else v) for k, v in args.items()}
  with pytest.raises(ValueError, match=message):
    load_from_args({"model": str(model_dir), **args})
