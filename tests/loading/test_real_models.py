"""The real GGUF checkpoints against transformers loading the same files."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests import real_models  # pylint: disable=g-import-not-at-top

pytestmark = pytest.mark.slow

LONG_TEXT = " ".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog number {i * 7}."
    for i in range(60)
)


@pytest.fixture(scope="module", params=real_models.NAMES)
def models(request):
  model, tokenizer = real_models.ours(request.param)
  return request.param, model, tokenizer, real_models.theirs(request.param)


@jax.jit
def _logits(model, tokens):
  return model(tokens)


def _ours(model, ids):
  out = _logits(pz.freeze_params(model), pz.nx.wrap(jnp.array(ids)).tag("seq"))
  return np.asarray(out.unwrap("seq", "vocabulary"))


def _theirs(hf, ids):
  with torch.no_grad():
    return hf(torch.tensor([ids])).logits[0].numpy()


def _prompts(name, tokenizer):
  prompts = [
      tokenizer.encode("The capital of France is"),
      tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n"),
      tokenizer.encode_chat([{"role": "user", "content": "What is 2+2?"}]),
  ]
  if name == "gemma3-270m":
    prompts.append(tokenizer.encode(LONG_TEXT)[:530])  # past the 512 window
  return prompts


def test_logits_match_transformers(models):
  name, model, tokenizer, hf = models
  for ids in _prompts(name, tokenizer):
    diff = np.abs(_ours(model, ids) - _theirs(hf, ids)).max()
    assert diff < 1e-3, (name, len(ids), diff)


def test_long_gemma_prompt_stays_close(models):
  """1,100+ tokens: float32 rounding grows on both sides at a few positions.

  Against a float64 numpy forward pass (tests/model/reference.py) on 700
  tokens, penzai_lm is off by 1.3e-3 and transformers by 2.1e-3, so a 1e-3
  bound on every position cannot hold for either; the bulk stays well inside.
  """
  name, model, tokenizer, hf = models
  if name != "gemma3-270m":
    pytest.skip("Gemma only: it has a 512-token sliding window")
  ids = tokenizer.encode(LONG_TEXT)
  assert len(ids) > 1000
  ours, theirs = _ours(model, ids), _theirs(hf, ids)
  per_position = np.abs(ours - theirs).max(-1)
  assert np.percentile(per_position, 99) < 1e-3
  assert per_position.max() < 2e-2
  assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_greedy_continuation_matches_transformers(models):
  name, model, tokenizer, hf = models
  ids = tokenizer.encode("The capital of France is")
  with torch.no_grad():
    expected = hf.generate(
        torch.tensor([ids]), max_new_tokens=16, do_sample=False
    )[0, len(ids):].tolist()
  # Greedy by recomputing the uncached logits (the engine has its own tests);
  # the prompt is padded to one length so this compiles once.
  seq = list(ids)
  for _ in range(16):
    seq.append(int(np.argmax(_ours(model, seq)[-1])))
  assert seq[len(ids):len(ids) + len(expected)] == expected[: 16]
