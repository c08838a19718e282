"""Remote prefill's faults on the in-memory stack: a downlink cut mid-KV (the cloud finishes the
reply), a corrupt block (caught by its CRC32C or its leaf, asked for again, never used), a block
outside the link's limits (the download is dropped), the cloud gone after the takeover (the reply
completes on the edge), the edge restarted after the switch (the next turn resyncs), and the
blocks pinned in the cloud's store until the edge acknowledged them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tandem.common.protocol.errors import LinkLost
from tandem.common.protocol.modes import Mode
from tandem.common.wire import chunks as wire
from tandem.common.wire.kvcodec import KVBlock
from tandem.common.wire.kvdown import KVDownAck, Takeover
from tandem.edge.events import TurnDone
from tests.doubles import B
from tests.helpers import RP_LONG, rp_chat, rp_turn, stream
from tests.remote_doubles import DownTamperLink, rp_stack


@pytest.fixture
async def toy():
    t = await rp_stack()
    yield t
    await t.batcher.stop()


def tamper(toy, **kw) -> DownTamperLink:
    """The edge's link to the cloud, wrapped (``DownTamperLink``)."""
    link = toy.edge.conn.link = DownTamperLink(toy.edge.conn.link, **kw)
    return link


async def direct_of(toy, text: str = RP_LONG) -> list[int]:
    return (await stream(toy.edge, rp_turn(text, Mode.DIRECT)))[0]


async def test_a_downlink_cut_mid_kv_leaves_the_whole_reply_to_the_cloud(toy):
    """Blocks after the second never arrive: the edge never takes over and the cloud's reply is
    complete and equal to direct mode's."""
    direct = await direct_of(toy)
    tamper(toy, down=lambda ev, n: None if isinstance(ev, KVBlock) and n > 2 else ev)
    got, done = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL))
    assert got == direct and len(got) == 40 and done.edge_decoded_tokens == 0
    assert toy.gateway.links.running == 0


def flip(b: KVBlock, recrc: bool) -> KVBlock:
    payload = bytes([b.payload[0] ^ 0x01]) + b.payload[1:]
    return replace(b, payload=payload, crc32c=wire.crc32c(payload) if recrc else b.crc32c)


@pytest.mark.parametrize("recrc", [False, True], ids=["crc", "leaf"])
async def test_a_corrupt_block_is_asked_for_again_and_never_used(toy, recrc):
    """The third block arrives with a flipped bit (its CRC32C as sent, or one computed after the
    flip so that only its leaf catches it): the edge asks for exactly that block again, the resent
    copy verifies, the edge takes over and the tokens equal direct mode's."""
    direct = await direct_of(toy)
    link = tamper(toy, down=lambda ev, n: flip(ev, recrc) if isinstance(ev, KVBlock) and n == 3 else ev)
    got, done = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL))
    asked = [a.resend_blocks for a in link.sent if isinstance(a, KVDownAck) and a.resend_blocks]
    assert asked == [(2,)] and got == direct and done.edge_decoded_tokens > 0


async def test_a_block_that_stays_corrupt_is_never_used_and_the_cloud_finishes(toy):
    direct = await direct_of(toy)
    link = tamper(toy, down=lambda ev, n: flip(ev, False) if isinstance(ev, KVBlock) and ev.leaf_index == 1 else ev)
    got, done = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL))
    asked = [a.resend_blocks for a in link.sent if isinstance(a, KVDownAck) and a.resend_blocks]
    assert asked == [(1,), (1,)] and got == direct and done.edge_decoded_tokens == 0


@pytest.mark.parametrize(
    "change", [{"raw_nbytes": 4}, {"leaf_index": 999}, {"layer_hi": 2}, {"wire_dtype": wire.WireDtype.INT8}]
)
async def test_a_block_outside_the_links_limits_drops_the_download(toy, change):
    """Sizes, indices, layers and format are checked on arrival against the turn and the link's
    params: a block outside them ends the download, and the cloud finishes the reply."""
    direct = await direct_of(toy)
    tamper(toy, down=lambda ev, n: replace(ev, **change) if isinstance(ev, KVBlock) and n == 2 else ev)
    got, done = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL))
    assert got == direct and done.edge_decoded_tokens == 0


async def test_the_reply_completes_on_the_edge_when_the_cloud_goes_after_the_takeover(toy):
    """The connection breaks as the takeover goes up (the cloud died): the edge holds the KV and
    every token it received, and decodes the rest; no token repeats or is missing."""
    direct = await direct_of(toy)

    def gone(item):
        if isinstance(item, Takeover):
            raise LinkLost("the cloud went away")
        return item

    tamper(toy, up=gone)
    got, done = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL))
    assert got == direct and done.edge_decoded_tokens > 0 and done.resumes == 0


async def test_the_reply_completes_on_the_edge_when_the_cloud_dies_before_the_kv_came(toy):
    """The connection breaks after 5 tokens, before any KV: the edge computes the prompt itself."""
    direct = await direct_of(toy)

    def cut(ev, n):
        if n > 5 and type(ev).__name__ == "TokensOut":
            raise LinkLost("the cloud went away")
        return None if isinstance(ev, KVBlock) else ev

    tamper(toy, down=cut)
    got, done = await stream(toy.edge, rp_turn(RP_LONG, Mode.REMOTE_PREFILL))
    assert got == direct and done.edge_decoded_tokens == 35


async def test_an_edge_restarted_after_the_switch_resyncs_on_its_next_turn(toy):
    """The edge took turn 1 over, then restarted (its sessions gone): turn 2 brings down every
    block of its prompt from the cloud's store and answers as a fresh session does."""
    _, first = await stream(toy.edge, rp_chat(RP_LONG, session="s"))
    assert first.edge_decoded_tokens > 0
    toy.edge.local.sessions.clear()
    answer = toy.edge.tok.decode(first.output_token_ids)
    second = rp_chat(RP_LONG, answer, "what next?", session="s")
    _, done = await stream(toy.edge, second)
    fresh, _ = await stream(toy.edge, replace(second, session_id="fresh"))
    assert list(done.output_token_ids) == fresh
    assert done.received_kv_bytes == len(toy.edge.tokenize(second)) // B * first.received_kv_bytes // (
        len(toy.edge.tokenize(rp_chat(RP_LONG, session="s"))) // B
    )


async def test_blocks_stay_pinned_until_the_edge_acknowledged_them(toy):
    """While the edge has not acknowledged a block, its store key is pinned (no eviction takes
    it); acknowledged blocks and, at the turn's end, all of them follow the normal eviction."""
    pinned_at_ack: list[tuple[int, int]] = []

    def watch(item):
        if isinstance(item, KVDownAck):
            pinned_at_ack.append((item.verified_blocks, len(toy.store._pins)))
        return item

    tamper(toy, up=watch)
    _, done = await stream(toy.edge, rp_chat(RP_LONG, session="p"))
    n = len(toy.edge.tokenize(rp_chat(RP_LONG, session="p"))) // B
    assert [v for v, _ in pinned_at_ack] == list(range(1, n + 1))
    # at each ack the blocks it acknowledges (and those after them) were still pinned
    assert all(pins >= n - v + 1 for v, pins in pinned_at_ack), pinned_at_ack
    assert not toy.store._pins and isinstance(done, TurnDone)


async def test_the_kv_that_comes_down_stays_within_the_edges_session_bound():
    """Sessions whose KV came down count against the local sessions' byte bound like local mode's,
    also when the cloud decoded the whole reply (the edge's model is slow here): the least recently
    used go first."""
    from tests.remote_doubles import ToyLocal, toy_lm

    toy = await rp_stack()
    bound = 3 * 6144 * 9  # about three sessions of RP_LONG's 7 blocks and its tokens (toy: 6 KB a block)
    toy.edge.local = ToyLocal(toy_lm(), session_bytes=bound, step_delay_s=0.2)
    try:
        for i in range(5):
            _, done = await stream(toy.edge, rp_chat(RP_LONG, session=f"m{i}", n=8))
            assert done.edge_decoded_tokens == 0 and done.received_kv_bytes > 0
            assert toy.edge.local.sessions.nbytes() <= bound
        assert "m4" in toy.edge.local.sessions and "m0" not in toy.edge.local.sessions
    finally:
        await toy.batcher.stop()
