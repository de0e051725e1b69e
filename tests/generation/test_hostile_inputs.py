"""Hostile generation inputs: padded vocabularies, bytes prompts, huge token
rule bounds.

A padded vocabulary is a model with more ids than its tokenizer (Qwen2.5 and
Phi-3 ship one): here the tiny random model of ``conftest`` (97 ids) with a
7-token tokenizer, so that at temperature 1 almost every draw would be a
padding id if nothing banned them.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from penzai import pz

from penzai_lm import generation
from penzai_lm import interp
from penzai_lm.generation import ChatSession
from penzai_lm.generation import generate
from penzai_lm.generation import generate_text
from penzai_lm.generation import stream_text
from penzai_lm.tokenizer import Tokenizer
from tests.generation.conftest import VOCAB
from tests.generation.conftest import tiny_model

SAMPLED = dict(temperature=1.0, max_new_tokens=8, stop_tokens=[])
SEEDS = range(5)


@pytest.fixture(scope="module")
def small_tok(tmp_path_factory):
  """A 7-token byte-level BPE tokenizer (ids 0..6; the model has 97)."""
  d = tmp_path_factory.mktemp("tok")
  vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "c": 4, "Ġ": 5, "Ġa": 6}
  backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [("Ġ", "a")]))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
      add_prefix_space=False)
  backend.decoder = tokenizers.decoders.ByteLevel()
  backend.add_special_tokens(["<s>", "</s>"])
  backend.save(str(d / "tokenizer.json"))
  (d / "tokenizer_config.json").write_text(
      json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                  "chat_template": "{% for m in messages %}{{ m['content'] }}"
                                   "</s>{% endfor %}"}))
  tok = Tokenizer.from_hf(d)
  assert tok.vocab_size == 7 < VOCAB
  return tok


def test_padded_vocab_generate_text_never_samples_padding(small_tok):
  engine = generation.Engine()
  model = tiny_model()
  for seed in SEEDS:
    result = generate_text(model, small_tok, ["a b", "c a"], seed=seed,
                           engine=engine, **SAMPLED)
    for tokens, text in zip(result.tokens, result.texts):
      assert len(tokens) == 8 and max(tokens) < small_tok.vocab_size
      assert text == small_tok.decode(tokens)
  # The ban is data: token ids (no ban) run on the same compiled programs.
  compiled = engine.compilations
  ids = [small_tok.encode("a b"), small_tok.encode("c a")]
  free = generate(model, ids, seed=0, engine=engine, **SAMPLED)
  assert engine.compilations == compiled


def test_padded_vocab_stream_text_never_samples_padding(small_tok):
  for seed in SEEDS:
    stream = stream_text(tiny_model(), small_tok, "a b", seed=seed,
                         chunk_size=3, **SAMPLED)
    pieces = "".join(event.text for event in stream)
    tokens = stream.result.tokens[0]
    assert len(tokens) == 8 and max(tokens) < small_tok.vocab_size
    assert pieces == stream.result.text == small_tok.decode(tokens)


def test_padded_vocab_token_ids_keep_every_id_unless_asked(small_tok):
  """generate() has no tokenizer: every id of the model may be sampled;
  tokenizer_vocab_size= asks for the text functions' ban."""
  ids = small_tok.encode("a b")
  free = generate(tiny_model(), ids, seed=0, **SAMPLED)
  assert max(free.tokens[0]) >= small_tok.vocab_size  # 90 of 97 ids pad.
  for seed in SEEDS:
    banned = generate(tiny_model(), ids, seed=seed,
                      tokenizer_vocab_size=small_tok.vocab_size, **SAMPLED)
    assert max(banned.tokens[0]) < small_tok.vocab_size
  with pytest.raises(ValueError, match=r"tokenizer_vocab_size must be an"
                     r" integer in \[1, 97\]"):
    generate(tiny_model(), ids, tokenizer_vocab_size=98, **SAMPLED)


def test_padded_vocab_greedy_and_user_bans_combine(small_tok):
  """The ban holds for greedy decoding too, and with the user's own bans;
  banning every real token is an error that says why."""
  model = tiny_model()
  result = generate_text(model, small_tok, "a b", temperature=0.0,
                         max_new_tokens=8, stop_tokens=[],
                         banned_tokens=[2, 3])
  assert set(result.tokens[0]) <= {0, 1, 4, 5, 6}
  with pytest.raises(ValueError, match=r"bans every token of the tokenizer"):
    generate_text(model, small_tok, "a b", banned_tokens=list(range(7)),
                  **SAMPLED)


def test_padded_vocab_chat_never_samples_padding(small_tok):
  chat = ChatSession(tiny_model(), small_tok, min_cache_len=64)
  for seed in range(3):
    chat.reset()
    "".join(event.text for event in chat.send("a b", seed=seed, **SAMPLED))
    assert max(chat.last_result.tokens[0]) < small_tok.vocab_size


@pytest.mark.parametrize("prompt", [b"Hello", bytearray(b"Hello"),
                                    ["a", b"b"]])
def test_bytes_prompt_is_a_type_error(small_tok, prompt):
  with pytest.raises(TypeError, match=r"bytes|bytearray"):
    generate_text(tiny_model(), small_tok, prompt, max_new_tokens=2)
  with pytest.raises(TypeError, match=r"not text: decode it first"):
    stream_text(tiny_model(), small_tok, prompt, max_new_tokens=2)


def test_bytes_token_ids_are_a_type_error():
  for prompt in (b"\x01\x02", bytearray(b"\x01\x02")):
    with pytest.raises(TypeError, match=r"not (bytes|bytearray)"):
      generate(tiny_model(), prompt, max_new_tokens=2)


def _mask(rule, positions, generation_start):
  side = {"token_positions": pz.nx.wrap(jnp.asarray(positions)).tag("seq"),
          "generation_start": pz.nx.wrap(jnp.asarray(generation_start))}
  return np.asarray(rule.mask(side).unwrap("seq"))


@pytest.mark.parametrize("end", [2**31, 2**40, 2**70, np.int64(2**40)])
def test_token_rule_steps_with_huge_end_still_applies(end):
  positions = np.arange(12)
  want = _mask(interp.TokenRule.steps(2), positions, 5)
  assert want.tolist() == [False] * 7 + [True] * 5
  np.testing.assert_array_equal(
      _mask(interp.TokenRule.steps(2, end), positions, 5), want)
  np.testing.assert_array_equal(
      _mask(interp.TokenRule.positions(3, end), positions, 5), positions >= 3)
  per_row = interp.TokenRule.steps([0, 1], [end, 3])
  assert np.asarray(per_row.stop.data_array).tolist() == [2**30, 3]


def test_token_rule_huge_start_selects_nothing():
  rule = interp.TokenRule.steps(2**40, 2**41)
  assert not _mask(rule, np.arange(12), 0).any()


def test_token_rule_huge_end_steers_generation_like_no_end():
  model = tiny_model()
  vector = np.random.default_rng(0).standard_normal(
      model.config.hidden_size).astype(np.float32)

  def run(where):
    steered = interp.insert_at(model, "blocks.1.resid_post",
                               interp.AddVector.build(vector, strength=8.0,
                                                      where=where))
    return generate(steered, [[1, 2, 3]], max_new_tokens=6,
                    temperature=0.0, stop_tokens=[]).tokens

  plain = generate(model, [[1, 2, 3]], max_new_tokens=6, temperature=0.0,
                   stop_tokens=[]).tokens
  huge, open_ended = run(interp.TokenRule.steps(1, 2**40)), run(
      interp.TokenRule.steps(1))
  assert huge == open_ended != plain
