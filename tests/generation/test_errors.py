"""Bad requests fail before anything runs, with a helpful message, and leave
the model untouched."""

import threading

import jax.numpy as jnp
import numpy as np
import pytest
from penzai import pz

from penzai_lm.generation import default_engine
from penzai_lm.generation import Engine
from penzai_lm.generation import Session
from penzai_lm.generation import generate
from penzai_lm.generation import generate_text
from penzai_lm.generation import stream
from penzai_lm.generation import CalculatorTool
from penzai_lm.model import KVCachingTransformerLM
from penzai_lm.model import build_transformer
from penzai_lm.tools import ToolCallParser
from tests.generation.conftest import VOCAB
from tests.model.configs import config


def _error(model, prompts, match, exc=ValueError, **settings):
  compiled = default_engine().compilations
  with pytest.raises(exc, match=match):
    generate(model, prompts, **settings)
  assert default_engine().compilations == compiled  # Nothing compiled.


@pytest.mark.parametrize("value", [0, -3, 2.5, None, True])
def test_max_new_tokens_below_one(model, value):
  _error(model, [1, 2], "max_new_tokens must be a positive integer",
         max_new_tokens=value)


def test_per_row_max_new_tokens_mentions_the_row(model):
  _error(model, [[1, 2], [3]], "for row 1", max_new_tokens=[4, 0])


def test_context_exceeded(model):
  limit = model.config.max_position_embeddings
  _error(model, [[1] * 10], r"exceed the model's context of \d+ tokens",
         max_new_tokens=limit - 5)
  gpt2 = build_transformer(config("gpt2"), seed=1)  # 64 positions.
  _error(gpt2, [[1] * 60], "prompt 0 has 60 tokens and max_new_tokens is 10",
         max_new_tokens=10)


@pytest.mark.parametrize("prompts,match", [
    ([], "prompts is empty"),
    ([[]], "prompt 0 is empty"),
    ([[1, 2], []], "prompt 1 is empty"),
    (np.zeros((2, 0), np.int32), "prompt 0 is empty"),
])
def test_empty_prompts(model, prompts, match):
  _error(model, prompts, match)


@pytest.mark.parametrize("prompts,match", [
    ([1, VOCAB], f"token id {VOCAB}, outside the model's vocabulary"),
    ([[1, 2], [-1]], "prompt 1 contains token id -1"),
    ([[1.5, 2.0]], "must contain integer token ids"),
    ([1, [2]], "mixes ids and other values"),
    (np.zeros((2, 2, 2), np.int32), "must be 1-D"),
])
def test_bad_token_ids(model, prompts, match):
  _error(model, prompts, match)


def test_text_prompt_to_token_api(model):
  _error(model, "hello", "must be token ids, not text", exc=TypeError)


@pytest.mark.parametrize("settings,match", [
    (dict(temperature=-1.0), r"temperature\[0\] = -1.0 is invalid"),
    (dict(top_p=0.0), r"top_p\[0\] = 0.0 is invalid"),
    (dict(top_p=[1.0, 1.5]), r"top_p\[1\] = 1.5 is invalid"),
    (dict(min_p=1.0), r"min_p\[0\] = 1.0 is invalid"),
    (dict(top_k=-2), r"top_k\[0\] = -2 is invalid"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(temperature=float("nan")), "must be finite"),
    (dict(logit_bias={VOCAB + 1: 1.0}), "outside the vocabulary"),
    (dict(banned_tokens=list(range(VOCAB))), "bans the whole vocabulary"),
    (dict(seed=-1), r"seed\[0\] = -1 is invalid"),
    (dict(seed=2**32), "seeds must be integers in"),
    (dict(stop_tokens=[VOCAB]), "stop_tokens.*outside the vocabulary"),
    (dict(forced_tokens=[[1], [2.5]]), "token ids must be integers"),
    (dict(logprobs_top_n=-1), "logprobs_top_n must be an integer"),
    (dict(num_samples=0), "num_samples must be a positive integer"),
    (dict(use_cache="yes"), "use_cache must be True or False"),
    (dict(min_new_tokens=-1), r"min_new_tokens must be an integer in \[0, "),
    (dict(min_new_tokens=[2, 9], max_new_tokens=8),
     r"max_new_tokens=8\].*got 9 for row 1"),
    (dict(min_new_tokens=1.5), "min_new_tokens must be an integer"),
    (dict(min_new_tokens=2, stop_tokens=[0],
          banned_tokens=list(range(1, VOCAB))),
     "row 0 bans every token but its stop tokens"),
    (dict(typical_p=0.0), r"typical_p\[0\] = 0.0 is invalid"),
    (dict(eta_cutoff=[0.1, 1.0]), r"eta_cutoff\[1\] = 1.0 is invalid"),
])
def test_bad_settings(model, settings, match):
  _error(model, [[1, 2], [3]], match, **settings)


@pytest.mark.parametrize("settings", [
    dict(temperature=[0.5, 0.5, 0.5]),
    dict(top_k=[1]),
    dict(max_new_tokens=[1, 2, 3]),
    dict(min_new_tokens=[1, 2, 3]),
    dict(seed=[1, 2, 3]),
    dict(stop_tokens=[[1], [2], [3]]),
    dict(logit_bias=[{1: 1.0}] * 3),
])
def test_per_row_settings_of_the_wrong_length(model, settings):
  name = next(iter(settings))
  _error(model, [[1, 2], [3]], f"{name} has .* values but the request has 2",
         **settings)


def test_per_row_settings_with_samples_accept_prompts_or_rows(model):
  run = default_engine().start(model, [[1, 2], [3]], num_samples=2,
                               temperature=[0.1, 0.2])
  np.testing.assert_allclose(run.request.sampling.temperature,
                             [0.1, 0.1, 0.2, 0.2])
  run = default_engine().start(model, [[1, 2], [3]], num_samples=2,
                               temperature=[0.1, 0.2, 0.3, 0.4])
  np.testing.assert_allclose(run.request.sampling.temperature,
                             [0.1, 0.2, 0.3, 0.4])
  with pytest.raises(ValueError, match=r"2 \(one per prompt\) or 4"):
    default_engine().start(model, [[1, 2], [3]], num_samples=2,
                           temperature=[0.1, 0.2, 0.3])


def test_named_array_prompts_with_wrong_axes(model):
  ids = jnp.ones((2, 3), jnp.int32)
  _error(model, pz.nx.wrap(ids).tag("batch", "tokens"), "needs a 'seq' axis")
  _error(model, pz.nx.wrap(jnp.ones((2, 2, 3), jnp.int32)).tag(
      "a", "b", "seq"), "only 'seq' and one batch axis")
  _error(model, pz.nx.wrap(ids), "positional axes")
  cached = KVCachingTransformerLM.from_uncached(model, 16, {"rows": 2})
  _error(cached, pz.nx.wrap(ids).tag("batch", "seq"),
         "batch axis is 'batch', but the cached model's batch axis is 'rows'")


def test_cached_model_too_small(model):
  small_batch = KVCachingTransformerLM.from_uncached(model, 16, {"batch": 1})
  _error(small_batch, [[1, 2], [3]], r"built for 1 row\(s\) but the request"
         r" needs 2")
  _error(small_batch, [1, 2], r"needs 3 .*1 prompt\(s\) x 3 sample",
         num_samples=3)
  short = KVCachingTransformerLM.from_uncached(model, 4, {"batch": 1})
  _error(short, [[1] * 6], "has 6 tokens but the cached model's cache holds"
         " only 4")
  _error(short, [1, 2], "use_cache=False needs the uncached TransformerLM",
         use_cache=False)


def test_used_cached_model_is_rejected_and_not_modified(model):
  cached = KVCachingTransformerLM.from_uncached(model, 16, {"batch": 1})
  cached.cache_end_index.value = jnp.asarray(3, jnp.int32)  # As if used.
  _error(cached, [1, 2], "already holds 3 tokens")
  assert int(cached.cache_end_index.value) == 3


def test_not_a_model():
  _error(object(), [1, 2], "model must be a penzai_lm TransformerLM",
         exc=TypeError)


def test_unbound_parameters():
  slots = build_transformer(config("llama_gqa"), seed=None)
  _error(slots, [1, 2], "unbound parameter slot")


def test_unknown_setting_and_bad_stream_args(model):
  with pytest.raises(TypeError, match="unknown generation option 'temprature'"
                     r" \(did you mean 'temperature'\?\)"):
    generate(model, [1, 2], temprature=0.5)
  with pytest.raises(ValueError, match="chunk_size must be a positive"):
    stream(model, [1, 2], chunk_size=0)
  with pytest.raises(TypeError, match="cancel must be a threading.Event"):
    stream(model, [1, 2], cancel=True)
  stream(model, [1, 2], cancel=threading.Event()).close()


def test_text_level_errors(text_model, tok, model):
  with pytest.raises(ValueError, match="stop strings must be non-empty"):
    generate_text(text_model, tok, "hi", stop_strings=[""])
  with pytest.raises(ValueError, match="stop_strings has 3 values"):
    generate_text(text_model, tok, ["a", "b"], stop_strings=[["x"]] * 3)
  with pytest.raises(TypeError, match="prompt 1 must be a string"):
    generate_text(text_model, tok, ["a", 3.5])
  with pytest.raises(ValueError, match="do not belong together"):
    generate_text(model, tok, "hi")
  with pytest.raises(ValueError, match="is not a single token"):
    CalculatorTool(tok)  # SmolLM2 has no <|python_start|> token.
  with pytest.raises(ValueError, match="either calculator= or tool="):
    generate_text(text_model, tok, "hi", calculator=True, tool=object())
  parser = ToolCallParser(call_start="<jupyter_code>",
                          call_end="<jupyter_output>",
                          output_start="<jupyter_text>",
                          output_end="<empty_output>")
  assert CalculatorTool(tok, parser).pause_token_id == tok.token_to_id(
      "<jupyter_output>")


@pytest.mark.parametrize("entry", ["generate", "stream", "generate_text",
                                   "session"])
@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(chunk_size=0), ValueError, "chunk_size must be a positive"),
    (dict(cancel="stop"), TypeError, "cancel must be a threading.Event"),
])
def test_run_controls_are_checked_before_the_model_is_prepared(
    model, text_model, tok, entry, kwargs, exc, match):
  """``chunk_size`` and ``cancel`` are refused at the boundary: no prepared
  model, no program."""
  engine = Engine()
  calls = {
      "generate": lambda: engine.generate(model, [1, 2], **kwargs),
      "stream": lambda: engine.stream(model, [1, 2], **kwargs),
      "generate_text": lambda: generate_text(
          text_model, tok, "hi", engine=engine, **kwargs),
      "session": lambda: Session(model, engine=engine).generate([1, 2],
                                                               **kwargs),
  }
  with pytest.raises(exc, match=match):
    calls[entry]()
  assert engine.compilations == 0
  assert len(engine._prepared) == 0  # pylint: disable=protected-access

