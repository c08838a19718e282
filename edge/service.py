"""The edge's domain service: one chat turn from messages to streamed text.

``EdgeService.chat`` reads like the design's data path: tokenize -> head over
the tokens the edge has not processed -> frame activations (CRC32C) and new
full KV blocks (BLAKE3 leaves, RFC 6962 root) -> stream to the cloud -> detokenize
tokens as they come back. No grpc servicer code here; ``edge.server`` adapts it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np

from common import merkle, wire
from common.errors import InvalidRequest, SessionOutOfSync
from common.grpc_errors import error_from_status
from common.kvblocks import LayerRange, block_hashes, hash_seed, kv_scope, split_blocks
from common.messages import KVBlock, TurnHeader
from common.params import LinkParams, Sampling
from edge.batcher import HeadBatcher
from edge.head_runner import HeadInput
from edge.session import EdgeSession, EdgeSessions
from edge.uplink import OutgoingTurn, Tamper, generate
from tandem.v1 import tandem_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class ChatTurn:
    """One request from the SDK: ``messages`` (chat template applied) or a raw ``prompt``."""

    messages: tuple[tuple[str, str], ...] = ()
    prompt: str = ""
    session_id: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    direct: bool = False


@dataclass(frozen=True)
class TextOut:
    text: str
    token_ids: list[int]


@dataclass(frozen=True)
class TurnDone:
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    head_tokens: int
    external_tokens: int
    split_layer: int
    timings_ms: dict[str, float]
    sent_bytes: dict[str, int]
    output_token_ids: list[int]


class EdgeService:
    """Holds the tokenizer, the batched ONNX head, sessions and the negotiated link."""

    def __init__(
        self,
        tokenizer,
        batcher: HeadBatcher,
        stub: pb_grpc.CloudStub,
        params: LinkParams,
        compatibility_key: str,
        max_sessions: int,
        tamper: Tamper | None = None,
    ) -> None:
        self.tok, self.batcher, self.stub, self.params = tokenizer, batcher, stub, params
        self.k = batcher.head.k
        self.sessions = EdgeSessions(max_sessions)
        self.model_key = compatibility_key
        self.tamper = tamper

    def tokenize(self, turn: ChatTurn) -> list[int]:
        """Prompt token ids. Raises InvalidRequest for an empty or too long prompt."""
        if turn.messages and turn.prompt:
            raise InvalidRequest("pass messages or a prompt, not both")
        if turn.messages:
            ids = self.tok.apply_chat_template(
                [{"role": r, "content": c} for r, c in turn.messages],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        elif turn.prompt:
            ids = list(self.tok(turn.prompt)["input_ids"])
        else:
            raise InvalidRequest("a chat turn needs messages or a prompt")
        if not 0 < len(ids) <= self.params.max_prompt_tokens:
            raise InvalidRequest(f"prompt has {len(ids)} tokens; the link allows 1..{self.params.max_prompt_tokens}")
        return ids

    async def chat(self, turn: ChatTurn) -> AsyncIterator[TextOut | TurnDone]:
        """Run one turn; yields text deltas then a ``TurnDone``.

        Raises:
            InvalidRequest: bad prompt or sampling parameters.
            TandemError: the cloud's error, mapped back from its gRPC status.
        """
        t_start = time.perf_counter()
        ids = await asyncio.to_thread(self.tokenize, turn)  # long prompts must not stall other requests
        timings = {"tokenize_ms": (time.perf_counter() - t_start) * 1e3}
        split = self.params.split_layer > 0 and not turn.direct
        session = self.sessions.get(turn.session_id) if split else EdgeSession()
        async with session.lock:
            head_tokens = await self._run_head(session, ids, timings) if split else 0
            for attempt in (0, 1):
                out = self._build_turn(session, ids, turn, split, timings, resend_all=attempt == 1)
                try:
                    async for ev in self._stream(out, session, ids, split, timings, t_start, head_tokens):
                        yield ev
                    return
                except SessionOutOfSync:
                    if attempt:
                        raise

    async def _run_head(self, s: EdgeSession, ids: list[int], timings: dict[str, float]) -> int:
        """Run the head over the tokens past the session's common prefix; updates ``s``."""
        t0 = time.perf_counter()
        c = s.common_prefix(ids)
        if c == len(ids):  # nothing new (identical prompt): recompute the last token so the turn has input
            c -= 1
        s.truncate(c)
        out = await self.batcher.run(HeadInput(np.asarray(ids[c:], np.int64), s.kv))
        s.kv = out.kv
        s.hidden = out.hidden if s.hidden is None else np.concatenate([s.hidden, out.hidden])
        s.token_ids = list(ids)
        timings["edge_head_ms"] = (time.perf_counter() - t0) * 1e3
        return len(ids) - c

    def _build_turn(
        self, s: EdgeSession, ids: list[int], turn: ChatTurn, split: bool, timings: dict[str, float], resend_all: bool
    ) -> OutgoingTurn:
        """Frame what the cloud lacks: activations past ``cloud_tokens``, blocks past its leaves."""
        t0 = time.perf_counter()
        p = self.params
        if resend_all:
            s.cloud_tokens, s.leaves = 0, []
        rid = uuid.uuid4().hex
        if not split:
            header = TurnHeader(rid, "", p.params_version, 0, tuple(ids), 0, 0, 0, turn.sampling)
            return OutgoingTurn(header, [], {}, 0, b"")
        assert s.hidden is not None and s.kv is not None
        cached = s.cloud_tokens
        chunks = wire.split(s.hidden[cached:], cached, p.chunk_tokens, p.wire_dtype, p.codec, p.codec_level)
        bs = p.kv_block_size_tokens
        hashes = block_hashes(ids, bs, hash_seed(self.model_key, bs, kv_scope(turn.session_id, rid)))
        first = len(s.leaves)
        part = LayerRange(0, self.k)
        blocks: dict[int, KVBlock] = {}
        leaves = list(s.leaves)
        for j, arr in zip(range(first, len(hashes)), split_blocks(s.kv, bs, first, len(hashes)), strict=True):
            raw = arr.tobytes()
            leaf = merkle.leaf_hash(merkle.leaf_data(hashes[j], part.lo, part.hi, raw))
            payload = raw if p.codec != wire.Codec.ZSTD else _zstd(raw, p.codec_level)
            blocks[j] = KVBlock(j, hashes[j], part.lo, part.hi, p.codec, len(raw), payload, leaf)
            leaves.append(leaf)
        header = TurnHeader(
            rid, turn.session_id, p.params_version, self.k, tuple(ids), cached, len(chunks), len(blocks), turn.sampling
        )
        timings["encode_ms"] = (time.perf_counter() - t0) * 1e3
        return OutgoingTurn(header, chunks, blocks, len(leaves), merkle.root(leaves))

    async def _stream(
        self,
        out: OutgoingTurn,
        s: EdgeSession,
        ids: list[int],
        split: bool,
        timings: dict[str, float],
        t_start: float,
        head_tokens: int,
    ) -> AsyncIterator[TextOut | TurnDone]:
        out_ids: list[int] = []
        text = ""
        try:
            async for d in generate(self.stub, out, self.tamper):
                kind = d.WhichOneof("msg")
                if kind == "upload_ack":
                    s.cloud_tokens = len(ids)
                    s.leaves = s.leaves + [out.blocks[j].leaf_hash for j in sorted(out.blocks)]
                    timings["uplink_ms"] = out.upload_ms
                elif kind == "tokens":
                    if not out_ids:
                        timings["ttft_ms"] = (time.perf_counter() - t_start) * 1e3
                    out_ids.extend(d.tokens.token_ids)
                    new_text = self.tok.decode(out_ids, skip_special_tokens=True)
                    if len(new_text) > len(text) and not new_text.endswith("\ufffd"):
                        yield TextOut(new_text[len(text) :], list(d.tokens.token_ids))
                        text = new_text
                elif kind == "final":
                    f = d.final
                    timings["total_ms"] = (time.perf_counter() - t_start) * 1e3
                    timings.update({f"cloud_{k}": v for k, v in f.timings_ms.items()})
                    sent = dict(out.sent_bytes)
                    sent["resent_chunks"], sent["repaired_blocks"] = out.resent_chunks, out.repaired_blocks
                    yield TurnDone(
                        f.finish_reason,
                        f.prompt_tokens,
                        f.output_tokens,
                        head_tokens,
                        f.external_tokens,
                        out.header.split_layer,
                        timings,
                        sent,
                        out_ids,
                    )
        except grpc.aio.AioRpcError as e:
            raise error_from_status(e.code(), e.details() or "") from e


def _zstd(raw: bytes, level: int) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(level=level).compress(raw)


async def negotiate(
    stub: pb_grpc.CloudStub,
    edge_id: str,
    model_id: str,
    compatibility_key: str,
    k: int,
    max_batch: int,
    rtt_ms: float,
    goodput_mbps: float,
    ttft_slo_ms: float,
    itl_slo_ms: float,
) -> LinkParams:
    """Call ``Cloud.Negotiate``; returns the agreed params.

    Raises:
        TandemError: mapped from the cloud's status (IncompatibleModel when the splits differ).
    """
    from tandem.v1 import tandem_pb2 as pb

    req = pb.NegotiateRequest(
        edge_id=edge_id,
        model_id=model_id,
        compatibility_key=compatibility_key,
        split_layers=[0, k],
        wire_dtypes=[wire.pb_name(x) for x in wire.WireDtype],
        codecs=[wire.pb_name(x) for x in wire.Codec],
        edge_max_batch=max_batch,
        link=pb.LinkMeasurement(rtt_ms=rtt_ms, goodput_mbps=goodput_mbps),
        slo=pb.LatencySlo(ttft_ms=ttft_slo_ms, itl_p99_ms=itl_slo_ms),
    )
    try:
        resp = await stub.Negotiate(req, timeout=30)
    except grpc.aio.AioRpcError as e:
        raise error_from_status(e.code(), e.details() or "") from e
    return LinkParams.from_pb(resp.params)
