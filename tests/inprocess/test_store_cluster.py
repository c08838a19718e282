"""The block store on a real Redis Cluster (Debian's redis-server: three primaries, three replicas on
loopback ports, ``redis-cli --cluster create``): the store's contract, a session's record and pieces
in one hash slot, a primary killed while turns upload and decode (its replica takes over; sessions go
on or resync; no value served that fails its check) and a shard whose data is lost (misses, resends,
the same tokens). Turns run on the toy stack (in-memory engines) with the store on the cluster."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import pytest
import redis

from tandem.cloud.engines.memory import MemoryEngines
from tandem.cloud.server import build_gateway
from tandem.cloud.sessions.store import piece_key, record_key
from tandem.cloud.store.redis_store import HOLD_OFF_S, RedisBlockStore
from tandem.cloud.turn import as_principal
from tandem.common.protocol.errors import EngineError, TandemError
from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import NegotiateOffer
from tandem.common.runtime.security import scoped
from tandem.edge import metrics
from tandem.edge.compute.batcher import HeadBatcher
from tandem.edge.compute.head import MemoryHead
from tandem.edge.link.base import InProcessLink
from tandem.edge.link.connection import CloudConnection
from tandem.edge.link.replicas import ReplicaSet
from tandem.edge.modes.split_head import Head
from tests.cluster import RedisCluster, RedisSentinel
from tests.doubles import HKV, MANIFEST, VOCAB, B, D, Down, H, K, cloud_config, toy_node, toy_stack
from tests.helpers import LONG, chat, run
from tests.remote_doubles import toy_lm


def session_key(session_id: str) -> str:
    """The cloud's key of a session of the in-process edge (the edge's namespace, then the id)."""
    return scoped(as_principal("in-process"), session_id)


@pytest.fixture
def cluster(tmp_path):
    c = RedisCluster(tmp_path)
    yield c
    c.stop()


@pytest.fixture
async def toy(cluster):
    store = RedisBlockStore(cluster.url, 1 << 30, prefix=f"t{time.monotonic_ns()}:", socket_timeout_s=1.0)
    t = await toy_stack(store=store)
    t.engines.toy = toy_lm()  # direct decodes: the toy whole model, whose tokens depend on the KV only
    t.engines.step_delay_s = 0.03  # a turn decodes for about 0.2 s: long enough to be cut
    yield t
    await t.batcher.stop()
    store.close()


def test_the_store_contract_holds_on_a_cluster(cluster):
    st = RedisBlockStore(cluster.url, 1 << 26, prefix="contract:")
    keys = [f"{i:02x}block:0-2:kv1" for i in range(64)]  # spread over many tags, so over every primary
    for k in keys:
        st.put(k, k.encode() * 10)
    assert all(st.get(k) == k.encode() * 10 for k in keys)
    st.pin(keys, "gw", lease_s=60)
    st.unpin(keys, "gw")
    st.delete(keys[0])
    assert st.get(keys[0]) is None and st.contains(keys[1])
    assert st.volume_bytes() > 0
    r = st._r
    slots = {r.keyslot(st._key(k)) for k in keys}
    assert len({r.nodes_manager.get_node_from_slot(s).port for s in slots}) == 3  # all three primaries hold some
    # a session's record and its activation pieces share one hash slot
    session = "e/some-session"
    group = {st._key(record_key(session))} | {st._key(piece_key(session, bytes([i]))) for i in range(5)}
    assert len({r.keyslot(k) for k in group}) == 1


async def turns(edge, sessions: list[str], conversation: tuple[str, ...], mode: Mode) -> dict[str, tuple[int, ...]]:
    """One turn per session, concurrently; a turn refused while the store fails over is tried again
    (at most 20 times, 0.5 s apart). Each session's output tokens."""

    async def one(s: str) -> tuple[int, ...]:
        for _ in range(20):
            try:
                return (await run(edge, chat(*conversation, session=s, n=6, mode=mode), 10.0)).output_token_ids
            except TandemError:
                await asyncio.sleep(0.5)
        raise AssertionError(f"session {s} never completed")

    out = await asyncio.gather(*(one(s) for s in sessions))
    return dict(zip(sessions, out, strict=True))


async def reference(edge, conversation: tuple[str, ...], mode: Mode) -> tuple[int, ...]:
    """The turn's tokens on a session the store has never seen. Right after a failover the store's
    client may still hold off the failed server for ``HOLD_OFF_S``: the turn is asked again until the
    store answers (at most 15 s)."""
    deadline = time.monotonic() + 15.0
    while True:
        try:
            done = await run(
                edge, replace(chat(*conversation, n=6, mode=mode), session_id=f"ref-{time.monotonic_ns()}")
            )
            return done.output_token_ids
        except EngineError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(HOLD_OFF_S / 2)


@pytest.mark.parametrize("mode", [Mode.DIRECT, Mode.SPLIT])
async def test_a_primary_killed_during_uploads_and_decodes_fails_over(cluster, toy, mode):
    edge, store = toy.edge, toy.store
    sessions = [f"{mode.value}-{i}" for i in range(6)]
    first = (LONG,)
    await turns(edge, sessions, first, mode)
    victim = cluster.primary_of(store._key(record_key(session_key(sessions[0]))))
    promoted = cluster.replica_of(victim)
    second = (LONG, "ok", "and what next?")
    killed_at: list[float] = []
    killer = threading.Timer(0.08, lambda: (cluster.kill(victim), killed_at.append(time.monotonic())))
    killer.start()  # while the second turns upload and decode
    got = await turns(edge, sessions, second, mode)
    finished_at = time.monotonic()
    killer.join()
    assert killed_at[0] < finished_at
    await asyncio.to_thread(cluster.wait_promoted, promoted)
    key = store._key(record_key(session_key(sessions[0])))
    now = await asyncio.to_thread(cluster.wait_serving, key, promoted)
    assert now == promoted, (victim, promoted, now, cluster.live())  # the replica took over
    # direct: every token (the toy whole model's depend on the KV alone); split: the tail's first token
    # (the in-memory decode's later ones also depend on how many blocks it loaded, not only on their values)
    n = None if mode is Mode.DIRECT else 1
    want = await reference(edge, second, mode)
    assert all(tokens[:n] == want[:n] for tokens in got.values())  # nothing wrong served during the failover
    third = (*second, "fine", "more please")
    after = await turns(edge, sessions, third, mode)
    want = await reference(edge, third, mode)
    assert all(tokens[:n] == want[:n] for tokens in after.values())
    assert store.corrupt_reads == 0


@pytest.fixture
async def pair(cluster):
    """Two toy gateways (replicas) sharing one store on the cluster, an edge with a ``ReplicaSet``."""
    store = RedisBlockStore(cluster.url, 1 << 30, prefix=f"p{time.monotonic_ns()}:", socket_timeout_s=1.0)
    engines = MemoryEngines(store, B, VOCAB)
    gateways = [build_gateway(cloud_config(cloud_id=f"replica-{i}"), MANIFEST, engines, store) for i in range(2)]
    links = [Down(InProcessLink(gw), lambda item, attempt: item) for gw in gateways]
    key = MANIFEST.compatibility_key()
    conns = [
        CloudConnection(
            link,
            NegotiateOffer(edge_id="e", model_id="toy", head_keys={K: key}, edge_max_batch=4),
            probe_bytes=0,
            poll_s=0.05,
            backoff_s=0.05,
        )
        for link in links
    ]
    rs = ReplicaSet(conns, ["r0:1", "r1:1"])
    rs.start()
    for c in conns:
        assert await c.wait_connected(5)
    batcher = HeadBatcher(MemoryHead(K, H, HKV, D), 4)
    batcher.start()
    edge = toy_node([Head(batcher, key)], rs, turn_timeout_s=10.0)
    yield edge, store, links, rs
    await rs.stop()
    await batcher.stop()
    store.close()


async def test_a_shard_whose_data_is_lost_gives_misses_and_resends_never_wrong_tokens(cluster, pair):
    edge, store, links, rs = pair
    homed_on_0 = [s for s in (f"lost-{i}" for i in range(80)) if rs.choose(s) is rs.members[0]]
    shard_of = {s: cluster.primary_of(store._key(record_key(session_key(s)))) for s in homed_on_0}
    shard = shard_of[homed_on_0[0]]
    on_shard = [s for s in homed_on_0 if shard_of[s] == shard][:3]
    elsewhere = [s for s in homed_on_0 if shard_of[s] != shard][:3]
    assert len(on_shard) == len(elsewhere) == 3
    for s in on_shard + elsewhere:
        await run(edge, chat(LONG, session=s, n=1))
    redis.Redis(port=shard).flushall()  # the shard's data is gone (its replica follows)
    links[0].down = True  # their replica is gone: they move to the other, which reads the store
    second = (LONG, "ok", "and what next?")
    want = (await run(edge, chat(*second, session="reference", n=1))).output_token_ids
    outcomes = {}
    for s in on_shard + elsewhere:
        before = {o: metrics.SESSION_SYNCS.labels(o)._value.get() for o in ("in_sync", "partial", "lost")}
        done = await run(edge, chat(*second, session=s, n=1))
        assert done.output_token_ids == want  # a miss is recomputed or resent, never served wrong
        outcomes[s] = [o for o, v in before.items() if metrics.SESSION_SYNCS.labels(o)._value.get() > v]
    assert all(outcomes[s] == ["lost"] for s in on_shard), outcomes  # the record was on the lost shard: resent from 0
    # the others load what they stored (the turn's reply, not yet in a stored prompt, makes it partial);
    # their KV blocks that were on the lost shard are recomputed by the engines
    assert all(outcomes[s] in (["in_sync"], ["partial"]) for s in elsewhere), outcomes
    assert store.corrupt_reads == 0


def test_a_shard_lost_with_its_replica_reads_as_misses_and_the_others_serve(cluster):
    st = RedisBlockStore(cluster.url, 1 << 26, prefix="whole-shard:", socket_timeout_s=0.5)
    keys = [f"{i:02x}block:0-2:kv1" for i in range(64)]
    for k in keys:
        st.put(k, k.encode())
    gone = cluster.primary_of(st._key(keys[0]))
    lost = {k for k in keys if cluster.primary_of(st._key(k)) == gone}
    replica = cluster.replica_of(gone)
    cluster.kill(gone)
    cluster.kill(replica)
    time.sleep(2.5)  # past cluster-node-timeout: the shard is marked failed, nobody to promote
    t0 = time.monotonic()
    for k in keys:
        assert st.get(k) == (None if k in lost else k.encode())  # a miss, never a wrong value
    assert time.monotonic() - t0 < 2.0  # the dead shard is held off: one failure, not one wait per key
    kept = next(k for k in keys if k not in lost)
    st.put(kept, b"rewritten")  # writes to the shards that remain go on
    assert st.get(kept) == b"rewritten" and st.corrupt_reads == 0


def test_the_store_through_sentinel_follows_a_failover(tmp_path):
    sentinel = RedisSentinel(tmp_path)
    try:
        st = RedisBlockStore(sentinel.url, 1 << 26, socket_timeout_s=1.0)
        st.put("aa-before", b"kept")
        st._r.wait(1, 2000)  # replicated before the primary goes
        sentinel.kill(sentinel.primary)
        deadline = time.monotonic() + 20
        while True:  # writes fail (EngineError) until Sentinel promotes the replica
            try:
                st.put("bb-after", b"written")
                break
            except TandemError:
                assert time.monotonic() < deadline, "Sentinel never promoted the replica"
                time.sleep(0.2)
        assert st.get("aa-before") == b"kept" and st.get("bb-after") == b"written"
        st.close()
    finally:
        sentinel.stop()
