"""`IncrementalDetokenizer`: turns a stream of token ids into text pieces.

Tokens do not map to whole characters: Gemma spells an emoji as four
byte-fallback tokens, and a byte-level BPE token can end in the middle of a
UTF-8 sequence. Decoders also depend on context (SentencePiece strips the
leading space of the first token only). The detokenizer therefore:

* keeps the ids not yet released (``pending``) and decodes only those,
  so each push costs O(tokens since the last release), not O(history);
* decodes them after an *anchor* token (a plain token such as ``!``) once
  text has been released, so the pending tokens decode exactly as
  they would in the middle of the whole sequence, and removes the anchor's
  text afterwards; at the start of the stream it decodes them alone, so the
  start-of-text rules (leading-space stripping) apply as in `decode`;
* holds the text back while it ends with U+FFFD (an incomplete character)
  or with a byte-fallback token (a later byte of the same run can still turn
  the whole run into U+FFFD, as `decode` does);
* applies ``clean_up_tokenization_spaces`` as a streaming filter that only
  releases text up to a character that no clean-up rule can touch.

The concatenation of all pieces returned by `push` and `flush` equals
``tokenizer.decode(all_ids)`` exactly.
"""

from __future__ import annotations

import itertools

from penzai_lm.tokenizer.tokenizer import Tokenizer
from penzai_lm.tokenizer.tokenizer import clean_up_tokenization

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
# Characters that occur in transformers' clean-up patterns. Text can be
# cleaned piecewise when split right after any other character.
_CLEANUP_CHARS = frozenset(" .?!,'ntmsvre")
_ANCHOR_CANDIDATES = "!#$%&*+/:;=?@^|~ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _find_anchor(tokenizer: Tokenizer, byte_ids: frozenset[int]) -> tuple[
    int | None, str]:
  """A plain token whose text is stable, non-empty and has no edge spaces."""
  first = (tokenizer.token_to_id(c) for c in _ANCHOR_CANDIDATES)
  for i in itertools.chain(first, range(min(tokenizer.vocab_size, 4096))):
    if i is None or i in tokenizer.special_ids or i in byte_ids:
      continue
    text = tokenizer.decode_raw([i])
    if (text and text == text.strip() and _REPLACEMENT not in text
        and tokenizer.decode_raw([i, i]).startswith(text)):
      return i, text
  return None, ""


class IncrementalDetokenizer:
  """Decodes a stream of token ids into text, one piece per token.

  Example::

      detok = IncrementalDetokenizer(tok)
      for token_id in generated:
        print(detok.push(token_id), end="", flush=True)
      print(detok.flush())

  Args:
    tokenizer: The `Tokenizer` the ids come from.
    skip_special_tokens: Whether to drop special tokens, as in
      `Tokenizer.decode`.
  """

  def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False):
    self.tokenizer = tokenizer
    self.skip_special_tokens = skip_special_tokens
    self._byte_ids = frozenset(
        i for i in (tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256))
        if i is not None)
    self._anchor_id, self._anchor_text = _find_anchor(
        tokenizer, self._byte_ids)
    self._cleanup = tokenizer.clean_up_tokenization_spaces
    self.reset()

  def reset(self) -> None:
    """Starts a new stream."""
    self._pending: list[int] = []
    self._started = False  # Whether any text has been released.
    self._held = ""  # Raw text held back by the clean-up filter.

  def _ends_in_byte_run(self) -> bool:
    """Whether the last token that decodes is a byte-fallback token.

    `tokenizers`' ByteFallback decoder turns a whole run of byte tokens into
    U+FFFD if the run is not valid UTF-8, so the run's text is final only
    once a token of another kind ends it.
    """
    for i in reversed(self._pending):
      if self.skip_special_tokens and i in self.tokenizer.special_ids:
        continue  # Skipped tokens vanish before the decoder: runs join.
      return i in self._byte_ids
    return False

  def _decode_pending(self) -> str:
    decode = lambda ids: self.tokenizer.decode_raw(  # pylint: disable=g-long-lambda
        ids, skip_special_tokens=self.skip_special_tokens)
    if not self._started or self._anchor_id is None:
      return decode(self._pending)
    text = decode([self._anchor_id, *self._pending])
    if text.startswith(self._anchor_text):
      return text[len(self._anchor_text):]
    return decode(self._pending)  # Unusual decoder: best effort.

  def _release(self, raw: str, final: bool) -> str:
    """Passes released raw text through the clean-up filter."""
    if not self._cleanup:
      return raw
    held = self._held + raw
    if final:
      self._held = ""
      return clean_up_tokenization(held)
    cut = len(held)
    while cut > 0 and held[cut - 1] in _CLEANUP_CHARS:
      cut -= 1
    self._held = held[cut:]
    return clean_up_tokenization(held[:cut])

  def push(self, token_id: int) -> str:
    """Adds one token id; returns the newly completed text (maybe '').

    Raises:
      ValueError: If the id is outside the vocabulary.
    """
    if not isinstance(token_id, int):
      try:
        token_id = int(token_id)  # numpy / JAX scalars
      except TypeError as e:
        raise TypeError(
            f"push expects one integer token id, got {type(token_id).__name__}"
        ) from e
    if not 0 <= token_id < self.tokenizer.vocab_size:
      raise ValueError(
          f"Token id {token_id} is outside the vocabulary "
          f"[0, {self.tokenizer.vocab_size})."
      )
    # A duplicate vocabulary entry decodes as the id it duplicates (and so
    # counts as a byte token when that one is).
    self._pending.append(self.tokenizer.id_aliases.get(token_id, token_id))
    if self._ends_in_byte_run():
      return ""
    text = self._decode_pending()
    if not text and self._started:
      self._pending.clear()  # Mid-stream tokens with no text (e.g. skipped).
      return ""
    if not text or text.endswith(_REPLACEMENT):
      return ""  # Nothing yet, or an incomplete character: wait.
    self._pending.clear()
    self._started = True
    return self._release(text, final=False)

  def flush(self) -> str:
    """Returns all remaining text (incomplete characters as U+FFFD)."""
    text = self._decode_pending() if self._pending else ""
    if text:
      self._started = True
    self._pending.clear()
    return self._release(text, final=True)
