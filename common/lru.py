"""One bounded least-recently-used table, for the session tables of edge and cloud.

Bounded by entry count and by bytes (``entry_bytes`` of each entry); eviction drops
from the least recently used end and skips entries a turn is using (its lock held).
Single event loop; no locking of its own.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Generic, Protocol, TypeVar


class Lockable(Protocol):
    lock: asyncio.Lock


V = TypeVar("V", bound=Lockable)


class BoundedLRU(ABC, Generic[V]):
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._s: OrderedDict[str, V] = OrderedDict()

    @abstractmethod
    def entry_bytes(self, key: str, value: V) -> int:
        """Bytes one entry holds (each table counts what it keeps)."""

    def peek(self, key: str) -> V | None:
        """The entry, marked most recently used; None if absent."""
        v = self._s.get(key)
        if v is not None:
            self._s.move_to_end(key)
        return v

    def put(self, key: str, value: V) -> None:
        """Insert or refresh an entry as the most recently used."""
        self._s[key] = value
        self._s.move_to_end(key)

    def nbytes(self) -> int:
        return sum(self.entry_bytes(k, v) for k, v in self._s.items())

    def evict(self) -> list[str]:
        """Drop least-recently-used idle entries until within bounds; returns the dropped keys.
        Stops when only entries in use remain."""
        dropped = []
        while len(self._s) > self.max_entries or self.nbytes() > self.max_bytes:
            victim = next((k for k, v in self._s.items() if not v.lock.locked()), None)
            if victim is None:
                break
            del self._s[victim]
            dropped.append(victim)
        return dropped

    def discard(self, key: str) -> None:
        self._s.pop(key, None)

    def clear(self) -> None:
        self._s.clear()

    def keys(self) -> list[str]:
        """The keys, least recently used first (not marked as used)."""
        return list(self._s)

    def __len__(self) -> int:
        return len(self._s)

    def __contains__(self, key: object) -> bool:
        return key in self._s
