"""The ``transformers`` engine of generate_vs_peers.py: HF model.generate.

Hugging Face transformers on torch CPU, float32, loading the same GGUF file
as penzai_lm. A forward pre-hook stamps the prefill start and a stopping
criterion stamps each new token. `load_hf` is also the starting point of the
``penzai_loop`` engine.
"""

from __future__ import annotations

import time

from peers.common import MODEL
from peers.common import run_record


class _TokenClock:
  """Forward pre-hook + stopping criterion that timestamp a HF generate.

  The hook times the first forward call (the prefill) of each run and then
  removes itself: with a static cache, generate compiles the later calls
  with fullgraph=True, and torch.compile cannot trace time.perf_counter.
  ``reset()`` arms it again for the next run.
  """

  def __init__(self, model):
    self.model = model
    self.prefill_start = None
    self.token_times = []
    self._hook = None
    self.reset()

  def reset(self):
    self.prefill_start, self.token_times = None, []
    if self._hook is not None:
      self._hook.remove()
    self._hook = self.model.register_forward_pre_hook(self.pre_hook,
                                                      with_kwargs=True)

  def pre_hook(self, module, args, kwargs):  # pylint: disable=unused-argument
    if self.prefill_start is None:
      self.prefill_start = time.perf_counter()
    self._hook.remove()

  def criterion(self):
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top

    clock = self

    class Stamp(transformers.StoppingCriteria):

      def __call__(self, input_ids, scores, **kwargs):
        clock.token_times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool,
                           device=input_ids.device)

    return Stamp()


def load_hf(threads: int, model: str = MODEL):
  """The transformers model (float32) from the same GGUF file."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from penzai_lm.fetch import resolve_model_path  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(threads)
  path = resolve_model_path(model)
  model = transformers.AutoModelForCausalLM.from_pretrained(
      str(path.parent), gguf_file=path.name, dtype=torch.float32)
  model.eval()
  # No stop token at all (min_new_tokens would mask EOS and change greedy).
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = model.config.pad_token_id
  return model


def run(spec: dict) -> dict:
  """HF model.generate, greedy, timed by `_TokenClock`."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top

  start = time.perf_counter()
  model = load_hf(spec["threads"], spec.get("model", MODEL))
  out = dict(load_s=time.perf_counter() - start, runs=[])
  prompts, new = spec["prompts"], spec["new"]
  ids = torch.tensor(prompts)
  clock = _TokenClock(model)
  kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new,
                do_sample=False,
                stopping_criteria=transformers.StoppingCriteriaList(
                    [clock.criterion()]))
  with torch.inference_mode():
    start = time.perf_counter()
    model.generate(ids, **kwargs)
    out["warmup_s"] = time.perf_counter() - start
    for _ in range(spec["repeats"]):
      clock.reset()
      start = time.perf_counter()
      tokens = model.generate(ids, **kwargs)
      total = time.perf_counter() - start
      times = clock.token_times
      out["runs"].append(run_record(
          len(prompts), len(prompts[0]), times[0] - clock.prefill_start,
          len(times) - 1, times[-1] - times[0], total))
  out["tokens"] = tokens[:, ids.shape[1]:].tolist()
  return out
