"""Unit tests of the gateway's and the edge service's logic with in-memory doubles at every
seam (``MemoryEngines``, ``MemoryBlockStore``, ``MemoryHead``, ``InProcessLink``); no vLLM,
no ONNX Runtime, no network. The same paths on real engines are in ``tests/engines/test_split_e2e.py``."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest

from tandem.common.protocol.errors import (
    DeadlineExceeded,
    InvalidRequest,
    QuotaExceeded,
    SessionOutOfSync,
    TandemError,
    UploadTimeout,
)
from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import Sampling
from tandem.common.runtime.logs import new_request_id
from tandem.common.wire import chunks as wire
from tandem.common.wire.messages import Commit, KVBlock, TurnHeader
from tandem.edge.compute.head import HeadInput
from tandem.edge.events import ChatTurn, TurnDone
from tandem.edge.link import framing
from tandem.stages import TTFT_STAGES, Stage
from tests.doubles import HKV, MANIFEST, B, D, H, K, TamperLink, ToyTokenizer, rechunk, toy_stack
from tests.helpers import LONG, Sent, chat, run, turn


@pytest.fixture
async def toy():
    t = await toy_stack()
    yield t
    await t.batcher.stop()


async def test_split_turn_loads_the_aligned_prefix_and_times_every_stage(toy):
    done = await run(toy.edge, turn(LONG))
    n = done.prompt_tokens
    assert done.head_tokens == n and done.output_tokens == 8 and done.split_layer == 2
    assert done.external_tokens == n // B * B > 0
    assert {Stage.TOKENIZE, Stage.EDGE_HEAD, Stage.ENCODE, Stage.UPLINK, Stage.TTFT, Stage.TOTAL} <= set(done.timings)
    assert {Stage.CLOUD_STORE_PUT, Stage.CLOUD_TAIL_PREFILL, Stage.CLOUD_DECODE} <= set(done.timings)
    # the same prompt computed without the split (direct) gives the same tokens: loads equal computes
    direct = await run(toy.edge, turn(LONG, mode=Mode.DIRECT))
    assert direct.split_layer == 0 and direct.external_tokens == 0


async def test_second_turn_sends_only_new_blocks(toy):
    first = await run(toy.edge, turn(LONG, "s1"))
    convo = (("user", LONG), ("assistant", "ok"), ("user", "and more words to make a new block or two, or three."))
    second = await run(
        toy.edge,
        ChatTurn(messages=convo, prompt="", session_id="s1", sampling=Sampling(max_new_tokens=8), mode=Mode.SPLIT),
    )
    assert second.head_tokens < second.prompt_tokens
    assert second.sent_bytes.kv_bytes < first.sent_bytes.kv_bytes
    assert second.external_tokens == second.prompt_tokens // B * B


async def test_edits_and_regenerations_send_only_what_changed():
    """An edited last message resends only the tokens past the edit (and the KV
    blocks that hold them); a regenerated answer resends one token. The answers equal those of a
    fresh session with the same conversation, and the cloud's session is the new conversation."""
    sent = Sent()
    toy = await toy_stack(lambda link: TamperLink(link, sent))
    try:
        await run(toy.edge, chat(LONG, session="e"))
        await run(toy.edge, chat(LONG, "ok", "tell me more about the fox", session="e"))
        cloud = toy.cloud_session("e")
        assert cloud is not None
        edited = chat(LONG, "ok", "tell me more about the dog instead", session="e")
        ids = toy.edge.tokenize(edited)
        c = next(i for i, (a, b) in enumerate(zip(ids, cloud.token_ids, strict=False)) if a != b)
        sent.take()
        done = await run(toy.edge, edited)
        assert sent.take() == (list(range(c, len(ids))), list(range(c // B, len(ids) // B)))
        fresh = await run(toy.edge, replace(edited, session_id="fresh"))
        assert done.output_token_ids == fresh.output_token_ids
        assert done.external_tokens == len(ids) // B * B
        assert cloud.token_ids == ids and len(cloud.leaves) == len(ids) // B

        sent.take()
        again = await run(toy.edge, edited)  # regenerate: the same conversation once more
        last_block = [len(ids) // B - 1] if len(ids) % B == 0 else []
        assert sent.take() == ([len(ids) - 1], last_block)
        assert again.output_token_ids == fresh.output_token_ids

        short = toy.edge.tokenize(chat(LONG))
        shorter = await run(toy.edge, chat(LONG, session="e"))  # back to the first turn's conversation
        assert sent.take() == ([len(short) - 1], [len(short) // B - 1] if len(short) % B == 0 else [])
        first = await run(toy.edge, chat(LONG, session="fresh2"))
        assert shorter.output_token_ids == first.output_token_ids
    finally:
        await toy.batcher.stop()


async def test_resend_from_token_0_never_reuses_kv_of_other_activations():
    """Ids X with X's activations, then from token 0 the same ids with the
    activations of another prompt Y: the answer equals a cold request with ids X and Y's activations."""
    swap: dict[str, np.ndarray] = {}

    def to_y(item, attempt):
        if "y" in swap and isinstance(item, wire.Chunk):
            return rechunk(item, swap["y"][item.token_offset : item.token_offset + item.num_tokens])
        return item

    toy = await toy_stack(link_wrapper=lambda link: TamperLink(link, to_y))
    try:
        x_text, y_text = LONG, LONG.upper()
        ids_y = ToyTokenizer().apply_chat_template([{"role": "user", "content": y_text}])
        swap_y = (await toy.batcher.run(HeadInput(np.asarray(ids_y, np.int64)))).hidden
        honest = await run(toy.edge, turn(x_text, "victim"))
        swap["y"] = swap_y
        toy.edge.sessions.discard("victim")  # the edge forgot the session: it resends from token 0
        resent = await run(toy.edge, turn(x_text, "victim"))
        cold = await run(toy.edge, turn(x_text))  # stateless: nothing stored to reuse
        assert resent.output_token_ids == cold.output_token_ids != honest.output_token_ids
        # and again after a "restart" that keeps the store: a fresh session table
        toy.lose_cloud_sessions()
        toy.edge.sessions.discard("victim")
        again = await run(toy.edge, turn(x_text, "victim"))
        assert again.output_token_ids == cold.output_token_ids
    finally:
        await toy.batcher.stop()


async def test_a_failed_upload_leaves_both_sides_unchanged():
    def nan_chunk(item, attempt):
        if isinstance(item, wire.Chunk) and item.seq == 1:
            return rechunk(item, np.full((item.num_tokens, H), np.nan, np.float32))
        return item

    toy = await toy_stack()
    try:
        await run(toy.edge, turn("hello there", "s"))
        edge_before = toy.edge.sessions.get("s").snapshot()
        cloud_before = toy.cloud_session("s")
        v = cloud_before.version
        toy.edge.conn.link = TamperLink(toy.edge.conn.link, nan_chunk)
        with pytest.raises(InvalidRequest, match="NaN"):
            await run(toy.edge, turn(LONG, "s"))
        with pytest.raises(InvalidRequest, match="NaN"):
            await run(toy.edge, turn(LONG, "new-session"))
        s = toy.edge.sessions.get("s")
        assert s.token_ids == edge_before.token_ids and s.cloud_tokens == edge_before.cloud_tokens
        assert "new-session" not in toy.edge.sessions  # a failed first turn keeps nothing
        assert toy.cloud_session("s").version == v
        assert toy.gateway.receiver.budget.uploads == 0 and toy.gateway.receiver.budget.nbytes == 0
    finally:
        await toy.batcher.stop()


def header_for(gw, ids, session="s", cached=0, **kw) -> TurnHeader:
    p = gw.params
    n_chunks = -(-(len(ids) - cached) // p.chunk_tokens)
    return TurnHeader(
        request_id="r",
        session_id=session,
        params_version=p.params_version,
        split_layer=gw.manifest.split_layer,
        prompt_token_ids=tuple(ids),
        cached_tokens=cached,
        num_chunks=n_chunks,
        num_kv_blocks=len(ids) // B,
        sampling=Sampling(max_new_tokens=4),
        **kw,
    )


async def forever():
    await asyncio.Event().wait()
    yield None


async def test_stalled_uploads_cannot_lock_out_the_sessions_owner(toy):
    """Two streams send a header for a session and then nothing; the owner's
    normal turn still completes while they stall."""
    await run(toy.edge, turn("hello there", "owner"))
    ids = ToyTokenizer().apply_chat_template([{"role": "user", "content": LONG}])
    stalls = [
        asyncio.create_task(_drain(toy.gateway.run_turn(header_for(toy.gateway, ids, "owner"), forever())))
        for _ in range(2)
    ]
    await asyncio.sleep(0.05)
    done = await run(toy.edge, turn("hello there, again", "owner"))
    assert done.output_tokens == 8 and not any(t.done() for t in stalls)
    for t in stalls:
        t.cancel()
    await asyncio.gather(*stalls, return_exceptions=True)


async def _drain(agen):
    async for _ in agen:
        pass


async def test_waiting_for_the_session_is_bounded_by_the_deadline(toy):
    await run(toy.edge, turn("hello", "busy"))
    session = toy.cloud_session("busy")
    loop = asyncio.get_running_loop()
    ids = ToyTokenizer().apply_chat_template([{"role": "user", "content": "hello"}])
    await session.lock.acquire()
    try:
        s, p, rid = toy.edge.sessions.get("busy"), toy.edge.conn.params(K), new_request_id()
        s.forget_cloud_past(0)  # all of it, as a resend from token 0
        base = TurnHeader(
            request_id=rid,
            session_id="busy",
            params_version=p.params_version,
            split_layer=K,
            prompt_token_ids=tuple(ids),
            cached_tokens=0,
            num_chunks=0,
            num_kv_blocks=0,
            sampling=Sampling(),
            link_id=toy.edge.conn.negotiated.link_id,
        )
        body = framing.split_turn(s, base, p, framing.block_ids(ids, p, MANIFEST.compatibility_key(), "busy", rid))

        async def items():
            for c in body.chunks:
                yield c
            for b in body.blocks.values():
                yield b
            yield Commit(leaf_count=body.leaf_count, merkle_root=body.merkle_root)
            await asyncio.Event().wait()

        t = toy.gateway.run_turn(body.header, items(), "in-process", loop.time() + 0.3)  # the session owner
        with pytest.raises(DeadlineExceeded, match="waiting for session"):
            await _drain(t)
    finally:
        session.lock.release()


async def test_upload_is_bounded_by_the_upload_timeout_and_deadline():
    toy = await toy_stack(upload_timeout_s=0.2)
    try:
        ids = ToyTokenizer().apply_chat_template([{"role": "user", "content": LONG}])
        with pytest.raises(UploadTimeout):
            await _drain(toy.gateway.run_turn(header_for(toy.gateway, ids), forever()))
        assert toy.gateway.receiver.budget.uploads == 0
    finally:
        await toy.batcher.stop()


async def test_oversized_payloads_are_refused_on_arrival(toy):
    """A 5 MiB chunk on a link of small chunks is INVALID_ARGUMENT at once."""
    ids = ToyTokenizer().apply_chat_template([{"role": "user", "content": LONG}])
    gw = toy.gateway
    header = header_for(gw, ids)
    chunk = wire.split(np.zeros((16, H), np.float32), 0, 16, params_version=header.params_version)[0]
    big = replace(chunk, payload=bytes(5 << 20), crc32c=wire.crc32c(bytes(5 << 20)))

    async def body():
        yield big
        await asyncio.Event().wait()  # never commits: the refusal must not wait for the end

    with pytest.raises(InvalidRequest, match="payload bytes"):
        await _drain(gw.run_turn(header, body()))
    block = KVBlock(
        leaf_index=0,
        block_hash=b"x" * 32,
        layer_lo=0,
        layer_hi=2,
        codec=wire.Codec.NONE,
        raw_nbytes=1,
        payload=bytes(5 << 20),
        leaf_hash=b"y" * 32,
        params_version=header.params_version,
    )

    async def body2():
        yield block
        await asyncio.Event().wait()

    with pytest.raises(InvalidRequest):
        await _drain(gw.run_turn(header, body2()))
    assert gw.receiver.budget.uploads == 0 and gw.registry.max_message_bytes() < 5 << 20


async def test_uploads_in_flight_are_bounded_per_edge_and_in_total():
    toy = await toy_stack(max_uploads_per_peer=2, max_uploads=3)
    try:
        gw = toy.gateway
        ids = ToyTokenizer().apply_chat_template([{"role": "user", "content": LONG}])
        stalls = [
            asyncio.create_task(_drain(gw.run_turn(header_for(gw, ids, f"s{i}"), forever(), "edge-a")))
            for i in range(2)
        ]
        await asyncio.sleep(0.05)
        with pytest.raises(QuotaExceeded):
            await _drain(gw.run_turn(header_for(gw, ids, "s3"), forever(), "edge-a"))
        other = asyncio.create_task(_drain(gw.run_turn(header_for(gw, ids, "s4"), forever(), "edge-b")))
        await asyncio.sleep(0.05)
        with pytest.raises(QuotaExceeded):
            await _drain(gw.run_turn(header_for(gw, ids, "s5"), forever(), "edge-c"))
        for t in [*stalls, other]:
            t.cancel()
        await asyncio.gather(*stalls, other, return_exceptions=True)
        assert gw.receiver.budget.uploads == 0 and gw.receiver.budget.nbytes == 0
    finally:
        await toy.batcher.stop()


async def test_a_restarted_cloud_serves_the_next_turn_from_its_store():
    """The gateway loses its memory (a restart) but not its store: the next turn
    sends only its new tokens and answers as a fresh session would."""
    sent = Sent()
    toy = await toy_stack(lambda link: TamperLink(link, sent))
    try:
        await run(toy.edge, chat(LONG, session="s"))
        n1 = len(toy.edge.tokenize(chat(LONG)))
        toy.lose_cloud_sessions(stored=False)  # as after a cloud restart that kept its store
        sent.take()
        second = chat(LONG, "ok", "and more", session="s")
        done = await run(toy.edge, second)
        n2 = len(toy.edge.tokenize(second))
        assert sent.take() == (list(range(n1, n2)), list(range(n1 // B, n2 // B)))
        fresh = await run(toy.edge, replace(second, session_id="fresh"))
        assert done.output_token_ids == fresh.output_token_ids
    finally:
        await toy.batcher.stop()


async def test_cloud_session_loss_is_answered_by_a_resend_from_token_0(toy):
    await run(toy.edge, turn("hello there", "s"))
    toy.lose_cloud_sessions()  # as after a cloud restart that lost its store
    done = await run(toy.edge, turn("hello there, and more", "s"))
    assert done.head_tokens < done.prompt_tokens and done.output_tokens == 8


async def test_edge_sessions_are_bounded_by_bytes():
    """Many long sessions stay within the configured byte bound (LRU)."""
    toy = await toy_stack(edge_session_bytes=60_000)
    try:
        for i in range(8):
            await run(toy.edge, turn(LONG, f"s{i}", n=2))
            assert toy.edge.sessions.nbytes() <= 60_000
        assert len(toy.edge.sessions) < 8 and "s7" in toy.edge.sessions
    finally:
        await toy.batcher.stop()


async def test_a_session_out_of_sync_twice_is_an_error():
    def always_stale(item, attempt):
        return replace(item, cached_tokens=1) if isinstance(item, TurnHeader) and item.cached_tokens == 0 else item

    toy = await toy_stack()
    try:
        toy.edge.conn.link = TamperLink(toy.edge.conn.link, lambda i, a: i)
        await run(toy.edge, turn("hi", "s"))
        toy.lose_cloud_sessions()
        toy.edge.conn.link = TamperLink(toy.edge.conn.link, always_stale)
        with pytest.raises((SessionOutOfSync, InvalidRequest)):
            await run(toy.edge, turn("hi there", "s"))
    finally:
        await toy.batcher.stop()


async def test_stop_strings_end_the_output_before_them(toy):
    full = await run_text(toy.edge, turn(LONG, n=24))
    stop = full[10:13]
    first = full.find(stop)
    text = await run_text(toy.edge, replace(turn(LONG, n=24), stop=(stop, "never-there")))
    assert text == full[:first] and stop not in text


async def run_text(svc, t: ChatTurn) -> str:
    parts = []
    async for ev in svc.chat(t):
        if not isinstance(ev, TurnDone):
            parts.append(ev.text)
    return "".join(parts)


def test_text_stream_holds_back_a_possible_stop_string():
    from tandem.edge.detok import TextStream

    s = TextStream(ToyTokenizer(), stop=("cde",))
    assert s.feed([0, 1]) == ""  # "ab": could still become "...cde"? keep 2 chars back
    assert s.feed([2]) == "a"  # "abc"
    assert s.feed([3, 4, 5]) == "b" and s.stopped  # "abcdef": stop at "cde"
    s = TextStream(ToyTokenizer(), stop=("zz",))
    assert s.feed([0, 1, 2]) == "ab" and s.flush() == "c"


async def test_zstd_payloads_must_be_exactly_one_frame_of_the_announced_size():
    """On a zstd link, a chunk whose payload is a valid frame plus garbage (CRC over
    it all) is NACKed like a CRC failure and, sent again the same, ends INVALID_ARGUMENT; a KV block
    that does not decode is asked for again (repair), then the turn fails."""
    from tandem.common.protocol.errors import CorruptPayload, MerkleMismatch

    def garbage_after_frame(item, attempt):
        if isinstance(item, wire.Chunk) and item.seq == 0:
            payload = item.payload + b"garbage"
            return replace(item, payload=payload, crc32c=wire.crc32c(payload))
        return item

    def bomb_block(item, attempt):
        if isinstance(item, KVBlock) and item.leaf_index == 0:
            import zstandard

            bomb = zstandard.ZstdCompressor().compress(bytes(1 << 20))  # declares 1 MiB, not the block size
            return replace(item, payload=bomb)
        return item

    for fn, err in ((garbage_after_frame, CorruptPayload), (bomb_block, MerkleMismatch)):
        toy = await toy_stack(link_wrapper=lambda link, fn=fn: TamperLink(link, fn), codecs=[wire.Codec.ZSTD])
        try:
            with pytest.raises(err):
                await run(toy.edge, turn(LONG))
            assert toy.gateway.receiver.budget.uploads == 0
        finally:
            await toy.batcher.stop()
    toy = await toy_stack(codecs=[wire.Codec.ZSTD])  # the honest zstd link works
    try:
        done = await run(toy.edge, turn(LONG))
        assert done.sent_bytes.kv_bytes < 2 * done.prompt_tokens // B * (2 * 2 * 4 * B * 4)
    finally:
        await toy.batcher.stop()


async def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing(toy):
    """The edge checks a prompt's length before tokenizing it, so megabytes of text are never tokenized."""
    calls = []
    tok = toy.edge.tok
    orig = tok.apply_chat_template
    tok.apply_chat_template = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        with pytest.raises(InvalidRequest, match="cannot fit"):
            await run(toy.edge, turn("x" * (toy.edge.max_prompt_chars + 1)))
        assert not calls
        with pytest.raises(InvalidRequest, match=r"temperature must be a number in \[0, 2\], got 3.0"):
            await run(toy.edge, replace(turn("hi"), sampling=Sampling(max_new_tokens=2, temperature=3.0)))
    finally:
        tok.apply_chat_template = orig


@pytest.mark.parametrize(
    "kv_dtype", [wire.WireDtype.FP16, wire.WireDtype.INT8, wire.WireDtype.INT4, wire.WireDtype.INT8_HADAMARD]
)
async def test_kv_blocks_travel_in_the_negotiated_format_and_are_stored_decoded(kv_dtype):
    """Each KV format end to end: the link agrees on it, blocks travel in it (and count its bytes),
    the cloud verifies the leaf over those bytes and stores exactly their float32 decoding; a
    second turn sends only the new blocks. A cloud that does not allow the edge's formats serves
    direct only, with a note."""
    from tandem.common.wire.kvblocks import LayerRange, part_key, split_blocks
    from tandem.common.wire.kvwire import decode_kv, encode_kv, kv_raw_nbytes

    toy = await toy_stack(kv_wire_dtypes=[kv_dtype], offer_kw={"kv_wire_dtypes": (kv_dtype, wire.WireDtype.FP32)})
    try:
        assert toy.edge.conn.params(K).kv_wire_dtype == kv_dtype
        done = await run(toy.edge, turn(LONG, "s1"))
        shape = (K, 2, HKV, B, D)
        n_blocks = done.prompt_tokens // B
        per_block = kv_raw_nbytes(shape, kv_dtype)  # + the message's hashes and fields, < 128 bytes
        assert n_blocks * per_block < done.sent_bytes.kv_bytes < n_blocks * (per_block + 128)
        cloud, edge = toy.cloud_session("s1"), toy.edge.sessions.peek("s1")
        assert len(cloud.leaves) == n_blocks
        for j, (leaf, blk) in enumerate(zip(cloud.leaves, split_blocks(edge.kv, B, 0, n_blocks), strict=True)):
            stored = toy.store.get(part_key(leaf, LayerRange(lo=0, hi=K)))
            want = decode_kv(encode_kv(blk, kv_dtype), kv_dtype, shape)
            assert stored == want.tobytes(), j
        convo = (("user", LONG), ("assistant", "ok"), ("user", "and more words to make a new block or two, or three."))
        second = await run(
            toy.edge,
            ChatTurn(messages=convo, prompt="", session_id="s1", sampling=Sampling(max_new_tokens=8), mode=Mode.SPLIT),
        )
        new_blocks = second.prompt_tokens // B - n_blocks
        assert new_blocks * per_block < second.sent_bytes.kv_bytes < new_blocks * (per_block + 128)
    finally:
        await toy.batcher.stop()
    toy = await toy_stack(kv_wire_dtypes=[kv_dtype], offer_kw={"kv_wire_dtypes": (wire.WireDtype.FP32,)})
    try:
        assert toy.edge.conn.params(K) is None and "KV block format" in toy.edge.conn.negotiated.note
        assert (await run(toy.edge, turn(LONG, mode=Mode.DIRECT))).split_layer == 0
        with pytest.raises(TandemError, match="common split layer"):
            await run(toy.edge, turn(LONG))
    finally:
        await toy.batcher.stop()


@pytest.mark.parametrize("pins", [True, False], ids=["pinned", "control-without-pins"])
async def test_blocks_of_a_request_in_flight_are_never_evicted(monkeypatch, pins):
    """While a turn is in flight, its head and tail KV blocks (this turn's and the
    session's earlier ones) are pinned: a flood of other writes, many times the store's bound,
    between the tail prefill and the decode engine's load evicts none of them (the decode loads
    every block). Once the turn ends nothing stays pinned. The control run without pins shows the
    flood does evict them (the decode engine then recomputes)."""
    from tandem.cloud.uploads.pins import Pins

    if not pins:

        async def no_pin(self, turn, keys):
            return None

        monkeypatch.setattr(Pins, "pin", no_pin)
    toy = await toy_stack()
    try:
        await run(toy.edge, chat(LONG, session="p"))  # a first turn: its blocks are the session's past
        toy.store.size_limit_bytes = 64 << 10
        inner = toy.engines.tail_prefill
        pinned_during: list[int] = []

        async def flood_after(*a, **kw):
            res = await inner(*a, **kw)
            pinned_during.append(len(toy.store._pins))
            for i in range(200):
                toy.store.put(f"junk{i}", bytes(4096))
            return res

        toy.engines.tail_prefill = flood_after
        t = chat(LONG, "ok", "tell me more", session="p")
        done = await run(toy.edge, t)
        n = done.prompt_tokens
        full = (n - 1) // B * B
        if pins:
            assert pinned_during[0] >= 2 * (n // B)  # head and tail keys of every full block
            assert done.external_tokens == full
        else:
            assert done.external_tokens < full
        assert toy.store._pins == {}
    finally:
        await toy.batcher.stop()


async def test_a_pin_that_finishes_after_its_turn_ended_is_released():
    """A keep (after a cut upload) pinning while the turn's own unpin runs: whatever the order of
    the two store calls, nothing stays pinned (not even one key until its lease lapses)."""
    import time

    from tandem.cloud.turn import Turn

    toy = await toy_stack()
    try:
        gw, st = toy.gateway, toy.store
        real_pin, real_unpin = st.pin, st.unpin

        def slow_pin(keys, owner, lease):
            keys = list(keys)
            if "K2" in keys:
                time.sleep(0.2)
            real_pin(keys, owner, lease)

        def slow_unpin(keys, owner):
            time.sleep(0.4)
            real_unpin(keys, owner)

        st.pin, st.unpin = slow_pin, slow_unpin
        turn = Turn(
            TurnHeader(
                request_id="r",
                session_id="s",
                params_version=1,
                split_layer=K,
                prompt_token_ids=(1, 2, 3),
                cached_tokens=0,
                num_chunks=1,
                num_kv_blocks=0,
                sampling=Sampling(max_new_tokens=1),
            ),
            None,
        )
        await gw.pins.pin(turn, ["K1"])

        async def keep() -> None:
            await gw.pins.pin(turn, ["K2"])

        async def turn_ends() -> None:
            await asyncio.sleep(0.05)
            turn.ended = True
            await gw.pins.unpin(turn)

        await asyncio.gather(keep(), turn_ends())
        assert st._pins == {} and not turn.pinned
    finally:
        await toy.batcher.stop()


# --- tail KV written after the first token (the connector's writer thread) ------------------------------


async def _until(cond, timeout_s: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < end, "condition not reached"
        await asyncio.sleep(0.01)


async def test_the_decode_waits_for_tail_writes_that_land_after_the_first_token(toy):
    """The tail's KV reaches the store after its first token: the decode still loads every aligned
    block (none recomputed), and the wait is timed, outside the first token's stages."""
    ref = await run(toy.edge, turn(LONG, n=6))
    toy.engines.save_delay_s = 0.05
    late = await run(toy.edge, turn(LONG, n=6))
    assert late.external_tokens == ref.external_tokens == late.prompt_tokens // B * B > 0
    assert late.output_token_ids == ref.output_token_ids
    assert late.timings[Stage.CLOUD_TAIL_SAVE_WAIT] > 20
    assert Stage.CLOUD_TAIL_SAVE_WAIT not in TTFT_STAGES


async def test_tail_writes_that_never_land_are_recomputed_after_the_bounded_wait():
    from tandem.cloud import metrics

    t = await toy_stack(tail_save_wait_s=0.05)
    try:
        ref = await run(t.edge, turn(LONG, n=6))
        t.engines.save_delay_s = None  # the store refuses the tail's writes
        before = metrics.TAIL_SAVE_MISSING._value.get()
        lost = await run(t.edge, turn(LONG + " once more", n=6))
        # the head blocks load, the tail blocks do not: the decode loads nothing past them and recomputes
        assert lost.external_tokens == 0 < ref.external_tokens
        assert lost.output_tokens == 6
        assert metrics.TAIL_SAVE_MISSING._value.get() - before == lost.prompt_tokens // B
        assert 50 <= lost.timings[Stage.CLOUD_TAIL_SAVE_WAIT] < 2000  # the whole bound, not more
    finally:
        await t.batcher.stop()


@pytest.mark.parametrize("n", [1, 6])
async def test_a_stateless_turn_drops_its_kv_after_the_late_tail_writes_even_when_its_client_leaves(toy, n):
    """Whether the turn ends at token 1, runs to the end, or loses its client right after token 1,
    its head and tail blocks leave the store once the tail's late writes have landed."""
    toy.engines.save_delay_s = 0.1
    done = await run(toy.edge, turn(LONG, n=n))
    assert done.output_tokens == n
    await _until(lambda: toy.store.volume_bytes() == 0)
    events = toy.edge.chat(turn(LONG + " and one more", n=n), None)
    async for _ in events:
        break  # the client leaves at its first event
    await events.aclose()
    await asyncio.sleep(0.15)  # past the late writes
    await _until(lambda: toy.store.volume_bytes() == 0)
    await toy.gateway.background.finish(1.0)
    assert not toy.gateway.background.tasks
