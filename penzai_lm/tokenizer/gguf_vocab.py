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
  tokenizer is cached (see `vocab_cache`).

Token types: control tokens (type 3) become special added tokens (matched
whole in the text, skipped by ``skip_special_tokens``); user-defined tokens
(type 4) become plain added tokens; byte tokens (``<0x41>``) serve the byte
fallback.

The vocabulary has one id per entry of ``tokenizer.ggml.tokens``. If two
entries spell the same string, text encodes to the last one (as in
llama.cpp and transformers) and the earlier id is an *alias*: `id_aliases`
maps it to the id that decodes to the same text. The metadata is checked
first (`check_fields`): a value of the wrong type, an id outside the
vocabulary or an array whose length is not the token count raises
`file_values.TokenizerFileError` naming the file and the key.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tokenizers
from tokenizers import decoders
from tokenizers import models
from tokenizers import normalizers
from tokenizers import pre_tokenizers

from penzai_lm.tokenizer.file_values import TokenizerFileError
from penzai_lm.tokenizer.file_values import parse_bool
from penzai_lm.tokenizer.file_values import parse_token_id

__all__ = ["CONTROL", "USER_DEFINED", "build_tokenizer", "check_fields",
           "id_aliases"]

CONTROL = 3
USER_DEFINED = 4

_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3", "gemma3n")
TOKENS, MERGES = "tokenizer.ggml.tokens", "tokenizer.ggml.merges"
# Special token ids the tokenizer uses, by GGUF key.
ID_KEYS = tuple(f"tokenizer.ggml.{k}_token_id"
                for k in ("bos", "eos", "unknown", "padding", "eot"))
_BOOL_KEYS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix")
_STR_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre",
             "tokenizer.chat_template", "general.architecture")
# Per-token arrays: key -> whether float values are allowed.
_PER_TOKEN = {"tokenizer.ggml.scores": True, "tokenizer.ggml.token_type": False}

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


def _string_array_length(meta: dict[str, Any], key: str, file: str) -> int:
  value = meta[key]
  if isinstance(value, list) and all(isinstance(v, str) for v in value):
    return len(value)
  if isinstance(value, int) and not isinstance(value, bool):
    return value  # Not decoded: `gguf_metadata` gives the length.
  raise TokenizerFileError(
      file, key, f"is a {type(value).__name__}, not an array of strings.")


def check_fields(meta: dict[str, Any], file: str) -> dict[str, Any]:
  """``meta`` with its tokenizer fields checked and in their one form.

  Ids are ints inside the vocabulary, flags bools (a GGUF bool, or the
  strings "true"/"false"), names strings, and per-token arrays numeric with
  one entry per token.

  Args:
    meta: Metadata from `gguf_metadata.read_tokenizer_fields` (string arrays
      decoded or not).
    file: The file, for error messages.

  Raises:
    TokenizerFileError: Naming the file and the key of a bad value.
  """
  if TOKENS not in meta:
    raise TokenizerFileError(file, TOKENS, "is missing; the file has no "
                             "vocabulary.")
  out = dict(meta)
  n = _string_array_length(meta, TOKENS, file)
  if MERGES in meta:
    _string_array_length(meta, MERGES, file)
  for key in _STR_KEYS:
    if key in meta and not isinstance(meta[key], str):
      raise TokenizerFileError(
          file, key, f"is {meta[key]!r}, not a string.")
  for key in ID_KEYS:
    out[key] = parse_token_id(meta.get(key), file, key, n)
  for key in _BOOL_KEYS:
    out[key] = parse_bool(meta.get(key), file, key)
  for key, floats in _PER_TOKEN.items():
    if key not in meta:
      continue
    value = meta[key]
    kinds = (np.integer, np.floating) if floats else (np.integer,)
    if not (isinstance(value, np.ndarray)
            and any(np.issubdtype(value.dtype, k) for k in kinds)):
      kind = "numeric" if floats else "integer"
      raise TokenizerFileError(
          file, key, f"must be an array of {kind} values, one per token; it "
          f"is a {type(value).__name__}"
          f"{f' of {value.dtype}' if isinstance(value, np.ndarray) else ''}.")
    if len(value) != n:
      raise TokenizerFileError(
          file, key, f"has {len(value)} entries but {TOKENS} has {n}; each "
          "token needs exactly one, so the file is corrupt.")
    if floats and not np.all(np.isfinite(value)):
      raise TokenizerFileError(
          file, key, f"holds a non-finite value at entry "
          f"{int(np.argmin(np.isfinite(value)))}; the file is corrupt.")
  return out


def spelled_tokens(meta: dict[str, Any]) -> list[str]:
  """Each id's token as the built vocabulary spells it."""
  tokens = meta[TOKENS]
  if meta.get("tokenizer.ggml.model") == "gpt2":
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    return [t if set(t) <= alphabet
            else "".join(spelling[b] for b in t.encode("utf-8"))
            for t in tokens]
  if meta.get("general.architecture", "") in _GEMMA_ARCHS:
    # Gemma stores runs of spaces as real spaces; the model spells them '▁'.
    return ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
  return list(tokens)


def id_aliases(
    backend: tokenizers.Tokenizer, meta: dict[str, Any]
) -> dict[int, int]:
  """Ids whose string another, later id also has -> that later id.

  Args:
    backend: The tokenizer built from ``meta``.
    meta: The metadata, with ``tokenizer.ggml.tokens`` decoded.
  """
  aliases = {}
  for i, token in enumerate(spelled_tokens(meta)):
    if backend.id_to_token(i) is None:
      target = backend.token_to_id(token)
      if target is not None:
        aliases[i] = target
  return aliases


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


def _bpe(file: str, merges_key: str, **kwargs: Any) -> models.BPE:
  """``models.BPE(**kwargs)``, its errors naming the file and merges key."""
  try:
    return models.BPE(**kwargs)
  except Exception as e:  # tokenizers raises a bare Exception.
    vocab = kwargs["vocab"]
    for i, (left, right) in enumerate(kwargs["merges"]):
      missing = [t for t in (left, right, left + right) if t not in vocab]
      if missing:
        raise TokenizerFileError(
            file, merges_key,
            f"entry {i} merges {left!r} and {right!r}, but {missing[0]!r} is "
            f"not a token of {TOKENS}; the file is corrupt.") from e
    raise TokenizerFileError(
        file, merges_key, f"cannot be used by tokenizers: {e}") from e


def _byte_level(meta: dict[str, Any], file: str) -> tokenizers.Tokenizer:
  tokens = meta[TOKENS]
  if not isinstance(meta.get(MERGES), list):
    raise TokenizerFileError(
        file, MERGES,
        "is missing; a byte-level (gpt2) vocabulary cannot be used without "
        "its merges.")
  alphabet = set(_bytes_to_unicode().values())
  vocab = {t: i for i, t in enumerate(spelled_tokens(meta))}
  merges = []
  for i, merge in enumerate(meta[MERGES]):
    pair = tuple(merge.split(" ", 1))
    if len(pair) != 2 or not all(pair):
      raise TokenizerFileError(
          file, MERGES,
          f"entry {i} is {merge!r}; each merge must be two tokens separated "
          "by one space. The file is corrupt.")
    merges.append(pair)
  tok = tokenizers.Tokenizer(_bpe(
      file, MERGES, vocab=vocab, merges=merges, dropout=None,
      continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
  ))
  prefix = bool(meta.get("tokenizer.ggml.add_space_prefix") or False)
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


def _sentencepiece(meta: dict[str, Any], file: str) -> tokenizers.Tokenizer:
  tokens = list(meta[TOKENS])
  gemma = meta.get("general.architecture", "") in _GEMMA_ARCHS
  spelled = spelled_tokens(meta)
  vocab = {t: i for i, t in enumerate(spelled)}
  if gemma:
    # Gemma's scores do not follow its merge order; the token order does.
    scores = {t: -i for i, t in enumerate(spelled)}
  else:
    if "tokenizer.ggml.scores" not in meta:
      raise TokenizerFileError(
          file, "tokenizer.ggml.scores",
          "is missing; a SentencePiece (llama) vocabulary needs it to rebuild "
          "its merges.")
    scores = dict(zip(tokens, (float(s) for s in meta["tokenizer.ggml.scores"])))
  unk_id = meta.get("tokenizer.ggml.unknown_token_id")
  unk = None if unk_id is None else tokens[unk_id]
  tok = tokenizers.Tokenizer(_bpe(
      file, "(merges rebuilt from the vocabulary)", vocab=vocab,
      merges=_generate_merges(vocab, scores), dropout=None, unk_token=unk,
      fuse_unk=True, byte_fallback=True,
  ))
  steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
  if gemma:
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
  else:
    prefix = meta.get("tokenizer.ggml.add_space_prefix")
    prefix = True if prefix is None else prefix
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
  extra = [tokens[i] for i in ids if i is not None]
  types = meta.get("tokenizer.ggml.token_type")
  types = [] if types is None else [int(t) for t in types]
  special, plain = _added_tokens(tokens, types, vocab, alphabet, extra)
  tok.add_special_tokens(special)
  tok.add_tokens(plain)
  return tok


def build_tokenizer(
    meta: dict[str, Any], file: str = "a GGUF file"
) -> tokenizers.Tokenizer:
  """Builds the tokenizer described by GGUF metadata.

  Args:
    meta: Metadata from `gguf_metadata.read_tokenizer_fields`, with
      ``tokenizer.ggml.tokens`` (and ``merges`` when present) decoded.
    file: The file, for error messages.

  Raises:
    TokenizerFileError: If a field is missing or malformed (see
      `check_fields`), the merges name tokens that do not exist, or the
      tokenizer type is not supported.
  """
  meta = check_fields(meta, file)
  if not isinstance(meta[TOKENS], list):
    raise ValueError(f"build_tokenizer needs {TOKENS} decoded (a list).")
  kind = meta.get("tokenizer.ggml.model")
  if kind == "gpt2":
    return _byte_level(meta, file)
  if kind == "llama":
    return _sentencepiece(meta, file)
  raise TokenizerFileError(
      file, "tokenizer.ggml.model",
      f"is {kind!r}, an unsupported tokenizer type; supported: 'gpt2' "
      "(byte-level BPE) and 'llama' (SentencePiece BPE). Load a Hugging Face "
      "tokenizer.json with Tokenizer.from_hf instead."
  )
