"""The block store several cloud replicas share (``RedisBlockStore``): one Redis server
(``redis://``, ``rediss://``), a Redis Cluster (``redis+cluster://``) or a primary found through
Sentinel (``redis+sentinel://``), each through redis-py's own client for it. Bounded by the servers'
``maxmemory`` with an LRU policy (set at connect when a server has none), pins as leases, writes and
pins as Lua scripts so that a pinned key is never evicted. The contract, seals and pins are described
in ``tandem.cloud.store.blocks``.

Key layout. Every key is ``<prefix>{<tag>}/<key>``; ``tag`` is ``kvstore.slot_tag(key)``: a
session's record and activation pieces share their session's tag, a KV block's tag is the first two
hex digits of its content key (256 groups). The pin tables of a tag live beside its values
(``<prefix>{<tag>}#pins``, ``#pinned``), so each script touches one hash slot, as Redis Cluster
requires, and a session's record and pieces move, fail over or are lost together. In a cluster a
primary's loss is a failover (its replica is promoted; meanwhile its reads are misses and its
writes fail) and a lost shard reads as misses: the engines recompute, the edge resends, never a
wrong value (values are sealed, KV is checked against its Merkle leaf).

A server that refused a connection or timed out is held off for ``HOLD_OFF_S``: its keys' reads
are misses and its writes fail at once instead of each waiting for the network, so a request that
touches many blocks of a dead shard costs one failure, not one per block; the shards that answer
serve as usual.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from tandem.cloud.store.blocks import DEFAULT_TTL_S, PASSWORD_ENV, SealedStore, check_store_url, log, slot_tag
from tandem.common.protocol.errors import EngineError, InvalidRequest

HOLD_OFF_S = 1.0  # a server that refused or timed out is not asked again for this long
T = TypeVar("T")

# Redis scripts (Lua 5.1, run atomically by the server). A pinned key has no TTL, so the server's
# volatile-lru policy never evicts it; every other value carries a TTL (``ttl_ms``, restarted by
# ``touch`` and ``unpin``) and is evicted least recently used first. Pins are members
# ``owner|key`` of the sorted set ``<prefix>{tag}#pins`` scored by their lease deadline (ms on the
# server's clock) and counted per key in the hash ``<prefix>{tag}#pinned``. ``ARGV[1]`` of pin,
# unpin and sweep is ``<prefix>{tag}/``. Lapsed leases of a tag are swept by each pin of that tag,
# and by a sweep of every tag that the index ``<prefix>{pins}#due`` (tag -> its earliest lease
# deadline, kept by the client after each pin and sweep; a hint, not atomic with them) says is due:
# each pin first sweeps the tags due, so a dead gateway's pins lapse wherever they are.
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
local function sweep()  -- release the lapsed leases of this tag; the server's time in ms
  local t = redis.call('TIME')  -- the server's clock: replicas' clocks may differ
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 512)) do
    redis.call('ZREM', KEYS[1], m)
    release(string.sub(m, string.find(m, '|', 1, true) + 1))
  end
  return now
end
"""


_REDIS_PIN = (
    _REDIS_RELEASE
    + """
local now = sweep()
local deadline = now + tonumber(ARGV[4])
for i = 5, #ARGV do
  if redis.call('ZADD', KEYS[1], deadline, ARGV[3] .. '|' .. ARGV[i]) == 1 then  -- a new pin (else: lease renewed)
    redis.call('HINCRBY', KEYS[2], ARGV[i], 1)
  end
  redis.call('PERSIST', ARGV[1] .. ARGV[i])
end
return deadline
"""
)


# sweep one tag; its earliest lease deadline left, or -1 when it has no pin left
_REDIS_SWEEP = (
    _REDIS_RELEASE
    + """
sweep()
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #first == 0 then return -1 end
return tonumber(first[2])
"""
)


# the tags whose earliest lease has lapsed, on the index's server clock
_REDIS_DUE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 256)
"""


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
    """A store shared by several cloud replicas (see module doc for the URLs and the key layout).
    Keys live under ``prefix``. The byte bound is the servers' ``maxmemory`` (``size_limit_bytes``
    split over a cluster's primaries) with ``volatile-lru`` eviction, which evicts only keys with a
    TTL: every value carries one (``ttl_s`` since last used) except pinned ones (see the scripts
    above). Both are set at connect on every node that has no bound; an operator's own bound and
    policy are kept, and a policy that breaks pins (``allkeys-*``) or does not evict is warned
    about. The password comes from ``$TANDEM_CLOUD_STORE_PASSWORD``, never from the URL, so it is
    in no config dump or log (a cluster's nodes and Sentinel's primary share it).

    Reads that fail on the network are misses (the caller recomputes); writes raise.

    Raises:
        InvalidRequest: the URL is not one of the forms above, or carries a password.
        EngineError: the server (cluster, Sentinel) does not answer at connect (``socket_timeout_s``).
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
        # every server-side failure too: OOM under a policy that does not evict, READONLY after a failover
        self._errors = (redis.RedisError,)
        self._unreachable = (redis.ConnectionError, redis.TimeoutError)
        self._held_until: dict[str, float] = {}  # server ("" = the one server) -> monotonic deadline
        try:
            self._r: Any = connect_redis(url, os.environ.get(PASSWORD_ENV) or None, socket_timeout_s)
            self._r.ping()
        except self._errors as e:
            raise EngineError(f"block store {url}: {e}") from None
        self._put_script = self._r.register_script(_REDIS_PUT)
        self._pin_script = self._r.register_script(_REDIS_PIN)
        self._unpin_script = self._r.register_script(_REDIS_UNPIN)
        self._touch_script = self._r.register_script(_REDIS_TOUCH)
        self._sweep_script = self._r.register_script(_REDIS_SWEEP)
        self._due_script = self._r.register_script(_REDIS_DUE)
        self._due_key = prefix + "{pins}#due"
        self._bound()

    # ------------------------------------------------------------------ layout

    def _group(self, key: str) -> str:
        return f"{self.prefix}{{{slot_tag(key)}}}"

    def _key(self, key: str) -> str:
        """The Redis key of store key ``key``."""
        return self._group(key) + "/" + key

    def _by_group(self, keys: Iterable[str]) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = defaultdict(list)
        for k in keys:
            groups[self._group(k)].append(k)
        return groups

    def _server_of(self, redis_key: str) -> str:
        """The name of the server holding ``redis_key`` ("" for one server or Sentinel's primary)."""
        from redis.cluster import RedisCluster

        if not isinstance(self._r, RedisCluster):
            return ""
        try:
            return str(self._r.get_node_from_key(redis_key).name)
        except self._errors:
            return ""

    def _on(self, redis_key: str, call: Callable[..., T], *args: Any, **kw: Any) -> T:
        """``call(*args, **kw)``, a command on the server holding ``redis_key``; that server held off
        for ``HOLD_OFF_S`` after it refused or timed out.

        Raises:
            redis.RedisError: the command failed, or the server is held off (``ConnectionError``).
        """
        import redis

        server = self._server_of(redis_key)
        if self._held_until.get(server, 0.0) > time.monotonic():
            raise redis.ConnectionError(f"{server or 'the server'} failed less than {HOLD_OFF_S} s ago")
        try:
            return call(*args, **kw)
        except self._unreachable:
            self._held_until[server] = time.monotonic() + HOLD_OFF_S
            raise

    # ------------------------------------------------------------------ bound

    def _servers(self) -> list[Any]:
        """A plain client per server: a cluster's every node (primaries and replicas: a replica
        promoted in a failover keeps the bound), else the one server."""
        from redis.cluster import RedisCluster

        if isinstance(self._r, RedisCluster):
            return [self._r.get_redis_connection(n) for n in self._r.get_nodes()]
        return [self._r]

    def _bound(self) -> None:
        import redis
        from redis.cluster import RedisCluster

        servers = self._servers()
        primaries = len(self._r.get_primaries()) if isinstance(self._r, RedisCluster) else 1
        limit = -(-self.size_limit_bytes // max(1, primaries))  # a cluster splits the bound over its primaries
        for server in servers:
            where = server.get_connection_kwargs().get("host", "?"), server.get_connection_kwargs().get("port", "?")
            try:
                bound_server(server, limit, f"{self.url} ({where[0]}:{where[1]})")
            except redis.ResponseError as e:  # CONFIG is disabled on managed servers: the operator bounds it
                log.warning("block store %s: cannot read or set its bound (%s); the server's own applies", self.url, e)
            except redis.RedisError as e:
                raise EngineError(f"block store {self.url}: {e}") from None

    # ------------------------------------------------------------------ primitives

    def _set(self, key: str, raw: bytes) -> None:
        k, g = self._key(key), self._group(key)
        try:
            self._on(k, self._put_script, keys=[k, g + "#pinned"], args=[raw, self.ttl_ms, key])
        except self._errors as e:
            raise EngineError(f"block store {self.url}: {e}") from None

    def pin(self, keys: Iterable[str], owner: str, lease_s: float) -> None:
        lease_ms = max(1, int(lease_s * 1000))
        self._sweep_due()
        deadlines: dict[str, int] = {}
        failure: Exception | None = None
        try:
            for g, ks in self._by_group(keys).items():
                args: list[str | int] = [g + "/", self.ttl_ms, owner, lease_ms, *ks]
                pins = g + "#pins"
                deadlines[g] = int(self._on(pins, self._pin_script, keys=[pins, g + "#pinned"], args=args))
        except self._errors as e:
            failure = e
        try:  # the index is a hint: a tag missing from it is swept by its next pin
            if deadlines:
                self._on(self._due_key, self._r.zadd, self._due_key, deadlines, lt=True)
        except self._errors as e:
            log.info("block store %s: lease index not updated (%s)", self.url, e)
        if failure is not None:
            raise EngineError(f"block store {self.url}: {failure}") from None

    def _sweep_due(self) -> None:
        """Sweep the tags whose earliest lease has lapsed (see the scripts above); a server that
        fails leaves its tags for a later sweep."""
        try:
            due = self._on(self._due_key, self._due_script, keys=[self._due_key])
            for raw in due:
                g = raw.decode() if isinstance(raw, bytes) else str(raw)
                pins = g + "#pins"
                first = int(self._on(pins, self._sweep_script, keys=[pins, g + "#pinned"], args=[g + "/", self.ttl_ms]))
                if first < 0:
                    self._r.zrem(self._due_key, g)
                else:
                    self._r.zadd(self._due_key, {g: first}, xx=True)
        except self._errors as e:
            log.info("block store %s: lapsed leases not swept now (%s)", self.url, e)

    def unpin(self, keys: Iterable[str], owner: str) -> None:
        try:
            for g, ks in self._by_group(keys).items():
                pins, args = g + "#pins", [g + "/", self.ttl_ms, owner, *ks]
                self._on(pins, self._unpin_script, keys=[pins, g + "#pinned"], args=args)
        except self._errors as e:
            raise EngineError(f"block store {self.url}: {e}") from None

    def _get(self, key: str) -> bytes | None:
        k = self._key(key)
        try:
            v = self._on(k, self._r.get, k)
        except self._errors as e:
            log.warning("block store %s: read of %s failed (%s): a miss", self.url, key, e)
            return None
        return None if v is None else bytes(v)

    def _has(self, key: str) -> bool:
        k = self._key(key)
        try:
            return bool(self._on(k, self._r.exists, k))
        except self._errors:
            return False

    def touch(self, key: str) -> None:
        k, g = self._key(key), self._group(key)
        try:
            self._on(k, self._touch_script, keys=[k, g + "#pinned"], args=[self.ttl_ms, key])
        except self._errors:
            pass

    def _del(self, key: str) -> None:
        k = self._key(key)
        try:
            self._on(k, self._r.delete, k)
        except self._errors as e:
            raise EngineError(f"block store {self.url}: {e}") from None

    def volume_bytes(self) -> int:
        """The servers' memory in use (all of their keys, not only tandem's; a cluster's primaries)."""
        from redis.cluster import RedisCluster

        servers = self._servers()
        total = 0
        for server in servers:
            try:
                if isinstance(self._r, RedisCluster) and server.info("replication").get("role") != "master":
                    continue  # a replica holds a copy of its primary's keys
                total += int(server.info("memory").get("used_memory", 0))
            except self._errors:
                continue
        return total

    def close(self) -> None:
        self._r.close()


def bound_server(server: Any, limit_bytes: int, name: str) -> None:
    """Bound one Redis server to its memory in use plus ``limit_bytes``, ``volatile-lru``, when it has
    no ``maxmemory``; warn about a policy that breaks pins or does not evict.

    Raises:
        redis.RedisError: the server refused or did not answer.
    """
    conf: dict = dict(server.config_get("maxmemory*"))
    maxmemory, policy = int(conf.get("maxmemory") or 0), str(conf.get("maxmemory-policy") or "")
    if maxmemory == 0:  # the bound is on tandem's values: the server's own memory comes on top
        used = int(server.info("memory").get("used_memory", 0))
        server.config_set("maxmemory", used + limit_bytes)
        server.config_set("maxmemory-policy", "volatile-lru")
        log.info("block store %s: bounded to %d + %d bytes, volatile-lru", name, used, limit_bytes)
    elif policy.startswith("allkeys-"):
        log.warning(
            "block store %s: maxmemory-policy %s may evict KV blocks of requests in flight (the engines "
            "recompute them); use volatile-lru",
            name,
            policy,
        )
    elif not policy.startswith("volatile-"):
        log.warning(
            "block store %s: maxmemory-policy %s evicts nothing; writes fail when full (use volatile-lru)", name, policy
        )


def connect_redis(url: str, password: str | None, socket_timeout_s: float, retries: int | None = None) -> Any:
    """redis-py's client for ``url`` (checked by ``check_store_url``): ``redis.Redis`` for
    ``redis://`` / ``rediss://``, ``redis.cluster.RedisCluster`` over the listed nodes for
    ``redis+cluster://`` (it learns the rest of the cluster and follows failovers), or the primary
    of ``redis+sentinel://HOST:PORT[,...]/SERVICE[/DB]`` as its Sentinels name it (re-asked on
    every reconnect, so a promoted replica is found). ``retries``: of a command that failed on the
    network (None: redis-py's own, one quick retry on a cluster; 0 where an answer is wanted at
    once, as the start-up check)."""
    import redis
    from redis.backoff import ExponentialBackoff, NoBackoff
    from redis.retry import Retry

    parts = urlsplit(url)
    scheme, tls = parts.scheme, parts.scheme.startswith("rediss")
    timeouts: dict[str, Any] = dict(socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s)
    retry: dict[str, Any] = {} if retries is None else {"retry": Retry(NoBackoff(), retries)}
    if scheme in ("redis", "rediss"):
        return redis.Redis.from_url(url, password=password, health_check_interval=30, **timeouts, **retry)
    nodes = [_host_port(n) for n in parts.netloc.rpartition("@")[2].split(",")]
    if scheme.endswith("+cluster"):
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in nodes],
            require_full_coverage=False,  # a shard lost with its replicas: the others still serve
            password=password,
            ssl=tls,
            # one quick retry (the client re-reads the slot map after a connection error), then a miss
            retry=Retry(ExponentialBackoff(cap=0.1, base=0.02), 1 if retries is None else retries),
            **timeouts,
        )
    from redis.sentinel import Sentinel

    path = [unquote(x) for x in parts.path.split("/") if x]
    service, db = path[0], int(path[1]) if len(path) > 1 else 0
    sentinel = Sentinel(nodes, sentinel_kwargs={"password": password, "ssl": tls, **timeouts}, **timeouts)
    return sentinel.master_for(service, db=db, password=password, ssl=tls, **retry)


def _host_port(node: str) -> tuple[str, int]:
    host, _, port = node.rpartition(":")
    return host.strip("[]"), int(port)


def check_store_reachable(url: str, timeout_s: float = 5.0) -> None:
    """Connect to the store at ``url`` as ``RedisBlockStore`` does (``connect_redis``, the password
    from ``$TANDEM_CLOUD_STORE_PASSWORD``; a server's database selected, a cluster's nodes or
    Sentinel's primary found) and ping it; then disconnect. Changes nothing on the server
    (``RedisBlockStore`` sets the bound when it opens the store).

    Raises:
        InvalidRequest: the URL does not parse (``check_store_url``), or the server refused the
            connection's set-up (a database index beyond its ``databases``, a wrong password, an
            unknown Sentinel service).
        EngineError: no server answered within ``timeout_s``.
    """
    import redis

    check_store_url(url)
    client = None
    try:
        client = connect_redis(url, os.environ.get(PASSWORD_ENV) or None, timeout_s, retries=0)
        client.ping()
    except (redis.ResponseError, redis.AuthenticationError) as e:
        raise InvalidRequest(f"store URL {url!r}: the server refused: {e}") from None
    except redis.RedisError as e:
        raise EngineError(f"store URL {url!r}: cannot connect: {e}") from None
    finally:
        if client is not None:
            client.close()
