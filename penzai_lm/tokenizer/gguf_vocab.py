"""Builds a `tokenizers.Tokenizer` from the vocabulary stored in a GGUF file.

A GGUF file has no ``tokenizer.json``; llama.cpp stores the vocabulary, the
merges (for byte-level BPE), scores, token types and special token ids as
metadata. This module rebuilds the equivalent Hugging Face `tokenizers`
pipeline, following what transformers does when it loads a GGUF file, so the
token ids are identical:

* ``tokenizer.ggml.model == "gpt2"``: byte-level BPE from the file's tokens
  and merges (SmolLM2, Llama 3, Qwen 2, ...).
* ``tokenizer.ggml.model == "llama"``: SentencePiece-style BPE with byte
  fallback and ``'▁'`` for spaces. The merges are not in the file, so they are
  rebuilt from the vocabulary (ordered by score, or for Gemma by position).
  This takes several seconds for Gemma 3's 262,144 tokens, so the built
  tokenizer is cached as JSON (see `load_or_build`).

Token types: control tokens (type 3) become special added tokens (matched
whole in the text, skipped by ``skip_special_tokens``); user-defined tokens
(type 4) become plain added tokens; byte tokens (``<0x41>``) serve the byte
fallback.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from typing import Any

import tokenizers
from tokenizers import decoders
from tokenizers import models
from tokenizers import normalizers
from tokenizers import pre_tokenizers

from penzai_lm import fetch

__all__ = ["CONTROL", "USER_DEFINED", "build_tokenizer", "load_or_build"]

CONTROL = 3
USER_DEFINED = 4

# Bump when the build logic changes, to invalidate cached tokenizer.json files.
_BUILD_VERSION = "1"
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3", "gemma3n")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp pre-tokenizer names whose split differs from GPT-2's regex.
# Others (e.g. SmolLM2's "smollm") use GPT-2's, as transformers does.
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's reversible map from bytes to printable unicode characters."""
  keep = (
      list(range(ord("!"), ord("~") + 1))
      + list(range(ord("¡"), ord("¬") + 1))
      + list(range(ord("®"), ord("ÿ") + 1))
  )
  chars, extra = list(keep), 0
  for b in range(256):
    if b not in keep:
      keep.append(b)
      chars.append(256 + extra)
      extra += 1
  return dict(zip(keep, map(chr, chars)))


def _added_tokens(
    tokens: list[str], token_types: Any, vocab: dict[str, int],
    alphabet: set[str] | None, extra_special: list[str],
) -> tuple[list[tokenizers.AddedToken], list[tokenizers.AddedToken]]:
  """Control tokens (special) and user-defined tokens (not special)."""
  special, plain = [], []
  for token, ttype in zip(tokens, token_types):
    if ttype == CONTROL and (alphabet is None or set(token) <= alphabet):
      special.append(tokenizers.AddedToken(token, normalized=False, special=True))
    elif ttype == USER_DEFINED and token in vocab:
      plain.append(tokenizers.AddedToken(token, normalized=False, special=False))
  present = {t.content for t in special}
  for token in extra_special:
    if token in vocab and token not in present:
      special.append(tokenizers.AddedToken(token, normalized=False, special=True))
  return special, plain


def _byte_level(meta: dict[str, Any]) -> tokenizers.Tokenizer:
  tokens = meta["tokenizer.ggml.tokens"]
  if not isinstance(meta.get("tokenizer.ggml.merges"), list):
    raise ValueError(
        "This GGUF file has a byte-level (gpt2) vocabulary but no "
        "tokenizer.ggml.merges; it cannot be used without its merges."
    )
  spelling = _bytes_to_unicode()
  alphabet = set(spelling.values())
  vocab = {
      (t if set(t) <= alphabet
       else "".join(spelling[b] for b in t.encode("utf-8"))): i
      for i, t in enumerate(tokens)
  }
  merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
  tok = tokenizers.Tokenizer(models.BPE(
      vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
      end_of_word_suffix="", fuse_unk=False,
  ))
  prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
  split = _PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
  if split is None:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix)
  else:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=False),
    ])
  tok.decoder = decoders.ByteLevel()
  return _finish(tok, meta, tokens, vocab, alphabet)


def _generate_merges(
    vocab: dict[str, int], scores: dict[str, float]
) -> list[tuple[str, str]]:
  """Rebuilds BPE merges from a vocabulary (as transformers does).

  Every token that splits into two tokens of the vocabulary yields a merge;
  merges are ordered by the score of the merged token, best first.
  """
  merges = []
  for token, score in scores.items():
    local = []
    for k in range(1, len(token)):
      left, right = token[:k], token[k:]
      if left in vocab and right in vocab:
        local.append((left, right, score))
    local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
    merges.extend(local)
  merges.sort(key=lambda x: (x[2], len(x[0]), len(x[1])), reverse=True)
  return [(left, right) for left, right, _ in merges]


def _sentencepiece(meta: dict[str, Any]) -> tokenizers.Tokenizer:
  tokens = list(meta["tokenizer.ggml.tokens"])
  arch = meta.get("general.architecture", "")
  gemma = arch in _GEMMA_ARCHS
  if gemma:
    # Gemma stores runs of spaces as real spaces; the model spells them '▁'.
    spelled = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    # Gemma's scores do not follow its merge order; the token order does.
    scores = {t: -i for i, t in enumerate(spelled)}
  else:
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.scores" not in meta:
      raise ValueError(
          "This GGUF file has a SentencePiece (llama) vocabulary without "
          "tokenizer.ggml.scores, so its merges cannot be rebuilt."
      )
    scores = dict(zip(tokens, (float(s) for s in meta["tokenizer.ggml.scores"])))
  unk_id = meta.get("tokenizer.ggml.unknown_token_id")
  unk = tokens[unk_id] if unk_id is not None and unk_id < len(tokens) else None
  tok = tokenizers.Tokenizer(models.BPE(
      vocab=vocab, merges=_generate_merges(vocab, scores), dropout=None,
      unk_token=unk, fuse_unk=True, byte_fallback=True,
  ))
  steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
  if gemma:
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
  else:
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never",
        split=False,
    )
    if prefix:
      steps.append(decoders.Strip(content=" ", left=1))
  tok.decoder = decoders.Sequence(steps)
  return _finish(tok, meta, tokens, vocab, None)


def _finish(tok, meta, tokens, vocab, alphabet) -> tokenizers.Tokenizer:
  ids = [meta.get(f"tokenizer.ggml.{k}_token_id")
         for k in ("bos", "eos", "unknown", "padding")]
  extra = [tokens[i] for i in ids if i is not None and 0 <= i < len(tokens)]
  types = meta.get("tokenizer.ggml.token_type")
  types = [] if types is None else [int(t) for t in types]
  special, plain = _added_tokens(tokens, types, vocab, alphabet, extra)
  tok.add_special_tokens(special)
  tok.add_tokens(plain)
  return tok


def build_tokenizer(meta: dict[str, Any]) -> tokenizers.Tokenizer:
  """Builds the tokenizer described by GGUF metadata.

  Args:
    meta: Metadata from `gguf_metadata.read_tokenizer_metadata`, with
      ``tokenizer.ggml.tokens`` (and ``merges`` when present) decoded.

  Raises:
    ValueError: If the file's tokenizer type is not supported.
  """
  kind = meta.get("tokenizer.ggml.model")
  if not isinstance(meta.get("tokenizer.ggml.tokens"), list):
    raise ValueError("The GGUF metadata has no tokenizer.ggml.tokens list.")
  if kind == "gpt2":
    return _byte_level(meta)
  if kind == "llama":
    return _sentencepiece(meta)
  raise ValueError(
      f"Unsupported GGUF tokenizer type tokenizer.ggml.model={kind!r}; "
      "supported: 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE). "
      "Load a Hugging Face tokenizer.json with Tokenizer.from_hf instead."
  )


def _cache_file(gguf_path: str, arch: str) -> pathlib.Path:
  digest = fetch.cached_sha256(gguf_path)
  if digest is None:
    st = os.stat(gguf_path)
    ident = f"{os.path.realpath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(ident.encode()).hexdigest()
  key = hashlib.sha256(f"{digest}|{_BUILD_VERSION}".encode()).hexdigest()
  directory = fetch.cache_dir() / "tokenizers"
  directory.mkdir(parents=True, exist_ok=True)
  return directory / f"{arch or 'gguf'}-{key[:24]}.json"


def load_or_build(
    meta: dict[str, Any], gguf_path: str | None, read_full: Any
) -> tokenizers.Tokenizer:
  """Returns the file's tokenizer, from the JSON cache when possible.

  SentencePiece vocabularies (slow to build) are cached under
  ``fetch.cache_dir() / "tokenizers"``, keyed by the GGUF file's verified
  sha256 when `penzai_lm.fetch` recorded one, else by its path, size and
  mtime. Byte-level vocabularies are fast to build and are not cached.

  Args:
    meta: Metadata read without the string arrays.
    gguf_path: The GGUF file, or None when unknown (no caching).
    read_full: A callable returning the metadata with the tokens (and
      merges) decoded; called only when the tokenizer must be built.
  """
  cacheable = meta.get("tokenizer.ggml.model") == "llama" and gguf_path
  if not cacheable:
    return build_tokenizer(read_full())
  path = _cache_file(gguf_path, meta.get("general.architecture", ""))
  if path.exists():
    try:
      return tokenizers.Tokenizer.from_file(str(path))
    except Exception:  # pylint: disable=broad-except
      path.unlink(missing_ok=True)  # corrupt cache: rebuild below
  tok = build_tokenizer(read_full())
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  tok.save(str(tmp))
  os.replace(tmp, path)
  return tok
