"""`ChatSession`: multi-turn chat that keeps the KV cache between turns.

Each turn renders the conversation with the tokenizer's chat template. When
the text the cache already holds is a prefix of the rendering (templates
that only append, like ChatML and Gemma's turn format), only the rest is
encoded and prefilled; otherwise (a template that rewrites earlier turns, a
reply cut by a stop string) the session starts over and reads the whole
conversation, counted in ``rereads``::

    chat = ChatSession(model, tokenizer)
    for event in chat.send("Name a prime number."):
      print(event.text, end="")
    print(chat.reply("And another one?"))
    chat.messages  # [{"role": "user", ...}, {"role": "assistant", ...}, ...]

Replies stop at the model's stop tokens (EOS, end of turn) by default; the
stop token stays in the cache (it ends the turn in the template too) but not
in the reply text.
"""

from __future__ import annotations

import threading
from typing import Any

from penzai_lm.generation import text as text_lib
from penzai_lm.generation.results import GenerationResult
from penzai_lm.generation.session import Session
from penzai_lm.generation.stream import GenerationStream


class ChatSession:
  """A chat with one model; see the module docstring.

  Attributes:
    session: The token-level `Session` holding the cache.
    tokenizer: The model's tokenizer (with a chat template).
    messages: The conversation (``{"role", "content"}`` dicts); a reply
      joins it once it has finished (or was closed).
    rereads: Turns that had to re-read the whole conversation.
    last_prefill_tokens: Tokens the latest turn prefilled.
  """

  def __init__(self, model, tokenizer, *, system: str | None = None,
               min_cache_len: int = 512, engine=None):
    """Starts an empty chat.

    Args:
      model: The uncached `TransformerLM`.
      tokenizer: Its `penzai_lm.tokenizer.Tokenizer`.
      system: Optional system message that opens the conversation.
      min_cache_len: Initial cache size (see `Session`): a few turns fit
        before the cache grows, and each growth compiles new programs.
      engine: The `Engine` to run on (default: `default_engine()`).
    """
    text_lib.check_vocabularies(model, tokenizer)
    self.session = Session(model, min_cache_len=min_cache_len, engine=engine)
    self.tokenizer = tokenizer
    self.system = system
    self._messages: list[dict[str, Any]] = []
    self.rereads = 0
    self.last_prefill_tokens = 0
    self._text = ""  # The text the session's tokens spell.
    self._stream: GenerationStream | None = None  # The latest turn.
    self._open = False  # Whether its reply is not in `messages` yet.
    self.reset()

  def send(self, content: str, *, stop_strings: Any = None,
           chunk_size: int = text_lib.DEFAULT_TEXT_CHUNK_SIZE,
           cancel: threading.Event | None = None,
           **settings) -> GenerationStream:
    """Adds a user message and streams the reply (events with ``text``).

    The reply joins ``messages`` when the stream ends (or is closed, or the
    next turn starts).

    Args:
      content: The user's message.
      stop_strings: Text that ends the reply (removed from it).
      chunk_size: Decode steps per compiled call.
      cancel: ``threading.Event`` that stops the reply when set.
      **settings: Sampling keywords of `penzai_lm.generation.generate`.
    """
    if not isinstance(content, str):
      raise TypeError(f"content must be a str, got {type(content).__name__}.")
    self._finish_reply()
    text_lib.stop_string_rows(stop_strings, 1, 1)  # Checked before anything.
    messages = self._messages + [{"role": "user", "content": content}]
    ids, rendered = self._new_tokens(messages)
    if settings.get("stop_tokens") is None:
      settings["default_stop_tokens"] = text_lib.default_stop_tokens(
          self.session.model, self.tokenizer)
    self._stream = self.session.stream(
        ids, chunk_size=chunk_size, cancel=cancel,
        text=lambda request: text_lib.TextView.for_request(
            self.tokenizer, request, stop_strings), **settings)
    self._messages, self._text = messages, rendered
    self.last_prefill_tokens = self._stream.run.request.row_prompt_lengths[0]
    self._open = True
    return self._stream

  def reply(self, content: str, **kwargs) -> str:
    """Adds a user message and returns the whole reply text."""
    return self.send(content, **kwargs).run_to_end().texts[0]

  @property
  def messages(self) -> list[dict[str, Any]]:
    """The conversation so far (a copy)."""
    if self._open and self._stream.done:
      self._finish_reply()
    return [dict(m) for m in self._messages]

  @property
  def last_result(self) -> GenerationResult | None:
    """The latest turn's `GenerationResult` (with ``texts``)."""
    return None if self._stream is None else self._stream.result

  def reset(self) -> None:
    """Starts the conversation over (only the system message is kept)."""
    self._finish_reply()
    self.session.reset()
    self._text = ""
    self._messages = ([{"role": "system", "content": self.system}]
                     if self.system is not None else [])

  # Internals.

  def _new_tokens(self, messages) -> tuple[list[int], str]:
    """Tokens to append for ``messages`` (resetting the session if the
    cache does not hold a prefix of them), and their rendered text."""
    rendered = self.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True)
    if self.session.tokens and rendered.startswith(self._text):
      ids = self.tokenizer.encode(rendered[len(self._text):], add_bos=False)
      return ids, rendered
    if self.session.tokens:
      self.rereads += 1
      self.session.reset()
    return self.tokenizer.encode_chat(messages), rendered

  def _finish_reply(self) -> None:
    """Adds the latest reply to the conversation (ending it if running)."""
    if not self._open:
      return
    self._open = False
    self._stream.close()
    result = self._stream.result
    self._messages.append({"role": "assistant", "content": result.texts[0]})
    self._text += self.tokenizer.decode(
        result.tokens[0], skip_special_tokens=False)
