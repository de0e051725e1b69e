"""`Tokenizer`: text <-> token ids for a model, on the `tokenizers` library.

Build one from a GGUF file (`Tokenizer.from_gguf`) or from a Hugging Face
directory with a ``tokenizer.json`` (`Tokenizer.from_hf`)::

    tok = Tokenizer.from_gguf(resolve_model_path("smollm2-135m-instruct"))
    ids = tok.encode_chat([{"role": "user", "content": "Hi!"}])
    text = tok.decode(ids)

Encoding never adds EOS; BOS is added when the model's files ask for it.
Text spelling a special token (``<|im_start|>``) encodes to that token.

The files are untrusted input: a malformed file or field raises
`TokenizerFileError` (a ValueError) naming the file and the field; see
`file_values`, `gguf_vocab.check_fields` and `hf_files`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tokenizers

from penzai_lm.model_paths import refuse_special
from penzai_lm.tokenizer import chat_template as chat_template_lib
from penzai_lm.tokenizer import gguf_metadata
from penzai_lm.tokenizer import gguf_vocab
from penzai_lm.tokenizer import hf_files
from penzai_lm.tokenizer import vocab_cache
from penzai_lm.tokenizer.file_values import TokenizerFileError

__all__ = ["Tokenizer", "TokenizerFileError", "clean_up_tokenization"]

# End-of-turn tokens that stop generation, in addition to EOS, when the
# vocabulary has them as special tokens.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>",
                      "<|eom_id|>", "<|end|>")


def clean_up_tokenization(text: str) -> str:
  """transformers' ``clean_up_tokenization`` (removes spaces before marks)."""
  return (
      text.replace(" .", ".").replace(" ?", "?").replace(" !", "!")
      .replace(" ,", ",").replace(" ' ", "'").replace(" n't", "n't")
      .replace(" 'm", "'m").replace(" 's", "'s").replace(" 've", "'ve")
      .replace(" 're", "'re")
  )


class Tokenizer:
  """Encodes text to token ids and decodes them back, for one model.

  Attributes:
    backend: The underlying `tokenizers.Tokenizer`.
    vocab_size: Number of token ids (including added tokens). For a GGUF
      file, the number of entries of ``tokenizer.ggml.tokens``.
    id_aliases: Ids that decode as another id: an earlier entry of a GGUF
      vocabulary that spells the same string as a later one (text encodes
      to the later one, as in llama.cpp).
    bos_id: Beginning-of-sequence id, or None if the model has none.
    eos_id: End-of-sequence id, or None if the model has none.
    pad_id: Padding id. If the files name none, falls back to ``eos_id``
      (padded positions are masked, so any valid id works), else 0.
    unk_id: Unknown-token id, or None.
    add_bos: Whether `encode` prepends BOS by default.
    stop_ids: Ids that end generation: EOS, any extra EOS ids the files list,
      and end-of-turn tokens such as ``<end_of_turn>`` or ``<|im_end|>``.
    special_ids: Ids of special (control) tokens; `decode` drops them when
      ``skip_special_tokens=True``.
    chat_template: The Jinja2 chat template: the files' own, else a fallback
      (see `chat_template.fallback_template`), else None.
    chat_template_source: Where the template comes from (named in errors,
      e.g. when it goes over a rendering limit).
    clean_up_tokenization_spaces: Whether `decode` removes spaces before
      punctuation (transformers' option; False for the GGUF models).
    architecture: ``general.architecture`` of a GGUF file (or the
      ``model_type`` of a Hugging Face config), if known.
  """

  def __init__(
      self,
      backend: tokenizers.Tokenizer,
      *,
      bos_id: int | None,
      eos_id: int | None,
      pad_id: int | None = None,
      unk_id: int | None = None,
      add_bos: bool = False,
      extra_eos_ids: Sequence[int] = (),
      chat_template: str | None = None,
      clean_up_tokenization_spaces: bool = False,
      architecture: str | None = None,
      chat_template_source: str | None = None,
      vocab_size: int | None = None,
      id_aliases: Mapping[int, int] | None = None,
  ):
    self.backend = backend
    self.vocab_size = (backend.get_vocab_size(with_added_tokens=True)
                       if vocab_size is None else int(vocab_size))
    self.id_aliases = dict(id_aliases or {})
    for name, value in (("bos_id", bos_id), ("eos_id", eos_id),
                        ("pad_id", pad_id), ("unk_id", unk_id)):
      if value is not None and not 0 <= value < self.vocab_size:
        raise ValueError(
            f"{name}={value} is outside the vocabulary [0, {self.vocab_size})"
            "; the tokenizer files are inconsistent."
        )
    self.bos_id, self.eos_id, self.unk_id = bos_id, eos_id, unk_id
    if pad_id is None:
      pad_id = eos_id if eos_id is not None else 0
    self.pad_id = pad_id
    self.add_bos = bool(add_bos) and bos_id is not None
    special = {
        i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    self.special_ids = frozenset(
        special | {i for i, j in self.id_aliases.items() if j in special})
    stops = [eos_id, *extra_eos_ids]
    for token in END_OF_TURN_TOKENS:
      i = backend.token_to_id(token)
      if i is not None and i in self.special_ids:
        stops.append(i)
    self.stop_ids = tuple(dict.fromkeys(
        int(i) for i in stops if i is not None and 0 <= i < self.vocab_size))
    if chat_template is None:
      chat_template = chat_template_lib.fallback_template(
          lambda t: backend.token_to_id(t) is not None)
      chat_template_source = "the built-in fallback chat template"
    self.chat_template = chat_template
    self.chat_template_source = chat_template_source or "the chat template"
    self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
    self.architecture = architecture

  def __repr__(self) -> str:
    return (
        f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
        f"eos_id={self.eos_id}, pad_id={self.pad_id}, "
        f"stop_ids={self.stop_ids}, architecture={self.architecture!r})"
    )

  # Construction.

  @classmethod
  def from_gguf(cls, path_or_reader: str | os.PathLike[str] | Any) -> Tokenizer:
    """Builds the tokenizer described by a GGUF file's metadata.

    Only ``tokenizer.*`` and ``general.architecture`` fields are read. The
    SentencePiece vocabularies (e.g. Gemma 3, slow to build) are cached
    under `penzai_lm.paths.cache_dir()`, keyed by a hash of those fields
    (see `vocab_cache`), for a path and an open reader alike.

    Args:
      path_or_reader: A GGUF file path, or an open `gguf.GGUFReader`.

    Raises:
      ValueError: If the file is missing or not GGUF;
        `TokenizerFileError` if a tokenizer field is malformed (wrong type,
        id outside the vocabulary, per-token array of the wrong length,
        invalid UTF-8) or of an unsupported tokenizer type.
    """
    if isinstance(path_or_reader, (str, os.PathLike)):
      refuse_special(path_or_reader)  # A FIFO would block forever.
    meta, digest = gguf_metadata.read_tokenizer_fields(path_or_reader)
    file = gguf_metadata.gguf_file_path(path_or_reader) or "a GGUF file"
    if "tokenizer.ggml.model" not in meta:
      raise ValueError(
          f"{file} has no tokenizer (no tokenizer.ggml.model key); "
          "use Tokenizer.from_hf with the model's tokenizer.json instead."
      )
    meta = gguf_vocab.check_fields(meta, file)
    arrays = (gguf_vocab.TOKENS, gguf_vocab.MERGES)

    def read_full() -> dict[str, Any]:
      full = gguf_metadata.read_tokenizer_metadata(path_or_reader, arrays)
      return {**meta, **{k: full[k] for k in arrays if k in full}}

    backend, aliases = vocab_cache.load_or_build(meta, digest, file, read_full)
    get = lambda key: meta.get(f"tokenizer.ggml.{key}")
    add_bos = get("add_bos_token")
    if add_bos is None:  # llama.cpp's default: BOS for SentencePiece vocabs.
      add_bos = get("model") == "llama"
    eos_extra = get("eot_token_id")
    return cls(
        backend,
        bos_id=get("bos_token_id"),
        eos_id=get("eos_token_id"),
        pad_id=get("padding_token_id"),
        unk_id=get("unknown_token_id"),
        add_bos=add_bos,
        extra_eos_ids=() if eos_extra is None else (eos_extra,),
        chat_template=meta.get("tokenizer.chat_template"),
        architecture=meta.get("general.architecture"),
        chat_template_source=(
            f"the chat template (tokenizer.chat_template) of {file}"),
        vocab_size=meta[gguf_vocab.TOKENS],
        id_aliases=aliases,
    )

  @classmethod
  def from_hf(cls, directory: str | os.PathLike[str]) -> Tokenizer:
    """Builds a tokenizer from a Hugging Face model directory.

    Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (special
    tokens, ``add_bos_token``, ``chat_template``,
    ``clean_up_tokenization_spaces``), ``chat_template.jinja``,
    ``special_tokens_map.json``, and the EOS ids of ``generation_config.json``
    and ``config.json`` when present.

    Args:
      directory: The model directory.

    Raises:
      ValueError: If the directory has no ``tokenizer.json``;
        `TokenizerFileError` if a file or field is malformed.
    """
    refuse_special(directory)  # A FIFO tokenizer.json would block forever.
    return cls(**hf_files.read_hf_tokenizer(directory))

  # Vocabulary.

  def token_to_id(self, token: str) -> int | None:
    """The id of a token string, or None if it is not in the vocabulary."""
    return self.backend.token_to_id(token)

  def id_to_token(self, token_id: int) -> str:
    """The token string of an id (in the vocabulary's own spelling)."""
    self._check_ids([token_id])
    token_id = int(token_id)
    return self.backend.id_to_token(self.id_aliases.get(token_id, token_id))

  # Encoding and decoding.

  def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
    """Encodes text to token ids.

    With the default ``add_bos=None`` the ids start with BOS when the model
    adds it (`add_bos`; Gemma does, SmolLM2 does not), so
    ``encode(" Paris")[0]`` may be BOS rather than the word: use `token_id`
    for the id of one token.

    Args:
      text: The text. Substrings spelling a special token (e.g.
        ``<|im_start|>``) become that token.
      add_bos: Whether to prepend BOS; None uses the model's default
        (`add_bos`). EOS is never added.

    Raises:
      TypeError: If ``text`` is not a str.
    """
    if not isinstance(text, str):
      raise TypeError(
          f"Tokenizer.encode expects a str, got {type(text).__name__}; "
          "decode bytes first (e.g. data.decode('utf-8'))."
      )
    ids = self.backend.encode(text, add_special_tokens=False).ids
    if add_bos is None:
      add_bos = self.add_bos
    if add_bos:
      if self.bos_id is None:
        raise ValueError("add_bos=True, but this tokenizer has no BOS token.")
      ids.insert(0, self.bos_id)
    return ids

  def token_id(self, text: str) -> int:
    """The id of the single token ``text`` encodes to, without BOS.

    E.g. ``token_id(" Paris")`` for the logit of the answer " Paris"
    (mind the leading space: most vocabularies spell a word after a space
    as a token of its own).

    Raises:
      TypeError: If ``text`` is not a str.
      ValueError: If ``text`` encodes to no token or to several.
    """
    ids = self.encode(text, add_bos=False)
    if len(ids) != 1:
      pieces = [self.id_to_token(i) for i in ids]
      raise ValueError(
          f"token_id({text!r}): the text encodes to {len(ids)} tokens, not"
          f" one: ids {ids} = {pieces}. Use a text that is one token (check"
          " the leading space: ' Paris' and 'Paris' differ), pick a token"
          " of encode(text, add_bos=False) yourself, or compare"
          " multi-token answers by their summed log-probabilities.")
    return ids[0]

  def _check_ids(self, ids: Any) -> list[int]:
    arr = np.asarray(ids)
    if arr.size == 0:
      return []
    if arr.ndim != 1:
      raise ValueError(
          f"Expected a 1-D sequence of token ids, got shape {arr.shape}; "
          "decode one sequence at a time."
      )
    if not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"Token ids must be integers, got dtype {arr.dtype}.")
    bad = arr[(arr < 0) | (arr >= self.vocab_size)]
    if bad.size:
      raise ValueError(
          f"Token id {int(bad[0])} is outside the vocabulary "
          f"[0, {self.vocab_size}) ({bad.size} such ids); these ids do not "
          "come from this tokenizer (or the model's vocabulary is larger)."
      )
    return arr.astype(np.int64).tolist()

  def decode_raw(self, ids: Any, *, skip_special_tokens: bool = False) -> str:
    """Like `decode`, but without ``clean_up_tokenization_spaces``."""
    ids = self._check_ids(ids)
    if self.id_aliases:
      ids = [self.id_aliases.get(i, i) for i in ids]
    return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

  def decode(self, ids: Any, *, skip_special_tokens: bool = False) -> str:
    """Decodes token ids to text.

    Args:
      ids: A 1-D sequence of ids (list, numpy or JAX array).
      skip_special_tokens: Whether to drop special tokens (BOS, EOS,
        ``<|im_start|>``, ...).

    Raises:
      ValueError: If an id is outside ``[0, vocab_size)``.
    """
    text = self.decode_raw(ids, skip_special_tokens=skip_special_tokens)
    if self.clean_up_tokenization_spaces:
      text = clean_up_tokenization(text)
    return text

  # Chat.

  def special_tokens_map(self) -> dict[str, str]:
    """Special token strings passed to chat templates (``bos_token``...)."""
    out = {}
    for name, i in (("bos_token", self.bos_id), ("eos_token", self.eos_id),
                    ("unk_token", self.unk_id), ("pad_token", self.pad_id)):
      if i is not None:
        out[name] = self.id_to_token(i)
    return out

  def apply_chat_template(
      self,
      messages: Sequence[Mapping[str, Any]],
      add_generation_prompt: bool = True,
      **kwargs: Any,
  ) -> str:
    """Renders a conversation to prompt text with the chat template.

    Uses the files' own template (rendered like transformers), or the
    documented fallback (Gemma's ``<start_of_turn>`` format with BOS at the
    start, or ChatML).

    Args:
      messages: Dicts with ``role`` and ``content`` keys.
      add_generation_prompt: Whether to end with the header of the
        assistant's turn.
      **kwargs: Extra template variables (e.g. ``tools``).

    Raises:
      ValueError: If there is no template. `ChatTemplateError` (a
        ValueError naming the template and line) if the template fails or
        rejects the messages (e.g. roles that do not alternate), or goes
        over a rendering limit (its subclass `TemplateLimitError`: size,
        time, loop iterations, output size).
    """
    if self.chat_template is None:
      raise ValueError(
          "This tokenizer has no chat template (its files define none and "
          "its vocabulary has no known turn tokens). Encode a plain prompt "
          "with encode() instead."
      )
    return chat_template_lib.render_chat_template(
        self.chat_template, messages,
        add_generation_prompt=add_generation_prompt,
        special_tokens=self.special_tokens_map(),
        source=self.chat_template_source, **kwargs)

  def encode_chat(
      self,
      messages: Sequence[Mapping[str, Any]],
      add_generation_prompt: bool = True,
      **kwargs: Any,
  ) -> list[int]:
    """Renders a conversation and encodes it, with exactly one leading BOS.

    BOS comes from the template when it writes ``bos_token`` itself;
    otherwise it is prepended if the model adds BOS (`add_bos`).
    """
    text = self.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, **kwargs)
    ids = self.encode(text, add_bos=False)
    if self.add_bos and (not ids or ids[0] != self.bos_id):
      ids.insert(0, self.bos_id)
    return ids
