"""Replicas found by DNS, with real processes: dnsmasq answers one name with the replicas' 127.0.0.x
addresses, each replica is a toy cloud in its own process (in-memory engines, real gRPC) over one
real Redis block store, and the edge is given only ``dns://<dnsmasq>/tandem-cloud.test:PORT``.
Replicas join and leave (one is SIGKILLed mid-stream): sessions keep their replica while it lives,
a joining one takes its rendezvous share, only the sessions of a replica that left move (and sync),
and no token is wrong or repeated."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import NegotiateOffer
from tandem.edge import metrics
from tandem.edge.compute.batcher import HeadBatcher
from tandem.edge.compute.head import MemoryHead
from tandem.edge.config import EdgeConfig
from tandem.edge.events import TextOut, TurnDone
from tandem.edge.link.replicas import ReplicaSet, rendezvous
from tandem.edge.modes.split_head import Head
from tandem.edge.server import connect_cloud
from tests.cluster import Dnsmasq, ToyReplica, free_port
from tests.doubles import HKV, MANIFEST, D, H, K, toy_node
from tests.helpers import LONG, RedisServer, chat, run

ADDRESSES = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]


def syncs() -> float:
    """SyncSession calls this edge process made so far (every outcome)."""
    return sum(metrics.SESSION_SYNCS.labels(o)._value.get() for o in ("in_sync", "partial", "lost"))


async def until(check, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.fixture
async def cluster(tmp_path):
    redis_server = RedisServer(tmp_path)
    dns = Dnsmasq(tmp_path)
    port = free_port(ADDRESSES[0])
    replicas: dict[str, ToyReplica] = {}

    def start(address: str) -> None:
        replicas[f"{address}:{port}"] = ToyReplica(address, port, redis_server.url, f"replica-{address}", 0.02)

    for a in ADDRESSES[:2]:
        start(a)
    dns.set(ADDRESSES[:2])
    cfg = EdgeConfig(cloud_target=dns.target(port), cloud_insecure=True, cloud_resolve_s=0.3, poll_s=0.2, probe_bytes=0)
    key = MANIFEST.compatibility_key()
    links, rs = await connect_cloud(
        cfg, NegotiateOffer(edge_id="e", model_id="toy", head_keys={K: key}, edge_max_batch=4), (1.0, 1.0, 1.0)
    )
    assert isinstance(rs, ReplicaSet)
    batcher = HeadBatcher(MemoryHead(K, H, HKV, D), 4)
    batcher.start()
    edge = toy_node([Head(batcher, key)], rs)
    try:
        await until(lambda: all(m.healthy for m in rs.members) and len(rs.members) == 2)
        yield edge, rs, dns, replicas, start
    finally:
        await rs.stop()
        await batcher.stop()
        for link in links:
            await link.close()
        for r in replicas.values():
            r.kill()
        dns.stop()
        redis_server.stop()


def home(rs: ReplicaSet, session: str) -> str:
    return rs.target_of(rs.choose(session))


async def test_dns_discovery_join_and_a_replica_killed_mid_stream(cluster):
    edge, rs, dns, replicas, start = cluster
    assert sorted(rs.targets) == sorted(replicas)  # both found through the one name
    first = [f"s{i}" for i in range(8)]
    for s in first:
        await run(edge, chat(LONG, session=s, n=2))
    homes = {s: home(rs, s) for s in first}
    assert set(homes.values()) == set(replicas)  # both serve some

    # a third replica joins: found at the next resolution
    start(ADDRESSES[2])
    dns.set(ADDRESSES)
    await until(lambda: len(rs.targets) == 3 and all(m.healthy for m in rs.members))
    third = next(t for t in rs.targets if t.startswith(ADDRESSES[2]))
    moved = [s for s in first if home(rs, s) == third]
    assert all(home(rs, s) == homes[s] for s in first if s not in moved)  # the others stay put
    assert moved == [s for s in first if rendezvous(s, rs.targets)[0] == rs.targets.index(third)]
    before = syncs()
    for s in first:  # second turns: only the sessions the new replica now ranks first sync
        done = await run(edge, chat(LONG, "ok", "and next?", session=s, n=2))
        fresh = await run(edge, replace(chat(LONG, "ok", "and next?", n=2), session_id=f"ref-{s}"))
        assert done.output_token_ids == fresh.output_token_ids
    assert syncs() - before == len(moved)
    new = [f"n{i}" for i in range(30)]
    assert sum(home(rs, s) == third for s in new) >= 3  # it takes its share of new sessions

    # a replica dies mid-stream and leaves the name: only its sessions move
    victim_session = next(s for s in first if home(rs, s) != third)
    victim = home(rs, victim_session)
    survivors = {s: home(rs, s) for s in first if home(rs, s) != victim}
    # a direct decode: the replicas run the toy whole model there, whose tokens do not depend on where
    # or in how many pieces they were computed, so the resumed stream must equal an uncut one
    long_turn = chat(LONG, "ok", "go on", session=victim_session, n=30, mode=Mode.DIRECT)
    want = await run(edge, replace(long_turn, session_id="ref-long"))
    streamed: list[int] = []
    done = None
    async for ev in edge.chat(long_turn):
        if isinstance(ev, TextOut):
            streamed += ev.token_ids
            if len(streamed) >= 3 and replicas[victim].proc.poll() is None:
                replicas[victim].kill()
                dns.set([a for a in ADDRESSES if not victim.startswith(a + ":")])
        elif isinstance(ev, TurnDone):
            done = ev
    assert done is not None and done.resumes == 1
    assert streamed == list(want.output_token_ids)  # no token wrong, none repeated, none missing
    await until(lambda: victim not in rs.targets)
    assert all(home(rs, s) == t for s, t in survivors.items())  # the others did not move
    before = syncs()
    for s in survivors:
        await run(edge, chat(LONG, "ok", "and next?", "fine", "more", session=s, n=2))
    assert syncs() == before  # no survivor resynced


async def tls_replica(address: str, port: int, cert: tuple[Path, Path]):
    """A toy gateway on ``address:port`` over TLS with the certificate ``cert`` (chain, key)."""
    from tandem.cloud.engines.memory import MemoryEngines
    from tandem.cloud.server import build_gateway
    from tandem.cloud.service import CloudServicer
    from tandem.cloud.store.blocks import MemoryBlockStore
    from tandem.common.runtime.grpc_setup import add_service, server_credentials, start_server
    from tests.doubles import VOCAB, B, cloud_config

    store = MemoryBlockStore(1 << 20)
    gateway = build_gateway(cloud_config(), MANIFEST, MemoryEngines(store, B, VOCAB), store)
    servicer = CloudServicer(gateway, "toy-cloud")
    server, _, _ = await start_server(
        [lambda s: add_service(s, servicer, "Cloud")],
        ["tandem.v1.Cloud"],
        address,
        port,
        gateway.registry.max_message_bytes(),
        server_credentials(cert[0], cert[1], None),
    )
    return server


def issue(tmp_path: Path, ca, name: str) -> tuple[Path, Path]:
    cert = ca.issue_cert(name)
    chain, key = tmp_path / f"{name}.pem", tmp_path / f"{name}.key"
    chain.write_bytes(b"".join(b.bytes() for b in cert.cert_chain_pems))
    key.write_bytes(cert.private_key_pem.bytes())
    return chain, key


async def test_replicas_found_by_dns_are_checked_against_the_name_over_tls(tmp_path):
    """Each replica is dialled by address and its certificate checked against the DNS name: one for
    that name is accepted, one for another name is refused."""
    import trustme

    ca = trustme.CA()
    ca_file = tmp_path / "ca.pem"
    ca_file.write_bytes(ca.cert_pem.bytes())
    dns = Dnsmasq(tmp_path)
    port = free_port(ADDRESSES[0])
    servers = [
        await tls_replica(ADDRESSES[0], port, issue(tmp_path, ca, dns.name)),
        await tls_replica(ADDRESSES[1], port, issue(tmp_path, ca, "someone-else.test")),
    ]
    dns.set(ADDRESSES[:2])
    cfg = EdgeConfig(cloud_target=dns.target(port), cloud_ca_file=ca_file, poll_s=0.2, probe_bytes=0)
    offer = NegotiateOffer(edge_id="e", model_id="toy", head_keys={K: MANIFEST.compatibility_key()}, edge_max_batch=4)
    links, rs = await connect_cloud(cfg, offer, (1.0, 1.0, 1.0))
    try:
        assert isinstance(rs, ReplicaSet) and len(rs.targets) == 2
        await until(lambda: rs.members[rs.targets.index(f"{ADDRESSES[0]}:{port}")].healthy)
        other = rs.members[rs.targets.index(f"{ADDRESSES[1]}:{port}")]
        assert not other.healthy and "UNAVAILABLE" in other.last_error  # its certificate names another host
    finally:
        await rs.stop()
        for link in links:
            await link.close()
        for s in servers:
            await s.stop(0)
        dns.stop()
