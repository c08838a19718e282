"""Property-based fuzzing, fast tier: the cloud's uplink verification and raw protobuf into the
Cloud and Edge gRPC services, on in-memory engines and head (no vLLM, no ONNX Runtime). The strategies and
properties live beside this file (``uploads``, ``strategies``, ``harness``; shared with ``python -m tests.fuzz``,
the longer run); here each target runs ``EXAMPLES[target]`` cases from a fixed seed, 2250 in all.

The bottom of the file holds a reproducer of each product bug this fuzzing guards against (five cases). An open
bug goes into ``KNOWN_BUGS`` (cases hitting it are counted, not failed) with a strict xfail reproducer here.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from typer.testing import CliRunner

from tandem.common.protocol.params import NegotiateOffer
from tandem.v1 import tandem_pb2 as pb
from tests.fuzz.harness import Harness, PropertyFailure, call, describe, run_good
from tests.fuzz.strategies import strategy_of
from tests.fuzz.uploads import (
    DATA_LOSS,
    GOOD_SESSION,
    MANIFEST,
    TARGETS,
    BlockEdit,
    ChunkEdit,
    ChunkValues,
    CloudStack,
    CommitEdit,
    Expect,
    HeaderEdit,
    K,
    Reorder,
    UplinkPlan,
    Work,
    make_upload,
    token_ids,
    uplink_to_pb,
)

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

EXAMPLES = {"uplink": 900, "cloud-typed": 350, "cloud-raw": 400, "edge-typed": 350, "edge-raw": 250}
SEEDS = {t: 1000 + i for i, t in enumerate(TARGETS)}


@pytest.fixture(scope="module")
def harness() -> Iterator[Harness]:
    h = Harness(hang_s=20.0)
    yield h
    print("\n" + describe(h.stats))
    h.close()


def fuzz(harness: Harness, target: str) -> None:
    """``EXAMPLES[target]`` cases of ``target`` from its fixed seed; each must keep the target's property."""

    @hypothesis_seed(SEEDS[target])
    @settings(
        max_examples=EXAMPLES[target],
        deadline=None,
        database=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
        phases=(Phase.generate, Phase.shrink),
    )
    @given(strategy_of(target))
    def prop(case: object) -> None:
        harness.check(target, case)

    before = harness.stats[target].cases
    prop()
    assert harness.stats[target].cases - before >= EXAMPLES[target]


def test_uplink_mutations_are_refused_with_their_status_and_disturb_nothing(harness):
    """A valid split upload mutated (fields, payload bytes, CRC, NaN/inf values, enums, order, duplicates, stalls,
    deadlines; the sender answering NACKs and repairs honestly, replaying or not at all) beside a good session of
    another edge: completes or ends with the status its mutation calls for, never another exception or a hang;
    the good session's tokens equal a fresh gateway's; a session refused a turn is unchanged; nothing stays
    reserved or admitted."""
    fuzz(harness, "uplink")


def test_adversarial_cloud_requests_end_with_a_refusal_status(harness):
    fuzz(harness, "cloud-typed")


def test_raw_bytes_into_the_cloud_end_with_a_refusal_status(harness):
    fuzz(harness, "cloud-raw")


def test_adversarial_edge_requests_end_with_a_refusal_status(harness):
    fuzz(harness, "edge-typed")


def test_raw_bytes_into_the_edge_end_with_a_refusal_status(harness):
    fuzz(harness, "edge-raw")


def test_a_valid_upload_completes_and_each_single_mutation_is_judged(harness):
    """Hand-picked plans through the same property (what the fuzzing relies on: the unmutated upload completes,
    a mutation's expected status is the one the gateway gives)."""
    plan = UplinkPlan("fp32", "next", 40, 60, 1, ())
    cases = [
        plan,
        UplinkPlan("zstd-fp16", "new", 0, 70, 2, (ChunkEdit(1, "crc32c", 7),), "replay"),
        UplinkPlan("int8", "stateless", 0, 70, 3, (ChunkValues(0, 1, 2, math.nan),)),
        UplinkPlan("fp32", "next", 40, 60, 4, (BlockEdit(0, "leaf_hash", b"x" * 32),), "honest"),
        UplinkPlan("fp32", "new", 0, 70, 5, (CommitEdit("merkle_root", b"r" * 32),)),
        UplinkPlan("fp32", "new", 0, 70, 6, (HeaderEdit("session_id", GOOD_SESSION),)),
        UplinkPlan("fp32", "new", 0, 70, 7, (Reorder("stall", 0, 1),)),
    ]
    before = Counter(harness.stats["uplink"].outcomes)
    for case in cases:
        harness.check("uplink", case)
    new = harness.stats["uplink"].outcomes - before
    assert set(new) == {"OK", "DATA_LOSS", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED"}
    with pytest.raises(PropertyFailure, match="expected"):  # a wrong expectation is caught
        harness.check("uplink", UplinkPlan("fp32", "new", 0, 70, 8, (_Wrong(),)))


class _Wrong:
    """A mutation that changes nothing but claims the upload must be refused (checks the checker)."""

    def apply(self, w: Work) -> Expect:
        return frozenset({DATA_LOSS})


def test_the_fuzz_script_runs_every_target_and_reports(monkeypatch):
    from tests.fuzz.cli import app

    r = CliRunner().invoke(app, ["--examples", "4", "--seconds", "120", "--seed", "3"])
    assert r.exit_code == 0, r.output
    assert "seed 3" in r.output and "no failures" in r.output
    for t in TARGETS:
        assert f"{t}: 4 cases" in r.output

    def broken(self, target, case):  # a property that always fails: exit 1, the minimal example printed
        raise PropertyFailure(f"broken on purpose: {type(case).__name__}")

    monkeypatch.setattr(Harness, "check", broken)
    r = CliRunner().invoke(app, ["--examples", "3", "--target", "edge-typed", "--seed", "5"])
    assert r.exit_code == 1, r.output
    assert "broken on purpose: TypedCall" in r.output and "minimal example" in r.output


def test_after_every_case_the_servers_are_idle_and_answer_good_requests(harness):
    harness.final_check()


# ------------------------------------------------------------------ reproducers of what the fuzzing guards against


def status_of_call(harness: Harness, method: str, arity: str, msgs: list[bytes]) -> grpc.StatusCode:
    channel = harness.services.edge_channel if method.startswith("/tandem.v1.Edge/") else harness.services.cloud_channel
    out = harness.loop.run(call(channel, method, arity, msgs, 10.0), 20.0)
    harness.loop.run(harness.services.wait_idle(), 20.0)
    return out.status


def good_header(harness: Harness, **fields: object) -> bytes:
    gw = harness.services.cloud.gateway
    u = make_upload(gw.params, token_ids(1, 40), "", "repro")
    m = pb.Uplink()
    m.CopyFrom(uplink_to_pb(u.header))
    for k, v in fields.items():
        setattr(m.header, k, v)
    return m.SerializeToString()


@pytest.mark.parametrize(
    "method", ["/tandem.v1.Cloud/Negotiate", "/tandem.v1.Cloud/GetServerInfo", "/tandem.v1.Edge/GetInfo"]
)
def test_an_undecodable_unary_request_is_invalid_argument(harness, method):
    assert status_of_call(harness, method, "uu", [b"\xff"]) == grpc.StatusCode.INVALID_ARGUMENT


def test_an_undecodable_chat_request_is_invalid_argument(harness):
    assert status_of_call(harness, "/tandem.v1.Edge/Chat", "us", [b"\xff"]) == grpc.StatusCode.INVALID_ARGUMENT


def test_an_undecodable_first_uplink_message_is_invalid_argument(harness):
    assert status_of_call(harness, "/tandem.v1.Cloud/Generate", "ss", [b"\xff"]) == grpc.StatusCode.INVALID_ARGUMENT


def test_an_undecodable_uplink_message_after_a_good_header_is_invalid_argument(harness):
    msgs = [good_header(harness), b"\xff"]
    assert status_of_call(harness, "/tandem.v1.Cloud/Generate", "ss", msgs) == grpc.StatusCode.INVALID_ARGUMENT


def test_an_undecodable_uplink_message_after_the_verdict_keeps_the_verdicts_status(harness):
    msgs = [good_header(harness, params_version=0), b"\xff"]  # refused at the header: FAILED_PRECONDITION
    assert status_of_call(harness, "/tandem.v1.Cloud/Generate", "ss", msgs) == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize("goodput_mbps, rtt_ms", [(math.inf, 0.0), (1e308, 10.0), (math.nan, 5.0), (5.0, math.inf)])
def test_negotiate_with_absurd_link_measurements_is_answered(harness, goodput_mbps, rtt_ms):
    offer = NegotiateOffer(
        edge_id="e",
        model_id="toy",
        head_keys={K: MANIFEST.compatibility_key()},
        edge_max_batch=4,
        rtt_ms=rtt_ms,
        goodput_mbps=goodput_mbps,
    ).to_pb()
    status = status_of_call(harness, "/tandem.v1.Cloud/Negotiate", "uu", [offer.SerializeToString()])
    assert status in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT)


def test_the_anonymous_link_survives_max_links_negotiations(harness):
    """Two negotiations on a cloud of max_links=2 (256 by default: anyone can send them) evict the anonymous link,
    the first in LRU order (its last_seen is -inf); every header without a link id fails from then on."""

    async def turn_after_negotiations() -> tuple[int, ...]:
        gw = CloudStack.create(max_links=2).gateway
        offer = NegotiateOffer(
            edge_id="e", model_id="toy", head_keys={K: MANIFEST.compatibility_key()}, edge_max_batch=4
        )
        for i in range(2):
            gw.negotiate(offer, f"edge-{i}")
        u = make_upload(gw.params, token_ids(1, 40), "", "after-negotiations")
        return await run_good(gw, u, "a turn on the anonymous link")

    assert harness.loop.run(turn_after_negotiations(), 20.0)
