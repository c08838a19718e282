"""The cloud gateway: a turn from verified upload to streamed tokens.

``Gateway.run_turn`` is the main loop of a request and reads like the design's
data path: verify the upload -> put head KV blocks in the store -> tail prefill
(prompt_embeds, saves tail KV) -> decode (loads all layers of the aligned prefix).
It takes domain messages and yields domain events; ``cloud.service`` adapts it
to gRPC.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from cloud.config import CloudConfig
from cloud.engines import EngineBackend
from cloud.sessions import CloudSession, SessionTable
from cloud.upload import TurnUpload, check_header
from common import wire
from common.errors import IncompatibleModel, InvalidRequest, MerkleMismatch, UploadTimeout
from common.kvblocks import LayerRange, block_hashes, hash_seed, kv_scope, store_key
from common.kvstore import BlockStore
from common.manifest import SplitManifest
from common.messages import KVBlock, TurnHeader
from common.params import LinkParams, Sampling


@dataclass(frozen=True)
class Nack:
    seq: int
    reason: str


@dataclass(frozen=True)
class Repair:
    leaf_indices: list[int]
    reason: str


@dataclass(frozen=True)
class UploadDone:
    verified_tokens: int
    leaf_count: int
    merkle_root: bytes


@dataclass(frozen=True)
class TokensOut:
    token_ids: list[int]
    index: int


@dataclass(frozen=True)
class TurnFinal:
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    external_tokens: int
    timings_ms: dict[str, float] = field(default_factory=dict)
    received_bytes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Commit:
    leaf_count: int
    merkle_root: bytes


UplinkItem = wire.Chunk | KVBlock | Commit
Event = Nack | Repair | UploadDone | TokensOut | TurnFinal


class Gateway:
    """Holds the link params, sessions, block store and engines of one cloud node."""

    def __init__(self, cfg: CloudConfig, manifest: SplitManifest, engines: EngineBackend, store: BlockStore):
        self.cfg, self.manifest, self.engines, self.store = cfg, manifest, engines, store
        self.sessions = SessionTable(cfg.max_sessions, cfg.session_bytes)
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

    def negotiate(self, compatibility_key: str, split_layers: list[int]) -> LinkParams:
        """Agree on link params for an edge (the configured ones, for now).

        Raises:
            IncompatibleModel: the edge's head is not this cloud's split, and it cannot run direct only.
        """
        if self.manifest.split_layer in split_layers and compatibility_key != self.manifest.compatibility_key():
            raise IncompatibleModel(
                f"edge head {compatibility_key!r} does not match cloud tail {self.manifest.compatibility_key()!r}"
            )
        if self.manifest.split_layer not in split_layers:
            return LinkParams(**{**self.params.__dict__, "split_layer": 0})
        return self.params

    def seed(self, header: TurnHeader) -> bytes:
        """Chain seed of a request's KV block ids: model, block size and sharing scope."""
        scope = kv_scope(header.session_id, header.request_id)
        return hash_seed(self.model_key, self.params.kv_block_size_tokens, scope)

    async def run_turn(self, header: TurnHeader, uplink: AsyncIterator[UplinkItem]) -> AsyncIterator[Event]:
        """One request: upload (split mode), tail prefill (samples the first token), decode.
        Yields events to send down.

        Raises:
            InvalidRequest, ParamsVersionMismatch, SessionOutOfSync, ChecksumMismatch, MerkleMismatch,
            EngineError: mapped to gRPC status by the servicer; session state is unchanged on error.
        """
        check_header(header, self.params, self.manifest)
        timings: dict[str, float] = {}
        if not header.split_layer:
            async for ev in self._decode(header, list(header.prompt_token_ids), None, header.sampling, 0, timings, {}):
                yield ev
            return
        t_start = time.perf_counter()
        # a session enters the table only once a turn verified: failed turns leave nothing behind
        session = self.sessions.get(header.session_id) or CloudSession()
        seed = self.seed(header)
        try:
            async with session.lock:
                upload = TurnUpload(header, self.params, self.manifest, session, seed, self.cfg.max_abs_activation)
                try:
                    async with asyncio.timeout(self.cfg.upload_timeout_s):
                        async for ev in self._receive(upload, uplink):
                            yield ev
                except TimeoutError:
                    raise UploadTimeout(f"upload not complete after {self.cfg.upload_timeout_s:.0f} s") from None
                timings["upload_wait_ms"] = (time.perf_counter() - t_start) * 1e3
                t0 = time.perf_counter()
                hidden_new = upload.activations()
                await asyncio.to_thread(self._put_head_blocks, upload.new_blocks())
                timings["store_put_ms"] = (time.perf_counter() - t0) * 1e3
                upload.apply_to_session(hidden_new)
                if header.session_id:
                    self.sessions.put(header.session_id, session)
                yield UploadDone(len(session.token_ids), len(session.leaves), b"")
                tail_range = [self.tail_part.lo, self.tail_part.hi]
                tail_params = {
                    "block_hashes": [h.hex() for h in upload.hashes],
                    "load": [tail_range],
                    "save": tail_range,
                }
                if session.hidden is None:  # apply_to_session always sets it
                    raise InvalidRequest("no activations for this turn")
                tail = await self.engines.tail_prefill(
                    header.request_id, session.hidden, {"tandem": tail_params}, header.sampling
                )
        finally:
            self.sessions.evict()
        timings["tail_prefill_ms"] = tail.elapsed_ms
        yield TokensOut([tail.first_token], 0)
        if tail.finish_reason is not None or header.sampling.max_new_tokens == 1:
            yield TurnFinal(
                tail.finish_reason or "length", len(header.prompt_token_ids), 1, 0, timings, dict(upload.received_bytes)
            )
            return
        # decode continues from prompt + first token, loading every layer of the aligned prefix
        ids = [*header.prompt_token_ids, tail.first_token]
        hashes = block_hashes(ids, self.params.kv_block_size_tokens, seed)
        kv_params = {
            "tandem": {
                "block_hashes": [h.hex() for h in hashes],
                "save": None,
                "load": [[self.head_part.lo, self.head_part.hi], tail_range],
            }
        }
        rest = replace(header.sampling, max_new_tokens=header.sampling.max_new_tokens - 1)
        async for ev in self._decode(header, ids, kv_params, rest, 1, timings, dict(upload.received_bytes)):
            yield ev

    async def _receive(self, upload: TurnUpload, uplink: AsyncIterator[UplinkItem]) -> AsyncIterator[Event]:
        repairs = 0
        async for item in uplink:
            if isinstance(item, wire.Chunk):
                if not upload.add_chunk(item):
                    yield Nack(item.seq, "crc32c mismatch")
            elif isinstance(item, KVBlock):
                upload.add_block(item)
            else:
                repair = upload.commit(item.leaf_count, item.merkle_root)
                if repair:
                    repairs += 1
                    if repairs > self.cfg.max_repair_rounds:
                        raise MerkleMismatch(f"KV blocks {repair[:8]} still bad after {repairs - 1} repair rounds")
                    yield Repair(repair, "leaf hash mismatch or block missing")
            if upload.complete:
                return
        raise InvalidRequest(
            f"uplink closed before the upload completed ({len(upload.chunks)}/"
            f"{upload.header.num_chunks} chunks, committed={upload.committed})"
        )

    def _put_head_blocks(self, blocks: list[tuple[bytes, bytes]]) -> None:
        for block_hash, raw in blocks:
            self.store.put(store_key(block_hash, self.head_part), raw)

    async def _decode(
        self,
        header: TurnHeader,
        ids: list[int],
        kv_params: dict[str, Any] | None,
        sampling: Sampling,
        first_index: int,
        timings: dict[str, float],
        received: dict[str, int],
    ) -> AsyncIterator[Event]:
        """Stream the decode engine's tokens; output indices start at ``first_index``."""
        t0 = time.perf_counter()
        n = first_index
        async for step in self.engines.decode(header.request_id, ids, kv_params, sampling):
            if step.token_ids:
                if n == first_index:
                    timings["decode_first_token_ms"] = (time.perf_counter() - t0) * 1e3
                yield TokensOut(step.token_ids, n)
                n += len(step.token_ids)
            if step.finish_reason is not None:
                timings["decode_ms"] = (time.perf_counter() - t0) * 1e3
                yield TurnFinal(
                    step.finish_reason, len(header.prompt_token_ids), n, step.external_tokens, timings, received
                )
