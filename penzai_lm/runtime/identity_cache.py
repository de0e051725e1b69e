"""`IdentityCache`: values derived from models, keyed by their weights.

Values derived from a model (its unstacked or prepared form) are keyed on
the model's structure and the identity of its weights, so a re-bound
parameter is a new key, while a patched variant of a cached model (other
steering values, same weights) reuses its value with the patch's arrays
replaced (`penzai_lm.runtime.derived`). Entries hold weak references to the
model's leaves, and the values made hold other array objects over the same
buffers (`derived.alias_weights`): when the user drops the model, its
entries are dropped at once, so the cache never keeps an old model's
memory.

It is thread-safe: a lock guards the LRU, and concurrent misses of one key
wait for the first thread's value instead of each making their own (a
prepared model holds a copy of the weights).
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Callable

import jax
from penzai import pz

from penzai_lm.runtime.derived import Derivable
from penzai_lm.runtime.derived import variant_key
from penzai_lm.runtime.program_cache import InFlight


def model_key(model) -> tuple[Any, list]:
  """A hashable key identifying a model's structure and current arrays.

  Variables (parameters, state) are pytree leaves: their identity and the
  identity of their current value are part of the key, so assigning a new
  value to a parameter gives a new key. Returns ``(key, leaves)``; keep the
  leaves alive as long as the key is used (ids are only unique then).
  """
  leaves, treedef = jax.tree_util.tree_flatten(model)
  ids = tuple((id(x), id(x.value)) if isinstance(x, pz.AbstractVariable)
              else id(x) for x in leaves)
  return (treedef, ids), leaves


class _Entry:
  """A cached `Derivable` and, weakly, the model leaves it was made (or
  last derived) for; ``values`` index the non-weight arrays among them."""

  def __init__(self, made: Derivable, leaves, values, on_dead=None):
    self.made, self.values = made, frozenset(values)
    self.refs = _refs(leaves, self.values, on_dead)

  def alive(self, leaves=None) -> bool:
    """Whether its weights (every leaf but the values) are alive (and,
    given ``leaves``, those very objects)."""
    for i, ref in enumerate(self.refs):
      if i not in self.values and (
          ref() is None if leaves is None else ref() is not leaves[i]):
        return False
    return True

  def changed(self, leaves) -> dict[int, Any]:
    """The values of ``leaves`` that are not those of the entry."""
    return {i: leaves[i] for i in self.values
            if self.refs[i]() is not leaves[i]}


class IdentityCache:
  """Values derived from models, LRU-bounded, keyed by
  `derived.variant_key`: a model's structure and the identity of its
  weights. A model that differs from a cached one in other arrays only (a
  patched variant: another steering vector or strength) gets the cached
  value with those arrays' parts recomputed, where the value was made as a
  `derived.Derivable` with recipes; otherwise it is made anew."""

  def __init__(self, size: int):
    self.size = size
    self._entries: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()
    self._making = InFlight()
    self.made = 0  # Values made (not found or derived): tests count these.
    self.derived = 0  # Values derived for a variant.

  def get_or_make(self, model, extra: Any, make: Callable[[], Any]) -> Any:
    """The cached value for ``(model, extra)``, made with ``make()`` on a
    miss (which may return a `derived.Derivable`)."""
    return self.get(model, extra, make).value

  def get(self, model, extra: Any, make: Callable[[], Any] | None
          ) -> Derivable | None:
    """Like `get_or_make`, but returns the `derived.Derivable`; with
    ``make`` None, None where it would be made."""
    key, leaves, values = variant_key(model)
    key = (key, extra)
    while True:
      with self._lock:
        entry = self._entries.get(key)
        if entry is not None and entry.alive(leaves):
          self._entries.move_to_end(key)
          changed = entry.changed(leaves)
          if not changed:
            return entry.made
          if entry.made.recipes is not None:
            break  # Derived below, outside the lock.
        if make is None and not self._making.busy(key):
          return None
        event = self._making.claim(key)
        entry = None
      if event is None:
        break  # This thread makes it.
      event.wait()
    if entry is not None:
      made = entry.made.derive(changed)
      with self._lock:
        self.derived += 1
        self._store(key, _Entry(made, leaves, values, self._drop_dead))
      return made
    try:
      made = make()
      if not isinstance(made, Derivable):
        made = Derivable(made)
      with self._lock:
        self.made += 1
        self._store(key, _Entry(made, leaves, values, self._drop_dead))
    finally:
      with self._lock:
        self._making.release(key)
    return made

  def _store(self, key, entry: _Entry) -> None:
    """Under the lock."""
    self._drop_dead_locked()
    self._entries[key] = entry
    self._entries.move_to_end(key)
    while len(self._entries) > self.size:
      self._entries.popitem(last=False)

  def _drop_dead(self) -> None:
    """A weight of an entry was freed (a weak reference's callback, on any
    thread, maybe inside this cache's own code): drops the dead entries
    now, so their values (the prepared weights) go with the model, unless
    the lock is held (the next `_store` drops them)."""
    if self._lock.acquire(blocking=False):
      try:
        self._drop_dead_locked()
      finally:
        self._lock.release()

  def _drop_dead_locked(self) -> None:
    for k in [k for k, e in self._entries.items() if not e.alive()]:
      del self._entries[k]

  def __len__(self) -> int:
    with self._lock:
      return len(self._entries)

  def clear(self) -> None:
    with self._lock:
      self._entries.clear()


def _refs(leaves, values=frozenset(), on_dead=None):
  """Weak references to ``leaves``; ``on_dead()`` runs when a weight (a
  leaf not in ``values``) goes."""
  refs = []
  for i, x in enumerate(leaves):
    callback = None if on_dead is None or i in values else (
        lambda _, on_dead=on_dead: on_dead())
    try:
      refs.append(weakref.ref(x, callback))
    except TypeError:
      refs.append(lambda x=x: x)
  return refs

