"""One bounded least-recently-used table with idle expiry, for the session tables of edge and cloud.

Bounded by entry count and by bytes (``entry_bytes`` of each entry), and by time: an entry
unused for ``idle_s`` seconds expires. Eviction drops from the least recently used end; neither
eviction nor expiry ever drops an entry that is busy (``busy``: by default, a turn holds its
lock). Every entry the table drops by itself is reported to ``on_drop`` with the reason
(``"evicted"`` or ``"expired"``); ``discard`` (the owner's own removal) reports nothing.
``clock`` is the time source (``time.monotonic``; tests pass a fake one). Single event loop; no
locking of its own.
"""

from __future__ import annotations

import asyncio
import math
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Generic, Protocol, TypeVar

EVICTED, EXPIRED = "evicted", "expired"


class Lockable(Protocol):
    lock: asyncio.Lock


V = TypeVar("V", bound=Lockable)
DropHook = Callable[[str, V, str], None]


class BoundedLRU(ABC, Generic[V]):
    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        idle_s: float = math.inf,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries, self.max_bytes, self.idle_s, self.clock = max_entries, max_bytes, idle_s, clock
        self._s: OrderedDict[str, V] = OrderedDict()
        self._used: dict[str, float] = {}  # key -> clock() at its last use
        self.on_drop: DropHook | None = None  # (key, value, reason) of every entry dropped by the table itself

    @abstractmethod
    def entry_bytes(self, key: str, value: V) -> int:
        """Bytes one entry holds (each table counts what it keeps)."""

    def busy(self, key: str, value: V) -> bool:
        """Whether ``key`` is in use now, so never evicted or expired: its lock is held."""
        return value.lock.locked()

    def peek(self, key: str) -> V | None:
        """The entry, marked most recently used; None if absent or (idle and expired: dropped now)."""
        v = self._s.get(key)
        if v is None:
            return None
        if self._idle_past(key, v, self.clock()):
            self._drop(key, EXPIRED)
            return None
        self._touch(key)
        return v

    def lookup(self, key: str) -> V | None:
        """The entry if present, not marked as used (and not expired by this look)."""
        return self._s.get(key)

    def put(self, key: str, value: V) -> None:
        """Insert or refresh an entry as the most recently used."""
        self._s[key] = value
        self._touch(key)

    def nbytes(self) -> int:
        return sum(self.entry_bytes(k, v) for k, v in self._s.items())

    def expire(self) -> list[str]:
        """Drop the entries unused for more than ``idle_s`` that are not busy; returns their keys."""
        if math.isinf(self.idle_s):
            return []
        now = self.clock()
        stale = [k for k, v in self._s.items() if self._idle_past(k, v, now)]
        for key in stale:
            self._drop(key, EXPIRED)
        return stale

    def evict(self) -> list[str]:
        """Expire idle entries, then drop least-recently-used entries that are not busy until within
        bounds; returns every key dropped. Stops when only busy entries remain."""
        dropped = self.expire()
        while len(self._s) > self.max_entries or self.nbytes() > self.max_bytes:
            victim = self.evict_one()
            if victim is None:
                break
            dropped.append(victim)
        return dropped

    def evict_one(self, among: Collection[str] | None = None) -> str | None:
        """Drop the least recently used entry that is not busy (only of the keys ``among``, when
        given); returns its key, or None when every candidate is busy."""
        victim = next(
            (k for k, v in self._s.items() if (among is None or k in among) and not self.busy(k, v)),
            None,
        )
        if victim is not None:
            self._drop(victim, EVICTED)
        return victim

    def discard(self, key: str) -> V | None:
        """Remove ``key`` (the owner's decision: not reported to ``on_drop``); returns its entry."""
        self._used.pop(key, None)
        return self._s.pop(key, None)

    def clear(self) -> None:
        self._s.clear()
        self._used.clear()

    def keys(self) -> list[str]:
        """The keys, least recently used first (not marked as used)."""
        return list(self._s)

    def idle_s_of(self, key: str) -> float:
        """Seconds since ``key`` was last used (inf when absent)."""
        t = self._used.get(key)
        return math.inf if t is None else self.clock() - t

    def __len__(self) -> int:
        return len(self._s)

    def __contains__(self, key: object) -> bool:
        return key in self._s

    def _touch(self, key: str) -> None:
        self._s.move_to_end(key)
        self._used[key] = self.clock()

    def _idle_past(self, key: str, value: V, now: float) -> bool:
        return now - self._used.get(key, now) > self.idle_s and not self.busy(key, value)

    def _drop(self, key: str, reason: str) -> None:
        value = self._s.pop(key)
        self._used.pop(key, None)
        self.dropped(key, value, reason)

    def dropped(self, key: str, value: V, reason: str) -> None:
        """Called for every entry the table drops by itself (``reason``: ``"evicted"`` or
        ``"expired"``); reports it to ``on_drop``. A subclass may extend it."""
        if self.on_drop is not None:
            self.on_drop(key, value, reason)


class RememberingLRU(BoundedLRU[V]):
    """A ``BoundedLRU`` that remembers the keys of the last ``4 * max_entries`` entries it dropped by
    itself (evicted or expired; not those ``discard``ed by the owner), so that the next use of one
    can be told its entry expired (``expired``): the edge's session tables, whose client then hears
    ``session_expired``."""

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        idle_s: float = math.inf,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(max_entries, max_bytes, idle_s, clock)
        self._expired: OrderedDict[str, None] = OrderedDict()

    def dropped(self, key: str, value: V, reason: str) -> None:
        self._expired[key] = None
        self._expired.move_to_end(key)
        while len(self._expired) > 4 * self.max_entries:
            self._expired.popitem(last=False)
        super().dropped(key, value, reason)

    def discard(self, key: str) -> V | None:
        self._expired.pop(key, None)  # the owner ended it: a later entry of that key is new, not expired
        return super().discard(key)

    def expired(self, key: str) -> bool:
        """True once for a key this table dropped by itself and has not held since (its next use
        starts it again), an entry idle past ``idle_s`` that no sweep dropped yet among them (dropped
        now); False for "" (no entry: stateless)."""
        if not key:
            return False
        v = self._s.get(key)
        if v is not None and self._idle_past(key, v, self.clock()):
            self._drop(key, EXPIRED)
        if key in self._s:
            return False
        return self._expired.pop(key, 0) is None
