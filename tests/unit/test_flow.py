"""The one flow-control window of a ``Generate`` call's payload (``common.wire.flow``), which the edge's upload
and remote prefill's KV downlink both keep: the sender's window and the receiver's count of each item once."""

from __future__ import annotations

from tandem.common.wire.flow import ReceivedBytes, SendWindow


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
