"""Tests for `penzai_lm.tokenizer.IncrementalDetokenizer`.

The invariant: the concatenation of every piece `push` returns, plus
`flush`, equals ``tokenizer.decode(all_ids)`` exactly.
"""

import json
import random

import pytest
import tokenizers

from penzai_lm.tokenizer import IncrementalDetokenizer
from penzai_lm.tokenizer import Tokenizer
from tests.tokenizer.conftest import TEXTS
from tests.tokenizer.conftest import write_tiny_bpe_gguf
from tests.tokenizer.conftest import write_tiny_spm_gguf


def stream(tok, ids, skip_special_tokens=False):
  detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
  pieces = [detok.push(i) for i in ids]
  return pieces, detok.flush()


def assert_streams_like_decode(tok, ids):
  for skip in (False, True):
    pieces, rest = stream(tok, ids, skip)
    assert "".join(pieces) + rest == tok.decode(
        ids, skip_special_tokens=skip), (ids, pieces, rest)


def random_ids(tok, rng, n):
  byte_ids = [tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]
  byte_ids = [i for i in byte_ids if i is not None]
  out = []
  for _ in range(n):
    if byte_ids and rng.random() < 0.4:
      out.append(rng.choice(byte_ids))
    else:
      out.append(rng.randrange(tok.vocab_size))
  return out


@pytest.fixture(params=["bpe", "spm", "gemma"])
def tiny_tok(request, tmp_path, tiny_cache):
  if request.param == "bpe":
    return Tokenizer.from_gguf(write_tiny_bpe_gguf(tmp_path / "b.gguf"))
  arch = "gemma3" if request.param == "gemma" else "llama"
  return Tokenizer.from_gguf(write_tiny_spm_gguf(tmp_path / "s.gguf", arch))


def test_tiny_texts(tiny_tok):
  for text in TEXTS + ("hello world hello", "🌁🌁 z"):
    assert_streams_like_decode(tiny_tok, tiny_tok.encode(text))


def test_tiny_random_ids(tiny_tok):
  rng = random.Random(0)
  for _ in range(200):
    assert_streams_like_decode(tiny_tok, random_ids(tiny_tok, rng, 12))


def test_leading_space_strip(tmp_path, tiny_cache):
  """SentencePiece strips the first token's leading space, only once."""
  tok = Tokenizer.from_gguf(write_tiny_spm_gguf(tmp_path / "s.gguf"))
  ids = tok.encode("hello world hello")
  assert tok.decode(ids, skip_special_tokens=True) == "hello world hello"
  pieces, rest = stream(tok, ids, skip_special_tokens=True)
  assert pieces == ["", "hello", " world", " hello"] and rest == ""


def test_byte_fallback_emoji_waits_for_whole_character(tmp_path, tiny_cache):
  tok = Tokenizer.from_gguf(write_tiny_spm_gguf(tmp_path / "s.gguf"))
  ids = tok.encode("hello 🌁 world", add_bos=False)
  assert len(ids) == 7  # ▁hello, ▁, 4 byte tokens, ▁world
  pieces, rest = stream(tok, ids)
  assert pieces[2:5] == ["", "", ""]
  assert all("\ufffd" not in p for p in pieces + [rest])
  assert "".join(pieces) + rest == "hello 🌁 world"


def test_cleanup_spaces_streaming(tmp_path):
  vocab = {c: i for i, c in enumerate(["a", "Ġ", ".", "'", "s", "n", "t", ",",
                                       "b"])}
  backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, []))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
      add_prefix_space=False)
  backend.decoder = tokenizers.decoders.ByteLevel()
  backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(
      json.dumps({"clean_up_tokenization_spaces": True}))
  tok = Tokenizer.from_hf(tmp_path)
  rng = random.Random(1)
  for _ in range(300):
    ids = [rng.randrange(len(vocab)) for _ in range(rng.randint(0, 15))]
    assert_streams_like_decode(tok, ids)
  assert tok.decode(tok.encode("a , b 's .")) == "a, b's."


def test_push_validation(tmp_path):
  tok = Tokenizer.from_gguf(write_tiny_bpe_gguf(tmp_path / "b.gguf"))
  detok = IncrementalDetokenizer(tok)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    detok.push(tok.vocab_size)
  with pytest.raises(TypeError, match="one integer token id"):
    detok.push([1, 2])


@pytest.mark.slow
def test_real_texts(real_tok):
  for text in TEXTS:
    assert_streams_like_decode(real_tok, real_tok.encode(text))


@pytest.mark.slow
def test_real_random_ids(real_tok):
  rng = random.Random(2)
  for _ in range(100):
    assert_streams_like_decode(real_tok, random_ids(real_tok, rng, 16))


@pytest.mark.slow
def test_gemma_byte_fallback_emoji(gemma_tok):
  ids = gemma_tok.encode("fog 🌁!", add_bos=False)
  byte_ids = [i for i in ids if gemma_tok.id_to_token(i).startswith("<0x")]
  assert len(byte_ids) == 4  # U+1F301 is not in the vocabulary.
  pieces, rest = stream(gemma_tok, ids)
  first_byte = ids.index(byte_ids[0])
  assert pieces[first_byte:first_byte + 3] == ["", "", ""]
  assert all("\ufffd" not in p for p in pieces + [rest])
  assert "".join(pieces) + rest == "fog 🌁!"


@pytest.mark.slow
def test_smollm2_split_utf8(smol_tok):
  """Byte-level BPE tokens can end inside a UTF-8 sequence."""
  ids = smol_tok.encode("👩‍👩‍👧")
  pieces, rest = stream(smol_tok, ids)
  assert "" in pieces
  assert all("\ufffd" not in p for p in pieces + [rest])
  assert "".join(pieces) + rest == "👩‍👩‍👧"


@pytest.mark.slow
def test_long_stream_is_linear(gemma_tok):
  text = " ".join(TEXTS) * 20
  ids = gemma_tok.encode(text)
  pieces, rest = stream(gemma_tok, ids)
  assert "".join(pieces) + rest == gemma_tok.decode(ids)
  detok = IncrementalDetokenizer(gemma_tok)
  for i in ids:
    detok.push(i)
    assert len(detok._pending) <= 8  # pylint: disable=protected-access
