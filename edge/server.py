"""Build the edge daemon: ONNX head + batcher + link to the cloud + the Edge gRPC service.

The servicer is an adapter: ``ChatTurn.from_pb`` -> ``EdgeService.chat`` -> ``to_pb``.
The edge's health follows the cloud's: it watches the cloud's health service and
goes NOT_SERVING while the cloud is unreachable or not serving (every mode the
edge offers today needs the cloud).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tandem import __version__
from tandem.common.errors import EngineError, TandemError
from tandem.common.grpc_errors import abort
from tandem.common.grpcsetup import set_health, start_server
from tandem.common.logs import new_request_id, set_ids
from tandem.common.manifest import SplitManifest
from tandem.common.params import MAX_STOP_TOKENS, NegotiateOffer
from tandem.edge.batcher import HeadBatcher
from tandem.edge.config import EdgeConfig
from tandem.edge.detok import MAX_STOP_STRINGS
from tandem.edge.events import ChatTurn
from tandem.edge.grpc_link import GrpcCloudLink
from tandem.edge.head_runner import OnnxHead
from tandem.edge.service import EdgeService
from tandem.edge.session import EdgeSessions
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

log = logging.getLogger("tandem.edge")
EDGE_SERVICE = pb.DESCRIPTOR.services_by_name["Edge"].full_name
CLOUD_SERVICE = pb.DESCRIPTOR.services_by_name["Cloud"].full_name
MAX_MESSAGE_BYTES = 4 << 20  # ChatRequest: a conversation of up to a few MB of text


class EdgeServicer(pb_grpc.EdgeServicer):
    def __init__(self, service: EdgeService, model_id: str) -> None:
        self.service, self.model_id = service, model_id
        self.draining = False  # set on SIGTERM: new turns are refused, turns in flight finish

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ChatEvent]:
        set_ids(new_request_id(), request.session_id)  # this call's own task; EdgeService.chat takes the id
        try:
            if self.draining:
                raise EngineError("this edge is draining (shutting down); retry on another")
            async for ev in self.service.chat(ChatTurn.from_pb(request), context.time_remaining()):
                yield ev.to_pb()
        except TandemError as e:
            await abort(context, e)
        except Exception:
            log.exception("Chat failed")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error in the edge daemon (see its log)")

    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.EdgeInfo:
        p = self.service.params
        return pb.EdgeInfo(
            model_id=self.model_id,
            split_layer=p.split_layer,
            max_prompt_tokens=p.max_prompt_tokens,
            max_new_tokens=p.max_new_tokens,
            max_stop_strings=MAX_STOP_STRINGS,
            max_stop_token_ids=MAX_STOP_TOKENS,
            default_timeout_s=self.service.turn_timeout_s,
            version=__version__,
        )


async def follow_cloud_health(channel: grpc.aio.Channel, hs: health.aio.HealthServicer, retry_s: float = 1.0) -> None:
    """Mirror the cloud's health into this server's until cancelled (reconnecting on errors)."""
    stub = health_pb2_grpc.HealthStub(channel)
    while True:
        try:
            async for r in stub.Watch(health_pb2.HealthCheckRequest(service=CLOUD_SERVICE)):
                serving = r.status == health_pb2.HealthCheckResponse.SERVING
                await set_health(hs, serving, ["", EDGE_SERVICE])
        except grpc.aio.AioRpcError as e:
            log.warning("cloud health: %s", e.code().name)
        await set_health(hs, False, ["", EDGE_SERVICE])
        await asyncio.sleep(retry_s)


@dataclass
class EdgeDaemon:
    server: grpc.aio.Server
    port: int
    service: EdgeService
    servicer: EdgeServicer
    link: GrpcCloudLink
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
        await self.service.batcher.stop()
        await self.link.close()


async def create_edge(cfg: EdgeConfig) -> EdgeDaemon:
    """Load the head, negotiate with the cloud, and start the Edge server (port 0 = any free).

    Raises:
        FileNotFoundError: no manifest in ``cfg.split_dir``.
        TandemError: negotiation refused (e.g. IncompatibleModel) or the cloud is unreachable.
    """
    from transformers import AutoTokenizer

    manifest = SplitManifest.load(cfg.split_dir)
    head = OnnxHead(cfg.split_dir, intra_op_threads=cfg.intra_op_threads)
    tokenizer = AutoTokenizer.from_pretrained(manifest.tokenizer_dir(cfg.split_dir))
    link = GrpcCloudLink(cfg.cloud_target, cfg.keepalive_time_s, cfg.keepalive_timeout_s)
    offer = NegotiateOffer(
        cfg.edge_id,
        manifest.model_id,
        manifest.compatibility_key(),
        (0, manifest.split_layer),
        cfg.max_batch,
        cfg.rtt_ms,
        cfg.goodput_mbps,
        cfg.ttft_slo_ms,
        cfg.itl_p99_slo_ms,
    )
    params = await link.negotiate(offer)
    batcher = HeadBatcher(head, cfg.max_batch)
    batcher.start()
    sessions = EdgeSessions(cfg.max_sessions, cfg.session_bytes)
    service = EdgeService(tokenizer, batcher, link, params, manifest.compatibility_key(), sessions, cfg.turn_timeout_s)
    servicer = EdgeServicer(service, manifest.model_id)
    server, port, hs = await start_server(
        [lambda s: pb_grpc.add_EdgeServicer_to_server(servicer, s)],
        [EDGE_SERVICE],
        cfg.host,
        cfg.port,
        MAX_MESSAGE_BYTES,
    )
    task = asyncio.create_task(follow_cloud_health(link.channel, hs))
    daemon = EdgeDaemon(server, port, service, servicer, link, hs, task)
    if cfg.http_port is not None:
        from tandem.edge.openai_api import create_openai_app, serve_openai

        app = create_openai_app(service, manifest.model_id, cfg.http_api_keys)
        daemon.http = await serve_openai(app, cfg.http_host, cfg.http_port)
    return daemon
