"""`TurnGate`: one turn at a time on a `Session` or `ChatSession`.

A session's conversation is one sequence: a turn reads the state the
previous turn left and leaves the next one's, so two turns cannot overlap.
A turn is either a call (``generate``, ``reply``, ``reset``), which ends
when the call returns, or a stream (``stream``, ``send``), which ends when
the stream is done: iterated to the end, closed, or garbage-collected.

Who waits and who is refused:

* A call waits until the current turn (another thread's call or stream)
  ends: calls from several threads are serialised.
* A stream waits for another thread's call (which ends by itself), but is
  refused with `SessionBusyError` while another thread's stream is open,
  since that ends only when its consumer finishes or closes it.
* A new call or stream from the thread that opened the open stream ends
  that stream first (its rows finish with ``"cancelled"``; a chunk in
  flight in another thread completes first), as in single-threaded use.
* A call from inside the session's own turn in the same thread (e.g. a
  tool's ``respond`` calling back into the session) is refused; it would
  wait for itself forever.

``gate.lock`` (reentrant) guards the session's own fields; it is never
held while a stream is closed, so a stream's done callbacks (which take it)
cannot deadlock with the thread closing it.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any


class SessionBusyError(RuntimeError):
  """A session was asked for a turn it cannot start now."""


@dataclasses.dataclass(eq=False)
class Turn:
  """One turn.

  Attributes:
    kind: "call" or "stream".
    thread: Ident of the thread that began it.
    stream: Weak reference to its stream, once attached.
  """

  kind: str
  thread: int
  stream: Any = None

  def open_stream(self):
    """The turn's stream if it is still alive, else None."""
    return None if self.stream is None else self.stream()


class TurnGate:
  """Lets one turn at a time through; see the module docstring.

  Attributes:
    owner: How messages name the session (e.g. "this Session").
    lock: Reentrant lock for the session's fields.
  """

  def __init__(self, owner: str):
    self.owner = owner
    self.lock = threading.RLock()
    self._free = threading.Condition(self.lock)
    self._turn: Turn | None = None

  def begin(self, kind: str) -> Turn:
    """Starts a turn of ``kind`` ("call" or "stream"), waiting, ending the
    caller's own open stream, or refusing as the module docstring says.

    Raises:
      SessionBusyError: for a stream while another thread's stream is open,
        or a call from inside the same thread's running call.
    """
    me = threading.get_ident()
    while True:
      with self.lock:
        turn = self._turn
        if turn is None:
          self._turn = Turn(kind, me)
          return self._turn
        if turn.thread == me and turn.kind == "call":
          raise SessionBusyError(
              f"{self.owner} was called from inside its own running turn"
              " (e.g. from a tool's respond()); a turn cannot start before"
              " the previous one has ended.")
        if turn.thread != me:
          if kind == "stream" and turn.kind == "stream":
            raise SessionBusyError(
                f"{self.owner} already has a reply streaming to another"
                " thread; a second stream is refused rather than queued"
                " behind a stream that only ends when its reader finishes or"
                " closes it. Wait for it to finish, close it, or use"
                " generate()/reply(), which wait their turn.")
          self._free.wait()
          continue
      # The caller's own open stream: end it outside the lock (its done
      # callbacks take the lock), then try again.
      stream = turn.open_stream()
      if stream is not None:
        stream.close()
      self.end(turn)

  def attach(self, turn: Turn, stream) -> None:
    """Ties a stream turn to ``stream``: the turn ends when it is done.

    Only a weak reference is kept, so an abandoned stream is collected
    (and its turn ended) like any other object.
    """
    turn.stream = weakref.ref(stream)
    stream.add_done_callback(lambda: self.end(turn))

  def end(self, turn: Turn) -> None:
    """Ends ``turn`` if it is the current one (idempotent)."""
    with self.lock:
      if self._turn is turn:
        self._turn = None
        self._free.notify_all()

  def active(self, turn: Turn | None) -> bool:
    """Whether ``turn`` is the current turn."""
    with self.lock:
      return turn is not None and self._turn is turn
