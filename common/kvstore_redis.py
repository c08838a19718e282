"""The block store several cloud replicas share (``RedisBlockStore``, ``redis://`` or ``rediss://``):
bounded by the server's ``maxmemory`` with an LRU policy (set at connect when the server has none),
pins as leases, writes and pins as Lua scripts so that a pinned key is never evicted. The contract,
seals and pins are described in ``tandem.common.kvstore``."""

from __future__ import annotations

import os
from collections.abc import Iterable

from tandem.common.errors import EngineError
from tandem.common.kvstore import DEFAULT_TTL_S, PASSWORD_ENV, SealedStore, check_store_url, log

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
