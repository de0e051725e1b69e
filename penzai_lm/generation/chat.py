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

Threads: a chat runs one turn at a time, like `Session`: ``reply`` and
``reset`` from several threads are serialised; ``send`` waits for another
thread's ``reply`` but raises `SessionBusyError` while another thread's
reply is streaming.
"""

from __future__ import annotations

import threading
from typing import Any

from penzai_lm.generation import text as text_lib
from penzai_lm.generation.results import GenerationResult
from penzai_lm.generation.session import Session
from penzai_lm.generation.stream import GenerationStream
from penzai_lm.generation.stream import result_with_text
from penzai_lm.generation.turns import TurnGate


class ChatSession:
  """A chat with one model; see the module docstring.

  Thread-safe: one turn at a time. ``reply`` and ``reset`` wait for the
  running turn (another thread's ``reply``, or its ``send`` stream until
  that is done or closed), so N threads calling ``reply`` add N complete
  exchanges (user message, then its reply) in some order. ``send`` waits
  for another thread's ``reply`` but raises `SessionBusyError` while
  another thread's stream is open. A call from the thread that opened the
  open stream ends it first. Use the chat's ``session`` only through the
  chat.

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
    self._gate = TurnGate("this ChatSession")
    # The latest turn: its run, text view and turn. Not its stream, so a
    # stream dropped unfinished is collected (ending its turn).
    self._run = self._view = self._turn = None
    self._open = False  # Whether its reply is not in `messages` yet.
    self.reset()

  def send(self, content: str, *, stop_strings: Any = None,
           chunk_size: int = text_lib.DEFAULT_TEXT_CHUNK_SIZE,
           cancel: threading.Event | None = None,
           **settings) -> GenerationStream:
    """Adds a user message and streams the reply (events with ``text``).

    The reply joins ``messages`` when the stream is done (iterated to the
    end, closed or garbage-collected), or the next turn starts.

    Args:
      content: The user's message.
      stop_strings: Text that ends the reply (removed from it).
      chunk_size: Decode steps per compiled call.
      cancel: ``threading.Event`` that stops the reply when set.
      **settings: Sampling keywords of `penzai_lm.generation.generate`.

    Raises:
      SessionBusyError: if another thread's reply is streaming.
    """
    return self._send("stream", content, stop_strings, chunk_size, cancel,
                      settings)

  def reply(self, content: str, *, stop_strings: Any = None,
            chunk_size: int = text_lib.DEFAULT_TEXT_CHUNK_SIZE,
            cancel: threading.Event | None = None, **settings) -> str:
    """Adds a user message and returns the whole reply text.

    Waits for a turn running in another thread (see the class docstring).
    """
    stream = self._send("call", content, stop_strings, chunk_size, cancel,
                        settings)
    try:
      return stream.run_to_end().texts[0]
    finally:
      stream.close()  # Ends the turn even if interrupted.

  @property
  def messages(self) -> list[dict[str, Any]]:
    """The conversation so far (a copy)."""
    with self._gate.lock:
      if self._open and not self._gate.active(self._turn):
        self._finish_reply()
      return [dict(m) for m in self._messages]

  @property
  def last_result(self) -> GenerationResult | None:
    """The latest turn's `GenerationResult` (with ``texts``)."""
    with self._gate.lock:
      if self._run is None:
        return None
      # Held-back text is flushed only once the turn is over: until then
      # the stream's own thread may still be pushing text.
      over = not self._gate.active(self._turn)
      return result_with_text(self._run, self._view,
                              finished=over and self._run.finished)

  def reset(self) -> None:
    """Starts the conversation over (only the system message is kept).

    Waits for a turn running in another thread, like `reply`.
    """
    turn = self._gate.begin("call")
    try:
      with self._gate.lock:
        self._finish_reply()
        self.session.reset()
        self._text = ""
        self._messages = ([{"role": "system", "content": self.system}]
                         if self.system is not None else [])
    finally:
      self._gate.end(turn)

  # Internals.

  def _send(self, kind, content, stop_strings, chunk_size, cancel,
            settings) -> GenerationStream:
    """Starts a turn of ``kind`` ("stream" or "call"; see `TurnGate`)."""
    if not isinstance(content, str):
      raise TypeError(f"content must be a str, got {type(content).__name__}.")
    text_lib.stop_string_rows(stop_strings, 1, 1)  # Checked before anything.
    turn = self._gate.begin(kind)
    try:
      with self._gate.lock:
        self._finish_reply()
        messages = self._messages + [{"role": "user", "content": content}]
        ids, rendered = self._new_tokens(messages)
        settings = text_lib.text_options(self.session.model, self.tokenizer,
                                         settings)
        stream = self.session.stream(
            ids, chunk_size=chunk_size, cancel=cancel,
            text=lambda request: text_lib.TextView.for_request(
                self.tokenizer, request, stop_strings), **settings)
        self._messages, self._text = messages, rendered
        self._run, self._view, self._turn = stream.run, stream.text, turn
        self.last_prefill_tokens = stream.run.request.row_prompt_lengths[0]
        self._open = True
    except BaseException:
      self._gate.end(turn)
      raise
    self._gate.attach(turn, stream)
    return stream

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
    """Adds the latest reply to the conversation. Holds the lock; its turn
    is over (its stream done)."""
    if not self._open:
      return
    self._open = False
    if not self._run.finished:
      self._run.cancel()
    result = result_with_text(self._run, self._view, finished=True)
    self._messages.append({"role": "assistant", "content": result.texts[0]})
    self._text += self.tokenizer.decode(
        result.tokens[0], skip_special_tokens=False)
