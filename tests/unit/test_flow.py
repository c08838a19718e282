"""The one flow-control window of a ``Generate`` call's payload (``common.wire.flow``), which the edge's upload
and remote prefill's KV downlink both keep: the sender's window and the receiver's count of each item once."""

from __future__ import annotations

import pytest

from tandem.common.wire.flow import DelayBoundWindow, ReceivedBytes, SendWindow


def test_the_window_holds_what_is_in_flight_and_lets_one_large_item_go_alone():
    w = SendWindow(window_bytes=1000)
    assert w.fits(5000)  # nothing in flight: an item larger than the window goes
    w.sent(600)
    assert w.fits(400) and not w.fits(401)
    w.ack(200)
    assert w.in_flight_bytes == 400 and w.fits(600) and not w.fits(601)


def test_an_ack_never_moves_back_nor_past_what_was_sent():
    w = SendWindow(window_bytes=1000)
    w.sent(900)
    w.ack(500)
    w.ack(100)  # an older ack arriving late
    assert w.acked_bytes == 500
    w.ack(10**9)  # more than was ever sent: the window opens no further than what went
    assert w.acked_bytes == 900 and w.in_flight_bytes == 0
    w.sent(800)
    assert not w.fits(201)


def test_the_receiver_counts_each_item_once():
    r = ReceivedBytes()
    assert r.count(("kv", 3), 100) and r.count(("chunk", 3), 50)
    assert not r.count(("kv", 3), 100)  # a resend
    assert r.received_bytes == 150


def link_acks(w: DelayBoundWindow, item_bytes: int, items: int, rtt_ms: float, bytes_per_ms: float) -> list[float]:
    """Send ``items`` items through a link of ``rtt_ms`` and ``bytes_per_ms`` (one queue, first in
    first out) as the window lets them go, each acked once it arrived plus half the round trip;
    returns the queueing delay each ack showed (ms)."""
    clock, free_at, pending, sent, queues = 0.0, 0.0, [], 0, []
    while sent < items or pending:
        while sent < items and w.fits(item_bytes):
            w.sent_at(item_bytes, clock)
            free_at = max(free_at, clock + rtt_ms / 2) + item_bytes / bytes_per_ms  # the item's last byte arrives
            pending.append((free_at + rtt_ms / 2, w.sent_bytes))
            sent += 1
        clock, acked = pending.pop(0)
        w.ack_at(acked, clock)
        queues.append(w.queue_ms)
    return queues


def test_a_delay_bound_window_stays_open_where_the_link_does_not_queue():
    """wifi6-like: 4 blocks of 312 KB in flight queue 15 ms at 500 Mbit/s, within the 20 ms target."""
    w = DelayBoundWindow(window_bytes=4 * 312_000, target_queue_ms=20.0)
    queues = link_acks(w, 312_000, 32, rtt_ms=6.0, bytes_per_ms=62_500)
    assert w.window_bytes == 4 * 312_000 and max(queues) <= 20.0


def test_a_delay_bound_window_keeps_fewer_blocks_queued_ahead_of_tokens_on_a_slow_link():
    """4g-like: a 312 KB block takes 62 ms at 40 Mbit/s, the round trip 55 ms. A window of four
    blocks that never shrinks keeps over two blocks queued (130 ms ahead of a token); the
    delay-bound one falls to one or two blocks in flight and keeps the mean queue under half a
    block's 62 ms, every block still going (one goes whenever none is in flight)."""
    fixed = DelayBoundWindow(window_bytes=4 * 312_000, target_queue_ms=float("inf"))
    bound = DelayBoundWindow(window_bytes=4 * 312_000, target_queue_ms=20.0)
    fixed_q, bound_q = (link_acks(w, 312_000, 64, rtt_ms=55.0, bytes_per_ms=5_000) for w in (fixed, bound))
    assert bound.base_delay_ms == pytest.approx(55.0 + 312_000 / 5_000)
    block_ms = 312_000 / 5_000
    assert sum(fixed_q[8:]) / len(fixed_q[8:]) > 2 * block_ms
    assert sum(bound_q[8:]) / len(bound_q[8:]) < block_ms / 2
    assert bound.window_bytes < 3 * 312_000 and bound.acked_bytes == 64 * 312_000


def test_a_delay_bound_window_halves_once_per_window_of_acks_and_grows_back():
    """Over the target: halved, and not again for the acks of what went before the halving; within
    it: one item more per window's worth of acks; an ack that covers no whole item: no sample."""
    w = DelayBoundWindow(window_bytes=1000, target_queue_ms=10.0)
    for _ in range(4):
        w.sent_at(250, 0.0)
    w.ack_at(250, 5.0)  # the base delay
    w.ack_at(500, 40.0)  # 35 ms of queue: halved
    w.ack_at(750, 45.0)  # the same burst's acks: not halved again
    w.ack_at(1000, 60.0)
    assert w.window_bytes == 500 and w.queue_ms == pytest.approx(55.0)
    w.sent_at(250, 60.0)
    w.ack_at(1250, 66.0)  # within the target: 250 * 250 / 500 more
    assert w.window_bytes == 625 and w.acked_bytes == 1250
    w.sent_at(250, 70.0)
    w.ack_at(1300, 90.0)  # part of an item: no delay sample
    assert w.window_bytes == 625 and w.queue_ms == pytest.approx(1.0)
    w.ack_at(1500, 200.0)  # far over the target, past the halving's hold: halved again
    assert w.window_bytes == 312


def test_a_delay_bound_window_stays_at_one_item_or_more_and_grows_back_an_item_an_ack():
    """One item in flight whose acks keep showing a queue (a busy receiver): the window halves to one
    item and no lower, so the first ack within the target lets two items go, not the whole window."""
    w = DelayBoundWindow(window_bytes=4000, target_queue_ms=10.0)
    w.sent_at(1000, 0.0)
    w.ack_at(1000, 5.0)  # the base delay
    clock = 5.0
    for _ in range(12):  # each ack 50 ms over the base: halved each time (one item per window of acks)
        w.sent_at(1000, clock)
        clock += 55.0
        w.ack_at(w.sent_bytes, clock)
        assert w.window_bytes >= 1000
    assert w.window_bytes == 1000
    w.sent_at(1000, clock)
    w.ack_at(w.sent_bytes, clock + 5.0)  # no queue: one item more
    assert w.window_bytes == 2000


def test_a_delay_bound_window_never_shrinks_below_an_item_larger_than_it():
    """An item larger than the window goes alone; a queue in its acks leaves the window as it is."""
    w = DelayBoundWindow(window_bytes=1000, target_queue_ms=10.0)
    w.sent_at(5000, 0.0)
    w.ack_at(5000, 5.0)
    w.sent_at(5000, 5.0)
    w.ack_at(10_000, 100.0)
    assert w.window_bytes == 1000 and w.fits(5000)


def test_a_delay_bound_window_resumes_where_the_links_last_flow_ended():
    """The next flow over a slow link starts at the window the last one ended with (within one
    byte and its own bound) and measures its own base delay."""
    last = DelayBoundWindow(window_bytes=4 * 312_000, target_queue_ms=20.0)
    link_acks(last, 312_000, 32, rtt_ms=55.0, bytes_per_ms=5_000)
    assert last.window_bytes < last.max_bytes
    nxt = DelayBoundWindow(window_bytes=4 * 312_000, target_queue_ms=20.0)
    nxt.resume(last.window_bytes)
    assert nxt.window_bytes == last.window_bytes and nxt.max_bytes == 4 * 312_000
    assert nxt.base_delay_ms == float("inf")
    queues = link_acks(nxt, 312_000, 8, rtt_ms=55.0, bytes_per_ms=5_000)
    assert max(queues) < 2 * 312_000 / 5_000  # never the three queued blocks of a fresh window
    wide = DelayBoundWindow(window_bytes=1000, target_queue_ms=20.0)
    wide.resume(10**9)
    assert wide.window_bytes == 1000
    wide.resume(0)
    assert wide.window_bytes == 1


def test_a_resumed_window_on_a_link_whose_round_trip_grew_is_not_read_as_queueing():
    """The link's round trip grew from 6 to 55 ms since the last flow: the next flow's base is its
    own, so a window of one item grows back rather than staying pinned at the least."""
    w = DelayBoundWindow(window_bytes=4 * 156_000, target_queue_ms=20.0)
    w.resume(156_000)
    link_acks(w, 156_000, 24, rtt_ms=55.0, bytes_per_ms=62_500)
    assert w.window_bytes > 156_000 and w.base_delay_ms >= 55.0
