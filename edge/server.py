"""Build the edge daemon: ONNX head + batcher + link to the cloud + the Edge gRPC service.

The servicer is an adapter: ``ChatTurn.from_pb`` -> ``EdgeService.chat`` -> ``to_pb``.
The edge's health is SERVING while some mode can serve: local mode needs no cloud, so an
edge with the whole model stays SERVING (degraded, see ``GetInfo``) while the cloud is down;
an edge with heads only is NOT_SERVING until its link to the cloud is negotiated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health

from tandem import __version__
from tandem.common.errors import EngineError, IncompatibleModel, InvalidRequest, TandemError
from tandem.common.grpc_errors import abort
from tandem.common.grpcsetup import add_service, channel_credentials, set_health, start_server, tls_credentials
from tandem.common.logs import new_request_id, set_ids
from tandem.common.manifest import FULL_ONNX, SplitManifest
from tandem.common.params import MAX_STOP_TOKENS, NegotiateOffer
from tandem.common.security import ApiKeys, Authenticator, Principal, scoped
from tandem.edge.batcher import HeadBatcher
from tandem.edge.cloudconn import CloudConnection, CloudTarget
from tandem.edge.config import EdgeConfig
from tandem.edge.costmodel import CostModel, zstd_pays
from tandem.edge.detok import MAX_STOP_STRINGS
from tandem.edge.events import ChatTurn
from tandem.edge.grpc_link import GrpcCloudLink
from tandem.edge.head_runner import HeadInput, OnnxHead
from tandem.edge.local import LocalEngine
from tandem.edge.replicas import ReplicaSet
from tandem.edge.service import EdgeService, Head
from tandem.edge.session import EdgeSessions
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

log = logging.getLogger("tandem.edge")
EDGE_SERVICE = pb.DESCRIPTOR.services_by_name["Edge"].full_name
MAX_MESSAGE_BYTES = 4 << 20  # ChatRequest: a conversation of up to a few MB of text
MAX_SESSION_ID_BYTES = 128  # as the cloud's bound on ids (cloud.upload.MAX_ID_BYTES)
WARMUP_TOKENS = 32  # tokens of the warm-up run that times each head


class EdgeServicer(pb_grpc.EdgeServicer):
    """``auth`` says who each call comes from (API keys, client certificates); when it requires
    credentials, each caller's session ids are its own (``common.security.scoped``): another key
    sending the same id starts another session."""

    def __init__(self, service: EdgeService, model_id: str, auth: Authenticator | None = None) -> None:
        self.service, self.model_id = service, model_id
        self.auth = auth or Authenticator()
        self.draining = False  # set on SIGTERM: new turns are refused, turns in flight finish

    def _identify(self, context: grpc.aio.ServicerContext) -> Principal:
        return self.auth.identify(context.invocation_metadata(), context.auth_context(), context.peer() or "")

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ChatEvent]:
        set_ids(new_request_id(), request.session_id)  # this call's own task; EdgeService.chat takes the id
        try:
            caller = self._identify(context)
            if self.draining:
                raise EngineError("this edge is draining (shutting down); retry on another")
            if len(request.session_id.encode()) > MAX_SESSION_ID_BYTES:  # the same bound in every mode
                raise InvalidRequest(f"session_id longer than {MAX_SESSION_ID_BYTES} bytes")
            turn = ChatTurn.from_pb(request)
            if self.auth.required and turn.session_id:
                turn = replace(turn, session_id=scoped(caller, turn.session_id))
            async for ev in self.service.chat(turn, context.time_remaining()):
                yield ev.to_pb()
        except TandemError as e:
            await abort(context, e)
        except Exception:
            log.exception("Chat failed")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error in the edge daemon (see its log)")

    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.EdgeInfo:
        try:
            self._identify(context)
        except TandemError as e:
            await abort(context, e)
        svc = self.service
        return pb.EdgeInfo(
            model_id=self.model_id,
            split_layer=max(svc.split_layers, default=0),
            max_prompt_tokens=svc.max_prompt_tokens,
            max_new_tokens=svc.max_new_tokens,
            max_stop_strings=MAX_STOP_STRINGS,
            max_stop_token_ids=MAX_STOP_TOKENS,
            default_timeout_s=svc.turn_timeout_s,
            version=__version__,
            modes=sorted({r.mode.value for r in svc.routes()}),
            split_layers=list(svc.split_layers),
            cloud_connected=svc.conn is not None and svc.conn.current().connected.is_set(),
            degraded=svc.degraded(),
        )


async def follow_link(service: EdgeService, hs: health.aio.HealthServicer, period_s: float = 0.5) -> None:
    """Keep this server's health current until cancelled: SERVING while some mode can serve (local
    mode, or the cloud connected), NOT_SERVING otherwise. Degraded service (local only) is SERVING;
    ``GetInfo`` says what is missing."""
    last: bool | None = None
    while True:
        serving = bool(service.routes())
        if serving != last:
            await set_health(hs, serving, ["", EDGE_SERVICE])
            if last is not None:
                log.warning("edge health: %s (%s)", "SERVING" if serving else "NOT_SERVING", service.degraded() or "ok")
            last = serving
        await asyncio.sleep(period_s)


@dataclass
class EdgeDaemon:
    server: grpc.aio.Server
    port: int
    service: EdgeService
    servicer: EdgeServicer
    links: list[GrpcCloudLink]  # one per cloud target
    health: health.aio.HealthServicer
    health_task: asyncio.Task
    http: tuple[Any, asyncio.Task, int] | None = None  # OpenAI-compatible API: (uvicorn server, task, port)

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http[2]

    async def stop(self, grace_s: float = 5.0) -> None:
        """Drain: NOT_SERVING first, refuse new turns (UNAVAILABLE), let turns in flight finish for up
        to ``grace_s``, then stop."""
        self.health_task.cancel()
        await set_health(self.health, False, ["", EDGE_SERVICE])
        self.servicer.draining = True
        if self.http is not None:
            from tandem.edge.openai_api import stop_openai

            await stop_openai(self.http[0], self.http[1], grace_s)
        await self.server.stop(grace_s)
        if self.service.conn is not None:
            await self.service.conn.stop()
        for h in self.service.heads.values():
            await h.batcher.stop()
        for link in self.links:
            await link.close()


def eos_token_ids(tokenizer: Any, tokenizer_dir: Path) -> list[int]:
    """End-of-sequence ids as vLLM takes them: ``generation_config.json``'s ``eos_token_id`` (an int
    or a list) and the tokenizer's own."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = tokenizer_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(int(i) for i in ids)


def measure_zstd(sample: bytes, level: int) -> tuple[float, float, float]:
    """zstd on ``sample`` (this model's wire bytes): (compressed/raw ratio, compress MB/s, decompress MB/s)."""
    import zstandard

    t0 = time.perf_counter()
    packed = zstandard.ZstdCompressor(level=level).compress(sample)
    t1 = time.perf_counter()
    zstandard.ZstdDecompressor().decompress(packed)
    t2 = time.perf_counter()
    mb = len(sample) / 1e6
    return len(packed) / max(1, len(sample)), mb / max(t1 - t0, 1e-9), mb / max(t2 - t1, 1e-9)


async def create_edge(cfg: EdgeConfig) -> EdgeDaemon:
    """Load the heads and the local model, start the link to the cloud, and start the Edge server
    (port 0 = any free). The edge starts whether or not the cloud answers: while it does not, local
    mode serves (health SERVING, ``GetInfo.degraded`` says why) and the link keeps reconnecting.

    Raises:
        FileNotFoundError: no manifest in a split directory.
        ValueError: split directories of different models, or nothing to serve (no head, no local model).
        IncompatibleModel: the cloud answered that the heads are not cut from its model.
    """
    from transformers import AutoTokenizer

    manifest = SplitManifest.load(cfg.split_dir)
    manifests = [manifest, *(SplitManifest.load(d) for d in cfg.extra_split_dirs)]
    if any(m.weights_blake3 != manifest.weights_blake3 or m.shape != manifest.shape for m in manifests):
        raise ValueError("every split directory must hold the same model (weights and shape)")
    tok_dir = manifest.tokenizer_dir(cfg.split_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    cost = CostModel(cfg.hysteresis, cfg.explore_every)
    heads: list[Head] = []
    sample = b""
    for m, d in zip(manifests, (cfg.split_dir, *cfg.extra_split_dirs), strict=True):
        batcher = HeadBatcher(OnnxHead(d, intra_op_threads=cfg.intra_op_threads), cfg.max_batch)
        batcher.start()
        heads.append(Head(batcher, m.compatibility_key()))
        # warm up and time the head (the cost model's first head rate)
        warm = np.arange(WARMUP_TOKENS, dtype=np.int64) % m.shape.vocab_size
        await batcher.run(HeadInput(warm))
        t0 = time.perf_counter()
        out = await batcher.run(HeadInput(warm))
        cost.edge.head(m.split_layer).add((time.perf_counter() - t0) * 1e3 / WARMUP_TOKENS)
        sample = out.hidden.tobytes() + out.kv.tobytes()
    local = None
    local_path = cfg.local_model or cfg.split_dir.parent / FULL_ONNX
    if cfg.local and local_path.is_file():
        local = LocalEngine(
            local_path,
            manifest.shape,
            eos_token_ids(tokenizer, tok_dir),
            cfg.intra_op_threads,
            cfg.max_sessions,
            cfg.session_bytes,
        )
        await local.warmup()  # the first rates, which the cost model reads from the engine
        log.info(
            "local mode: %s (%.2f ms/token prefill, %.1f ms/token decode)",
            local_path,
            local.prefill_ms_per_token,
            local.decode_ms_per_token,
        )
    elif cfg.local:
        log.warning("local mode off: no %s", local_path)
    ratio, c_mbps, d_mbps = measure_zstd(sample, 3)
    creds = (
        channel_credentials(cfg.cloud_ca_file, cfg.cloud_cert_file, cfg.cloud_key_file) if cfg.cloud_uses_tls else None
    )
    links = [
        GrpcCloudLink(
            target,
            cfg.keepalive_time_s,
            cfg.keepalive_timeout_s,
            credentials=creds,
            server_name=cfg.cloud_server_name,
            api_key=cfg.cloud_api_key,
        )
        for target in cfg.cloud_targets
    ]
    offer = NegotiateOffer(
        cfg.edge_id,
        manifest.model_id,
        {h.k: h.compatibility_key for h in heads},
        cfg.max_batch,
        ttft_slo_ms=cfg.ttft_slo_ms,
        itl_p99_slo_ms=cfg.itl_p99_slo_ms,
        wire_dtypes=tuple(cfg.wire_dtypes),
        kv_wire_dtypes=tuple(cfg.kv_wire_dtypes),
    )
    conns = [
        CloudConnection(
            link,
            offer,
            poll_s=cfg.poll_s,
            probe_bytes=cfg.probe_bytes,
            zstd_pays=lambda g: zstd_pays(ratio, c_mbps, d_mbps, g),
        )
        for link in links
    ]
    conn: CloudTarget = conns[0] if len(conns) == 1 else ReplicaSet(conns, cfg.cloud_targets)
    conn.start()
    if not await conn.wait_connected(cfg.connect_timeout_s):
        wrong = next((m.last_exc for m in conns if isinstance(m.last_exc, IncompatibleModel)), None)
        if wrong is not None:
            await conn.stop()
            raise wrong
        log.warning(
            "cloud %s not answering yet (%s): starting degraded",
            ", ".join(cfg.cloud_targets),
            conn.current().last_error or "no reply",
        )
    sessions = EdgeSessions(cfg.max_sessions, cfg.session_bytes)
    service = EdgeService(
        tokenizer,
        heads,
        conn,
        sessions,
        cfg.turn_timeout_s,
        local=local,
        max_prompt_tokens=cfg.max_prompt_tokens,
        cost=cost,
        shape=manifest.shape,
        pipeline_tokens=cfg.pipeline_tokens,
    )
    service.eos_token_ids = frozenset(eos_token_ids(tokenizer, tok_dir))
    service.codec_ratio = ratio
    auth = Authenticator(ApiKeys(cfg.api_keys), client_certs=cfg.tls_client_ca_file is not None)
    servicer = EdgeServicer(service, manifest.model_id, auth)
    server, port, hs = await start_server(
        [lambda s: add_service(s, servicer, "Edge")],
        [EDGE_SERVICE],
        cfg.host,
        cfg.port,
        MAX_MESSAGE_BYTES,
        tls_credentials(cfg),
    )
    task = asyncio.create_task(follow_link(service, hs))
    daemon = EdgeDaemon(server, port, service, servicer, links, hs, task)
    if cfg.http_port is not None:
        from tandem.edge.openai_api import create_openai_app, serve_openai

        app = create_openai_app(service, manifest.model_id, [*cfg.api_keys, *cfg.http_api_keys])
        tls = (cfg.tls_cert_file, cfg.tls_key_file) if cfg.tls_cert_file and cfg.tls_key_file else None
        daemon.http = await serve_openai(app, cfg.http_host, cfg.http_port, tls=tls)
    return daemon
