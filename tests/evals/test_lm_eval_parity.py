"""penzai_lm's lm-eval model against lm-eval's own ``hf`` model on the same
weights (the real checkpoints, transformers loading the same GGUF file):
loglikelihoods, rolling loglikelihoods and greedy generations, a local
multiple-choice and generate-until task end to end through
``lm_eval.simple_evaluate``, and a steered model against the same steering
done with a transformers forward hook inside ``hf``."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

import lm_eval  # pylint: disable=g-import-not-at-top
from lm_eval.api.instance import Instance  # pylint: disable=g-import-not-at-top
from lm_eval.models.huggingface import HFLM  # pylint: disable=g-import-not-at-top
from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top

from penzai_lm import interp  # pylint: disable=g-import-not-at-top
from penzai_lm.evals import LM  # pylint: disable=g-import-not-at-top
from penzai_lm.fetch import resolve_model_path  # pylint: disable=g-import-not-at-top
from tests import real_models  # pylint: disable=g-import-not-at-top

pytestmark = pytest.mark.slow

PAIRS = [("The capital of France is", " Paris"),
         ("The capital of France is ", "Paris"),  # The space moves over.
         ("", "Hello world"),  # The prefix token.
         ("2 + 2 =", " 4, and 3 + 3 = 6"),
         ("Question: Is the sky blue?\nAnswer:", " yes")]
TEXT = "The quick brown fox jumps over the lazy dog. " * 6
QUESTIONS = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome",
                                                        " Berlin"],
     "answer": 0},
    {"question": "The opposite of hot is", "choices": [" cold", " warm"],
     "answer": 0},
    {"question": "Two plus two equals", "choices": [" five", " four"],
     "answer": 1},
    {"question": "The color of grass is", "choices": [" green", " blue",
                                                     " red"], "answer": 0},
]
TASKS = {
    "pzlm_mc": """task: pzlm_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""",
    "pzlm_gen": """task: pzlm_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module", params=real_models.NAMES)
def pair(request):
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  name = request.param
  model, tokenizer = real_models.ours(name)
  path = resolve_model_path(name)
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(
      path.parent, gguf_file=path.name)
  theirs = HFLM(pretrained=real_models.theirs(name), tokenizer=hf_tokenizer,
                batch_size=4)
  yield name, model, tokenizer, theirs
  torch.set_num_threads(threads)


def _instances(kind, args):
  return [Instance(request_type=kind, doc={}, arguments=a, idx=i)
          for i, a in enumerate(args)]


def _close(ours, theirs):
  np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def test_requests_score_as_lm_evals_hf_model(pair):
  _, model, tokenizer, theirs = pair
  ours = LM(model, tokenizer, batch_size=4)
  got = ours.loglikelihood(_instances("loglikelihood", PAIRS))
  want = theirs.loglikelihood(_instances("loglikelihood", PAIRS))
  _close([s for s, _ in got], [s for s, _ in want])
  assert [g for _, g in got] == [g for _, g in want]
  rolling = _instances("loglikelihood_rolling", [(TEXT,)])
  _close(ours.loglikelihood_rolling(rolling),
         theirs.loglikelihood_rolling(rolling))
  generations = _instances("generate_until", [
      (f"Q: {q['question']}?\nA:", {"until": ["\n"], "max_gen_toks": 12})
      for q in QUESTIONS[:2]])
  assert ours.generate_until(generations) == theirs.generate_until(
      generations)


def test_a_local_task_end_to_end(pair, tmp_path, monkeypatch):
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  _, model, tokenizer, theirs = pair
  data = tmp_path / "data.jsonl"
  data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
  for name, text in TASKS.items():
    (tmp_path / f"{name}.yaml").write_text(text.format(data=data))
  manager = TaskManager(include_path=str(tmp_path))
  results = {}
  for label, lm in (("ours", LM(model, tokenizer, batch_size=4)),
                    ("theirs", theirs)):
    out = lm_eval.simple_evaluate(model=lm, tasks=list(TASKS),
                                  task_manager=manager, log_samples=True)
    results[label] = out
  for task, metric in (("pzlm_mc", "acc,none"),
                       ("pzlm_gen", "exact_match,none")):
    assert (results["ours"]["results"][task][metric]
            == results["theirs"]["results"][task][metric]), task
  scores = {label: [float(r[0][0]) for s in out["samples"]["pzlm_mc"]
                    for r in s["resps"]]
            for label, out in results.items()}
  assert len(scores["ours"]) == sum(len(q["choices"]) for q in QUESTIONS)
  _close(scores["ours"], scores["theirs"])


def test_a_steered_model_scores_as_the_same_hook_in_hf(pair):
  name, model, tokenizer, theirs = pair
  hidden, layer, strength = model.config.hidden_size, 3, 4.0
  vector = np.random.default_rng(0).standard_normal(hidden).astype(
      np.float32)
  vector /= np.linalg.norm(vector)
  steered = interp.insert_at(model, f"blocks.{layer}.resid_post",
                             interp.AddVector.build(vector, strength))
  ours = LM(steered, tokenizer, batch_size=4).loglikelihood(
      _instances("loglikelihood", PAIRS))

  def hook(_module, _args, output):
    add = torch.from_numpy(strength * vector)
    if isinstance(output, tuple):
      return (output[0] + add,) + tuple(output[1:])
    return output + add

  handle = theirs.model.model.layers[layer].register_forward_hook(hook)
  try:
    want = theirs.loglikelihood(_instances("loglikelihood", PAIRS))
  finally:
    handle.remove()
  plain = LM(model, tokenizer, batch_size=4).loglikelihood(
      _instances("loglikelihood", PAIRS))
  assert max(abs(a[0] - b[0]) for a, b in zip(ours, plain)) > 1e-2, name
  _close([s for s, _ in ours], [s for s, _ in want])
