"""penzai_lm.evals.LM on a tiny random model: lm-eval's request types
answered from the model's own scores, batches that reuse one program, and
clear errors for what a user gets wrong."""

import dataclasses

import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # pylint: disable=g-import-not-at-top

import penzai_lm  # pylint: disable=g-import-not-at-top
from penzai_lm import generation  # pylint: disable=g-import-not-at-top
from penzai_lm import interp  # pylint: disable=g-import-not-at-top
from penzai_lm.evals import LM  # pylint: disable=g-import-not-at-top
from penzai_lm.evals.requests import encode_pair  # pylint: disable=g-import-not-at-top
from penzai_lm.evals.requests import generation_options  # pylint: disable=g-import-not-at-top
from penzai_lm.evals.requests import load_from_args  # pylint: disable=g-import-not-at-top
from penzai_lm.tokenizer import Tokenizer  # pylint: disable=g-import-not-at-top
from tests.model.configs import config  # pylint: disable=g-import-not-at-top
from tests.tokenizer.conftest import write_tiny_bpe_gguf  # pylint: disable=g-import-not-at-top


@pytest.fixture(name="tok")
def _tok(tmp_path, monkeypatch):
  """A real byte-level BPE tokenizer with a tiny vocabulary (268 ids)."""
  monkeypatch.setenv("PENZAI_LM_CACHE", str(tmp_path / "cache"))
  return Tokenizer.from_gguf(write_tiny_bpe_gguf(tmp_path / "t.gguf"))


def _model(name="llama_gqa", stacked=True):
  return penzai_lm.build_transformer(
      dataclasses.replace(config(name, stacked), vocab_size=268), seed=3)


def _requests(kind, args):
  return [Instance(request_type=kind, doc={}, arguments=a, idx=i)
          for i, a in enumerate(args)]


def test_loglikelihoods_are_the_models_token_losses_and_reuse_programs(tok):
  model = _model()
  engine = generation.Engine()
  lm = LM(model, tok, batch_size=4, engine=engine)
  pairs = [("hello", " world"), ("hello ", "world"), ("", "hello"),
           ("zz", "y"), ("the cat", " sat on"), ("a", "b")]
  got = lm.loglikelihood(_requests("loglikelihood", pairs))
  compiled = engine.compilations
  for (context, continuation), (score, greedy) in zip(pairs, got):
    ctx, cont = (([tok.bos_id], tok.encode(continuation, add_bos=False))
                 if not context else
                 encode_pair(tok.encode, context, continuation))
    losses = interp.token_losses(model, [ctx + cont])[0]
    assert score == pytest.approx(-float(losses[-len(cont):].sum()),
                                  rel=1e-5, abs=1e-5)
    assert isinstance(greedy, bool)
  # The trailing space moved to the continuation: the same request.
  assert got[0] == got[1]
  lm.loglikelihood(_requests("loglikelihood", pairs[::-1]))
  assert engine.compilations == compiled  # Same buckets, same programs.


def test_rolling_loglikelihood_covers_every_token_once(tok):
  model = _model("gpt2", False)
  lm = LM(model, tok, batch_size=2, max_length=8)
  text = "the quick brown fox"
  (total,) = lm.loglikelihood_rolling(_requests("loglikelihood_rolling",
                                                [(text,)]))
  ids = tok.encode(text)
  # Windows of at most 8 predictions, each with as much context as fits.
  want, done = 0.0, 0
  while done < len(ids):
    end = min(done + 8, len(ids))
    row = ([tok.bos_id] + ids)[max(0, end - 8):end + 1]
    losses = interp.token_losses(model, [row])[0]
    want -= float(losses[-(end - done):].sum())
    done = end
  assert total == pytest.approx(want, rel=1e-5)


def test_generate_until_is_greedy_generation_cut_at_the_stop_string(tok):
  model = _model()
  lm = LM(model, tok, batch_size=2)
  args = [("hello", {"until": ["e"], "max_gen_toks": 6}),
          ("xyz", {"max_gen_toks": 4, "do_sample": False})]
  texts = lm.generate_until(_requests("generate_until", args))
  for (context, kwargs), text in zip(args, texts):
    ids = penzai_lm.generate(model, [tok.encode(context)],
                             max_new_tokens=kwargs["max_gen_toks"],
                             temperature=0.0).tokens[0]
    want = tok.decode(ids, skip_special_tokens=True)
    for stop in kwargs.get("until", []):
      want = want.split(stop)[0]
    assert text == want


@pytest.mark.parametrize("call, message", [
    (lambda m, t: LM(m, t, batch_size=0), "batch_size"),
    (lambda m, t: LM(m, t, max_length=10**6), "context"),
    (lambda m, t: generation_options({"num_beams": 4}, None, 8), "num_beams"),
    (lambda m, t: generation_options({"until": [1]}, None, 8), "until"),
    (lambda m, t: generation_options({"max_gen_toks": 0}, None, 8),
     "max_gen_toks"),
    (lambda m, t: load_from_args({"dtype": "float32"}), "model="),
    (lambda m, t: load_from_args({"model": "x", "temperature": 1}),
     "temperature"),
])
def test_bad_options_are_clear_errors(call, message, tok):
  model = _model()
  with pytest.raises(ValueError, match=message):
    call(model, tok)


def test_registered_in_lm_eval_next_to_its_own_models():
  from lm_eval.api.registry import get_model  # pylint: disable=g-import-not-at-top
  assert get_model("penzai_lm") is LM
  assert get_model("hf").__name__ == "HFLM"
