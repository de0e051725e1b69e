"""Hostile and broken tokenizer files (issue 26).

Each builder writes a tiny GGUF file or Hugging Face directory with one
thing wrong. Broken values must raise `TokenizerFileError` (a ValueError)
naming the file and the field; odd but usable values (duplicate tokens,
"false" as a string, a list of named chat templates) must work. The
tokenizer cache must not let a file choose where its entry is written, must
check entries before use, and must serve `penzai_lm.load` too.
"""

from __future__ import annotations

import json
import re
import time

import gguf
import pytest
import tokenizers

import penzai_lm
from penzai_lm.checkpoints.gguf_file import open_gguf_reader
from penzai_lm.tokenizer import IncrementalDetokenizer
from penzai_lm.tokenizer import Tokenizer
from penzai_lm.tokenizer import TokenizerFileError
from penzai_lm.tokenizer import gguf_vocab
from tests.checkpoints import corrupt_file_builders as cb
from tests.checkpoints.checkpoint_test_utils import real_model_path
from tests.checkpoints.checkpoint_test_utils import write_gguf
from tests.tokenizer.conftest import BYTE
from tests.tokenizer.conftest import CONTROL
from tests.tokenizer.conftest import NORMAL
from tests.tokenizer.conftest import USER_DEFINED
from tests.tokenizer.conftest import _bytes_to_unicode

# ---- Builders --------------------------------------------------------------

PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello",
          "▁hello", "or", "▁w", "▁wor", "▁world", "ld", "<tag>"]
SPM_TOKENS = (["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
              + PIECES)
SPM_TYPES = [2, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * (
    len(PIECES) - 1) + [USER_DEFINED]
SPM_SCORES = [0.0] * 259 + [-float(i) for i in range(len(PIECES))]
BPE_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d",
              "Ġwor ld"]
BPE_TOKENS = (["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
              + _bytes_to_unicode() + [m.replace(" ", "") for m in BPE_MERGES])


def spm_gguf(tmp_path, *, arch="llama", tokens=SPM_TOKENS, types=SPM_TYPES,
             scores=SPM_SCORES, extra=None, name="s.gguf"):
  """A tiny SentencePiece GGUF; ``extra(writer)`` adds or overrides keys."""
  return _write(tmp_path / name, arch, "llama", tokens, types, scores=scores,
                extra=extra)


def bpe_gguf(tmp_path, *, tokens=BPE_TOKENS, merges=BPE_MERGES, extra=None):
  types = [CONTROL] * 3 + [NORMAL] * (len(tokens) - 3)
  return _write(tmp_path / "b.gguf", "llama", "gpt2", tokens, types,
                merges=merges, extra=extra)


def _write(path, arch, model, tokens, types, *, scores=None, merges=None,
           extra=None):
  w = gguf.GGUFWriter(str(path), arch)
  w.add_tokenizer_model(model)
  w.add_token_list(tokens)
  w.add_token_types(types)
  if scores is not None:
    w.add_token_scores(scores)
  if merges is not None:
    w.add_token_merges(merges)
  w.add_unk_token_id(0)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  if extra is not None:
    extra(w)  # A key added again replaces the one above (type included).
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def hf_dir(tmp_path, *, merges=(("Ġ", "a"),), config=None, model_config=None,
           generation_config=None):
  """A tiny Hugging Face tokenizer directory; ``config`` updates
  tokenizer_config.json."""
  d = tmp_path / "hf"
  d.mkdir(exist_ok=True)
  vocab = {"<s>": 0, "</s>": 1, "<eot>": 2, "[UNK]": 3, "a": 4, "b": 5,
           ".": 6, "Ġ": 7, "Ġa": 8}
  backend = tokenizers.Tokenizer(tokenizers.models.BPE(
      vocab, list(merges), unk_token="[UNK]"))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
      add_prefix_space=False)
  backend.decoder = tokenizers.decoders.ByteLevel()
  backend.add_special_tokens(["<s>", "</s>", "<eot>"])
  backend.save(str(d / "tokenizer.json"))
  cfg = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
  cfg.update(config or {})
  (d / "tokenizer_config.json").write_text(json.dumps(cfg))
  for name, data in (("config.json", model_config),
                     ("generation_config.json", generation_config)):
    if data is not None:
      (d / name).write_text(json.dumps(data))
  return d


def _edit_json(path, edit):
  data = json.loads(path.read_text())
  edit(data)
  path.write_text(json.dumps(data))


def gguf_bos_id_float(tmp_path):
  return spm_gguf(tmp_path, extra=lambda w: w.add_float32(
      "tokenizer.ggml.bos_token_id", 1.0))


def gguf_eos_id_outside(tmp_path):
  return spm_gguf(tmp_path, extra=lambda w: w.add_uint32(
      "tokenizer.ggml.eos_token_id", 10**6))


def gguf_add_bos_maybe(tmp_path):
  return spm_gguf(tmp_path, extra=lambda w: w.add_string(
      "tokenizer.ggml.add_bos_token", "maybe"))


def gguf_add_bos_int(tmp_path):
  return spm_gguf(tmp_path, extra=lambda w: w.add_uint8(
      "tokenizer.ggml.add_bos_token", 0))


def gguf_scores_short(tmp_path):
  return spm_gguf(tmp_path, scores=SPM_SCORES[:10])


def gguf_types_long(tmp_path):
  return spm_gguf(tmp_path, types=SPM_TYPES + [NORMAL] * 5)


def gguf_scores_nan(tmp_path):
  return spm_gguf(tmp_path, scores=SPM_SCORES[:-1] + [float("nan")])


def gguf_tokens_numeric(tmp_path):
  return spm_gguf(tmp_path, extra=lambda w: w.add_array(
      "tokenizer.ggml.tokens", [1, 2, 3]))


def gguf_invalid_utf8_token(tmp_path):
  tokens = [t.encode() for t in SPM_TOKENS]
  tokens[262] = b"l\xff"
  return spm_gguf(tmp_path, tokens=tokens)


def gguf_truncated_tokens(tmp_path):
  path = spm_gguf(tmp_path)
  raw = path.read_bytes()
  path.write_bytes(raw[:raw.index(b"<0x41>")])
  return path


def gguf_garbage_merges(tmp_path):
  return bpe_gguf(tmp_path, merges=BPE_MERGES[:3] + ["garbage"])


def gguf_merges_unknown_token(tmp_path):
  return bpe_gguf(tmp_path, merges=BPE_MERGES + ["hello Ġworld"])


def gguf_unknown_model(tmp_path):
  return spm_gguf(tmp_path, extra=lambda w: w.add_tokenizer_model("bert"))


def hf_truncated_tokenizer_json(tmp_path):
  d = hf_dir(tmp_path)
  f = d / "tokenizer.json"
  f.write_bytes(f.read_bytes()[:-40])
  return d


def hf_garbage_merges(tmp_path):
  d = hf_dir(tmp_path)
  _edit_json(d / "tokenizer.json",
             lambda t: t["model"].update(merges=["garbage"]))
  return d


def hf_merges_unknown_token(tmp_path):
  d = hf_dir(tmp_path)
  _edit_json(d / "tokenizer.json",
             lambda t: t["model"]["merges"].append(["a", "zz"]))
  return d


def hf_invalid_tokenizer_config(tmp_path):
  d = hf_dir(tmp_path)
  (d / "tokenizer_config.json").write_text('{"bos_token": "<s>",')
  return d


def hf_tokenizer_config_list(tmp_path):
  d = hf_dir(tmp_path)
  (d / "tokenizer_config.json").write_text('["<s>"]')
  return d


def hf_add_bos_maybe(tmp_path):
  return hf_dir(tmp_path, config={"add_bos_token": "maybe"})


def hf_bos_token_int(tmp_path):
  return hf_dir(tmp_path, config={"bos_token": 5})


def hf_bos_token_id_float(tmp_path):
  return hf_dir(tmp_path, config={"bos_token": None},
                model_config={"bos_token_id": 1.5})


def hf_eos_ids_with_float(tmp_path):
  return hf_dir(tmp_path, generation_config={"eos_token_id": [1, 2.0]})


def hf_chat_template_no_default(tmp_path):
  return hf_dir(tmp_path, config={"chat_template": [
      {"name": "tool_use", "template": "x"}]})


def hf_chat_template_bad_entry(tmp_path):
  return hf_dir(tmp_path, config={"chat_template": ["{{ x }}"]})


def hf_chat_template_number(tmp_path):
  return hf_dir(tmp_path, config={"chat_template": 7})


ERROR_CASES = [
    # (builder, file name, field, message regex)
    (gguf_bos_id_float, "s.gguf", "tokenizer.ggml.bos_token_id",
     r"is 1.0 \(float\); a token id must be a non-negative integer"),
    (gguf_eos_id_outside, "s.gguf", "tokenizer.ggml.eos_token_id",
     r"is 1000000, outside the vocabulary \[0, 278\)"),
    (gguf_add_bos_maybe, "s.gguf", "tokenizer.ggml.add_bos_token",
     r"is 'maybe' \(str\), not a boolean"),
    (gguf_add_bos_int, "s.gguf", "tokenizer.ggml.add_bos_token",
     r"is 0 \(int\), not a boolean"),
    (gguf_scores_short, "s.gguf", "tokenizer.ggml.scores",
     r"has 10 entries but tokenizer.ggml.tokens has 278"),
    (gguf_types_long, "s.gguf", "tokenizer.ggml.token_type",
     r"has 283 entries but tokenizer.ggml.tokens has 278"),
    (gguf_scores_nan, "s.gguf", "tokenizer.ggml.scores",
     r"holds a non-finite value at entry 277"),
    (gguf_tokens_numeric, "s.gguf", "tokenizer.ggml.tokens",
     r"is a ndarray, not an array of strings"),
    (gguf_invalid_utf8_token, "s.gguf", "tokenizer.ggml.tokens",
     r"is not valid UTF-8: entry 262 is b'l\\xff'"),
    (gguf_truncated_tokens, "s.gguf", "tokenizer.ggml.tokens",
     r"needs bytes \d+..\d+, past the end of the file \(\d+ bytes\); the file"
     r" is truncated"),
    (gguf_garbage_merges, "b.gguf", "tokenizer.ggml.merges",
     r"entry 3 is 'garbage'; each merge must be two tokens"),
    (gguf_merges_unknown_token, "b.gguf", "tokenizer.ggml.merges",
     r"entry 9 merges 'hello' and 'Ġworld', but 'helloĠworld' is not a token"),
    (gguf_unknown_model, "s.gguf", "tokenizer.ggml.model",
     r"is 'bert', an unsupported tokenizer type"),
    (hf_truncated_tokenizer_json, "tokenizer.json", "",
     r"is not valid JSON \(.* at line \d+ column \d+\); the file is truncated"),
    (hf_garbage_merges, "tokenizer.json", "model.merges[0]",
     r"is 'garbage'; a merge is two tokens"),
    (hf_merges_unknown_token, "tokenizer.json", "model.merges[1]",
     r"merges 'a' and 'zz', but 'zz' is not in model.vocab"),
    (hf_invalid_tokenizer_config, "tokenizer_config.json", "",
     r"is not valid JSON"),
    (hf_tokenizer_config_list, "tokenizer_config.json", "",
     r"holds a JSON list, not an object"),
    (hf_add_bos_maybe, "tokenizer_config.json", "add_bos_token",
     r"is 'maybe' \(str\), not a boolean"),
    (hf_bos_token_int, "tokenizer_config.json", "bos_token",
     r"is 5; a special token must be given as its string"),
    (hf_bos_token_id_float, "config.json", "bos_token_id",
     r"is 1.5 \(float\)"),
    (hf_eos_ids_with_float, "generation_config.json", "eos_token_id[1]",
     r"is 2.0 \(float\)"),
    (hf_chat_template_no_default, "tokenizer_config.json", "chat_template",
     r"lists templates named \['tool_use'\] but none named 'default'"),
    (hf_chat_template_bad_entry, "tokenizer_config.json", "chat_template[0]",
     r"each entry of a list of chat templates must be"),
    (hf_chat_template_number, "tokenizer_config.json", "chat_template",
     r"is a int; it must be a string, or a list"),
]


def _open(path):
  return Tokenizer.from_hf(path) if path.is_dir() else Tokenizer.from_gguf(path)


@pytest.mark.parametrize(
    "builder,file,field,pattern", ERROR_CASES,
    ids=[c[0].__name__ for c in ERROR_CASES])
def test_broken_tokenizer_file_names_file_and_field(
    builder, file, field, pattern, tmp_path, tiny_cache):
  path = builder(tmp_path)
  with pytest.raises(TokenizerFileError) as info:
    _open(path)
  err = info.value
  assert isinstance(err, ValueError)
  assert err.file.endswith(file), err.file
  assert err.field == field
  where = f"{field} in {err.file}" if field else err.file
  assert str(err).startswith(f"{where} "), str(err)
  assert re.search(pattern, str(err)), str(err)


def test_library_errors_are_chained(tmp_path):
  with pytest.raises(TokenizerFileError) as info:
    _open(hf_truncated_tokenizer_json(tmp_path))
  assert isinstance(info.value.__cause__, json.JSONDecodeError)
  with pytest.raises(TokenizerFileError) as info:
    _open(gguf_merges_unknown_token(tmp_path))
  assert "out of vocabulary" in str(info.value.__cause__)  # tokenizers'


# ---- Finding 1: the cache's names and contents ------------------------------


def _cache_entries(cache):
  return sorted((cache / "tokenizers").iterdir())


def _fail_build(meta, file="?"):
  raise AssertionError("should have come from the cache")


def test_architecture_path_traversal_stays_in_cache(tmp_path, tiny_cache):
  """general.architecture once named the cache file: '../' escaped it."""
  path = spm_gguf(tmp_path, arch="../../pwned")
  tok = Tokenizer.from_gguf(path)
  assert tok.decode(tok.encode("hello world", add_bos=False)) == "hello world"
  assert not list(tmp_path.glob("**/pwned*"))
  (entry,) = _cache_entries(tiny_cache)
  assert re.fullmatch(r"[0-9a-f]{32}-[0-9a-f]{32}\.json", entry.name)


def test_cache_key_is_vocabulary_content(tmp_path, tiny_cache, monkeypatch):
  """Same vocabulary anywhere -> one entry; another vocabulary -> another."""
  a = spm_gguf(tmp_path, name="a.gguf")
  first = Tokenizer.from_gguf(a).encode("hello world")
  (tmp_path / "elsewhere").mkdir()
  b = spm_gguf(tmp_path / "elsewhere", name="b.gguf")
  with monkeypatch.context() as m:
    m.setattr(gguf_vocab, "build_tokenizer", _fail_build)
    assert Tokenizer.from_gguf(b).encode("hello world") == first
  spm_gguf(tmp_path, name="c.gguf", scores=SPM_SCORES[:-1] + [-99.0])
  Tokenizer.from_gguf(tmp_path / "c.gguf")
  assert len(_cache_entries(tiny_cache)) == 2


@pytest.mark.parametrize("damage", ["truncate", "edit", "garbage"])
def test_damaged_cache_entry_is_rebuilt(tmp_path, tiny_cache, damage):
  path = spm_gguf(tmp_path)
  expected = Tokenizer.from_gguf(path).encode("hello world <tag>")
  (entry,) = _cache_entries(tiny_cache)
  data = entry.read_bytes()
  entry.write_bytes({
      "truncate": data[: len(data) // 2],
      # Valid JSON, still a tokenizer, but another vocabulary.
      "edit": data.replace(b'"\xe2\x96\x81hello"', b'"\xe2\x96\x81jello"'),
      "garbage": b"\0" * len(data),
  }[damage])
  with pytest.warns(RuntimeWarning, match="is damaged.*removed and rebuilt"):
    tok = Tokenizer.from_gguf(path)
  assert tok.encode("hello world <tag>") == expected
  (rebuilt,) = _cache_entries(tiny_cache)
  assert rebuilt.read_bytes() == data


def test_unwritable_cache_still_loads(tmp_path, monkeypatch):
  blocker = tmp_path / "not_a_dir"
  blocker.write_text("")
  monkeypatch.setenv("PENZAI_LM_CACHE", str(tmp_path / "cache"))
  (tmp_path / "cache").mkdir()
  (tmp_path / "cache" / "tokenizers").write_text("a file, not a directory")
  with pytest.warns(RuntimeWarning, match="could not be cached"):
    tok = Tokenizer.from_gguf(spm_gguf(tmp_path))
  assert tok.decode(tok.encode("hello", add_bos=False)) == "hello"


# ---- Finding 2: load() and open readers use the cache -----------------------


def test_open_reader_uses_cache(tmp_path, tiny_cache, monkeypatch):
  path = spm_gguf(tmp_path)
  expected = Tokenizer.from_gguf(path).encode("hello world")
  monkeypatch.setattr(gguf_vocab, "build_tokenizer", _fail_build)
  tok = Tokenizer.from_gguf(open_gguf_reader(path))
  assert tok.encode("hello world") == expected
  assert str(path) in tok.chat_template_source or tok.chat_template is None


def test_load_uses_tokenizer_cache(tmp_path, tiny_cache, monkeypatch):
  """`penzai_lm.load` passes an open reader: it must hit the cache too."""
  def tokenizer_kv(w):
    w.add_tokenizer_model("llama")
    w.add_token_list(SPM_TOKENS)
    w.add_token_types(SPM_TYPES)
    w.add_token_scores(SPM_SCORES)

  path = write_gguf(tmp_path / "m.gguf", "llama", cb.state_dict(), cb.CFG,
                    extra_kv=tokenizer_kv)
  _, first = penzai_lm.load(path)
  assert len(_cache_entries(tiny_cache)) == 1
  monkeypatch.setattr(gguf_vocab, "build_tokenizer", _fail_build)
  _, second = penzai_lm.load(path)
  assert second.encode("hello world") == first.encode("hello world")


@pytest.mark.slow
def test_load_reuses_gemma_tokenizer_cache(monkeypatch):
  """One real load of Gemma 3 270M with its tokenizer from the cache."""
  path = real_model_path("gemma3-270m")
  text = "Hello  world 🌁 <start_of_turn>"
  expected = Tokenizer.from_gguf(path).encode(text)  # Builds it if needed.
  monkeypatch.setattr(gguf_vocab, "build_tokenizer", _fail_build)
  start = time.perf_counter()
  _, tok = penzai_lm.load(path)
  assert time.perf_counter() - start < 120
  assert tok.vocab_size == 262144
  assert tok.encode(text) == expected
  assert tok.decode(expected, skip_special_tokens=True) == "Hello  world 🌁 "


# ---- Finding 3: vocab_size counts ids; duplicates decode --------------------


@pytest.mark.parametrize("kind,text_of_last", [
    ("sentencepiece", "world"), ("byte_level", "<|im_end|>")])
def test_duplicate_tokens_decode_every_id(tmp_path, tiny_cache, kind,
                                          text_of_last):
  """Two entries spelling one string: every id decodes; text encodes to
  the last (as llama.cpp and transformers do)."""
  if kind == "sentencepiece":
    tokens = SPM_TOKENS + ["hello", "▁world"]  # Copies of earlier pieces.
    types, scores = SPM_TYPES + [NORMAL] * 2, SPM_SCORES + [-50.0, -51.0]
    loads = [lambda: Tokenizer.from_gguf(spm_gguf(  # pylint: disable=g-long-lambda
        tmp_path, tokens=tokens, types=types, scores=scores))] * 2  # 2: cache
    text = lambda t: t.replace("▁", " ")
  else:
    tokens = BPE_TOKENS + ["hello", "<|im_end|>"]
    loads = [lambda: Tokenizer.from_gguf(bpe_gguf(tmp_path, tokens=tokens))]
    text = lambda t: t.replace("Ġ", " ")
  for load in loads:
    tok = load()
    assert tok.vocab_size == len(tokens)
    first = tokens.index("hello")
    assert tok.id_aliases[first] == len(tokens) - 2
    assert tok.decode([first]) == tok.decode([len(tokens) - 2]) == "hello"
    assert tok.id_to_token(first) == tok.id_to_token(len(tokens) - 2)
    for i in range(len(tokens)):  # Every id decodes (none raises).
      piece = tok.decode([i])
      if tokens[i] in ("hello", "▁hello", "▁world"):
        assert piece == text(tokens[i]).lstrip()
    assert tok.encode(text_of_last, add_bos=False) == [len(tokens) - 1]
  detok = IncrementalDetokenizer(tok)
  ids = [1, first, len(tokens) - 1, first]
  assert "".join([*map(detok.push, ids), detok.flush()]) == tok.decode(ids)


# ---- Finding 4: booleans given as strings ------------------------------------


@pytest.mark.parametrize("value,expected", [
    ("false", False), ("False", False), ("TRUE", True), (False, False),
    (True, True)])
def test_add_bos_token_strings(tmp_path, tiny_cache, value, expected):
  def extra(w):
    add = w.add_bool if isinstance(value, bool) else w.add_string
    add("tokenizer.ggml.add_bos_token", value)

  gguf_tok = Tokenizer.from_gguf(spm_gguf(tmp_path, extra=extra))
  hf_tok = Tokenizer.from_hf(hf_dir(tmp_path, config={"add_bos_token": value}))
  for tok in (gguf_tok, hf_tok):
    assert tok.add_bos is expected
    assert (tok.encode("hello")[0] == tok.bos_id) is expected


def test_space_prefix_string_false(tmp_path, tiny_cache):
  tok = Tokenizer.from_gguf(spm_gguf(tmp_path, extra=lambda w: w.add_string(
      "tokenizer.ggml.add_space_prefix", "false")))
  assert tok.id_to_token(tok.encode("hello", add_bos=False)[0]) == "hello"


# ---- Finding 5: a list of named chat templates ------------------------------


def test_chat_template_list_picks_default_like_transformers(tmp_path):
  transformers = pytest.importorskip("transformers")
  d = hf_dir(tmp_path, config={"chat_template": [
      {"name": "tool_use", "template": "TOOLS{{ messages[0]['content'] }}"},
      {"name": "default",
       "template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                   "<eot>{% endfor %}"},
  ]})
  ours = Tokenizer.from_hf(d)
  theirs = transformers.AutoTokenizer.from_pretrained(str(d))
  chat = [{"role": "user", "content": "a b"}]
  expected = theirs.apply_chat_template(chat, tokenize=False)
  assert ours.apply_chat_template(chat) == expected == "<s>a b<eot>"
  assert "'default'" in ours.chat_template_source
