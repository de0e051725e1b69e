"""Tests for `penzai_lm.tokenizer.Tokenizer`.

Fast tests use tiny synthetic GGUF files and tokenizer.json files; tests
marked ``slow`` compare with transformers on the two real models (fetched
once into the cache by `penzai_lm.fetch`).
"""

import json

import numpy as np
import pytest
import tokenizers

from penzai_lm.tokenizer import Tokenizer
from penzai_lm.tokenizer import gguf_vocab
from tests.tokenizer.conftest import TEXTS
from tests.tokenizer.conftest import write_tiny_bpe_gguf
from tests.tokenizer.conftest import write_tiny_spm_gguf

# Tiny synthetic files.


def test_byte_level_gguf(tmp_path):
  tok = Tokenizer.from_gguf(write_tiny_bpe_gguf(tmp_path / "t.gguf"))
  assert (tok.bos_id, tok.eos_id, tok.unk_id) == (1, 2, 0)
  assert tok.pad_id == tok.eos_id  # The file has no pad: falls back to EOS.
  assert tok.stop_ids == (2,)
  assert tok.special_ids == {0, 1, 2}
  ids = tok.encode("hello world")
  assert [tok.id_to_token(i) for i in ids] == ["hello", "Ġworld"]
  assert tok.encode("<|im_start|>hello") == [1, tok.token_to_id("hello")]
  assert tok.decode(tok.encode("héllo\tw🌁")) == "héllo\tw🌁"
  assert tok.decode([1, *ids, 2], skip_special_tokens=True) == "hello world"
  assert tok.encode("hello", add_bos=True)[0] == 1
  assert tok.chat_template is not None  # ChatML fallback (<|im_start|>).


def test_gguf_from_open_reader_matches_path(tmp_path):
  gguf = pytest.importorskip("gguf")
  path = write_tiny_bpe_gguf(tmp_path / "t.gguf", template="{{ 'x' }}")
  a = Tokenizer.from_gguf(path)
  b = Tokenizer.from_gguf(gguf.GGUFReader(path))
  assert a.encode("hello <|im_end|> world") == b.encode("hello <|im_end|> world")
  assert (a.chat_template, a.bos_id, a.vocab_size) == (
      b.chat_template, b.bos_id, b.vocab_size)


def test_sentencepiece_gguf(tmp_path, tiny_cache):
  tok = Tokenizer.from_gguf(write_tiny_spm_gguf(tmp_path / "s.gguf"))
  assert tok.add_bos  # llama.cpp's default for SentencePiece vocabularies.
  ids = tok.encode("hello world")
  assert ids[0] == tok.bos_id
  assert [tok.id_to_token(i) for i in ids[1:]] == ["▁hello", "▁world"]
  # Unknown characters fall back to byte tokens, and decode back.
  z_ids = tok.encode("z", add_bos=False)
  assert [tok.id_to_token(i) for i in z_ids] == ["▁", "<0x7A>"]
  assert tok.decode(tok.encode("hello zé🌁", add_bos=False)) == "hello zé🌁"
  assert tok.encode("<tag>", add_bos=False) == [tok.token_to_id("<tag>")]


def test_sentencepiece_cache(tmp_path, tiny_cache, monkeypatch):
  path = write_tiny_spm_gguf(tmp_path / "s.gguf")
  first = Tokenizer.from_gguf(path)
  cached = list((tiny_cache / "tokenizers").glob("*.json"))
  assert len(cached) == 1

  def fail(meta):
    raise AssertionError("should load from the cache")

  monkeypatch.setattr(gguf_vocab, "build_tokenizer", fail)
  second = Tokenizer.from_gguf(path)
  assert second.encode("hello world") == first.encode("hello world")


def test_gemma_style_spaces(tmp_path, tiny_cache):
  """Gemma stores runs of spaces as real spaces; they must be matched."""
  path = write_tiny_spm_gguf(tmp_path / "g.gguf", arch="gemma3")
  tok = Tokenizer.from_gguf(path)
  double = tok.encode("a  b", add_bos=False)
  assert tok.id_to_token(double[1]) == "▁▁"
  assert tok.decode(double) == "a  b"


def test_validation_errors(tmp_path, tiny_cache):
  tok = Tokenizer.from_gguf(write_tiny_bpe_gguf(tmp_path / "t.gguf"))
  with pytest.raises(TypeError, match="expects a str"):
    tok.encode(b"bytes")
  with pytest.raises(TypeError, match="expects a str"):
    tok.encode(None)
  with pytest.raises(ValueError, match=r"outside the vocabulary \[0, "):
    tok.decode([1, tok.vocab_size])
  with pytest.raises(ValueError, match="outside the vocabulary"):
    tok.decode([-1])
  with pytest.raises(ValueError, match="1-D"):
    tok.decode([[1, 2]])
  with pytest.raises(ValueError, match="integers"):
    tok.decode([1.5])
  assert tok.decode([]) == ""
  assert tok.decode(np.array([1, 2], np.int32)) == "<|im_start|><|im_end|>"
  with pytest.raises(ValueError, match="not a GGUF file"):
    (tmp_path / "x.gguf").write_bytes(b"nope" * 10)
    Tokenizer.from_gguf(tmp_path / "x.gguf")
  with pytest.raises(ValueError, match="does not exist"):
    Tokenizer.from_gguf(tmp_path / "missing.gguf")
  no_template = Tokenizer.from_gguf(write_tiny_spm_gguf(tmp_path / "s.gguf"))
  with pytest.raises(ValueError, match="no chat template"):
    no_template.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_errors(tmp_path):
  template = ("{% if messages[0]['role'] != 'user' %}"
              "{{ raise_exception('first must be user') }}{% endif %}"
              "{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
              "{% endfor %}{% if add_generation_prompt %}>{% endif %}")
  tok = Tokenizer.from_gguf(
      write_tiny_bpe_gguf(tmp_path / "t.gguf", template=template))
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
      "<|im_start|>hi>")
  with pytest.raises(ValueError, match="first must be user"):
    tok.apply_chat_template([{"role": "system", "content": "x"}])
  with pytest.raises(ValueError, match="empty conversation"):
    tok.apply_chat_template([])
  with pytest.raises(TypeError, match="list of dicts"):
    tok.apply_chat_template("hi")


def test_from_hf(tmp_path):
  vocab = {"<s>": 0, "</s>": 1, "<eot>": 2, "[UNK]": 3, "a": 4, "b": 5,
           ".": 6, "Ġ": 7, "Ġa": 8}
  backend = tokenizers.Tokenizer(tokenizers.models.BPE(
      vocab, [("Ġ", "a")], unk_token="[UNK]"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
      add_prefix_space=False)
  backend.decoder = tokenizers.decoders.ByteLevel()
  backend.add_special_tokens(["<s>", "</s>", "<eot>"])
  backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "<s>", "eos_token": {"content": "</s>"},
      "add_bos_token": True, "clean_up_tokenization_spaces": True,
      "chat_template": "{{ bos_token }}{% for m in messages %}"
                       "{{ m['content'] }}<eot>{% endfor %}",
  }))
  (tmp_path / "generation_config.json").write_text(
      json.dumps({"eos_token_id": [1, 2]}))
  tok = Tokenizer.from_hf(tmp_path)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 1)
  assert tok.stop_ids == (1, 2)
  assert tok.encode("a a") == [0, 4, 8]
  assert tok.decode([4, 7, 6]) == "a."  # clean_up_tokenization_spaces
  chat = [{"role": "user", "content": "a"}]
  assert tok.apply_chat_template(chat) == "<s>a<eot>"
  assert tok.encode_chat(chat) == [0, 4, 2]  # One BOS only.
  with pytest.raises(ValueError, match="has no tokenizer.json"):
    Tokenizer.from_hf(tmp_path / "nowhere")


# Real models (slow): ids, decoding and chat templates match transformers.


@pytest.mark.slow
def test_ids_match_transformers(real_tok, hf_tok):
  for text in TEXTS:
    assert real_tok.encode(text) == hf_tok.encode(text), repr(text)


@pytest.mark.slow
def test_decode_matches_transformers_and_round_trips(real_tok, hf_tok):
  for text in TEXTS:
    ids = real_tok.encode(text, add_bos=False)
    if not ("▁" in text and real_tok.architecture == "gemma3"):
      # SentencePiece encodes ' ' as '▁', so a literal '▁' decodes as ' '.
      assert real_tok.decode(ids) == text, repr(text)
    for skip in (False, True):
      assert real_tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(
          ids, skip_special_tokens=skip), repr(text)


@pytest.mark.slow
def test_real_special_tokens(smol_tok, gemma_tok):
  assert (smol_tok.vocab_size, smol_tok.bos_id, smol_tok.eos_id) == (
      49152, 1, 2)
  assert smol_tok.stop_ids == (2,) and not smol_tok.add_bos
  assert smol_tok.encode("<|im_start|>") == [1]
  assert (gemma_tok.vocab_size, gemma_tok.bos_id, gemma_tok.eos_id) == (
      262144, 2, 1)
  assert gemma_tok.pad_id == 0 and gemma_tok.add_bos
  assert gemma_tok.stop_ids == (1, 106)
  assert gemma_tok.encode("<end_of_turn>", add_bos=False) == [106]
  assert {1, 2, 105, 106} <= gemma_tok.special_ids


@pytest.mark.slow
def test_smollm2_chat_template_matches_transformers(smol_tok, smol_hf):
  hf = smol_hf
  conversations = [
      [{"role": "user", "content": "Hi there!"}],
      [{"role": "system", "content": "Be brief."},
       {"role": "user", "content": "2+2?"},
       {"role": "assistant", "content": "4"},
       {"role": "user", "content": "日本 😀 and\ttabs"}],
  ]
  for chat in conversations:
    for gen in (True, False):
      want = hf.apply_chat_template(
          chat, tokenize=False, add_generation_prompt=gen)
      assert smol_tok.apply_chat_template(chat, add_generation_prompt=gen) == (
          want)
      want_ids = hf.apply_chat_template(
          chat, add_generation_prompt=gen, return_dict=False)
      assert smol_tok.encode_chat(chat, add_generation_prompt=gen) == want_ids


@pytest.mark.slow
def test_gemma_fallback_chat_template(gemma_tok):
  chat = [{"role": "system", "content": "Be brief."},
          {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"},
          {"role": "user", "content": "Bye"}]
  text = gemma_tok.apply_chat_template(chat)
  assert text == (
      "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
      "<start_of_turn>model\nHello!<end_of_turn>\n"
      "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
  ids = gemma_tok.encode_chat(chat[1:2])
  assert ids[:2] == [2, 105] and ids.count(2) == 1  # No double BOS.
  assert ids[-3:] == gemma_tok.encode("<start_of_turn>model\n", add_bos=False)
  with pytest.raises(ValueError, match="alternate"):
    gemma_tok.apply_chat_template([{"role": "assistant", "content": "x"}])
