"""``dns:`` targets parsed as gRPC names them, and a ``ReplicaSet`` whose members change: joins and
leaves move only the sessions whose rendezvous order says so; a resolution that fails or finds
nothing keeps the set."""

from __future__ import annotations

import pytest

from tandem.common.protocol.errors import EngineError, InvalidRequest
from tandem.common.protocol.params import NegotiateOffer
from tandem.edge.link.connection import CloudConnection
from tandem.edge.link.discovery import DnsName, parse_dns_target
from tandem.edge.link.replicas import ReplicaSet


@pytest.mark.parametrize(
    "target, want",
    [
        ("dns:///tandem-cloud.svc:50051", DnsName("tandem-cloud.svc", 50051)),
        ("dns:tandem-cloud:7", DnsName("tandem-cloud", 7)),
        ("dns://10.0.0.10/tandem-cloud.svc:50051", DnsName("tandem-cloud.svc", 50051, "10.0.0.10", 53)),
        ("dns://127.0.0.1:5353/a.test:1", DnsName("a.test", 1, "127.0.0.1", 5353)),
        ("dns://[::1]:5353/a.test:1", DnsName("a.test", 1, "::1", 5353)),
        ("localhost:50051", None),
        ("ipv4:127.0.0.1:1", None),
    ],
)
def test_dns_targets_parse_as_grpc_names_them(target, want):
    assert parse_dns_target(target) == want


@pytest.mark.parametrize(
    "target", ["dns:///tandem-cloud.svc", "dns:///:50051", "dns://resolver.local/a:1", "dns://1.2.3.4", "dns:a:0"]
)
def test_malformed_dns_targets_are_refused(target):
    with pytest.raises(InvalidRequest, match="cloud target"):
        parse_dns_target(target)


def test_a_resolved_address_becomes_a_target():
    n = DnsName("a", 50051)
    assert n.target_of("10.1.2.3") == "10.1.2.3:50051" and n.target_of("fd00::1") == "[fd00::1]:50051"


class NoLink:
    async def close(self) -> None:
        self.closed = True


def conn() -> CloudConnection:
    return CloudConnection(NoLink(), NegotiateOffer(edge_id="e", model_id="toy", head_keys={}, edge_max_batch=4))  # type: ignore[arg-type]


async def test_membership_changes_move_only_the_sessions_they_must():
    answers: list[list[str] | Exception] = []

    async def discover() -> list[str]:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    rs = ReplicaSet([conn(), conn()], ["a:1", "b:1"], discover=discover, connect=lambda t: conn(), linger_s=0)
    for m in rs.members:
        m.connected.set()
    keys = [f"s{i}" for i in range(300)]
    before = {k: rs.target_of(rs.choose(k)) for k in keys}
    answers += [["a:1", "b:1", "c:1"]]
    assert await rs.refresh() and rs.targets == ["a:1", "b:1", "c:1"]
    rs.members[2].connected.set()
    joined = {k: rs.target_of(rs.choose(k)) for k in keys}
    assert all(joined[k] in (before[k], "c:1") for k in keys)  # a key moves only to the new replica
    assert 60 < sum(v == "c:1" for v in joined.values()) < 140  # its share, about a third
    kept = rs.members[0]
    answers += [["a:1", "c:1"], EngineError("no DNS"), []]
    assert await rs.refresh() and rs.targets == ["a:1", "c:1"] and rs.members[0] is kept
    left = {k: rs.target_of(rs.choose(k)) for k in keys}
    assert all(left[k] == joined[k] for k in keys if joined[k] != "b:1")  # only b's sessions moved
    assert not await rs.refresh() and not await rs.refresh()  # failed, empty: the set stays
    assert rs.targets == ["a:1", "c:1"]
    await rs.stop()


async def test_a_failed_turn_resolves_again_at_once_and_the_period_otherwise():
    import asyncio

    calls: list[float] = []

    async def discover() -> list[str]:
        calls.append(asyncio.get_running_loop().time())
        return ["a:1", "b:1"]

    rs = ReplicaSet(
        [conn(), conn()], ["a:1", "b:1"], discover=discover, connect=lambda t: conn(), resolve_s=60, min_resolve_s=0.2
    )
    for m in rs.members:
        m.start = lambda: None  # no link behind them: only the discovery loop runs
    rs.start()
    await asyncio.sleep(0.05)
    assert len(calls) == 1  # at start, then not before the period
    rs.members[0].connected.set()
    rs.fail_over(rs.members[0], "k", EngineError("refused"))
    await asyncio.sleep(0.4)
    assert len(calls) == 2 and calls[1] - calls[0] >= 0.2  # at once, but no sooner than min_resolve_s
    rs.fail_over(rs.members[0], "k", EngineError("refused"))
    rs.fail_over(rs.members[1], "k", EngineError("refused"))
    await asyncio.sleep(0.4)
    assert len(calls) == 3  # failures close together: one resolution
    await rs.stop()
