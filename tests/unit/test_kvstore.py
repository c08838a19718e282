"""Unit tests: KV block identity, canonical blocks and the bounded block stores."""

import multiprocessing as mp

import numpy as np
import pytest

from tandem.cloud.store.blocks import (
    PASSWORD_ENV,
    SEAL_BYTES,
    MemoryBlockStore,
    check_store_url,
    open_store,
    seal,
    unseal,
)
from tandem.cloud.store.disk import DiskBlockStore
from tandem.cloud.store.redis_store import RedisBlockStore
from tandem.common.protocol.errors import EngineError, InvalidRequest
from tandem.common.wire.kvblocks import LayerRange, block_hashes, hash_seed, part_key, split_blocks


def test_chained_hashes_share_prefixes():
    seed = hash_seed("m", 4)
    a = block_hashes(list(range(10)), 4, seed)
    b = block_hashes(list(range(8)) + [99, 100, 101, 102], 4, seed)
    assert len(a) == 2 and len(b) == 3
    assert a == b[:2]
    assert block_hashes([1, 0, 2, 3, 4, 5, 6, 7], 4, seed)[1] != a[1]  # a change earlier changes later ids
    assert block_hashes(list(range(8)), 4, hash_seed("other", 4)) != a


def test_split_blocks_shapes():
    """split_blocks cuts a session's KV [L, 2, Hkv, T, D] into [L, 2, Hkv, B, D] blocks of the asked range,
    refusing a range past the full blocks or an empty layer range with ValueError."""
    kv = np.arange(2 * 2 * 3 * 10 * 4, dtype=np.float32).reshape(2, 2, 3, 10, 4)
    blocks = split_blocks(kv, 4, 1, 2)
    assert len(blocks) == 1 and blocks[0].shape == (2, 2, 3, 4, 4)
    assert np.array_equal(blocks[0], kv[:, :, :, 4:8])
    with pytest.raises(ValueError):
        split_blocks(kv, 4, 0, 3)
    with pytest.raises(ValueError):
        LayerRange(lo=3, hi=3)


def test_memory_store_is_bounded_lru():
    s = MemoryBlockStore(size_limit_bytes=2 * (SEAL_BYTES + 4) + 10)  # two sealed values fit, not three
    s.put("a", b"1234")
    s.put("b", b"1234")
    assert s.get("a") == b"1234"  # a is now most recent
    s.put("c", b"1234")  # evicts b
    assert s.contains("a") and s.contains("c") and not s.contains("b")


def _writer(directory, n):
    st = DiskBlockStore(directory, 1 << 26)
    for i in range(n):
        st.put(f"k{i}", bytes([i % 256]) * 1000)


def test_disk_store_across_processes(tmp_path):
    p = mp.get_context("spawn").Process(target=_writer, args=(str(tmp_path), 50))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    st = DiskBlockStore(tmp_path, 1 << 26)
    assert st.get("k7") == bytes([7]) * 1000
    assert st.get("missing") is None


def test_a_store_key_names_the_layer_range_and_the_canonical_layout():
    """A block written under another canonical layout version is never found under this one."""
    from tandem.common.wire import kvblocks

    key = part_key(bytes(32), LayerRange(lo=0, hi=4))
    assert key == "00" * 32 + f":L0-4:kv{kvblocks.KV_LAYOUT_VERSION}"
    assert part_key(bytes(32), LayerRange(lo=0, hi=5)) != key


def test_disk_store_is_bounded(tmp_path):
    st = DiskBlockStore(tmp_path, size_limit_bytes=200_000)
    for i in range(100):
        st.put(f"k{i}", bytes(10_000))
    assert st.volume_bytes() < 400_000  # diskcache culls past the limit (SQLite pages count too)
    assert not st.contains("k0") and st.contains("k99")


# ---------------------------------------------------------------- one contract, every backend


@pytest.fixture(params=["memory", "disk", "redis"])
def store(request, tmp_path):
    """Each ``BlockStore`` backend, empty (Redis: a fresh key prefix on the session's server)."""
    import uuid

    if request.param == "memory":
        st = MemoryBlockStore(1 << 26)
    elif request.param == "disk":
        st = DiskBlockStore(tmp_path / "kv", 1 << 26)
    else:
        st = RedisBlockStore(request.getfixturevalue("redis_server").url, 1 << 26, prefix=f"t{uuid.uuid4().hex}:")
    yield st
    st.close()


def test_contract_put_get_contains_delete(store):
    assert store.get("k") is None and not store.contains("k")
    store.put("k", b"value")
    assert store.get("k") == b"value" and store.contains("k")
    store.put("k", b"other value")  # a put replaces
    assert store.get("k") == b"other value"
    store.put("empty", b"")
    assert store.get("empty") == b""
    big = np.random.default_rng(0).bytes(3 << 20)
    store.put("big", big)
    assert store.get("big") == big
    big2 = np.random.default_rng(1).bytes(640 << 10)  # a KV block's size; replaces a file-backed value
    store.put("big", big2)
    assert store.get("big") == big2
    store.delete("k")
    store.delete("never there")
    assert store.get("k") is None and not store.contains("k")


@pytest.mark.parametrize("size", [64, 100_000])  # in the disk store's SQLite table, and in a file of its own
@pytest.mark.parametrize("offset", [0, 5, 16, -1])
def test_contract_a_corrupt_value_reads_as_a_miss(store, offset, size):
    """A flipped bit anywhere (seal or value) is never returned: a miss, dropped, counted."""
    store.put("k", np.random.default_rng(size).bytes(size))
    before = store.corrupt_reads
    assert store.corrupt_for_test("k", offset)
    assert store.get("k") is None and store.corrupt_reads == before + 1
    assert not store.contains("k")  # dropped: the next reader does not pay for it again
    assert not store.corrupt_for_test("missing")


def test_contract_concurrent_writers_and_readers(store):
    """Readers never see a torn value while writers replace it (put is atomic)."""
    import threading

    values = [bytes([i]) * 50_000 for i in range(8)]
    stop, bad = threading.Event(), []

    def write() -> None:
        i = 0
        while not stop.is_set():
            store.put("shared", values[i % 8])
            i += 1

    def read() -> None:
        for _ in range(300):
            v = store.get("shared")
            if v is not None and v not in values:
                bad.append(len(v))

    store.put("shared", values[0])
    threads = [threading.Thread(target=write), *(threading.Thread(target=read) for _ in range(2))]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert not bad


def test_seal_format():
    """A sealed value is the seal's bytes then the value; a truncated or too short value unseals to None."""
    raw = seal(b"abc")
    assert len(raw) == SEAL_BYTES + 3 and unseal(raw) == b"abc"
    assert unseal(raw[:-1]) is None and unseal(b"short") is None


def test_redis_store_is_bounded_lru_at_the_server(tmp_path):
    """A server without a bound gets the store's byte bound and volatile-lru at connect (every value
    but a pinned one has a TTL); writes past it evict the least recently used keys instead of failing.
    Redis's LRU is approximate (it evicts the oldest of a few sampled keys, redis.io "Key eviction"),
    so a few early keys may outlive later ones: the test asks that the early half is nearly all gone,
    not that one given early key is."""
    from tests.helpers import RedisServer

    server = RedisServer(tmp_path)
    try:
        st = RedisBlockStore(server.url, 4 << 20)
        assert st._r.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
        for i in range(200):
            st.put(f"k{i}", bytes(100_000))
        assert st.contains("k199")
        early_alive = sum(st.contains(f"k{i}") for i in range(100))
        assert early_alive <= 15, f"{early_alive} of the first 100 keys outlived the bound"
        assert st.volume_bytes() < 8 << 20
    finally:
        server.stop()


def test_redis_store_refusals(redis_server, monkeypatch):
    """A password in the store URL and a scheme other than redis are refused with InvalidRequest; an
    unreachable server is an EngineError."""
    with pytest.raises(InvalidRequest, match="password"):
        RedisBlockStore("redis://:secret@127.0.0.1:1/0", 1 << 20)
    with pytest.raises(InvalidRequest, match="redis://"):
        open_store("http://127.0.0.1/", "/nonexistent", 1 << 20)
    with pytest.raises(EngineError):
        RedisBlockStore("redis://127.0.0.1:1/0", 1 << 20, socket_timeout_s=0.5)


def test_redis_password_comes_from_the_environment(tmp_path, monkeypatch):
    from tests.helpers import RedisServer

    server = RedisServer(tmp_path, password="s3cret-store-pass")
    try:
        with pytest.raises(EngineError):  # no password: NOAUTH
            RedisBlockStore(server.url, 1 << 20).put("k", b"v")
        monkeypatch.setenv(PASSWORD_ENV, "wrong")
        with pytest.raises(EngineError):
            RedisBlockStore(server.url, 1 << 20)
        monkeypatch.setenv(PASSWORD_ENV, "s3cret-store-pass")
        st = RedisBlockStore(server.url, 1 << 20)
        st.put("k", b"v")
        assert st.get("k") == b"v"
    finally:
        server.stop()


def test_redis_reads_during_an_outage_are_misses_and_writes_raise(tmp_path):
    from tests.helpers import RedisServer

    server = RedisServer(tmp_path)
    st = RedisBlockStore(server.url, 1 << 20, socket_timeout_s=0.5)
    st.put("k", b"v")
    server.stop()
    assert st.get("k") is None and not st.contains("k")
    with pytest.raises(EngineError):
        st.put("k", b"v")


def test_redis_server_errors_are_engine_errors_on_write_and_misses_on_read(tmp_path, caplog):
    """A server that refuses writes (full under a policy that evicts nothing) makes put raise
    EngineError, and is warned about."""
    from tests.helpers import RedisServer

    server = RedisServer(tmp_path, maxmemory_bytes=2 << 20)
    try:
        import redis

        redis.Redis.from_url(server.url).config_set("maxmemory-policy", "noeviction")
        with caplog.at_level("WARNING", logger="tandem.store"):
            st = RedisBlockStore(server.url, 1 << 30)
        assert "evicts nothing" in caplog.text
        with pytest.raises(EngineError, match="OOM|maxmemory"):
            for i in range(100):
                st.put(f"k{i}", bytes(100_000))
        assert st.get("k0") == bytes(100_000)  # what was written stays readable
    finally:
        server.stop()


def _fill(store, n: int, size: int, tag: str = "f") -> None:
    for i in range(n):
        store.put(f"{tag}{i}", bytes(size))


@pytest.fixture(params=["memory", "disk", "redis"])
def small_store(request, tmp_path):
    """Each backend bounded to about 1 MB (Redis: its own server, so that the bound is its own)."""
    bound = 1 << 20
    if request.param == "memory":
        st = MemoryBlockStore(bound)
    elif request.param == "disk":
        st = DiskBlockStore(tmp_path / "kv", bound)
    else:
        from tests.helpers import RedisServer

        server = RedisServer(tmp_path)
        request.addfinalizer(server.stop)
        st = RedisBlockStore(server.url, bound)
    yield st
    st.close()


def test_contract_pinned_keys_are_never_evicted(small_store):
    """Keys pinned by a request in flight, written before or after the pin, survive
    writes of many times the bound; unpinned, they are evictable like any other, least recently
    used first. Pins of two owners stack."""
    st = small_store
    st.put("early", b"e" * 50_000)
    st.pin(["early", "late", "shared"], "req-1", lease_s=600)
    st.pin(["shared"], "req-2", lease_s=600)
    st.put("late", b"l" * 50_000)  # written while pinned (a tail block the engine saves later)
    st.put("shared", b"s" * 50_000)
    st.put("free", b"f" * 50_000)
    _fill(st, 200, 100_000)  # 20 MB through a store of a few MB
    assert st.get("early") == b"e" * 50_000 and st.get("late") == b"l" * 50_000 and st.get("shared")
    assert not st.contains("free") and not st.contains("f0")  # the LRU did run
    st.unpin(["early", "late", "shared"], "req-1")
    _fill(st, 200, 100_000, "g")
    assert not st.contains("early") and not st.contains("late")
    assert st.get("shared") == b"s" * 50_000  # req-2 still holds it
    st.unpin(["shared"], "req-2")
    _fill(st, 200, 100_000, "h")
    assert not st.contains("shared")


def test_contract_a_lapsed_pin_no_longer_protects(small_store):
    """A pin is a lease: the pins of a gateway that died lapse on their own."""
    st = small_store
    st.put("k", b"k" * 50_000)
    st.pin(["k"], "dead-gateway", lease_s=0.3)
    import time

    time.sleep(0.5)
    st.pin(["other"], "live-gateway", lease_s=600)  # sweeps lapsed leases (Redis), harmless elsewhere
    _fill(st, 200, 100_000)
    assert not st.contains("k")


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0",
        "rediss://redis.example:6380/1",
        "redis://localhost/0",
        "redis+cluster://10.0.0.1:6379,10.0.0.2:6379",
        "rediss+cluster://redis-0.redis:6379",
        "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/tandem/0",
        "redis+sentinel://s:26379/tandem",
    ],
)
def test_store_urls_of_a_server_a_cluster_or_sentinel_are_accepted(url):
    assert check_store_url(url) == url


@pytest.mark.parametrize(
    "url, match",
    [
        ("redis://a:1,b:2/0", "several hosts"),
        ("redis+cluster://a:1,b", "not host:port"),
        ("redis+cluster://:pw@a:1", "password"),
        ("redis+sentinel://a:26379", "service"),
        ("memcached://a:1", "scheme"),
    ],
)
def test_malformed_store_urls_are_refused(url, match):
    with pytest.raises(InvalidRequest, match=match):
        check_store_url(url)


def test_a_sessions_record_and_pieces_share_a_group_and_blocks_spread():
    from tandem.cloud.sessions.store import piece_key, record_key
    from tandem.cloud.store.blocks import slot_tag

    tags = {slot_tag(record_key("e/s"))} | {slot_tag(piece_key("e/s", bytes([i]))) for i in range(4)}
    assert len(tags) == 1 and slot_tag(record_key("e/t")) not in tags
    blocks = {slot_tag(f"{i:064x}:L0-2:kv1") for i in range(0, 1 << 256, 1 << 248)}
    assert len(blocks) == 256
