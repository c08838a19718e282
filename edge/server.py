"""Build the edge daemon: ONNX head + batcher + link to the cloud + the Edge gRPC service."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.errors import InvalidRequest, TandemError
from common.grpc_errors import abort
from common.manifest import SplitManifest
from common.params import Sampling
from edge.batcher import HeadBatcher
from edge.config import EdgeConfig
from edge.head_runner import OnnxHead
from edge.service import ChatTurn, EdgeService, TextOut, negotiate
from edge.uplink import Tamper
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 64 << 20
ROLES = ("system", "user", "assistant")


def turn_from_pb(r: pb.ChatRequest) -> ChatTurn:
    """Raises InvalidRequest for unknown roles or mode."""
    for m in r.messages:
        if m.role not in ROLES:
            raise InvalidRequest(f"message role {m.role!r} not in {ROLES}")
    if r.mode not in (pb.MODE_UNSPECIFIED, pb.MODE_SPLIT, pb.MODE_DIRECT):
        raise InvalidRequest(f"unknown mode {r.mode}")
    sampling = Sampling.from_pb(r.sampling) if r.HasField("sampling") else Sampling()
    if not math.isfinite(sampling.temperature) or sampling.temperature < 0 or not 0 < sampling.top_p <= 1:
        raise InvalidRequest(f"bad sampling: temperature={sampling.temperature} top_p={sampling.top_p}")
    return ChatTurn(
        tuple((m.role, m.content) for m in r.messages), r.prompt, r.session_id, sampling, r.mode == pb.MODE_DIRECT
    )


class EdgeServicer(pb_grpc.EdgeServicer):
    def __init__(self, service: EdgeService) -> None:
        self.service = service

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ChatEvent]:
        try:
            async for ev in self.service.chat(turn_from_pb(request)):
                if isinstance(ev, TextOut):
                    yield pb.ChatEvent(delta=pb.TextDelta(text=ev.text, token_ids=ev.token_ids))
                else:
                    yield pb.ChatEvent(
                        done=pb.ChatDone(
                            finish_reason=ev.finish_reason,
                            prompt_tokens=ev.prompt_tokens,
                            output_tokens=ev.output_tokens,
                            head_tokens=ev.head_tokens,
                            external_tokens=ev.external_tokens,
                            split_layer=ev.split_layer,
                            timings_ms=ev.timings_ms,
                            sent_bytes=ev.sent_bytes,
                            output_token_ids=ev.output_token_ids,
                        )
                    )
        except TandemError as e:
            await abort(context, e)
        except Exception:
            logging.getLogger("tandem.edge").exception("Chat failed")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error in the edge daemon (see its log)")


@dataclass
class EdgeDaemon:
    server: grpc.aio.Server
    port: int
    service: EdgeService
    channel: grpc.aio.Channel

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.server.stop(grace_s)
        await self.service.batcher.stop()
        await self.channel.close()


async def create_edge(cfg: EdgeConfig, tamper: Tamper | None = None) -> EdgeDaemon:
    """Load the head, negotiate with the cloud, and start the Edge server (port 0 = any free).

    Raises:
        FileNotFoundError: no manifest in ``cfg.split_dir``.
        TandemError: negotiation refused (e.g. IncompatibleModel) or the cloud is unreachable.
    """
    from transformers import AutoTokenizer

    manifest = SplitManifest.load(cfg.split_dir)
    head = OnnxHead(cfg.split_dir, intra_op_threads=cfg.intra_op_threads)
    tokenizer = AutoTokenizer.from_pretrained(manifest.resolve(cfg.split_dir, manifest.full_checkpoint))
    channel = grpc.aio.insecure_channel(
        cfg.cloud_target,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    stub = pb_grpc.CloudStub(channel)
    params = await negotiate(
        stub,
        cfg.edge_id,
        manifest.model_id,
        manifest.compatibility_key(),
        manifest.split_layer,
        cfg.max_batch,
        cfg.rtt_ms,
        cfg.goodput_mbps,
        cfg.ttft_slo_ms,
        cfg.itl_p99_slo_ms,
    )
    batcher = HeadBatcher(head, cfg.max_batch)
    batcher.start()
    service = EdgeService(tokenizer, batcher, stub, params, manifest.compatibility_key(), cfg.max_sessions, tamper)
    server = grpc.aio.server()
    pb_grpc.add_EdgeServicer_to_server(EdgeServicer(service), server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    await hs.set("tandem.v1.Edge", health_pb2.HealthCheckResponse.SERVING)
    await hs.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        (pb.DESCRIPTOR.services_by_name["Edge"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    if port == 0:
        raise RuntimeError(f"could not bind {cfg.host}:{cfg.port}")
    await server.start()
    return EdgeDaemon(server, port, service, channel)
