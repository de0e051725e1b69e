"""lm-eval on penzai_lm's model against lm-eval's own ``hf`` model.

The same two local tasks (written here: no network) through
``lm_eval.simple_evaluate`` on the same SmolLM2 weights: a multiple-choice
task of ``--docs`` questions with 4 choices each (4 x docs loglikelihood
requests) and a generate-until task of ``--generations`` prompts
(``max_gen_toks`` 16, greedy). ``hf`` runs at lm-eval's default batch size
(1, as ``lm_eval --model hf`` runs) and at ``--batch`` (as penzai_lm runs);
torch uses every core. Prints the wall time of each (median of
``--repeats``, after a first run that compiles / warms up) and the
accuracies, which must agree.

Run: python benchmarks/eval_speed.py [--docs 125] [--generations 50]
"""

import argparse
import json
import pathlib
import statistics
import tempfile
import time

import lm_eval
import numpy as np
import transformers
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

import penzai_lm
from penzai_lm.evals import LM
from penzai_lm.fetch import resolve_model_path

MODEL = "smollm2-135m-instruct"
WORDS = ("red", "blue", "green", "cat", "dog", "river", "stone", "light",
         "seven", "music", "winter", "paper", "garden", "silver", "cloud")


def _write_tasks(folder: pathlib.Path, docs: int, generations: int) -> list:
  rng = np.random.default_rng(0)
  mc = []
  for i in range(docs):
    words = list(rng.choice(WORDS, 6, replace=False))
    mc.append({"question": f"Item {i}: the list {', '.join(words[:3])} ends"
                           " with the word",
               "choices": [f" {w}" for w in [words[2], *words[3:6]]],
               "answer": 0})
  gen = [{"question": f"Repeat the word {rng.choice(WORDS)} three times.",
          "answer": ""} for _ in range(generations)]
  for name, rows in (("mc", mc), ("gen", gen)):
    (folder / f"{name}.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))
  (folder / "speed_mc.yaml").write_text(f"""task: speed_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
  (folder / "speed_gen.yaml").write_text(f"""task: speed_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
""")
  return ["speed_mc", "speed_gen"]


def _time(lm, tasks, manager, repeats):
  times, out = [], None
  for _ in range(repeats + 1):  # The first run compiles / warms up.
    start = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=tasks,
                                  task_manager=manager)
    times.append(time.perf_counter() - start)
  return statistics.median(times[1:]), times[0], out["results"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--docs", type=int, default=125)
  parser.add_argument("--generations", type=int, default=50)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--repeats", type=int, default=2)
  args = parser.parse_args()
  folder = pathlib.Path(tempfile.mkdtemp())
  tasks = _write_tasks(folder, args.docs, args.generations)
  manager = TaskManager(include_path=str(folder))
  path = resolve_model_path(MODEL)
  model, tokenizer = penzai_lm.load(MODEL)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      path.parent, gguf_file=path.name, dtype="float32").eval()
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(
      path.parent, gguf_file=path.name)
  engines = {
      f"penzai_lm (batch {args.batch})": LM(model, tokenizer,
                                             batch_size=args.batch),
      "hf (batch 1, lm-eval's default)": HFLM(
          pretrained=hf_model, tokenizer=hf_tokenizer, batch_size=1),
      f"hf (batch {args.batch})": HFLM(pretrained=hf_model,
                                       tokenizer=hf_tokenizer,
                                       batch_size=args.batch),
  }
  print(f"{4 * args.docs} loglikelihood requests, {args.generations}"
        " generations (16 tokens)")
  print("| engine | median s | first run s | acc | exact_match |")
  print("|---|---|---|---|---|")
  base = None
  for name, lm in engines.items():
    median, first, results = _time(lm, tasks, manager, args.repeats)
    base = base or median
    print(f"| {name} | {median:.1f} ({median / base:.2f}x) | {first:.1f} |"
          f" {results['speed_mc']['acc,none']:.3f} |"
          f" {results['speed_gen']['exact_match,none']:.3f} |")


if __name__ == "__main__":
  main()
