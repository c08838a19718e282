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

Pins: the gateway pins the keys a request will read or write (``pin``) for as long as it is in
flight, and unpins them when it ends. No backend evicts a pinned key (present, or written while
pinned); a pin is a lease, so the pins of a process that died lapse on their own. The byte bound
applies to what is not pinned: requests in flight are bounded by the upload budget and the
engines' ``max_num_seqs``, so the store needs room for those beside its LRU.

Integrity at rest: every value is stored sealed, ``blake3(value)[:16] || value``; ``get`` checks
the seal and answers a value that fails it (a flipped bit on disk, a torn or foreign write) as a
miss, drops it and counts it in ``corrupt_reads``. Values are opaque bytes; readers also check
their length against the part's shape.
"""

from __future__ import annotations

import io
import logging
import os
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

import blake3

from tandem.common.errors import EngineError, InvalidRequest
from tandem.common.security import private_dir

SEAL_BYTES = 16  # BLAKE3 digest prefix of a stored value: 128 bits, far past accidental collisions
PASSWORD_ENV = "TANDEM_CLOUD_STORE_PASSWORD"  # the shared store's password, never in a URL or a log
DEFAULT_TTL_S = 7 * 86400.0  # Redis: the longest a value stays unused (touch, or unpin, restarts it)
DISK_POLICY = "tandem-lru-unpinned"  # diskcache eviction policy: least recently used among unpinned keys
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


# Redis scripts (Lua 5.1, run atomically by the server). A pinned key has no TTL, so the server's
# volatile-lru policy never evicts it; every other value carries a TTL (``ttl_ms``, restarted by
# ``touch`` and ``unpin``) and is evicted least recently used first. Pins are members
# ``owner|key`` of the sorted set ``<prefix>pins`` scored by their lease deadline (ms on the
# server's clock) and counted per key in the hash ``<prefix>pinned``; lapsed leases are swept by
# each pin.
_REDIS_PUT = """
if redis.call('HEXISTS', KEYS[2], ARGV[3]) == 1 then
  redis.call('SET', KEYS[1], ARGV[1])
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
"""
_REDIS_RELEASE = """
local function release(k)
  if redis.call('HINCRBY', KEYS[2], k, -1) <= 0 then
    redis.call('HDEL', KEYS[2], k)
    redis.call('PEXPIRE', ARGV[1] .. k, ARGV[2])
  end
end
"""
_REDIS_PIN = (
    _REDIS_RELEASE
    + """
local t = redis.call('TIME')  -- the server's clock: replicas' clocks may differ
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local deadline = now + tonumber(ARGV[4])
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 512)) do
  redis.call('ZREM', KEYS[1], m)
  release(string.sub(m, string.find(m, '|', 1, true) + 1))
end
for i = 5, #ARGV do
  if redis.call('ZADD', KEYS[1], deadline, ARGV[3] .. '|' .. ARGV[i]) == 1 then  -- a new pin (else: lease renewed)
    redis.call('HINCRBY', KEYS[2], ARGV[i], 1)
  end
  redis.call('PERSIST', ARGV[1] .. ARGV[i])
end
"""
)
_REDIS_UNPIN = (
    _REDIS_RELEASE
    + """
for i = 4, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[3] .. '|' .. ARGV[i]) == 1 then
    release(ARGV[i])
  end
end
"""
)
_REDIS_TOUCH = """
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
end
"""


class RedisBlockStore(SealedStore):
    """A store shared by several cloud replicas: a Redis server (``redis://host:port/db``, or
    ``rediss://`` for TLS; one server or a primary, not Redis Cluster: a script touches a key and
    the pin tables together). Keys live under ``prefix``. The byte bound is the server's
    ``maxmemory`` with ``volatile-lru`` eviction, which evicts only keys with a TTL: every value
    carries one (``ttl_s`` since last used) except pinned ones (see the scripts above). Both are
    set at connect when the server has no bound; an operator's own bound and policy are kept, and
    a policy that breaks pins (``allkeys-*``) or does not evict is warned about. The password comes
    from ``$TANDEM_CLOUD_STORE_PASSWORD``, never from the URL, so it is in no config dump or log.

    Reads that fail on the network are misses (the caller recomputes); writes raise.

    Raises:
        InvalidRequest: the URL is not ``redis://`` / ``rediss://``, or carries a password.
        EngineError: the server does not answer at connect (``socket_timeout_s``).
    """

    def __init__(
        self,
        url: str,
        size_limit_bytes: int,
        prefix: str = "tandem:",
        socket_timeout_s: float = 5.0,
        ttl_s: float = DEFAULT_TTL_S,
    ):
        import redis

        check_store_url(url)
        self.url, self.prefix, self.size_limit_bytes = url, prefix, size_limit_bytes
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._pins_key, self._pinned_key = prefix + "pins", prefix + "pinned"
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
        self._put_script = self._r.register_script(_REDIS_PUT)
        self._pin_script = self._r.register_script(_REDIS_PIN)
        self._unpin_script = self._r.register_script(_REDIS_UNPIN)
        self._touch_script = self._r.register_script(_REDIS_TOUCH)
        self._bound()

    def _bound(self) -> None:
        import redis

        try:
            conf: dict = dict(self._r.config_get("maxmemory*"))  # type: ignore[arg-type]
            maxmemory, policy = int(conf.get("maxmemory") or 0), str(conf.get("maxmemory-policy") or "")
            if maxmemory == 0:  # the bound is on tandem's values: the server's own memory comes on top
                used = int(self._r.info("memory").get("used_memory", 0))
                self._r.config_set("maxmemory", used + self.size_limit_bytes)
                self._r.config_set("maxmemory-policy", "volatile-lru")
                log.info(
                    "block store %s: bounded to %d + %d bytes, volatile-lru", self.url, used, self.size_limit_bytes
                )
            elif policy.startswith("allkeys-"):
                log.warning(
                    "block store %s: maxmemory-policy %s may evict KV blocks of requests in flight (the engines "
                    "recompute them); use volatile-lru",
                    self.url,
                    policy,
                )
            elif not policy.startswith("volatile-"):
                log.warning(
                    "block store %s: maxmemory-policy %s evicts nothing; writes fail when full (use volatile-lru)",
                    self.url,
                    policy,
                )
        except redis.ResponseError as e:  # CONFIG is disabled on managed servers: the operator bounds it
            log.warning("block store %s: cannot read or set its bound (%s); the server's own applies", self.url, e)
        except redis.RedisError as e:
            raise EngineError(f"block store {self.url}: {e}") from None

    def _set(self, key: str, raw: bytes) -> None:
        try:
            self._put_script(keys=[self.prefix + key, self._pinned_key], args=[raw, self.ttl_ms, key])
        except self._errors as e:
            raise EngineError(f"block store {self.url}: {e}") from None

    def pin(self, keys: Iterable[str], owner: str, lease_s: float) -> None:
        args: list[str | int] = [self.prefix, self.ttl_ms, owner, max(1, int(lease_s * 1000)), *keys]
        try:
            self._pin_script(keys=[self._pins_key, self._pinned_key], args=args)
        except self._errors as e:
            raise EngineError(f"block store {self.url}: {e}") from None

    def unpin(self, keys: Iterable[str], owner: str) -> None:
        try:
            self._unpin_script(keys=[self._pins_key, self._pinned_key], args=[self.prefix, self.ttl_ms, owner, *keys])
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
            self._touch_script(keys=[self.prefix + key, self._pinned_key], args=[self.ttl_ms, key])
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


def check_store_url(url: str) -> str:
    """``url`` if it can name a Redis block store: ``redis://`` or ``rediss://``, with no password in it.

    Raises:
        InvalidRequest: otherwise.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise InvalidRequest(f"store URL {url!r}: only redis:// and rediss:// are supported")
    if parts.password:
        raise InvalidRequest(f"store URL must not carry a password: put it in ${PASSWORD_ENV}")
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number in 0..65535)
    except ValueError as e:
        raise InvalidRequest(f"store URL {url!r}: {e}") from None
    return url


def open_store(url: str, directory: Path | str, size_limit_bytes: int) -> SealedStore:
    """The store a cloud node (and its engines' connectors) use: Redis at ``url`` when given,
    else the disk store in ``directory``. Both bounded by ``size_limit_bytes``.

    Raises:
        InvalidRequest, EngineError: see ``RedisBlockStore`` and ``DiskBlockStore``.
    """
    if url:
        return RedisBlockStore(url, size_limit_bytes)
    return DiskBlockStore(directory, size_limit_bytes)
