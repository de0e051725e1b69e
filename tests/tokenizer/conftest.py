"""Fixtures for tokenizer tests: tiny synthetic GGUF files and real models.

Tiny GGUF files (metadata only, written with gguf-py) exercise both GGUF
vocabulary types without a download. Real-model fixtures are session-scoped
so each tokenizer (ours and transformers') is built once per run.
"""

import functools
import pathlib

import gguf
import pytest

from penzai_lm.tokenizer import Tokenizer

CONTROL, NORMAL, USER_DEFINED, BYTE = 3, 1, 4, 6


def _bytes_to_unicode():
  keep = (list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD))
          + list(range(0xAE, 0x100)))
  chars, n = list(keep), 0
  for b in range(256):
    if b not in keep:
      keep.append(b)
      chars.append(256 + n)
      n += 1
  return [chr(c) for _, c in sorted(zip(keep, chars))]


def _write(path, arch, model, tokens, types, *, merges=None, scores=None,
           bos=None, eos=None, unk=None, pad=None, add_bos=None,
           template=None, space_prefix=None):
  w = gguf.GGUFWriter(str(path), arch)
  w.add_tokenizer_model(model)
  w.add_token_list(tokens)
  w.add_token_types(types)
  if merges is not None:
    w.add_token_merges(merges)
  if scores is not None:
    w.add_token_scores(scores)
  for value, add in ((bos, w.add_bos_token_id), (eos, w.add_eos_token_id),
                     (unk, w.add_unk_token_id), (pad, w.add_pad_token_id)):
    if value is not None:
      add(value)
  if add_bos is not None:
    w.add_add_bos_token(add_bos)
  if space_prefix is not None:
    w.add_add_space_prefix(space_prefix)
  if template is not None:
    w.add_chat_template(template)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return pathlib.Path(path)


def write_tiny_bpe_gguf(path, **kwargs):
  """A byte-level (gpt2) vocabulary: 256 bytes, a few merges, 3 controls."""
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  tokens = specials + _bytes_to_unicode()
  merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d",
            "Ġwor ld"]
  tokens += [m.replace(" ", "") for m in merges]
  types = [CONTROL] * 3 + [NORMAL] * (len(tokens) - 3)
  kwargs = {"bos": 1, "eos": 2, "unk": 0, "add_bos": False, **kwargs}
  return _write(path, "llama", "gpt2", tokens, types, merges=merges, **kwargs)


def write_tiny_spm_gguf(path, arch="llama", **kwargs):
  """A SentencePiece (llama) vocabulary with byte fallback and scores."""
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
  types = [2, CONTROL, CONTROL] + [BYTE] * 256
  pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "a", "b", "he", "ll",
            "hell", "hello", "▁hello", "or", "▁w", "▁wor", "▁world", "ld",
            "  ", "<tag>"]
  tokens += pieces
  types += [NORMAL] * (len(pieces) - 2) + [USER_DEFINED, USER_DEFINED]
  scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
  kwargs = {"bos": 1, "eos": 2, "unk": 0, **kwargs}
  return _write(path, arch, "llama", tokens, types, scores=scores, **kwargs)


@pytest.fixture
def tiny_cache(tmp_path, monkeypatch):
  """Points penzai_lm's cache at a temporary directory."""
  cache = tmp_path / "cache"
  monkeypatch.setenv("PENZAI_LM_CACHE", str(cache))
  return cache


@functools.cache
def _real_tokenizer(name):
  from penzai_lm.fetch import resolve_model_path  # pylint: disable=g-import-not-at-top
  return Tokenizer.from_gguf(resolve_model_path(name))


@functools.cache
def _hf_tokenizer(name):
  transformers = pytest.importorskip("transformers")
  from penzai_lm.fetch import resolve_model_path  # pylint: disable=g-import-not-at-top
  path = resolve_model_path(name)
  return transformers.AutoTokenizer.from_pretrained(
      str(path.parent), gguf_file=path.name)


REAL_MODELS = ("smollm2-135m-instruct", "gemma3-270m")


@pytest.fixture(scope="session", params=REAL_MODELS)
def real_name(request):
  return request.param


@pytest.fixture(scope="session")
def real_tok(real_name):
  return _real_tokenizer(real_name)


@pytest.fixture(scope="session")
def hf_tok(real_name):
  return _hf_tokenizer(real_name)


@pytest.fixture(scope="session")
def smol_tok():
  return _real_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smol_hf():
  return _hf_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma_tok():
  return _real_tokenizer("gemma3-270m")


# Varied text for id-equality and round-trip tests.
TEXTS = (
    "",
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café Ünïcödé façade",
    "日本語のテキスト、中文文本。한국어 문장",
    "مرحبا بالعالم",
    "שלום עולם",
    "👩‍👩‍👧 family, 😀🎉 and 🏳️‍🌈",
    "🌁 foggy (byte fallback in Gemma)",
    "def f(x):\n    return x ** 2  # square\n",
    "tabs\tand\t\ttabs",
    "runs  of   spaces    here     ",
    "   leading spaces",
    "line1\nline2\n\n\nline5\r\n",
    "\n",
    " ",
    "12345 67890 3.14159 1e-9 007 2024-11-22",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "<bos>text<eos>",
    "<table><tr><td>1</td></tr></table>",
    "don't I'm it's we've you're , . ?",
    "zero\u200bwidth and non\u00a0breaking",
    "▁ underscore-like and Ġ Ċ",
)
