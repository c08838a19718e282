"""Build and run the cloud gRPC server (gateway + engines + health + reflection)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cloud.config import CloudConfig
from cloud.engines import EngineBackend
from cloud.gateway import Gateway
from cloud.service import CloudServicer
from common.kvstore import DiskBlockStore
from common.manifest import SplitManifest
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 64 << 20


async def create_server(cfg: CloudConfig, engines: EngineBackend) -> tuple[grpc.aio.Server, int, Gateway]:
    """A started grpc.aio server on ``cfg.host:cfg.port`` (port 0 = any free). Returns (server, port, gateway).

    Raises:
        RuntimeError: the port could not be bound.
    """
    manifest = SplitManifest.load(cfg.split_dir)
    store = DiskBlockStore(cfg.store_dir, cfg.store_bytes)
    gateway = Gateway(cfg, manifest, engines, store)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    pb_grpc.add_CloudServicer_to_server(CloudServicer(gateway, cfg.cloud_id), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("tandem.v1.Cloud", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    names = (pb.DESCRIPTOR.services_by_name["Cloud"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    if port == 0:
        raise RuntimeError(f"could not bind {cfg.host}:{cfg.port}")
    await server.start()
    return server, port, gateway
