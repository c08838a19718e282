"""Build and run the cloud gRPC server (gateway + engines + health + reflection + engine supervisor)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from tandem.cloud.config import CloudConfig
from tandem.cloud.engines import EngineBackend
from tandem.cloud.gateway import Gateway
from tandem.cloud.service import CloudServicer
from tandem.cloud.supervisor import EngineSupervisor, SupervisedEngines
from tandem.common.grpcsetup import add_service, set_health, start_server, tls_credentials
from tandem.common.kvstore import open_store
from tandem.common.manifest import SplitManifest
from tandem.common.security import ApiKeys, Authenticator
from tandem.v1 import tandem_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Cloud"].full_name  # "tandem.v1.Cloud"
HEALTH_NAMES = ("", SERVICE_NAME)


@dataclass
class CloudServer:
    """A started cloud: gRPC server, its bound port, the gateway, health, and the engine
    supervisor (None for engines without liveness, e.g. test fakes)."""

    server: grpc.aio.Server
    port: int
    gateway: Gateway
    health: health.aio.HealthServicer
    supervisor: EngineSupervisor | None
    servicer: CloudServicer
    controller: asyncio.Task | None = None  # the gateway's SLO control loop

    async def set_serving(self, serving: bool) -> None:
        self.gateway.serving = serving
        await set_health(self.health, serving, HEALTH_NAMES)

    async def stop(self, grace_s: float) -> None:
        """Drain: NOT_SERVING first, new turns refused with UNAVAILABLE, turns in flight finish for up
        to ``grace_s`` (long-lived calls such as an edge's health watch do not hold the drain), then
        stop supervising and stop the server. The engines are the caller's to shut down afterwards."""
        await self.set_serving(False)
        self.servicer.draining = True
        if self.controller is not None:
            self.controller.cancel()
        deadline = time.monotonic() + grace_s
        while self.servicer.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.gateway.finish_background(max(0.0, deadline - time.monotonic()))
        if self.supervisor is not None:
            await self.supervisor.stop()
        await self.server.stop(min(1.0, grace_s))


async def create_cloud(
    cfg: CloudConfig, engines: EngineBackend, *, on_give_up: Callable[[], None] | None = None
) -> CloudServer:
    """A started grpc.aio server on ``cfg.host:cfg.port`` (port 0 = any free), all SERVING, with
    an ``EngineSupervisor`` running when ``engines`` report liveness (``on_give_up`` is called
    when it cannot restart them).

    Raises:
        RuntimeError: the port could not be bound.
        InvalidRequest: a TLS file cannot be read, an edge key is too short, the store directory
            belongs to another user, or the store URL is malformed.
        EngineError: the shared block store (``store_url``) does not answer.
    """
    manifest = SplitManifest.load(cfg.split_dir)
    extra = tuple(SplitManifest.load(d) for d in cfg.extra_split_dirs)
    store = open_store(cfg.store_url, cfg.store_dir, cfg.store_bytes)
    gateway = Gateway(cfg, manifest, engines, store, extra)
    auth = Authenticator(ApiKeys(cfg.edge_keys), client_certs=cfg.tls_client_ca_file is not None)
    servicer = CloudServicer(gateway, cfg.cloud_id, auth)
    server, port, hs = await start_server(
        [lambda s: add_service(s, servicer, "Cloud")],
        [SERVICE_NAME],
        cfg.host,
        cfg.port,
        gateway.max_message_bytes(),  # the largest legal message under the link params
        tls_credentials(cfg),
    )
    cloud = CloudServer(server, port, gateway, hs, None, servicer)
    cloud.controller = asyncio.create_task(gateway.control_loop(), name="slo-controller")
    if isinstance(engines, SupervisedEngines):
        cloud.supervisor = EngineSupervisor(engines, cloud.set_serving, on_give_up=on_give_up)
        cloud.supervisor.start()
    return cloud


async def create_server(cfg: CloudConfig, engines: EngineBackend) -> tuple[grpc.aio.Server, int, Gateway]:
    """``create_cloud`` for callers that need only (server, port, gateway); the supervisor runs
    until the engines are shut down.

    Raises:
        RuntimeError: the port could not be bound.
    """
    cloud = await create_cloud(cfg, engines)
    return cloud.server, cloud.port, cloud.gateway
