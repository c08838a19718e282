"""The cloud's KV block store: canonical KV blocks by ``common.kvblocks.store_key``, and the
session records and activation pieces that let a restarted cloud, or another replica, serve a
session's next turn (``cloud.sessionstore``).

Who uses it: the gateway puts the edge's verified head blocks and session records; the
tail-prefill engine's connector (in a vLLM worker process) puts tail blocks; the decode and tail
engines' connectors get blocks. Writers and readers live in different processes (and, with Redis,
on different hosts). A miss is normal (never written, evicted, or failed its check): callers fall
back to recomputing or resending, never to wrong data.

Backends (one contract, tests/test_kvstore.py runs it against each):

* ``DiskBlockStore``: one node's default, a directory (``diskcache``: SQLite index, atomic
  writes, bounded by ``size_limit_bytes`` with least-recently-used eviction).
* ``RedisBlockStore``: shared by several cloud replicas (``redis://`` or ``rediss://``); bounded
  by the server's ``maxmemory`` with an LRU policy (set at connect when the server has none).
* ``MemoryBlockStore``: in-process, for unit tests and single-process use.

Integrity at rest: every value is stored sealed, ``blake3(value)[:16] || value``; ``get`` checks
the seal and answers a value that fails it (a flipped bit on disk, a torn or foreign write) as a
miss, drops it and counts it in ``corrupt_reads``. Values are opaque bytes; readers also check
their length against the part's shape.
"""

from __future__ import annotations

import logging
import os
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

import blake3

from tandem.common.errors import EngineError, InvalidRequest
from tandem.common.security import private_dir

SEAL_BYTES = 16  # BLAKE3 digest prefix of a stored value: 128 bits, far past accidental collisions
PASSWORD_ENV = "TANDEM_CLOUD_STORE_PASSWORD"  # the shared store's password, never in a URL or a log
log = logging.getLogger("tandem.store")


class BlockStore(Protocol):
    """Calling contract: ``put`` is atomic (a reader sees all of a value or none); ``get`` returns
    None for a missing key or a value that fails its seal; ``delete`` of a missing key is a no-op;
    keys are ``store_key`` strings (or ``cloud.sessionstore`` keys).

    Raises (put, delete): ``EngineError`` when a remote store cannot be reached."""

    def put(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def contains(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def touch(self, key: str) -> None: ...


def seal(value: bytes) -> bytes:
    """``blake3(value)[:16] || value``: what a backend stores."""
    return blake3.blake3(value).digest(length=SEAL_BYTES) + value


def unseal(raw: bytes) -> bytes | None:
    """The value inside a sealed ``raw``, or None when the seal does not match (corrupt)."""
    if len(raw) < SEAL_BYTES:
        return None
    value = raw[SEAL_BYTES:]
    return value if blake3.blake3(value).digest(length=SEAL_BYTES) == raw[:SEAL_BYTES] else None


class SealedStore(ABC):
    """A ``BlockStore`` over four raw primitives each backend implements (``_set``, ``_get``, ``_has``,
    ``_del``): seals on put, checks on get (see module doc)."""

    corrupt_reads = 0

    @abstractmethod
    def _set(self, key: str, raw: bytes) -> None: ...

    @abstractmethod
    def _get(self, key: str) -> bytes | None: ...

    @abstractmethod
    def _has(self, key: str) -> bool: ...

    @abstractmethod
    def _del(self, key: str) -> None: ...

    def put(self, key: str, value: bytes) -> None:
        self._set(key, seal(bytes(value)))

    def get(self, key: str) -> bytes | None:
        raw = self._get(key)
        if raw is None:
            return None
        value = unseal(bytes(raw))
        if value is None:
            self.corrupt_reads += 1
            log.warning("block store: value of %s failed its seal; dropped (the reader recomputes or resyncs)", key)
            self._del(key)
        return value

    def contains(self, key: str) -> bool:
        return self._has(key)

    def delete(self, key: str) -> None:
        self._del(key)

    def touch(self, key: str) -> None:
        """Mark ``key`` recently used (the LRU keeps it longer); a missing key is a no-op."""
        self._get(key)

    def corrupt_for_test(self, key: str, offset: int = -1) -> bool:
        """Flip one bit of the stored (sealed) value at ``offset``: how fault tests model corruption
        at rest. Returns False when the key is missing."""
        raw = self._get(key)
        if raw is None:
            return False
        b = bytearray(raw)
        b[offset] ^= 0x01
        self._set(key, bytes(b))
        return True


class DiskBlockStore(SealedStore):
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

    def _set(self, key: str, raw: bytes) -> None:
        self._cache.set(key, raw)

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


class MemoryBlockStore(SealedStore):
    """In-process LRU store bounded by bytes: for unit tests and single-process use."""

    def __init__(self, size_limit_bytes: int) -> None:
        self.size_limit_bytes = size_limit_bytes
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def _set(self, key: str, raw: bytes) -> None:
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._data[key] = raw
            self._bytes += len(raw)
            while self._bytes > self.size_limit_bytes and self._data:
                _, v = self._data.popitem(last=False)
                self._bytes -= len(v)

    def _get(self, key: str) -> bytes | None:
        with self._lock:
            v = self._data.get(key)
            if v is not None:
                self._data.move_to_end(key)
            return v

    def _has(self, key: str) -> bool:
        with self._lock:
            return key in self._data

    def _del(self, key: str) -> None:
        with self._lock:
            v = self._data.pop(key, None)
            if v is not None:
                self._bytes -= len(v)

    def volume_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def close(self) -> None:
        return None


class RedisBlockStore(SealedStore):
    """A store shared by several cloud replicas: a Redis server (``redis://host:port/db``, or
    ``rediss://`` for TLS). Keys live under ``prefix``. The byte bound is the server's
    ``maxmemory`` with ``allkeys-lru`` eviction: set at connect when the server has no bound
    (an operator's own bound and policy are kept, and a policy that does not evict is warned
    about: its writes fail once full). The password comes from ``$TANDEM_CLOUD_STORE_PASSWORD``,
    never from the URL, so it is in no config dump or log.

    Reads that fail on the network are misses (the caller recomputes); writes raise.

    Raises:
        InvalidRequest: the URL is not ``redis://`` / ``rediss://``, or carries a password.
        EngineError: the server does not answer at connect (``socket_timeout_s``).
    """

    def __init__(self, url: str, size_limit_bytes: int, prefix: str = "tandem:", socket_timeout_s: float = 5.0):
        import redis

        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise InvalidRequest(f"store URL {url!r}: only redis:// and rediss:// are supported")
        if parts.password:
            raise InvalidRequest(f"store URL must not carry a password: put it in ${PASSWORD_ENV}")
        self.url, self.prefix, self.size_limit_bytes = url, prefix, size_limit_bytes
        # every server-side failure too: OOM under a policy that does not evict, READONLY after a failover
        self._errors = (redis.RedisError,)
        self._r = redis.Redis.from_url(
            url,
            password=os.environ.get(PASSWORD_ENV) or None,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            health_check_interval=30,
        )
        try:
            self._r.ping()
        except self._errors as e:
            raise EngineError(f"block store {url}: {e}") from None
        self._bound()

    def _bound(self) -> None:
        import redis

        try:
            conf: dict = dict(self._r.config_get("maxmemory*"))  # type: ignore[arg-type]
            maxmemory, policy = int(conf.get("maxmemory") or 0), str(conf.get("maxmemory-policy") or "")
            if maxmemory == 0:
                self._r.config_set("maxmemory", self.size_limit_bytes)
                self._r.config_set("maxmemory-policy", "allkeys-lru")
                log.info("block store %s: bounded to %d bytes, allkeys-lru", self.url, self.size_limit_bytes)
            elif not policy.startswith("allkeys-"):  # volatile-*: only keys with a TTL, and tandem sets none
                log.warning(
                    "block store %s: maxmemory-policy %s evicts none of tandem's keys; writes fail when full "
                    "(use allkeys-lru)",
                    self.url,
                    policy,
                )
        except redis.ResponseError as e:  # CONFIG is disabled on managed servers: the operator bounds it
            log.warning("block store %s: cannot read or set its bound (%s); the server's own applies", self.url, e)
        except redis.RedisError as e:
            raise EngineError(f"block store {self.url}: {e}") from None

    def _set(self, key: str, raw: bytes) -> None:
        try:
            self._r.set(self.prefix + key, raw)
        except self._errors as e:
            raise EngineError(f"block store {self.url}: {e}") from None

    def _get(self, key: str) -> bytes | None:
        try:
            v = self._r.get(self.prefix + key)
        except self._errors as e:
            log.warning("block store %s: read of %s failed (%s): a miss", self.url, key, e)
            return None
        return None if v is None else bytes(v)  # type: ignore[arg-type]

    def _has(self, key: str) -> bool:
        try:
            return bool(self._r.exists(self.prefix + key))
        except self._errors:
            return False

    def touch(self, key: str) -> None:
        try:
            self._r.touch(self.prefix + key)
        except self._errors:
            pass

    def _del(self, key: str) -> None:
        try:
            self._r.delete(self.prefix + key)
        except self._errors as e:
            raise EngineError(f"block store {self.url}: {e}") from None

    def volume_bytes(self) -> int:
        """The server's memory in use (all of its keys, not only tandem's)."""
        try:
            return int(self._r.info("memory").get("used_memory", 0))
        except self._errors:
            return 0

    def close(self) -> None:
        self._r.close()


def open_store(url: str, directory: Path | str, size_limit_bytes: int) -> SealedStore:
    """The store a cloud node (and its engines' connectors) use: Redis at ``url`` when given,
    else the disk store in ``directory``. Both bounded by ``size_limit_bytes``.

    Raises:
        InvalidRequest, EngineError: see ``RedisBlockStore`` and ``DiskBlockStore``.
    """
    if url:
        return RedisBlockStore(url, size_limit_bytes)
    return DiskBlockStore(directory, size_limit_bytes)
