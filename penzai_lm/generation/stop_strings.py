"""Stop strings: text that ends a row, matched as the text arrives.

`StopStringMatcher` finds the earliest stop string in text arriving piece by
piece and holds back a piece while it could still be the start of one, so
nothing that is later removed is ever released. `stop_string_rows` checks
the ``stop_strings`` option and expands it to one list per row.
"""

from __future__ import annotations

from collections.abc import Sequence

from penzai_lm.generation.row_options import expand_rows


class StopStringMatcher:
  """Finds the earliest stop string in text arriving piece by piece.

  ``push(piece)`` returns ``(safe_text, match)``: text that can be released
  (it cannot be part of a stop string any more) and the matched stop string
  or None. After a match, ``match_end`` is the end of the match in the whole
  text (counted from the start of the stream).
  """

  def __init__(self, stop_strings: Sequence[str]):
    self.stop_strings = [s for s in stop_strings if s]
    self._held = ""
    self._released = 0  # Characters released so far.
    self.match_end: int | None = None

  def push(self, piece: str) -> tuple[str, str | None]:
    text = self._held + piece
    if not self.stop_strings:
      self._released += len(text)
      self._held = ""
      return text, None
    best = None
    for s in self.stop_strings:
      i = text.find(s)
      if i >= 0 and (best is None or i < best[0]
                     or (i == best[0] and len(s) > len(best[1]))):
        best = (i, s)
    if best is not None:
      i, s = best
      self.match_end = self._released + i + len(s)
      self._released += i
      self._held = ""
      return text[:i], s
    hold = 0
    for s in self.stop_strings:
      for k in range(min(len(s) - 1, len(text)), 0, -1):
        if text.endswith(s[:k]):
          hold = max(hold, k)
          break
    safe = text[:len(text) - hold]
    self._held = text[len(text) - hold:]
    self._released += len(safe)
    return safe, None

  def flush(self) -> str:
    """Releases the held text (the stream ended without a match)."""
    text, self._held = self._held, ""
    self._released += len(text)
    return text


def stop_string_rows(stop_strings, num_prompts: int,
                     num_samples: int) -> list[list[str]]:
  """Validates ``stop_strings`` and expands it to one list per row."""

  def is_scalar(v):
    return v is None or isinstance(v, str) or (
        isinstance(v, Sequence) and all(isinstance(x, str) for x in v))

  if stop_strings is None:
    return [[] for _ in range(num_prompts * num_samples)]
  if not isinstance(stop_strings, (str, Sequence)):
    raise ValueError(
        "stop_strings must be a string, a list of strings, or one such list"
        f" per prompt/row; got {stop_strings!r}.")
  rows = expand_rows(
      "stop_strings", stop_strings, num_prompts, num_samples, is_scalar)
  out = []
  for r, value in enumerate(rows):
    value = [] if value is None else [value] if isinstance(value, str) else (
        list(value))
    for s in value:
      if not isinstance(s, str) or not s:
        raise ValueError(
            f"stop_strings[{r}] contains {s!r}; stop strings must be"
            " non-empty strings.")
    out.append(value)
  return out
