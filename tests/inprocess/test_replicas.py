"""On the in-memory doubles: two gateways (replicas) sharing one block store, an
edge with a ``ReplicaSet`` over both. Sessions stay on their replica (rendezvous hashing) and move
when it fails, syncing from the shared store so that only what the new replica lacks travels."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tandem.cloud.engines.memory import MemoryEngines
from tandem.cloud.server import build_gateway
from tandem.cloud.store.blocks import MemoryBlockStore
from tandem.common.protocol.errors import EngineError
from tandem.common.protocol.params import NegotiateOffer
from tandem.edge.compute.batcher import HeadBatcher
from tandem.edge.compute.head import MemoryHead
from tandem.edge.link.base import InProcessLink
from tandem.edge.link.connection import CloudConnection
from tandem.edge.link.replicas import ReplicaSet, rendezvous
from tandem.edge.modes.split_head import Head
from tests.doubles import HKV, MANIFEST, VOCAB, B, D, Down, H, K, cloud_config, toy_node
from tests.helpers import LONG, Sent, chat, run


def test_rendezvous_moves_only_the_keys_of_a_removed_target():
    targets = ["a:1", "b:1", "c:1"]
    keys = [f"session-{i}" for i in range(300)]
    first = {k: targets[rendezvous(k, targets)[0]] for k in keys}
    assert {t: sum(v == t for v in first.values()) for t in targets} == pytest.approx({t: 100 for t in targets}, abs=35)
    without_b = ["a:1", "c:1"]
    after = {k: without_b[rendezvous(k, without_b)[0]] for k in keys}
    assert all(after[k] == first[k] for k in keys if first[k] != "b:1")  # only b's sessions moved
    assert rendezvous("x", targets) == rendezvous("x", targets)


@pytest.fixture
async def pair():
    store = MemoryBlockStore(1 << 30)
    engines = MemoryEngines(store, B, VOCAB)
    gateways = [build_gateway(cloud_config(cloud_id=f"replica-{i}"), MANIFEST, engines, store) for i in range(2)]
    sent = Sent()
    links = [Down(InProcessLink(gw), sent) for gw in gateways]
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
    svc = toy_node([Head(batcher, key)], rs, turn_timeout_s=10.0)
    yield svc, gateways, links, rs, sent
    await rs.stop()
    await batcher.stop()


def held_by(gateways, session: str) -> list[int]:
    return [i for i, gw in enumerate(gateways) if any(k.endswith("/" + session) for k in gw.sessions.keys())]


async def test_sessions_stay_on_their_replica_and_spread(pair):
    svc, gateways, *_ = pair
    for i in range(8):
        for _turn in range(2):
            await run(svc, chat(LONG, session=f"s{i}", n=2))
    homes = [held_by(gateways, f"s{i}") for i in range(8)]
    assert all(len(h) == 1 for h in homes)  # each on one replica only, both turns
    assert {h[0] for h in homes} == {0, 1}  # and both replicas serve some


async def test_a_session_moves_when_its_replica_dies_and_resends_only_the_new_tokens(pair):
    svc, gateways, links, rs, sent = pair
    await run(svc, chat(LONG, session="m"))
    (home,) = held_by(gateways, "m")
    held = len(svc.tokenize(chat(LONG)))
    links[home].down = True  # the replica's host is gone
    second = chat(LONG, "ok", "and what next?", session="m")
    sent.take()
    done = await run(svc, second)
    n = done.prompt_tokens
    assert held_by(gateways, "m") == [0, 1]  # the other replica loaded it from the shared store
    tokens, leaves = sent.take()
    assert tokens == list(range(held, n)) and leaves == list(range(held // B, n // B))
    fresh = await run(svc, replace(second, session_id="fresh"))
    assert done.output_token_ids == fresh.output_token_ids
    assert rs.status()[home] == ("r0:1" if home == 0 else "r1:1", False)


async def test_a_stream_cut_mid_decode_resumes_on_the_other_replica(pair):
    svc, gateways, links, rs, _ = pair
    await run(svc, chat(LONG, session="d", n=2))
    (home,) = held_by(gateways, "d")
    real = gateways[home].calls.engines

    class Dies:
        def __getattr__(self, name):
            return getattr(real, name)

        async def decode(self, request_id, token_ids, kv, sampling):
            n = 0
            async for step in real.decode(request_id, token_ids, kv, sampling):
                if n >= 3:
                    links[home].down = True
                    raise EngineError("replica process died")
                n += len(step.token_ids)
                yield step

    gateways[home].calls.engines = Dies()
    done = await run(svc, chat(LONG, "ok", "go on", session="d", n=10))
    assert done.resumes == 1 and done.output_tokens == len(done.output_token_ids) == 10
    assert held_by(gateways, "d") == [0, 1]
