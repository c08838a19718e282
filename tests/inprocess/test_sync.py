"""On the in-memory doubles: ``SyncSession`` (RFC 6962 consistency
proofs, the cloud naming what it lacks), a restarted gateway serving a session from its store,
and corruption at rest (a flipped bit in an activation piece, a session record or a KV block)
never reaching an answer. Each turn's tokens are checked against a fresh session's."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tandem.cloud.gateway import Gateway
from tandem.cloud.server import build_gateway
from tandem.cloud.sessions.store import piece_key, record_key
from tandem.cloud.turn import as_principal
from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import SyncRequest
from tandem.common.runtime.security import scoped
from tandem.common.wire import merkle
from tandem.common.wire.kvblocks import LayerRange, part_key
from tandem.edge.events import TurnDone
from tandem.edge.link.base import InProcessLink
from tests.doubles import MANIFEST, B, K, TamperLink, cloud_config, toy_stack
from tests.helpers import LONG, Sent, chat, run

TOY_CALLER = as_principal("in-process")


def key_of(session: str) -> str:
    return scoped(TOY_CALLER, session)


@pytest.fixture
async def toy():
    sent = Sent()
    t = await toy_stack(lambda link: TamperLink(link, sent))
    t.sent = sent  # type: ignore[attr-defined]
    yield t
    await t.batcher.stop()


async def two_turns(toy, session: str = "s"):
    """Two turns of one session; returns the third turn's conversation (not yet run)."""
    await run(toy.edge, chat(LONG, session=session))
    await run(toy.edge, chat(LONG, "ok", "tell me more", session=session))
    return chat(LONG, "ok", "tell me more", "fine", "and then what happened to the fox?", session=session)


async def answer_of(toy, convo) -> tuple[int, ...]:
    return (await run(toy.edge, replace(convo, session_id=f"fresh-{id(convo)}"))).output_token_ids


async def restart_gateway(toy) -> Gateway:
    """A new gateway (another instance id) over the same block store, as a cloud process restart
    that kept its store; the edge reconnects to it."""
    gw = build_gateway(cloud_config(), MANIFEST, toy.engines, toy.store)
    toy.gateway = gw
    toy.edge.conn.link.inner = InProcessLink(gw)
    await toy.edge.conn.connect()
    return gw


async def test_a_restarted_cloud_is_synced_before_the_turn_and_gets_only_new_tokens(toy):
    third = await two_turns(toy)
    held = len(toy.cloud_session("s").token_ids)
    await restart_gateway(toy)
    syncs = getattr(toy.edge.conn.link, "syncs", 0)
    toy.sent.take()
    done = await run(toy.edge, third)
    n = done.prompt_tokens
    assert toy.edge.conn.link.syncs == syncs + 1  # the edge saw a new instance: one SyncSession first
    assert toy.sent.take() == (list(range(held, n)), list(range(held // B, n // B)))
    assert done.output_token_ids == await answer_of(toy, third)


@pytest.mark.parametrize("piece", [0, 3, "last"])
async def test_a_lost_or_corrupt_activation_piece_is_resent_from_there_only(toy, piece):
    """The cloud loses its memory, and one activation piece of the session is corrupt at rest:
    the turn's optimistic upload is refused as out of sync, SyncSession names what the cloud holds
    (the prefix before the piece), and only the rest travels."""
    third = await two_turns(toy)
    s = toy.cloud_session("s")
    held = len(s.token_ids)
    pieces = -(-held // B)
    i = pieces - 1 if piece == "last" else piece
    data = s.hidden[i * B : (i + 1) * B].tobytes()
    assert toy.store.corrupt_for_test(piece_key(key_of("s"), data), 40)
    toy.lose_cloud_sessions(stored=False)
    toy.sent.take()
    done = await run(toy.edge, third)
    n = done.prompt_tokens
    tokens, leaves = toy.sent.take()
    # the refused optimistic attempt sent activations from `held`; the synced one from i * B
    resent = tokens[tokens.index(i * B) :] if i * B in tokens else tokens
    assert resent == list(range(i * B, n))
    assert leaves[-(n // B - i) :] == list(range(i, n // B))
    assert done.output_token_ids == await answer_of(toy, third)


async def test_a_corrupt_session_record_means_a_resend_from_token_0(toy):
    third = await two_turns(toy)
    assert toy.store.corrupt_for_test(record_key(key_of("s")), 30)
    toy.lose_cloud_sessions(stored=False)
    toy.sent.take()
    done = await run(toy.edge, third)
    tokens, _ = toy.sent.take()
    assert tokens[-done.prompt_tokens :] == list(range(done.prompt_tokens))
    assert done.output_token_ids == await answer_of(toy, third)


async def test_a_corrupt_kv_block_at_rest_is_never_loaded(toy):
    """A flipped bit in the session's first head block: the engines find it missing (their load
    stops before it; the real engines recompute it, tests/engines/test_split_e2e.py checks those tokens)."""
    third = await two_turns(toy)
    first = toy.cloud_session("s").leaves[0]
    assert toy.store.corrupt_for_test(part_key(first, LayerRange(lo=0, hi=MANIFEST.split_layer)), 100)
    before = toy.store.corrupt_reads
    done = await run(toy.edge, third)
    assert toy.store.corrupt_reads == before + 1
    assert done.external_tokens == 0  # nothing past the corrupt block was loaded either


async def test_sync_proofs_and_the_cloud_naming_its_first_wrong_leaf(toy):
    await two_turns(toy)
    gw, s = toy.gateway, toy.cloud_session("s")
    ids, leaves = list(s.token_ids), list(s.leaves)
    m = len(leaves)
    more = [bytes([7]) * 32, bytes([8]) * 32]  # the edge holds two more blocks than the cloud

    def req(leaf_list, proof_from, proof, tokens=ids + [5] * 2 * B) -> SyncRequest:
        return SyncRequest(
            link_id="",
            session_id="s",
            split_layer=MANIFEST.split_layer,
            token_ids=tuple(tokens),
            leaf_count=len(leaf_list),
            merkle_root=merkle.root(leaf_list),
            proof_from=proof_from,
            consistency_proof=tuple(proof),
            block_size_tokens=B,
        )

    full = leaves + more
    good = await gw.sync_session(req(full, m, merkle.consistency_proof(full, m)), TOY_CALLER)
    assert good.found and good.proven and good.held_tokens == len(ids) and good.held_leaves == m
    assert good.leaf_hashes == ()
    # the edge's tree differs at leaf 2: the proof fails, the cloud hands back its leaves
    other = leaves[:2] + [bytes(32)] + leaves[3:] + more
    bad = await gw.sync_session(req(other, m, merkle.consistency_proof(other, m)), TOY_CALLER)
    assert bad.found and not bad.proven and bad.leaf_hashes == tuple(leaves)
    # the edge holds fewer leaves than the cloud: the cloud checks the prefix root itself
    short = await gw.sync_session(req(leaves[:3], 0, (), ids[: 3 * B + 1]), TOY_CALLER)
    assert short.proven and short.held_tokens == 3 * B + 1
    # another edge's session of the same id, another split layer: nothing
    assert not (await gw.sync_session(req(full, m, ()), "someone-else")).found
    assert not (await gw.sync_session(replace(req(full, m, ()), split_layer=1), TOY_CALLER)).found


@pytest.mark.parametrize(
    "bad",
    [
        dict(session_id=""),
        dict(session_id="x" * 200),
        dict(token_ids=(10**6,)),
        dict(block_size_tokens=B + 1),
        dict(leaf_count=99),
        dict(proof_from=5, leaf_count=1),
        dict(merkle_root=b"short"),
        dict(consistency_proof=(b"x" * 31,)),
        dict(consistency_proof=(bytes(32),) * 65),
    ],
)
async def test_sync_requests_outside_the_limits_are_refused(toy, bad):
    ok = SyncRequest(
        link_id="",
        session_id="s",
        split_layer=MANIFEST.split_layer,
        token_ids=tuple(range(3 * B)),
        leaf_count=3,
        merkle_root=bytes(32),
        proof_from=0,
        consistency_proof=(),
        block_size_tokens=B,
    )
    with pytest.raises(InvalidRequest):
        await toy.gateway.sync_session(replace(ok, **bad), TOY_CALLER)
    await toy.gateway.sync_session(ok, TOY_CALLER)  # the same request within the limits is answered


class DiesMidDecode:
    """Wraps ``MemoryEngines``: the first ``times`` decodes raise ``EngineError`` after ``after``
    tokens, as a cloud whose engine or process died mid-stream."""

    def __init__(self, inner, after: int, times: int = 1, on_death=None) -> None:
        self.inner, self.after, self.times, self.on_death = inner, after, times, on_death
        self.prompts: list[list[int]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def decode(self, request_id, token_ids, kv, sampling):
        from tandem.common.protocol.errors import EngineError

        self.prompts.append(list(token_ids))
        n = 0
        async for step in self.inner.decode(request_id, token_ids, kv, sampling):
            if self.times and n >= self.after:
                self.times -= 1
                if self.on_death is not None:
                    self.on_death()
                raise EngineError("decode engine died")
            n += len(step.token_ids)
            yield step


@pytest.mark.parametrize("mode", [Mode.SPLIT, Mode.DIRECT])
async def test_a_turn_resumes_after_its_cloud_fails_mid_stream_and_repeats_no_token(mode):
    """The decode engine dies after 3 tokens reached the client; the edge waits
    for the cloud to answer again and continues from the prompt plus the emitted tokens: one
    stream of max_new_tokens tokens, none repeated, the resumed request's prompt = prompt + output."""
    toy = await toy_stack()
    flaky = DiesMidDecode(toy.engines, after=3)
    toy.gateway.calls.engines = flaky
    toy.edge.conn.start()
    try:
        t = chat(LONG, session="r" if mode == "split" else "", n=12, mode=mode)
        ids = toy.edge.tokenize(t)
        deltas, done = [], None
        async for ev in toy.edge.chat(t):
            if isinstance(ev, TurnDone):
                done = ev
            else:
                deltas.append(ev.token_ids)
        assert done is not None and done.resumes == 1 and done.finish_reason == "length"
        streamed = [tok for d in deltas for tok in d]
        assert list(done.output_token_ids) == streamed and len(streamed) == done.output_tokens == 12
        assert done.prompt_tokens == len(ids)
        # split: the tail's first token, then 2 decoded; the resumed request's prompt carries them
        emitted = streamed[:4] if mode == "split" else streamed[:3]
        resumed_prompt = flaky.prompts[-1]
        assert resumed_prompt[: len(ids) + len(emitted)] == ids + emitted
    finally:
        await toy.edge.conn.stop()
        await toy.batcher.stop()


async def test_a_failure_with_no_cloud_to_resume_on_is_a_deadline_error_in_time():
    """The cloud fails mid-stream and never comes back: the client gets DeadlineExceeded naming
    the failure, at its deadline (not later)."""
    import time

    from tandem.common.protocol.errors import DeadlineExceeded, EngineError

    class Gone(TamperLink):  # a cloud host that vanished: nothing answers any more
        down = False

        async def negotiate(self, offer):
            if self.down:
                raise EngineError("connection refused")
            return await self.inner.negotiate(offer)

        async def server_info(self, link_id, padding_bytes=0, timeout_s=5.0):
            if self.down:
                raise EngineError("connection refused")
            return await self.inner.server_info(link_id, padding_bytes, timeout_s)

    toy = await toy_stack(lambda link: Gone(link, lambda i, a: i))
    link = toy.edge.conn.link
    toy.gateway.calls.engines = DiesMidDecode(toy.engines, after=2, on_death=lambda: setattr(link, "down", True))
    toy.edge.conn.start()
    try:
        t0 = time.perf_counter()
        with pytest.raises(DeadlineExceeded, match="failed mid-stream"):
            async for _ in toy.edge.chat(chat(LONG, n=12, mode=Mode.DIRECT), 1.5):
                pass
        assert time.perf_counter() - t0 < 1.5 + 1.0
    finally:
        await toy.edge.conn.stop()
        await toy.batcher.stop()


async def test_a_turn_cut_during_its_upload_is_sent_again_once_the_cloud_answers():
    """The connection dies while chunks are in flight (nothing committed,
    no token out): the edge waits for the cloud, sends the turn again and the client sees one
    clean answer, the same as an uncut one's."""
    from tandem.common.protocol.errors import LinkLost
    from tandem.common.wire import chunks as wire

    cut = {"done": False}

    def die_once(item, attempt):
        if isinstance(item, wire.Chunk) and item.seq == 2 and not cut["done"]:
            cut["done"] = True
            raise LinkLost("UNAVAILABLE: connection reset by peer")
        return item

    toy = await toy_stack(lambda link: TamperLink(link, die_once))
    toy.edge.conn.start()
    try:
        t = chat(LONG * 2, session="u", n=6)
        done = await run(toy.edge, t)
        assert cut["done"] and done.resumes == 1 and done.output_tokens == 6
        assert done.output_token_ids == await answer_of(toy, t)
    finally:
        await toy.edge.conn.stop()
        await toy.batcher.stop()


class AckLog(TamperLink):
    """A ``TamperLink`` that also records the ``held_tokens`` of every ``WindowAck`` the edge gets."""

    def __init__(self, inner, fn) -> None:
        super().__init__(inner, fn)
        self.held: list[int] = []

    def open(self, timeout_s):
        call, log = super().open(timeout_s), self

        class Call:
            send, close_send, cancel = call.send, call.close_send, call.cancel

            async def events(self):
                from tandem.common.wire.messages import WindowAck

                async for ev in call.events():
                    if isinstance(ev, WindowAck):
                        log.held.append(ev.held_tokens)
                    yield ev

        return Call()


@pytest.mark.parametrize("restart", [False, True], ids=["same-cloud", "restarted-cloud"])
async def test_an_upload_cut_midway_resumes_from_the_last_acknowledged_token(monkeypatch, restart):
    """A session turn's upload is cut (LinkLost) after the cloud acknowledged
    keeping part of it (``WindowAck.held_tokens``); the resumed upload sends exactly the tokens
    and KV blocks past the last acknowledged token, on the same cloud or on a restarted one (a new
    instance over the same store, as after ``kill -9``: it learns the kept prefix from the store
    through ``SyncSession``). The answer equals an uncut turn's."""
    from tandem.cloud.links import negotiation
    from tandem.common.protocol.errors import LinkLost
    from tandem.common.wire import chunks as wire

    monkeypatch.setattr(negotiation, "MIN_WINDOW_BYTES", 0)  # a window of a few items: acks as it goes
    monkeypatch.setattr(negotiation, "MAX_WINDOW_BYTES", 0)
    sent = Sent()
    state: dict = {"cut_at": None}
    toy = None

    def cut_once(item, attempt):
        sent(item, attempt)
        if isinstance(item, wire.Chunk) and item.seq == 20 and state["cut_at"] is None:
            state["cut_at"] = max(toy.edge.conn.link.held, default=0)
            state["sent_before"] = sent.take()
            raise LinkLost("UNAVAILABLE: connection reset by peer")
        return item

    toy = await toy_stack(lambda link: AckLog(link, cut_once))
    assert toy.edge.conn.params(K).inflight_window_bytes < 64 << 10
    toy.edge.conn.start()
    try:
        t = chat(LONG * 2, session="u", n=6, mode=Mode.SPLIT)
        if restart:  # the cut also takes the cloud down; a new instance over the same store answers
            real_cut = cut_once

            def cut_and_restart(item, attempt):
                try:
                    return real_cut(item, attempt)
                except LinkLost:
                    gw = build_gateway(cloud_config(), MANIFEST, toy.engines, toy.store)
                    toy.gateway = gw
                    toy.edge.conn.link.inner = InProcessLink(gw)
                    raise

            toy.edge.conn.link.fn = cut_and_restart
        syncs = getattr(toy.edge.conn.link, "syncs", 0)
        done = await run(toy.edge, t)
        held, n = state["cut_at"], done.prompt_tokens
        assert held is not None and 0 < held < n and done.resumes == 1
        before, after = state["sent_before"], sent.take()
        assert before[0][0] == 0  # the first attempt started from token 0
        # only what was not acknowledged; a restarted cloud may hold more (a keep that finished
        # after the last ack reached the edge), which SyncSession finds
        start = held if not restart else after[0][0]
        assert held <= start < n and after == (list(range(start, n)), list(range(start // B, n // B)))
        assert getattr(toy.edge.conn.link, "syncs", 0) == syncs + (1 if restart else 0)
        assert done.output_token_ids == await answer_of(toy, t)
        assert toy.cloud_session("u").token_ids == toy.edge.tokenize(t)
    finally:
        await toy.edge.conn.stop()
        await toy.batcher.stop()


async def test_the_client_is_told_when_its_session_expired_at_the_edge():
    """The edge's session table is bounded; a turn of a session it evicted says so
    (ChatDone.session_expired), once, and still answers as a fresh session would."""
    toy = await toy_stack(edge_session_bytes=60_000)
    try:
        for i in range(6):
            done = await run(toy.edge, chat(LONG, session=f"x{i}", n=2))
            assert not done.session_expired
        assert "x0" not in toy.edge.sessions
        again = await run(toy.edge, chat(LONG, "ok", "more", session="x0", n=2))
        assert again.session_expired
        assert again.output_token_ids == await answer_of(toy, chat(LONG, "ok", "more", session="x0", n=2))
        assert not (await run(toy.edge, chat(LONG, "ok", "more", session="x0", n=2))).session_expired
    finally:
        await toy.batcher.stop()


class LosesFinal:
    """Wraps ``MemoryEngines``: every token arrives, then the stream breaks before the final message."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def decode(self, request_id, token_ids, kv, sampling):
        from tandem.common.protocol.errors import EngineError

        async for step in self.inner.decode(request_id, token_ids, kv, sampling):
            if step.finish_reason is not None:
                yield replace(step, finish_reason=None)
                raise EngineError("connection lost after the last token")
            yield step


@pytest.mark.parametrize("ends_with", ["length", "eos"])
async def test_a_stream_that_breaks_after_its_last_token_finishes_without_resuming(ends_with):
    """Every token reached the client and only the final message was lost: the turn ends there
    (length, or stop at end-of-sequence), never generating past its end."""
    toy = await toy_stack()
    toy.edge.conn.start()
    try:
        t = chat(LONG, n=10, mode=Mode.DIRECT)
        normal = await run(toy.edge, t)
        if ends_with == "eos":
            eos = normal.output_token_ids[4]
            toy.engines.eos_token_id = eos
            toy.edge.compute.eos_token_ids = frozenset([eos])
            normal = await run(toy.edge, t)
            assert normal.finish_reason == "stop" and normal.output_token_ids[-1] == eos
        toy.gateway.calls.engines = LosesFinal(toy.engines)
        done = await run(toy.edge, t)
        assert done.resumes == 0 and done.output_token_ids == normal.output_token_ids
        assert done.finish_reason == ("length" if ends_with == "length" else "stop")
    finally:
        await toy.edge.conn.stop()
        await toy.batcher.stop()


async def test_a_sync_that_would_load_a_session_counts_against_the_edges_bounds(toy):
    """SyncSession may load a session from the store into memory: only within the edge's session
    bound, which the edge's least recently used idle session leaves (to the store) to make room."""
    await run(toy.edge, chat(LONG, session="one", n=2))
    await run(toy.edge, chat(LONG, session="two", n=2))
    toy.lose_cloud_sessions(stored=False)
    await run(toy.edge, chat(LONG, "ok", "more", session="one", n=2))  # "one" back in memory
    toy.gateway.edge_limits.max_sessions = 1
    ids = toy.edge.tokenize(chat(LONG))
    req = SyncRequest(
        link_id="",
        session_id="two",
        split_layer=MANIFEST.split_layer,
        token_ids=tuple(ids),
        leaf_count=0,
        merkle_root=merkle.root([]),
        proof_from=0,
        consistency_proof=(),
        block_size_tokens=B,
    )
    reply = await toy.gateway.sync_session(req, TOY_CALLER)
    assert reply.found and reply.held_tokens == len(ids)
    assert toy.cloud_session("two") is not None and toy.cloud_session("one") is None
    assert len(toy.gateway.sessions) == 1
    done = await run(toy.edge, chat(LONG, "ok", "more", "again", session="one", n=2))  # resyncs from the store
    assert done.mode is Mode.SPLIT and toy.cloud_session("one") is not None and toy.cloud_session("two") is None


def test_a_save_keeps_the_earlier_pieces_recent():
    from tandem.cloud.sessions.store import SessionStore
    from tandem.cloud.sessions.table import CloudSession
    from tandem.cloud.store.blocks import MemoryBlockStore

    store = MemoryBlockStore(1 << 20)
    touched: list[str] = []
    real_touch = store.touch
    store.touch = lambda key: (touched.append(key), real_touch(key))  # type: ignore[method-assign]
    ss = SessionStore(store, 8)
    hidden = np.arange(10 * B * 8, dtype=np.float32).reshape(10 * B, 8)
    s = CloudSession(
        token_ids=list(range(10 * B)), hidden=hidden, leaves=[bytes(32)] * 10, split_layer=K, block_tokens=B
    )
    ss.save("k", s, 0)
    assert touched == []
    ss.save("k", s, 3 * B + 1)
    assert touched == [piece_key("k", hidden[i * B : (i + 1) * B].tobytes()) for i in range(3)]
    loaded = ss.load("k")
    assert loaded is not None and np.array_equal(loaded.session.hidden, hidden)


async def test_a_session_the_cloud_evicted_is_resent_from_token_0_with_the_same_answer():
    """An evicted session: the cloud's session table holds one session, so a
    second session's turn evicts the first from memory, and the store's LRU has dropped its record
    too. The first session's next turn finds nothing (SessionNotFound): the edge syncs, learns the
    cloud holds nothing, and resends from token 0 once; the answer equals a fresh session's."""
    sent = Sent()
    toy = await toy_stack(lambda link: TamperLink(link, sent), max_sessions=1)
    try:
        third = await two_turns(toy, "a")
        await run(toy.edge, chat(LONG, "another user", session="b"))  # evicts "a" from the cloud's table
        assert toy.cloud_session("a") is None
        toy.store.delete(record_key(key_of("a")))  # and the store's LRU took its record
        sent.take()
        done = await run(toy.edge, third)
        tokens, leaves = sent.take()
        n = done.prompt_tokens
        assert tokens[-n:] == list(range(n)) and leaves[-(n // B) :] == list(range(n // B))  # all of it, once more
        assert done.output_token_ids == await answer_of(toy, third)
    finally:
        await toy.batcher.stop()


async def test_a_commit_whose_root_fails_drops_what_a_slow_keep_kept(monkeypatch):
    """A keep still running when the commit's Merkle root fails: it is waited for, then the session
    is dropped, so no leaf that the edge's root does not cover survives."""
    import asyncio
    import time

    from tandem.cloud.links import negotiation
    from tandem.common.protocol.errors import TandemError
    from tandem.common.wire.messages import Commit

    monkeypatch.setattr(negotiation, "MIN_WINDOW_BYTES", 0)
    monkeypatch.setattr(negotiation, "MAX_WINDOW_BYTES", 0)

    def bad_root(item, attempt):
        return replace(item, merkle_root=b"\1" * 32) if isinstance(item, Commit) else item

    toy = await toy_stack(lambda link: TamperLink(link, bad_root))
    try:
        real, calls = toy.store.pin, [0]

        def slow_first_pin(keys, owner, lease):
            calls[0] += 1
            if calls[0] == 1:
                time.sleep(0.3)
            real(keys, owner, lease)

        toy.store.pin = slow_first_pin
        with pytest.raises(TandemError):
            await run(toy.edge, chat(LONG * 2, session="m", mode=Mode.SPLIT))
        await asyncio.sleep(0.6)
        s = toy.cloud_session("m")
        assert calls[0] >= 1 and (s is None or not s.leaves)
        assert toy.store.get(record_key(key_of("m"))) is None
    finally:
        await toy.batcher.stop()
