"""`Tokenizer.token_id`: the id of one token, never BOS.

The idiom it replaces, ``encode(" Paris")[0]``, picks BOS on models that add
it (Gemma). Fast tests use a tiny SentencePiece GGUF file that adds BOS like
Gemma; tests marked ``slow`` check the real tokenizers against transformers.
"""

import pytest

from penzai_lm.tokenizer import Tokenizer
from tests.tokenizer.conftest import write_tiny_bpe_gguf
from tests.tokenizer.conftest import write_tiny_spm_gguf


def test_token_id_skips_bos(tmp_path, tiny_cache):
  tok = Tokenizer.from_gguf(write_tiny_spm_gguf(tmp_path / "s.gguf"))
  assert tok.add_bos and tok.encode(" hello")[0] == tok.bos_id
  got = tok.token_id(" hello")
  assert got != tok.bos_id
  assert tok.id_to_token(got) == "▁hello"
  assert tok.encode(" hello", add_bos=False) == [got]


def test_token_id_of_a_special_token(tmp_path):
  tok = Tokenizer.from_gguf(write_tiny_bpe_gguf(tmp_path / "t.gguf"))
  assert tok.token_id("<|im_end|>") == tok.token_to_id("<|im_end|>")
  assert tok.id_to_token(tok.token_id(" world")) == "Ġworld"


@pytest.mark.parametrize("text, count", [
    ("hello world", 2), ("", 0), ("hez", 2)])
def test_token_id_refuses_other_than_one_token(tmp_path, text, count):
  tok = Tokenizer.from_gguf(write_tiny_bpe_gguf(tmp_path / "t.gguf"))
  assert len(tok.encode(text)) == count
  with pytest.raises(ValueError, match=f"encodes to {count} tokens, not one"
                     ) as info:
    tok.token_id(text)
  for i in tok.encode(text):  # It names the tokens it became.
    assert repr(tok.id_to_token(i)) in str(info.value)


def test_token_id_refuses_non_text(tmp_path):
  tok = Tokenizer.from_gguf(write_tiny_bpe_gguf(tmp_path / "t.gguf"))
  with pytest.raises(TypeError, match="expects a str"):
    tok.token_id(42)


@pytest.mark.slow
@pytest.mark.parametrize("text", [" Paris", " Rome", " the"])
def test_token_id_matches_transformers(real_tok, hf_tok, text):
  want = hf_tok.encode(text, add_special_tokens=False)
  assert len(want) == 1
  assert real_tok.token_id(text) == want[0]
  if real_tok.add_bos:  # Gemma: the old idiom picked BOS.
    assert real_tok.encode(text)[0] == real_tok.bos_id != want[0]


@pytest.mark.slow
def test_token_id_refuses_several_tokens_on_real_models(real_tok):
  with pytest.raises(ValueError, match="tokens, not one"):
    real_tok.token_id(" Eiffel Tower")
