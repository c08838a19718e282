"""Build and run the cloud gRPC server (gateway + engines + health + reflection + engine supervisor).

``build_gateway`` assembles a node's gateway from its config: the link limits, the tables
(links, sessions, upload budget, per-edge bounds), the stores and the collaborators that share
them (the engine calls, which the gateway and remote prefill both make); ``create_cloud`` serves it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from tandem.cloud import metrics
from tandem.cloud.config import CloudConfig
from tandem.cloud.engine_calls import EngineCalls
from tandem.cloud.engines.supervisor import EngineSupervisor, SupervisedEngines
from tandem.cloud.engines.vllm_engines import EngineBackend
from tandem.cloud.gateway import Gateway
from tandem.cloud.links.fidelity import ENGINE_KV_FORMATS, load_tables
from tandem.cloud.links.negotiation import LinkLimits
from tandem.cloud.links.rates import CloudRates
from tandem.cloud.links.registry import LinkRegistry
from tandem.cloud.links.table import ControllerConfig, LinkTable
from tandem.cloud.links.tenancy import EdgeLimits
from tandem.cloud.remote_prefill import RemotePrefills
from tandem.cloud.service import CloudServicer
from tandem.cloud.sessions.store import SessionStore
from tandem.cloud.sessions.sync import SessionSync
from tandem.cloud.sessions.table import SessionTable
from tandem.cloud.splits import Splits
from tandem.cloud.store.blocks import BlockStore, open_store
from tandem.cloud.turn import Background
from tandem.cloud.uploads.admission import UploadBudget
from tandem.cloud.uploads.pins import Pins
from tandem.cloud.uploads.receive import Receiver
from tandem.common.protocol.manifest import ModelShape, SplitManifest
from tandem.common.runtime.grpc_setup import add_service, set_health, start_health_server, start_server, tls_credentials
from tandem.common.runtime.security import ApiKeys, Authenticator
from tandem.common.wire.kvblocks import LayerRange, block_nbytes
from tandem.v1 import tandem_pb2 as pb

log = logging.getLogger("tandem.cloud")

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
    sweeper: asyncio.Task | None = None  # expires idle sessions
    health_server: grpc.aio.Server | None = None  # plaintext health only (``health_port``)
    health_port: int | None = None

    async def set_serving(self, serving: bool) -> None:
        self.gateway.serving = serving
        await set_health(self.health, serving, HEALTH_NAMES)

    async def stop(self, grace_s: float, reason: str = "") -> None:
        """Drain: NOT_SERVING first, new turns refused with UNAVAILABLE, turns in flight finish for up
        to ``grace_s`` (long-lived calls such as an edge's health watch do not hold the drain), then
        stop supervising and stop the server. The engines are the caller's to shut down afterwards.
        Logs (INFO) the drain's start, with ``reason`` (the signal's name, or why), the turns in
        flight and the grace period, and its end with the turns still in flight at the grace."""
        log.info(
            "tandem-cloud draining%s: %d turns in flight, grace %g s",
            f" ({reason})" if reason else "",
            self.servicer.in_flight,
            grace_s,
        )
        await self.set_serving(False)
        self.servicer.draining = True
        for task in (self.controller, self.sweeper):
            if task is not None:
                task.cancel()
        deadline = time.monotonic() + grace_s
        while self.servicer.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        log.info("tandem-cloud drained: %d turns still in flight at the grace period", self.servicer.in_flight)
        await self.gateway.background.finish(max(0.0, deadline - time.monotonic()))
        if self.supervisor is not None:
            await self.supervisor.stop()
        await self.server.stop(min(1.0, grace_s))
        if self.health_server is not None:
            await self.health_server.stop(0)


def link_limits(cfg: CloudConfig, manifest: SplitManifest) -> LinkLimits:
    """The cloud-wide limits every link's params live within; the fidelity tables are those
    measured in the dtype the engines compute ``manifest``'s checkpoint in, and remote prefill's
    downlink sends KV in that dtype where the edge accepts it."""
    e = cfg.engine
    dtype = e.compute_dtype(manifest.resolve(cfg.split_dir, manifest.full_checkpoint))
    return LinkLimits(
        chunk_tokens=min(cfg.chunk_tokens, cfg.max_chunk_tokens),
        max_chunk_tokens=cfg.max_chunk_tokens,
        wire_dtypes=tuple(cfg.wire_dtypes),
        kv_wire_dtypes=tuple(cfg.kv_wire_dtypes),
        codecs=tuple(cfg.codecs),
        codec_level=cfg.codec_level,
        kv_block_size_tokens=e.block_size_tokens,
        max_prompt_tokens=min(cfg.max_prompt_tokens, e.max_model_len_tokens - 1),
        max_new_tokens=cfg.max_new_tokens,
        max_chunk_resends=cfg.max_chunk_resends,
        max_model_len_tokens=e.max_model_len_tokens,
        fidelity=load_tables(cfg.fidelity_tables, dtype),
        engine_kv_dtype=ENGINE_KV_FORMATS.get(dtype),
    )


def link_table(cfg: CloudConfig) -> LinkTable:
    """The links' shares of the engines' batch and their SLO controller."""
    e = cfg.engine
    return LinkTable(
        e.max_num_seqs,
        e.max_num_batched_tokens,
        max_links=cfg.max_links,
        idle_s=cfg.link_idle_s,
        max_queue=cfg.max_queue_per_link,
        max_queue_wait_s=cfg.max_queue_wait_s,
        controller=ControllerConfig(interval_s=cfg.slo_interval_s, window_s=cfg.slo_window_s),
    )


def edge_limits(cfg: CloudConfig, shape: ModelShape) -> EdgeLimits:
    """Each edge's own bounds; its stored bytes count KV blocks of every layer and float32 activations."""
    bs = cfg.engine.block_size_tokens
    block_bytes = block_nbytes(LayerRange(lo=0, hi=shape.num_layers), shape.num_kv_heads, bs, shape.head_dim)
    return EdgeLimits(
        cfg.edge_rate_limit, cfg.edge_max_sessions, cfg.edge_max_stored_bytes, block_bytes, bs, 4 * shape.hidden_size
    )


def build_gateway(
    cfg: CloudConfig,
    manifest: SplitManifest,
    engines: EngineBackend,
    store: BlockStore,
    extra_manifests: tuple[SplitManifest, ...] = (),
) -> Gateway:
    """The gateway of one node serving the split ``manifest`` (and ``extra_manifests``: splits of
    the same model at other layers, each with its own tail engine) on ``engines`` over ``store``,
    with its collaborators and their tables built from ``cfg``; the cloud's metrics watch them.

    Raises:
        ValueError: an extra split holds another model (weights or shape).
    """
    splits = Splits.of(manifest, extra_manifests)
    limits, links, rates = link_limits(cfg, manifest), link_table(cfg), CloudRates()
    sessions = SessionTable(cfg.max_sessions, cfg.session_bytes, cfg.session_idle_s)
    per_edge = edge_limits(cfg, manifest.shape)
    sync = SessionSync(
        sessions, SessionStore(store, manifest.shape.hidden_size), per_edge, limits, manifest.shape.vocab_size
    )
    budget = UploadBudget(
        cfg.max_uploads, cfg.max_upload_bytes, cfg.max_uploads_per_peer, cfg.max_upload_bytes_per_peer
    )
    background = Background()
    pins = Pins(store, cfg.tail_save_wait_s, background)
    registry = LinkRegistry(cfg, links, limits, splits, rates)
    calls = EngineCalls(engines, rates, registry.load)
    gateway = Gateway(
        cfg,
        splits,
        calls,
        remote=RemotePrefills(splits, pins, store, calls, cfg.max_repair_rounds),
        registry=registry,
        sync=sync,
        receiver=Receiver(cfg, splits, budget, store, sync, pins, background),
        pins=pins,
        edge_limits=per_edge,
        background=background,
    )
    metrics.watch_cloud(sessions, budget, store)
    metrics.watch_links(links)
    return gateway


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
    gateway = build_gateway(cfg, manifest, engines, store, extra)
    auth = Authenticator(ApiKeys(cfg.edge_keys), client_certs=cfg.tls_client_ca_file is not None)
    servicer = CloudServicer(gateway, cfg.cloud_id, auth)
    server, port, hs = await start_server(
        [lambda s: add_service(s, servicer, "Cloud")],
        [SERVICE_NAME],
        cfg.host,
        cfg.port,
        gateway.registry.max_message_bytes(),  # the largest legal message under the link params
        tls_credentials(cfg),
    )
    cloud = CloudServer(server, port, gateway, hs, None, servicer)
    if cfg.health_port is not None:
        cloud.health_server, cloud.health_port = await start_health_server(hs, cfg.health_host, cfg.health_port)
    cloud.controller = asyncio.create_task(gateway.registry.control_loop(), name="slo-controller")
    sweep_s = min(60.0, cfg.session_idle_s / 4)
    cloud.sweeper = asyncio.create_task(gateway.sync.sweep_loop(sweep_s), name="session-sweeper")
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
