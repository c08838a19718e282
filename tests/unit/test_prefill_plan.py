"""``edge.compute.prefill.PrefillPlan``: how a run of new tokens is cut into chunks and padded."""

from __future__ import annotations

import pytest

from tandem.edge.compute.prefill import CHUNK_TOKENS, PrefillPlan


def test_the_bucketed_plan_pads_to_powers_of_two_up_to_the_chunk():
    p = PrefillPlan.bucketed()
    assert p.chunk_tokens == CHUNK_TOKENS == 512 and p.capacity_mask
    assert p.bucket_tokens == (4, 8, 16, 32, 64, 128, 256, 512)
    assert [p.width(n, 10_000) for n in (1, 2, 3, 4, 5, 64, 65, 511, 512)] == [1, 4, 4, 4, 8, 64, 128, 512, 512]
    assert p.shapes(256) == [4, 8, 16, 32, 64, 128, 256] and p.shapes(8192)[-1] == 512
    assert not p.exact and PrefillPlan.EXACT.exact


def test_pieces_cut_a_long_run_into_chunks_the_last_one_shorter():
    p = PrefillPlan.bucketed(8)
    assert p.pieces(3) == [3] and p.pieces(8) == [8] and p.pieces(20) == [8, 8, 4] and p.pieces(16) == [8, 8]
    assert sum(p.pieces(1001)) == 1001
    assert PrefillPlan.EXACT.pieces(5000) == [5000]


def test_a_run_pads_only_where_the_slot_has_room_and_never_one_token():
    p = PrefillPlan(bucket_tokens=(4, 8))
    assert p.width(5, 8) == 8 and p.width(5, 7) == 5  # no room for the padding: its own length
    assert p.width(9, 100) == 9  # past the largest bucket: its own length
    assert p.width(1, 100) == 1  # a decode step's shape
    assert PrefillPlan.EXACT.width(37, 100) == 37


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunk_tokens": -1},
        {"bucket_tokens": (1, 4)},
        {"bucket_tokens": (8, 4)},
        {"bucket_tokens": (4, 4)},
        {"chunk_tokens": 16, "bucket_tokens": (4, 8)},
    ],
)
def test_a_plan_that_would_run_unwarmed_shapes_is_refused(kwargs):
    with pytest.raises(ValueError):
        PrefillPlan(**kwargs)
    with pytest.raises(ValueError, match="at least"):
        PrefillPlan.bucketed(2)
