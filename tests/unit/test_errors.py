"""Domain errors on the wire: every error class has its own fixed wire name, unique, and the
status details, a refused turn's ``Error`` and the OpenAI API's error code use it, never the
Python class name."""

from __future__ import annotations

import grpc
import pytest

from tandem.cloud.links.table import LinkBusy
from tandem.cloud.links.tenancy import EdgeOverLimit
from tandem.common.protocol import errors as e
from tandem.common.protocol.grpc_errors import STATUS_OF, error_from_status, status_details
from tandem.common.wire.messages import TurnError, downlink_from_pb, downlink_to_pb
from tandem.edge.api.http_api import api_error_of

# What edges and clouds of every version call these errors: changing one breaks interoperation.
WIRE_NAMES: dict[type[e.TandemError], str] = {
    e.TandemError: "TandemError",
    e.InvalidRequest: "InvalidRequest",
    e.ChecksumMismatch: "ChecksumMismatch",
    e.MerkleMismatch: "MerkleMismatch",
    e.SessionOutOfSync: "SessionOutOfSync",
    e.SessionNotFound: "SessionNotFound",
    e.QuotaExceeded: "QuotaExceeded",
    e.ParamsVersionMismatch: "ParamsVersionMismatch",
    e.ModeUnavailable: "ModeUnavailable",
    e.IncompatibleModel: "IncompatibleModel",
    e.UploadTimeout: "UploadTimeout",
    e.EngineError: "EngineError",
    e.LinkLost: "LinkLost",
    e.Unauthenticated: "Unauthenticated",
    e.PermissionDenied: "PermissionDenied",
    e.DeadlineExceeded: "DeadlineExceeded",
    e.CorruptPayload: "CorruptPayload",
    LinkBusy: "LinkBusy",
    EdgeOverLimit: "EdgeOverLimit",
}


def all_error_classes() -> set[type[e.TandemError]]:
    found, stack = set(), [e.TandemError]
    while stack:
        cls = stack.pop()
        found.add(cls)
        stack.extend(cls.__subclasses__())
    return found


@pytest.fixture
def registry_restored():
    """Classes a test defines leave ``ERRORS_BY_NAME`` as it was."""
    saved = dict(e.ERRORS_BY_NAME)
    yield
    e.ERRORS_BY_NAME.clear()
    e.ERRORS_BY_NAME.update(saved)


def test_wire_names_are_pinned_and_indexed():
    assert {cls: cls.wire_name for cls in WIRE_NAMES} == WIRE_NAMES
    assert all("wire_name" in cls.__dict__ for cls in all_error_classes())  # each its own, none inherited
    assert {n: e.ERRORS_BY_NAME[n] for n in WIRE_NAMES.values()} == {n: c for c, n in WIRE_NAMES.items()}


def test_wire_names_are_unique():
    classes = all_error_classes()
    assert len({cls.wire_name for cls in classes}) == len(classes)
    assert set(e.ERRORS_BY_NAME.values()) == classes


def test_a_taken_wire_name_is_refused_at_definition(registry_restored):
    with pytest.raises(
        TypeError, match="'QuotaExceeded' of .*Impostor is tandem.common.protocol.errors.QuotaExceeded's"
    ):

        class Impostor(e.TandemError):
            wire_name = "QuotaExceeded"

    assert e.ERRORS_BY_NAME["QuotaExceeded"] is e.QuotaExceeded


def test_a_class_without_its_own_wire_name_is_refused(registry_restored):
    with pytest.raises(TypeError, match="Unnamed must declare its wire_name"):

        class Unnamed(e.QuotaExceeded):  # would otherwise travel as QuotaExceeded
            pass


def test_the_same_class_defined_again_takes_its_place(registry_restored):
    def define() -> type[e.TandemError]:
        class Reloaded(e.EngineError):
            wire_name = "TestReloaded"

        return Reloaded

    first, second = define(), define()
    assert first is not second and e.ERRORS_BY_NAME["TestReloaded"] is second


def test_a_renamed_class_keeps_its_wire():
    err = e.QuotaExceeded("link share used up")
    e.QuotaExceeded.__name__ = "RenamedQuota"
    try:
        assert status_details(err) == "QuotaExceeded: link share used up"
        back = error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, status_details(err))
        assert type(back) is e.QuotaExceeded and str(back) == "link share used up"
        assert api_error_of(err).code == "QuotaExceeded"
        pb = downlink_to_pb(TurnError(error=err))
        assert (pb.error.kind, list(pb.error.base_kinds)) == ("QuotaExceeded", ["TandemError"])
        pb = downlink_to_pb(TurnError(error=LinkBusy("queue full")))
        assert (pb.error.kind, list(pb.error.base_kinds)) == ("LinkBusy", ["QuotaExceeded", "TandemError"])
    finally:
        e.QuotaExceeded.__name__ = "QuotaExceeded"


def test_wire_name_and_class_name_may_differ(registry_restored):
    class Throttled(e.QuotaExceeded):
        wire_name = "TestThrottled"

    pb = downlink_to_pb(TurnError(error=Throttled("slow down")))
    assert (pb.error.kind, list(pb.error.base_kinds)) == ("TestThrottled", ["QuotaExceeded", "TandemError"])
    back = downlink_from_pb(pb)
    assert isinstance(back, TurnError) and type(back.error) is Throttled and str(back.error) == "slow down"
    assert status_details(Throttled("slow down")) == "TestThrottled: slow down"
    assert api_error_of(Throttled("slow down")).code == "TestThrottled"
    del e.ERRORS_BY_NAME["TestThrottled"]  # an edge that does not know it: its nearest known ancestor
    back = downlink_from_pb(pb)
    assert isinstance(back, TurnError) and type(back.error) is e.QuotaExceeded


@pytest.mark.parametrize("cls", list(STATUS_OF), ids=lambda c: c.wire_name)
def test_every_mapped_error_comes_back_from_its_status(cls):
    back = error_from_status(STATUS_OF[cls], status_details(cls("why")))
    assert type(back) is cls and str(back) == "why"


def test_a_name_with_another_status_is_the_status_default():
    back = error_from_status(grpc.StatusCode.UNAVAILABLE, "QuotaExceeded: busy")
    assert type(back) is e.EngineError and str(back) == "UNAVAILABLE: QuotaExceeded: busy"


def test_the_http_api_sends_the_grpc_retry_hint_as_retry_after():
    """A refusal worth retrying carries HTTP's ``Retry-After`` (whole seconds, rounded up) from the
    hint the gRPC API sends as ``retry-after-ms``; one that is not worth retrying carries none."""
    busy = LinkBusy("queue full")
    busy.retry_after_ms = 1500  # type: ignore[attr-defined]
    assert api_error_of(busy).response().headers["retry-after"] == "2"
    assert api_error_of(e.QuotaExceeded("local_kv_bytes")).response().headers["retry-after"] == "1"
    assert api_error_of(e.EngineError("engine down")).response().headers["retry-after"] == "2"
    assert "retry-after" not in api_error_of(e.InvalidRequest("bad", param="top_p")).response().headers
