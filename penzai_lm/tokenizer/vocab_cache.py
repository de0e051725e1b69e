"""The on-disk cache of tokenizers built from GGUF vocabularies.

Rebuilding a SentencePiece vocabulary's merges is slow for a large
vocabulary (Gemma 3's 262,144 tokens), so the built tokenizer is saved as a
``tokenizer.json`` under `penzai_lm.paths.tokenizers_dir` and read from
there next time, which is faster. Byte-level vocabularies carry their
merges and build fast, so they are not cached.

An entry is named ``<key>-<check>.json``, both hex digests:

* ``key`` hashes the raw bytes of the file's tokenizer metadata (every
  ``tokenizer.*`` key and ``general.architecture``; see
  `gguf_metadata.read_tokenizer_fields`) with the build version and the
  `tokenizers` version. Files with the same vocabulary share an entry,
  wherever they are; nothing a file says reaches a name except through a
  hash, so a file cannot choose where its entry is written.
* ``check`` hashes the entry's own bytes. An entry is used only if its bytes
  still hash to its name; a truncated or edited one is removed with a
  warning and rebuilt.

A cache directory that cannot be written only costs the rebuild (with a
warning); it never stops the tokenizer from loading.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import warnings
from collections.abc import Callable
from typing import Any

import tokenizers

from penzai_lm import paths
from penzai_lm.tokenizer import gguf_vocab

__all__ = ["load_or_build"]

# Bump when the build logic changes, to invalidate cached entries.
_BUILD_VERSION = "2"
_DIGITS = 32  # Hex digits of each hash in an entry's name.


def _directory() -> pathlib.Path:
  return paths.tokenizers_dir()


def _entry_key(digest: str) -> str:
  ident = f"{digest}|{_BUILD_VERSION}|tokenizers {tokenizers.__version__}"
  return hashlib.sha256(ident.encode()).hexdigest()[:_DIGITS]


def _warn(message: str) -> None:
  warnings.warn(f"penzai_lm: {message}", RuntimeWarning, stacklevel=5)


def _discard(path: pathlib.Path, why: str) -> None:
  _warn(f"the cached tokenizer {path} {why}; it is removed and rebuilt.")
  try:
    path.unlink()
  except OSError:
    pass


def _read_entry(key: str) -> tokenizers.Tokenizer | None:
  """The verified cache entry for ``key``, or None."""
  for path in sorted(_directory().glob(f"{key}-*.json")):
    check = path.name[len(key) + 1 : -len(".json")]
    try:
      data = path.read_bytes()
    except OSError:
      continue
    if hashlib.sha256(data).hexdigest()[:_DIGITS] != check:
      _discard(path, "is damaged (its bytes do not match the checksum in "
               "its name)")
      continue
    try:
      return tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # pylint: disable=broad-except
      _discard(path, f"cannot be read ({e})")
  return None


def _write_entry(key: str, backend: tokenizers.Tokenizer) -> None:
  data = backend.to_str().encode("utf-8")
  name = f"{key}-{hashlib.sha256(data).hexdigest()[:_DIGITS]}.json"
  try:
    directory = _directory()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = directory / f".{name}.{os.getpid()}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, directory / name)  # Atomic: readers never see half.
  except OSError as e:
    _warn(f"the tokenizer could not be cached ({e}); it is rebuilt on "
          "every load.")


def load_or_build(
    meta: dict[str, Any],
    digest: str | None,
    file: str,
    read_full: Callable[[], dict[str, Any]],
) -> tuple[tokenizers.Tokenizer, dict[int, int]]:
  """Returns the file's tokenizer and its id aliases, cached when possible.

  Args:
    meta: Checked metadata (`gguf_vocab.check_fields`) without the string
      arrays decoded.
    digest: `gguf_metadata.read_tokenizer_fields`' digest of the metadata;
      None (the file is unknown) builds without the cache.
    file: The file, for error messages.
    read_full: Returns ``meta`` with the tokens (and merges) decoded; called
      only when the tokenizer must be built, or when the vocabulary has
      duplicate tokens (to find the aliases, `gguf_vocab.id_aliases`).

  Returns:
    ``(backend, aliases)``.
  """
  full = None
  key = None
  backend = None
  if meta.get("tokenizer.ggml.model") == "llama" and digest is not None:
    key = _entry_key(digest)
    backend = _read_entry(key)
  if backend is None:
    full = read_full()
    backend = gguf_vocab.build_tokenizer(full, file)
    if key is not None:
      _write_entry(key, backend)
  n = meta[gguf_vocab.TOKENS]
  n = len(n) if isinstance(n, list) else n
  # With one id per distinct string, the vocabulary fills [0, n) exactly.
  if backend.get_vocab_size(with_added_tokens=True) == n:
    return backend, {}
  return backend, gguf_vocab.id_aliases(backend, full or read_full())
