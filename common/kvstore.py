"""The cloud's KV block store: canonical KV blocks by ``common.kvblocks.store_key``.

Who uses it: the gateway puts the edge's verified head blocks; the tail-prefill
engine's connector (in a vLLM worker process) puts tail blocks; the decode and
tail engines' connectors get blocks. Writers and readers live in different
processes, so the production store is on disk (``diskcache``: SQLite index,
atomic writes, bounded by ``size_limit_bytes`` with least-recently-used
eviction). A miss is normal (never written, or evicted): callers fall back to
recomputing, never to wrong data.

Values are opaque bytes; their length is checked by the reader against the part's shape.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path
from typing import Protocol

from tandem.common.security import private_dir


class BlockStore(Protocol):
    """Calling contract: ``put`` is atomic (a reader sees all of a value or none);
    ``get`` returns None for a missing key; keys are ``store_key`` strings."""

    def put(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def contains(self, key: str) -> bool: ...


class DiskBlockStore:
    """Process-safe bounded store in a directory (``diskcache.Cache``)."""

    def __init__(self, directory: Path | str, size_limit_bytes: int) -> None:
        import diskcache

        self.directory = private_dir(Path(directory))  # mode 0700, owned by this user
        self.size_limit_bytes = size_limit_bytes
        self._cache = diskcache.Cache(
            str(self.directory),
            size_limit=size_limit_bytes,
            eviction_policy="least-recently-used",
            statistics=False,
            sqlite_synchronous=1,  # NORMAL: safe across processes, no fsync per put
        )

    def put(self, key: str, value: bytes) -> None:
        self._cache.set(key, value)

    def get(self, key: str) -> bytes | None:
        v = self._cache.get(key)
        return None if v is None else bytes(v)

    def contains(self, key: str) -> bool:
        return key in self._cache

    def volume_bytes(self) -> int:
        return int(self._cache.volume())

    def close(self) -> None:
        self._cache.close()


class MemoryBlockStore:
    """In-process LRU store bounded by bytes: for unit tests and single-process use."""

    def __init__(self, size_limit_bytes: int) -> None:
        self.size_limit_bytes = size_limit_bytes
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, key: str, value: bytes) -> None:
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._data[key] = value
            self._bytes += len(value)
            while self._bytes > self.size_limit_bytes and self._data:
                _, v = self._data.popitem(last=False)
                self._bytes -= len(v)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            v = self._data.get(key)
            if v is not None:
                self._data.move_to_end(key)
            return v

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._data
