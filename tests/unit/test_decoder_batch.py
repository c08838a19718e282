"""The batch pool's bookkeeping (``edge.compute.decoder_batch``): rows kept compact as members join and
leave, the bucket a step runs at, the members that sat out too many steps, the rows an idle pool
shrinks to, the bytes held against the KV memory bound. Pure, no ONNX Runtime."""

from __future__ import annotations

import pytest

from tandem.common.protocol.errors import QuotaExceeded
from tandem.common.protocol.grpc_errors import status_of
from tandem.edge.compute.decoder_batch import IDLE_STEPS, MIN_POOL_ROWS, KVMemory, RowTable, bucket_rows, shrink_rows


class Member:
    """A stand-in for a session's KV slot (members are compared by identity)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __eq__(self, other: object) -> bool:  # equal names, distinct members
        return isinstance(other, Member) and other.name == self.name

    __hash__ = None  # type: ignore[assignment]


@pytest.mark.parametrize(("n", "rows"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (9, 16), (16, 16), (17, 32)])
def test_a_step_runs_at_the_power_of_two_that_covers_its_rows(n, rows):
    assert bucket_rows(n) == rows


def test_no_step_over_no_rows():
    with pytest.raises(ValueError, match="at least one row"):
        bucket_rows(0)


def test_rows_stay_compact_as_members_leave():
    t: RowTable[Member] = RowTable()
    a, b, c, d = (Member(x) for x in "abcd")
    assert [t.add(m) for m in (a, b, c, d)] == [0, 1, 2, 3]
    assert t.remove(b) == (3, 1)  # the last row's member moves into the hole
    assert t.row(d) == 1 and t.members() == [a, d, c] and len(t) == 3
    assert t.remove(c) is None  # the last row: nothing moves
    assert t.members() == [a, d]
    assert t.add(Member("e")) == 2
    with pytest.raises(KeyError):
        t.remove(b)
    with pytest.raises(ValueError, match="one row at most"):
        t.add(a)


def test_members_equal_by_value_are_still_distinct_rows():
    t: RowTable[Member] = RowTable()
    x, y = Member("same"), Member("same")
    t.add(x)
    t.add(y)
    assert t.row(x) == 0 and t.row(y) == 1 and y in t
    t.remove(x)
    assert t.row(y) == 0 and x not in t


def test_members_that_sit_out_steps_are_named_and_their_count_follows_their_row():
    t: RowTable[Member] = RowTable()
    a, b, c = (Member(x) for x in "abc")
    for m in (a, b, c):
        t.add(m)
    for _ in range(IDLE_STEPS - 1):
        assert t.step([a, b]) == []
    assert t.step([a, b]) == [c]
    assert t.step([a, c]) == [] and t.missed == [0, 1, 0]
    t.remove(a)  # c moves to row 0 with its count
    assert t.members() == [c, b] and t.missed == [0, 1]


@pytest.mark.parametrize(
    ("members", "rows", "to"),
    [(0, 1, 0), (0, 16, 0), (1, 16, 1), (2, 16, 2), (3, 16, 4), (5, 16, 8), (8, 16, 8), (9, 16, None), (16, 16, None)],
)
def test_an_idle_pool_shrinks_to_the_rows_its_members_need_and_is_freed_when_empty(members, rows, to):
    assert shrink_rows(members, rows) == to
    assert to is None or to == 0 or to >= max(MIN_POOL_ROWS, members)


def test_a_pool_cannot_hold_more_members_than_rows():
    with pytest.raises(ValueError, match="cannot hold"):
        shrink_rows(5, 4)
    with pytest.raises(ValueError, match="cannot hold"):
        shrink_rows(-1, 4)


def test_kv_memory_counts_what_is_held_and_refuses_beyond_its_bound():
    m = KVMemory(1000)
    assert m.fits(1000) and not m.fits(1001)
    m.took(600)
    assert m.held_bytes == 600 and m.fits(400) and not m.fits(401)
    m.freed(200)
    assert m.held_bytes == 400 and m.fits(600)
    with pytest.raises(ValueError, match="500 bytes freed, 400 held"):
        m.freed(500)  # a buffer counted twice
    err = m.refusal(700)
    assert isinstance(err, QuotaExceeded) and "400 of 1000 bytes held" in str(err) and "700 more" in str(err)
    assert "local_kv_bytes" in str(err) and status_of(err).name == "RESOURCE_EXHAUSTED"


def test_kv_memory_without_a_bound_fits_everything_and_refuses_a_bound_below_one_byte():
    m = KVMemory()
    m.took(1 << 40)
    assert m.fits(1 << 40)
    with pytest.raises(ValueError, match="at least 1 byte"):
        KVMemory(0)
