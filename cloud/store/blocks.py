"""The cloud's KV block store: canonical KV blocks by ``common.wire.kvblocks.store_key``, and the
session records and activation pieces that let a restarted cloud, or another replica, serve a
session's next turn (``cloud.sessions.store``).

Who uses it: the gateway puts the edge's verified head blocks and session records; the
tail-prefill engine's connector (in a vLLM worker process) puts tail blocks; the decode and tail
engines' connectors get blocks. Writers and readers live in different processes (and, with Redis,
on different hosts). A miss is normal (never written, evicted, or failed its check): callers fall
back to recomputing or resending, never to wrong data. Values are opaque bytes; readers also check
their length against the part's shape.

Backends (one contract, tests/unit/test_kvstore.py runs it against each): ``DiskBlockStore``
(``cloud.store.disk``, one node's default), ``RedisBlockStore`` (``cloud.store.redis_store``,
shared by several cloud replicas) and ``MemoryBlockStore`` (in-process, for unit tests and
single-process use). Keys, sealed values (``blake3(value)[:16] || value``; a value failing its seal
reads as a miss, is dropped and counted in ``corrupt_reads``), pins (``pin``: a lease no backend
evicts while it holds) and lifetimes: docs/architecture.md, "The block store".
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

import blake3

from tandem.common.protocol.errors import InvalidRequest

SEAL_BYTES = 16  # BLAKE3 digest prefix of a stored value: 128 bits, far past accidental collisions
PASSWORD_ENV = "TANDEM_CLOUD_STORE_PASSWORD"  # the shared store's password, never in a URL or a log
DEFAULT_TTL_S = 7 * 86400.0  # Redis: the longest a value stays unused (touch, or unpin, restarts it)
DISK_POLICY = "tandem-lru-unpinned"  # diskcache eviction policy: least recently used among unpinned keys
log = logging.getLogger("tandem.store")


class BlockStore(Protocol):
    """Calling contract: ``put`` is atomic (a reader sees all of a value or none); ``get`` returns
    None for a missing key or a value that fails its seal; ``delete`` of a missing key is a no-op;
    keys are ``store_key`` strings (or ``cloud.sessions.store`` keys).

    Raises (put, delete): ``EngineError`` when a remote store cannot be reached."""

    def put(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def contains(self, key: str) -> bool: ...

    def delete(self, key: str) -> None: ...

    def touch(self, key: str) -> None: ...

    def pin(self, keys: Iterable[str], owner: str, lease_s: float) -> None:
        """Keep ``keys`` (present, or written while pinned) from eviction until ``unpin(keys, owner)``
        or for ``lease_s`` seconds (a pinner that died). Pins of different owners stack."""
        ...

    def unpin(self, keys: Iterable[str], owner: str) -> None: ...


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

    @abstractmethod
    def pin(self, keys: Iterable[str], owner: str, lease_s: float) -> None:
        """See ``BlockStore.pin``. Raises EngineError when a remote store cannot be reached."""

    @abstractmethod
    def unpin(self, keys: Iterable[str], owner: str) -> None:
        """See ``BlockStore.pin``. Raises EngineError when a remote store cannot be reached."""

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


class MemoryBlockStore(SealedStore):
    """In-process LRU store bounded by bytes: for unit tests and single-process use."""

    def __init__(self, size_limit_bytes: int) -> None:
        self.size_limit_bytes = size_limit_bytes
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._pins: dict[str, dict[str, float]] = {}  # key -> owner -> lease deadline (monotonic s)

    def _pinned(self, key: str, now: float) -> bool:
        owners = self._pins.get(key)
        if owners is None:
            return False
        for o in [o for o, d in owners.items() if d <= now]:
            del owners[o]
        if not owners:
            del self._pins[key]
        return bool(owners)

    def _set(self, key: str, raw: bytes) -> None:
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            self._data[key] = raw
            self._bytes += len(raw)
            if self._bytes > self.size_limit_bytes:
                now = time.monotonic()
                for k in [k for k in self._data if not self._pinned(k, now)]:  # least recently used first
                    if self._bytes <= self.size_limit_bytes:
                        break
                    self._bytes -= len(self._data.pop(k))

    def pin(self, keys: Iterable[str], owner: str, lease_s: float) -> None:
        deadline = time.monotonic() + lease_s
        with self._lock:
            for k in keys:
                self._pins.setdefault(k, {})[owner] = deadline

    def unpin(self, keys: Iterable[str], owner: str) -> None:
        with self._lock:
            for k in keys:
                owners = self._pins.get(k)
                if owners is not None:
                    owners.pop(owner, None)
                    if not owners:
                        del self._pins[k]

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


def slot_tag(key: str) -> str:
    """The group a store key belongs to (a Redis Cluster hash tag, ``cloud.store.redis_store``): a
    session's record (``sess/<h>``) and activation pieces (``act/<h>/...``) the session's ``h[:16]``;
    any other key (a KV block's ``<content key hex>:...``) its first two characters."""
    if key.startswith("sess/"):
        return key[5:21]
    if key.startswith("act/"):
        return key[4:20]
    return key[:2]


STORE_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel")


def check_store_url(url: str) -> str:
    """``url`` if it names a Redis block store as ``kvstore_redis.connect_redis`` connects to it:
    ``redis[s]://HOST[:PORT][/DB]`` (one server), ``redis[s]+cluster://HOST:PORT[,HOST:PORT...]``
    (nodes of a Redis Cluster, which has no databases: no path) or
    ``redis[s]+sentinel://HOST:PORT[,HOST:PORT...]/SERVICE[/DB]`` (Sentinels and the service they
    watch). Every host named, every port in 1..65535, a database the path's one decimal number; no
    password (it comes from ``$TANDEM_CLOUD_STORE_PASSWORD``), no query parameters and no fragment
    (redis-py takes unknown parameters as connection arguments and fails later, and reads a
    database path that is not a number as database 0). Whether the server has that database is
    known only by connecting (``kvstore_redis.check_store_reachable``).

    Raises:
        InvalidRequest: otherwise (the message names the part).
    """
    parts = urlsplit(url)
    if parts.scheme not in STORE_SCHEMES:
        schemes = ", ".join(x + "://" for x in STORE_SCHEMES)
        raise InvalidRequest(f"store URL {url!r}: the scheme must be one of {schemes}")
    if parts.password or "@" in parts.netloc and ":" in parts.netloc.rpartition("@")[0]:
        raise InvalidRequest(f"store URL must not carry a password: put it in ${PASSWORD_ENV}")
    if parts.query or parts.fragment or url.rstrip().endswith(("?", "#")):
        raise InvalidRequest(
            f"store URL {url!r}: takes no query parameters or fragment (the password in ${PASSWORD_ENV})"
        )
    path = [x for x in parts.path.split("/") if x]
    if "+" not in parts.scheme:
        if not parts.hostname:
            raise InvalidRequest(f"store URL {url!r} names no host (redis://HOST:PORT/DB)")
        try:
            port = parts.port
        except ValueError as e:
            raise InvalidRequest(f"store URL {url!r}: {e} (several hosts need redis+cluster:// or +sentinel)") from None
        if port == 0:
            raise InvalidRequest(f"store URL {url!r}: port 0 cannot be connected to (give 1..65535)")
        _check_db(url, parts.path.removeprefix("/"), "redis://HOST:PORT/DB")
        return url
    for node in parts.netloc.rpartition("@")[2].split(","):
        host, _, port_text = node.rpartition(":")
        if not host.strip("[]") or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise InvalidRequest(f"store URL {url!r}: {node!r} is not host:port with a port in 1..65535")
    if parts.scheme.endswith("+cluster"):
        if path:
            raise InvalidRequest(f"store URL {url!r}: a Redis Cluster has no databases: give no path")
        return url
    if not path:
        raise InvalidRequest(f"store URL {url!r}: name the service Sentinel watches (/SERVICE[/DB])")
    if len(path) > 2:
        raise InvalidRequest(f"store URL {url!r}: the path is /SERVICE[/DB]")
    _check_db(url, path[1] if len(path) > 1 else "", "redis+sentinel://HOST:PORT/SERVICE/DB")
    return url


def _check_db(url: str, db: str, form: str) -> None:
    """``db`` ("" for the default, 0) is a database index: decimal digits.

    Raises:
        InvalidRequest: otherwise.
    """
    if db and not (db.isascii() and db.isdigit()):
        raise InvalidRequest(f"store URL {url!r}: the database {db!r} is not a number ({form}, DB 0..)")


def open_store(url: str, directory: Path | str, size_limit_bytes: int) -> SealedStore:
    """The store a cloud node (and its engines' connectors) use: Redis at ``url`` when given,
    else the disk store in ``directory``. Both bounded by ``size_limit_bytes``.

    Raises:
        InvalidRequest, EngineError: see ``RedisBlockStore`` and ``DiskBlockStore``.
    """
    if url:
        from tandem.cloud.store.redis_store import RedisBlockStore

        return RedisBlockStore(url, size_limit_bytes)
    from tandem.cloud.store.disk import DiskBlockStore

    return DiskBlockStore(directory, size_limit_bytes)
