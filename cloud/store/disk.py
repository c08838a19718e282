"""The block store of one cloud node (``DiskBlockStore``): a directory (``diskcache``: SQLite index,
atomic writes, bounded by ``size_limit_bytes`` with least-recently-used eviction), pins as leases in
a ``tandem_pins`` table of the same database that the eviction policy skips. The contract, seals and
pins are described in ``tandem.cloud.store.blocks``."""

from __future__ import annotations

import io
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from tandem.cloud.store.blocks import DISK_POLICY, SealedStore
from tandem.common.runtime.security import private_dir


def _register_disk_policy() -> None:
    """diskcache's least-recently-used eviction, less the keys with a live pin: the cull query of
    ``diskcache.core.EVICTION_POLICY["least-recently-used"]`` (diskcache 5.6) with a filter on the
    ``tandem_pins`` table that ``DiskBlockStore`` keeps in the same SQLite database."""
    from diskcache.core import EVICTION_POLICY

    lru = EVICTION_POLICY["least-recently-used"]
    EVICTION_POLICY.setdefault(
        DISK_POLICY,
        {
            "init": lru["init"],
            "get": lru["get"],
            "cull": "SELECT {fields} FROM Cache WHERE key NOT IN "
            "(SELECT key FROM tandem_pins WHERE deadline > {now}) ORDER BY access_time LIMIT ?",
        },
    )


class DiskBlockStore(SealedStore):
    """Process-safe bounded store in a directory (``diskcache.Cache``). Pins are rows of a
    ``tandem_pins`` table in the cache's own SQLite database (shared by every process that opens
    the directory), which the eviction policy ``DISK_POLICY`` skips while their lease lasts."""

    def __init__(self, directory: Path | str, size_limit_bytes: int) -> None:
        import diskcache

        self.directory = private_dir(Path(directory))  # mode 0700, owned by this user
        self.size_limit_bytes = size_limit_bytes
        _register_disk_policy()
        # the pins table must exist before the policy's first cull, and be made after diskcache set
        # the database up (its auto_vacuum, which gives culled pages back, only applies to a new file)
        self._cache = diskcache.Cache(
            str(self.directory),
            size_limit=size_limit_bytes,
            eviction_policy="least-recently-used",
            statistics=False,
            sqlite_synchronous=1,  # NORMAL: safe across processes, no fsync per put
        )
        self._pins_db = sqlite3.connect(
            self.directory / "cache.db", timeout=60, isolation_level=None, check_same_thread=False
        )
        self._pins_lock = threading.Lock()
        with self._pins_lock:
            self._pins_db.execute("PRAGMA synchronous=NORMAL")  # pins need no fsync: leases, rebuilt by use
            self._pins_db.execute(
                "CREATE TABLE IF NOT EXISTS tandem_pins "
                "(key TEXT NOT NULL, owner TEXT NOT NULL, deadline REAL NOT NULL, PRIMARY KEY (key, owner))"
            )
        self._cache.reset("eviction_policy", DISK_POLICY)

    def pin(self, keys: Iterable[str], owner: str, lease_s: float) -> None:
        now = time.time()
        rows = [(k, owner, now + lease_s) for k in keys]
        with self._pins_lock:
            self._pins_db.execute("BEGIN IMMEDIATE")
            try:
                self._pins_db.execute("DELETE FROM tandem_pins WHERE deadline <= ?", (now,))  # lapsed leases
                self._pins_db.executemany("INSERT OR REPLACE INTO tandem_pins VALUES (?, ?, ?)", rows)
                self._pins_db.execute("COMMIT")
            except BaseException:
                self._pins_db.execute("ROLLBACK")
                raise

    def unpin(self, keys: Iterable[str], owner: str) -> None:
        rows = [(k, owner) for k in keys]
        with self._pins_lock:
            self._pins_db.execute("BEGIN IMMEDIATE")  # one transaction, not one per key
            try:
                self._pins_db.executemany("DELETE FROM tandem_pins WHERE key = ? AND owner = ?", rows)
                self._pins_db.execute("COMMIT")
            except BaseException:
                self._pins_db.execute("ROLLBACK")
                raise

    def _set(self, key: str, raw: bytes) -> None:
        if len(raw) < self._cache.disk_min_file_size:  # small values live in SQLite itself
            self._cache.set(key, raw)
        else:
            # as a file-like value: diskcache then writes it in 4 MiB chunks. Given bytes, it writes
            # ``io.BytesIO(value)`` line by line (diskcache 5.6 ``Disk.store``), a write per 0x0A byte:
            # about 2,000 writes for 640 KB of KV, 3.5x the time of one chunked write.
            self._cache.set(key, io.BytesIO(raw), read=True)

    def _get(self, key: str) -> bytes | None:
        v = self._cache.get(key)
        return None if v is None else bytes(v)

    def _has(self, key: str) -> bool:
        return key in self._cache

    def _del(self, key: str) -> None:
        self._cache.delete(key)

    def volume_bytes(self) -> int:
        return int(self._cache.volume())

    def close(self) -> None:
        self._cache.close()
        with self._pins_lock:
            self._pins_db.close()
