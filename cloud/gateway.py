"""The cloud gateway: a turn from verified upload to streamed tokens.

``Gateway.run_turn`` is the main loop of a request and reads like the design's
data path: receive and verify the upload -> commit it into the session (head KV
blocks into the store) -> tail prefill (prompt_embeds, saves tail KV, samples the
first token) -> decode (loads all layers of the aligned prefix). It takes domain
messages and yields domain events; ``cloud.service`` adapts it to gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import numpy as np

from tandem.cloud.admission import UploadBudget
from tandem.cloud.config import CloudConfig
from tandem.cloud.engines import EngineBackend, TailResult
from tandem.cloud.sessions import CloudSession, SessionTable
from tandem.cloud.upload import TurnUpload, check_header, upload_bound_bytes
from tandem.common import metrics, wire
from tandem.common.errors import DeadlineExceeded, IncompatibleModel, InvalidRequest, MerkleMismatch, UploadTimeout
from tandem.common.kvblocks import LayerRange, activation_keys, block_nbytes, part_key, request_seed
from tandem.common.kvparams import KVTransferSpec, PartSpec
from tandem.common.kvstore import BlockStore
from tandem.common.logs import bind_request, turn_log
from tandem.common.manifest import SplitManifest
from tandem.common.messages import Commit, DownEvent, KVBlock, Nack, Repair, TokensOut, TurnFinal, TurnHeader, UploadAck
from tandem.common.params import LinkParams, NegotiateOffer, Sampling
from tandem.common.tracing import span, traced
from tandem.stages import Stage, Timings

UplinkBody = wire.Chunk | KVBlock | Commit
HEADER_SLACK_BYTES = 4096  # protobuf framing and the header's fixed fields
T = TypeVar("T")
log = logging.getLogger("tandem.cloud")


async def bounded(
    it: AsyncIterator[T], deadline: float | None, on_timeout: Callable[[], Exception]
) -> AsyncIterator[T]:
    """Items of ``it``, each awaited no later than ``deadline`` (event-loop time; None = no bound).
    The bound applies to waiting for the next item only, never to the consumer's time between items.

    Raises:
        ``on_timeout()``: the deadline passed while waiting.
    """
    ait = it.__aiter__()
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                item = await ait.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise on_timeout() from None
        yield item


@dataclass
class Turn:
    """One request in flight: its header, deadline (event-loop time, None = none) and timings."""

    header: TurnHeader
    deadline: float | None
    t_start: float = field(default_factory=time.perf_counter)
    timings: Timings = field(default_factory=dict)
    received_bytes: dict[str, int] = field(default_factory=dict)
    t_engine: float | None = None  # when its first engine request started (queue time)
    # the engines' request id: the cloud's own, so that an id from the wire can never name (and
    # collide with or abort) another edge's request inside vLLM; logs carry both
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def time(self, stage: Stage, t0: float) -> None:
        self.timings[stage] = (time.perf_counter() - t0) * 1e3

    def engine_start(self) -> None:
        if self.t_engine is None:
            self.t_engine = time.perf_counter()


class Gateway:
    """Holds the link params, sessions, block store and engines of one cloud node."""

    def __init__(self, cfg: CloudConfig, manifest: SplitManifest, engines: EngineBackend, store: BlockStore):
        self.cfg, self.manifest, self.engines, self.store = cfg, manifest, engines, store
        self.sessions = SessionTable(cfg.max_sessions, cfg.session_bytes)
        self.budget = UploadBudget(
            cfg.max_uploads, cfg.max_upload_bytes, cfg.max_uploads_per_peer, cfg.max_upload_bytes_per_peer
        )
        self.model_key = manifest.compatibility_key()
        self.params = LinkParams(
            params_version=1,
            split_layer=manifest.split_layer,
            chunk_tokens=cfg.chunk_tokens,
            wire_dtype=cfg.wire_dtype,
            codec=cfg.codec,
            codec_level=cfg.codec_level,
            kv_block_size_tokens=cfg.engine.block_size_tokens,
            inflight_window_chunks=64,
            max_concurrent_requests=cfg.engine.max_num_seqs,
            max_batched_tokens=cfg.engine.max_num_batched_tokens,
            max_prompt_tokens=min(cfg.max_prompt_tokens, cfg.engine.max_model_len_tokens - 1),
            max_new_tokens=cfg.max_new_tokens,
            hidden_size=manifest.shape.hidden_size,
            max_chunk_resends=cfg.max_chunk_resends,
        )
        self.tail_part = LayerRange(manifest.split_layer, manifest.shape.num_layers)
        self.head_part = LayerRange(0, manifest.split_layer)
        metrics.watch_cloud(self.sessions, self.budget, store)

    def negotiate(self, offer: NegotiateOffer) -> LinkParams:
        """Agree on link params for an edge (the configured ones, for now).

        Raises:
            IncompatibleModel: the edge's head is not this cloud's split, and it cannot run direct only.
        """
        k, key = self.manifest.split_layer, self.manifest.compatibility_key()
        if k in offer.split_layers and offer.compatibility_key != key:
            raise IncompatibleModel(f"edge head {offer.compatibility_key!r} does not match cloud tail {key!r}")
        if k not in offer.split_layers:
            return replace(self.params, split_layer=0)
        return self.params

    def max_message_bytes(self) -> int:
        """The largest legal ``Uplink`` message under the link params: a chunk or KV block at its
        largest payload, or a header of ``max_prompt_tokens`` token ids (5 bytes each as varints)."""
        p, sh = self.params, self.manifest.shape
        chunk = wire.max_payload_bytes(wire.raw_nbytes_of(p.chunk_tokens, p.wire_dtype, sh.hidden_size), p.codec)
        block = wire.max_payload_bytes(
            block_nbytes(self.head_part, sh.num_kv_heads, p.kv_block_size_tokens, sh.head_dim), p.codec
        )
        return max(chunk, block, 5 * p.max_prompt_tokens) + HEADER_SLACK_BYTES

    async def run_turn(
        self, header: TurnHeader, uplink: AsyncIterator[UplinkBody], peer: str = "", deadline: float | None = None
    ) -> AsyncIterator[DownEvent]:
        """One request: upload (split mode), tail prefill (samples the first token), decode.
        ``peer`` names the edge for upload bounds; ``deadline`` is event-loop time or None.
        Yields events to send down.

        Raises:
            InvalidRequest, ParamsVersionMismatch, SessionOutOfSync, ChecksumMismatch, MerkleMismatch,
            QuotaExceeded, UploadTimeout, DeadlineExceeded, EngineError: mapped to gRPC status by the
            servicer; session state is unchanged on error.
        """
        turn = Turn(header, deadline)
        mode = "split" if header.split_layer else "direct"
        with (
            bind_request(header.request_id, header.session_id),
            turn_log(log, mode) as done_fields,
            metrics.cloud_turn(mode, turn),
            span("cloud_turn", mode=mode, request_id=header.request_id, session_id=header.session_id),
        ):
            done_fields.update(engine_id=turn.engine_id)
            async for ev in self._run(turn, uplink, peer):
                if isinstance(ev, TurnFinal):
                    done_fields.update(
                        prompt_tokens=ev.prompt_tokens, output_tokens=ev.output_tokens, finish=ev.finish_reason
                    )
                yield ev

    async def _run(self, turn: Turn, uplink: AsyncIterator[UplinkBody], peer: str) -> AsyncIterator[DownEvent]:
        """The turn itself (``run_turn`` adds its log ids, logs, metrics and span)."""
        header = turn.header
        check_header(header, self.params, self.manifest)
        if not header.split_layer:
            async for ev in self._decode(turn, list(header.prompt_token_ids), None, header.sampling, 0):
                yield ev
            return
        with self.budget.reserve(peer, upload_bound_bytes(header, self.params, self.manifest)):
            upload = TurnUpload(
                header,
                self.params,
                self.manifest,
                self._session(header),
                self._seed(header),
                self.cfg.max_abs_activation,
            )
            try:
                async for ev in self._receive(turn, upload, uplink):
                    yield ev
                hidden, leaves = await self._commit(turn, upload)
            finally:
                metrics.record_received(upload.received_bytes, sum(upload.resends.values()))
                upload.release()
        yield UploadAck(len(header.prompt_token_ids), len(leaves))
        tail_keys = activation_keys(hidden, self.params.kv_block_size_tokens, self._seed(header), self.tail_part)
        tail = await self._tail_prefill(turn, hidden, tail_keys)
        yield TokensOut((tail.first_token,), 0)
        if tail.finish_reason is not None or header.sampling.max_new_tokens == 1:
            yield self._final(turn, tail.finish_reason or "length", 1, 0)
            return
        # decode continues from prompt + first token, loading every layer of the aligned prefix
        ids = [*header.prompt_token_ids, tail.first_token]
        spec = KVTransferSpec(
            loads=(PartSpec(self.head_part, tuple(leaves)), PartSpec(self.tail_part, tuple(tail_keys)))
        )
        rest = replace(header.sampling, max_new_tokens=header.sampling.max_new_tokens - 1)
        async for ev in self._decode(turn, ids, spec, rest, 1):
            yield ev

    # ------------------------------------------------------------------ stages

    def _session(self, header: TurnHeader) -> CloudSession:
        """The session the upload is checked against (a fresh one for new or stateless turns)."""
        return self.sessions.get(header.session_id) or CloudSession()

    def _seed(self, header: TurnHeader) -> bytes:
        return request_seed(self.model_key, self.params.kv_block_size_tokens, header.session_id, header.request_id)

    def _upload_deadline(self, turn: Turn) -> float:
        loop_deadline = asyncio.get_running_loop().time() + self.cfg.upload_timeout_s
        return loop_deadline if turn.deadline is None else min(loop_deadline, turn.deadline)

    @traced("cloud_upload")
    async def _receive(
        self, turn: Turn, upload: TurnUpload, uplink: AsyncIterator[UplinkBody]
    ) -> AsyncIterator[Nack | Repair]:
        """Verify the upload item by item (decoding off the event loop), within the upload deadline."""

        def late() -> Exception:
            return UploadTimeout(f"upload not complete within {self.cfg.upload_timeout_s:.0f} s or the deadline")

        async for ev in self._verify_items(upload, bounded(uplink, self._upload_deadline(turn), late)):
            yield ev
        turn.time(Stage.CLOUD_UPLOAD_WAIT, turn.t_start)
        turn.received_bytes = dict(upload.received_bytes)

    async def _verify_items(
        self, upload: TurnUpload, uplink: AsyncIterator[UplinkBody]
    ) -> AsyncIterator[Nack | Repair]:
        repairs = 0
        async for item in uplink:
            if isinstance(item, wire.Chunk):
                if not await asyncio.to_thread(upload.add_chunk, item):
                    log.info("chunk %d failed its CRC32C or did not decode: NACK", item.seq)
                    yield Nack(item.seq, "crc32c mismatch or payload does not decode")
            elif isinstance(item, KVBlock):
                await asyncio.to_thread(upload.add_block, item)
            elif isinstance(item, Commit):
                repair = upload.commit(item.leaf_count, item.merkle_root)
                if repair:
                    repairs += 1
                    if repairs > self.cfg.max_repair_rounds:
                        raise MerkleMismatch(f"KV blocks {repair[:8]} still bad after {repairs - 1} repair rounds")
                    log.info("repair round %d: asking for %d KV blocks again", repairs, len(repair))
                    metrics.record_repair_request(len(repair))
                    yield Repair(tuple(repair), "leaf hash mismatch, block missing or not decodable")
            else:
                raise InvalidRequest(f"unexpected {type(item).__name__} after the header")
            if upload.complete:
                return
        raise InvalidRequest(
            f"uplink closed before the upload completed ({len(upload.chunks)}/"
            f"{upload.header.num_chunks} chunks, committed={upload.committed})"
        )

    async def _commit(self, turn: Turn, upload: TurnUpload) -> tuple[np.ndarray, list[bytes]]:
        """Put the verified head blocks in the store and commit the turn into its session under the
        session's lock, waited for no longer than the request's deadline. Returns the prompt's
        activations ``[T, H]`` and head-KV leaves."""
        t0 = time.perf_counter()
        hidden = upload.activations()
        await asyncio.to_thread(self._put_head_blocks, upload.new_blocks())
        turn.time(Stage.CLOUD_STORE_PUT, t0)
        sid = upload.header.session_id
        if not sid:
            return hidden, upload.leaves()
        session = upload.session
        try:
            async with asyncio.timeout_at(turn.deadline), session.lock:
                current = self.sessions.get(sid)
                if current is not None and current is not session:
                    session = current  # another turn created the session meanwhile: version check fails
                upload.apply_to(session, hidden)
                self.sessions.put(sid, session)
        except TimeoutError:
            raise DeadlineExceeded(f"deadline passed waiting for session {sid!r}") from None
        finally:
            self.sessions.evict()
        return hidden, list(session.leaves)

    @traced("cloud_store_put")
    def _put_head_blocks(self, blocks: list[tuple[bytes, bytes]]) -> None:
        for leaf, raw in blocks:
            self.store.put(part_key(leaf, self.head_part), raw)

    @traced("cloud_tail_prefill")
    async def _tail_prefill(self, turn: Turn, hidden: np.ndarray, tail_keys: list[bytes]) -> TailResult:
        """Tail engine over ``prompt_embeds = hidden``: loads tail KV of blocks computed from the same
        activations before, saves the rest, samples the first output token."""
        part = PartSpec(self.tail_part, tuple(tail_keys))
        turn.engine_start()
        try:
            async with asyncio.timeout_at(turn.deadline):
                tail = await self.engines.tail_prefill(
                    turn.engine_id, hidden, KVTransferSpec(loads=(part,), save=part), turn.header.sampling
                )
        except TimeoutError:
            raise DeadlineExceeded("deadline passed during the tail prefill") from None
        turn.timings[Stage.CLOUD_TAIL_PREFILL] = tail.elapsed_ms
        return tail

    @traced("cloud_decode")
    async def _decode(
        self, turn: Turn, ids: list[int], kv: KVTransferSpec | None, sampling: Sampling, first_index: int
    ) -> AsyncIterator[DownEvent]:
        """Stream the decode engine's tokens; output indices start at ``first_index``."""
        t0 = time.perf_counter()
        turn.engine_start()
        n = first_index
        steps = self.engines.decode(turn.engine_id, ids, kv, sampling)
        async for step in bounded(steps, turn.deadline, lambda: DeadlineExceeded("deadline passed while decoding")):
            if step.token_ids:
                if n == first_index:
                    turn.time(Stage.CLOUD_DECODE_FIRST_TOKEN, t0)
                yield TokensOut(tuple(step.token_ids), n)
                n += len(step.token_ids)
            if step.finish_reason is not None:
                turn.time(Stage.CLOUD_DECODE, t0)
                yield self._final(turn, step.finish_reason, n, step.external_tokens)

    def _final(self, turn: Turn, finish_reason: str, output_tokens: int, external_tokens: int) -> TurnFinal:
        n_prompt = len(turn.header.prompt_token_ids)
        return TurnFinal(finish_reason, n_prompt, output_tokens, external_tokens, turn.timings, turn.received_bytes)
