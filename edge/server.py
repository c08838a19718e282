"""Build the edge daemon: ONNX heads + batchers, the local model, the link to the cloud, the
``EdgeNode`` and its gRPC servicer (``edge.api.grpc_service``), and the OpenAI-compatible HTTP API.

``build_node`` assembles a node from its config and its loaded parts: the sessions, the cost model,
the router, the cloud calls and the turn's bounds; ``create_edge`` loads the parts, starts the node
whether or not the cloud answers, and serves it; ``EdgeDaemon.stop`` drains it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health

from tandem.common.protocol.errors import IncompatibleModel, TandemError
from tandem.common.protocol.limits import RequestLimits
from tandem.common.protocol.manifest import FULL_DECODER, FULL_ONNX, ExportCheck, ModelShape, SplitManifest
from tandem.common.protocol.params import NegotiateOffer
from tandem.common.runtime.grpc_setup import add_service, channel_credentials, set_health, start_server, tls_credentials
from tandem.common.runtime.security import ApiKeys, Authenticator
from tandem.common.wire.kvdown import full_model_key
from tandem.edge import metrics
from tandem.edge.api.grpc_service import EDGE_SERVICE, EdgeServicer, follow_link
from tandem.edge.compute.batcher import HeadBatcher
from tandem.edge.compute.builder_head import open_head
from tandem.edge.compute.head import HeadInput
from tandem.edge.compute.local import LocalEngine
from tandem.edge.compute.prefill import prefill_plan
from tandem.edge.config import EdgeConfig
from tandem.edge.link.connection import CloudConnection, CloudTarget
from tandem.edge.link.discovery import DnsResolver, parse_dns_target
from tandem.edge.link.grpc_link import GrpcCloudLink
from tandem.edge.link.replicas import ReplicaSet
from tandem.edge.modes.cloud import CloudCalls
from tandem.edge.modes.split_head import Head
from tandem.edge.node import EdgeCompute, EdgeNode
from tandem.edge.routing.costmodel import CostModel, zstd_pays
from tandem.edge.routing.occupancy import PromptKV
from tandem.edge.routing.router import Router
from tandem.edge.session import EdgeSessions

log = logging.getLogger("tandem.edge")
MAX_MESSAGE_BYTES = 4 << 20  # ChatRequest: a conversation of up to a few MB of text
WARMUP_TOKENS = 32  # tokens of the warm-up run that times each head


@dataclass
class EdgeDaemon:
    server: grpc.aio.Server
    port: int
    node: EdgeNode
    servicer: EdgeServicer
    links: list[GrpcCloudLink]  # one per cloud target
    health: health.aio.HealthServicer
    health_task: asyncio.Task
    http: tuple[Any, asyncio.Task, int] | None = None  # OpenAI-compatible API: (uvicorn server, task, port)
    sweeper: asyncio.Task | None = None  # expires idle sessions

    @property
    def http_port(self) -> int | None:
        return None if self.http is None else self.http[2]

    async def stop(self, grace_s: float = 5.0, reason: str = "") -> None:
        """Drain: NOT_SERVING first, refuse new turns (UNAVAILABLE), let turns in flight finish for up
        to ``grace_s``, then stop. Logs (INFO) the drain's start, with ``reason`` (the signal's name),
        the turns in flight and the grace period, and its end."""
        t0 = time.monotonic()
        log.info(
            "tandem-edge draining%s: %d turns in flight, grace %g s",
            f" ({reason})" if reason else "",
            self.node.turns_in_flight[1],
            grace_s,
        )
        self.health_task.cancel()
        await set_health(self.health, False, ["", EDGE_SERVICE])
        self.servicer.draining = True
        if self.http is not None:
            from tandem.edge.api.http_api import stop_openai

            await stop_openai(self.http[0], self.http[1], grace_s)
        await self.server.stop(grace_s)
        if self.sweeper is not None:
            self.sweeper.cancel()
        await self.node.lifetime.close()
        if self.node.conn is not None:
            await self.node.conn.stop()
        for h in self.node.heads.values():
            await h.batcher.stop()
        if self.node.local is not None:
            await self.node.local.close()
        for link in self.links:
            await link.close()
        log.info("tandem-edge stopped (drained in %.1f s)", time.monotonic() - t0)


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


async def load_heads(cfg: EdgeConfig, manifests: list[SplitManifest], cost: CostModel) -> tuple[list[Head], bytes]:
    """Start a batched head per split directory (``builder_head.open_head``: the model builder's
    where ``cfg.builder_head`` and the manifest name one that passed its check, else ``head.onnx``),
    warm each up and time it (the cost model's first head rate). Returns the heads and a sample of
    this model's wire bytes (the last head's activations and KV) for measuring zstd."""
    heads: list[Head] = []
    sample = b""
    for m, d in zip(manifests, (cfg.split_dir, *cfg.extra_split_dirs), strict=True):
        if not m.split_layer:  # a direct manifest: no head
            continue
        runner = open_head(d, cfg.builder_head, cfg.intra_op_threads, prefill_plan(cfg.prefill_shapes))
        warm_prefills = getattr(runner, "warm_prefills", None)
        if warm_prefills is not None:  # before the batcher's thread runs it: one thread at a time
            t0 = time.perf_counter()
            caps = await asyncio.to_thread(warm_prefills)
            if caps:
                log.info(
                    "split %s: prefill shapes run on KV capacities %s in %.1f s", d, caps, time.perf_counter() - t0
                )
        batcher = HeadBatcher(runner, cfg.max_batch)
        batcher.start()
        heads.append(Head(batcher, m.compatibility_key()))
        warm = np.arange(WARMUP_TOKENS, dtype=np.int64) % m.shape.vocab_size
        await batcher.run(HeadInput(warm))
        t0 = time.perf_counter()
        out = await batcher.run(HeadInput(warm))
        cost.edge.head(m.split_layer).add((time.perf_counter() - t0) * 1e3 / WARMUP_TOKENS)
        sample = out.hidden.tobytes() + out.kv.tobytes()
    return heads, sample


def local_check_problem(path: Path) -> str:
    """Why the whole-model graph at ``path`` must not serve local mode ("" when it may): its check
    against HF (``path.with_suffix(".check.json")``, written by ``tandem-model``) is missing,
    unreadable or failed."""
    check_path = path.with_suffix(".check.json")
    try:
        check = ExportCheck.load(check_path)
    except FileNotFoundError:
        return f"{path} has no check against HF ({check_path.name}): run tandem-model again"
    except ValueError as e:
        return f"{check_path} is not a check ({e.__class__.__name__}): run tandem-model again"
    if not check.passed:
        return f"{path} failed its check against HF (max |ONNX - HF| {check.max_abs_error:.2e} > {check.tolerance:.2e})"
    return ""


def local_model_path(cfg: EdgeConfig) -> tuple[Path | None, str]:
    """The whole model local mode runs and "" , or None and why not: ``cfg.local_model`` when set
    (a builder folder or an ``.onnx`` file), else ``edge-decoder/`` beside the split directory
    (ONNX Runtime GenAI's builder graph), else ``edge-full.onnx`` there; each must have passed its
    check against HF."""
    from tandem.common.model.builder_export import decoder_problem

    model_dir = cfg.split_dir.parent
    candidates = [cfg.local_model] if cfg.local_model else [model_dir / FULL_DECODER, model_dir / FULL_ONNX]
    why = []
    for path in candidates:
        if path.is_dir():
            problem = decoder_problem(path)
        elif path.is_file():
            problem = local_check_problem(path)
        else:
            problem = f"no {path}"
        if not problem:
            return path, ""
        why.append(problem)
    return None, "; ".join(why)


async def load_local(
    cfg: EdgeConfig, shape: ModelShape, eos: list[int], max_positions: int | None = None
) -> LocalEngine | None:
    """The whole model for local mode (warmed up: its first rates), or None when off or missing.
    It serves sequences up to ``max_positions`` (the highest ``max_model_len`` its preparation's
    ``EngineAgreement`` holds for: a LongRoPE model's short factors end at its threshold)."""
    if not cfg.local:
        return None
    path, problem = local_model_path(cfg)
    if path is None:
        log.warning("local mode off: %s", problem)
        return None
    if max_positions is not None and max_positions < shape.max_position_embeddings:
        shape = shape.model_copy(update={"max_position_embeddings": max_positions})
    local = LocalEngine(
        path,
        shape,
        eos,
        cfg.intra_op_threads,
        cfg.max_sessions,
        cfg.session_bytes,
        cfg.session_idle_s,
        kv_bytes=cfg.local_kv_bytes,
        prefill=prefill_plan(cfg.prefill_shapes),
    )
    await local.warmup()  # the first rates, which the cost model reads from the engine
    log.info(
        "local mode: %s (%s; %.2f ms/token prefill, %.1f ms/token decode)",
        path,
        local_model_kind(path),
        local.prefill_ms_per_token,
        local.decode_ms_per_token,
    )
    return local


def local_model_kind(path: Path) -> str:
    """What the local model at ``path`` is, for the start-up log: a builder graph's precision and
    execution provider (int4 named as lossy: its replies are not the cloud's), or the torch.onnx
    export."""
    from tandem.common.model.builder_export import QUANTIZED_PRECISIONS, load_build

    if not path.is_dir():
        return "torch.onnx export"
    try:
        build = load_build(path)
    except (FileNotFoundError, ValueError):
        return "builder graph"
    lossy = ", quantized: replies differ from the cloud's" if build.precision in QUANTIZED_PRECISIONS else ""
    return f"builder graph, {build.precision} on {build.execution_provider}{lossy}"


def cloud_link(cfg: EdgeConfig, target: str, server_name: str | None = None) -> GrpcCloudLink:
    """A gRPC link to ``target`` with the configured keepalive, TLS and API key; ``server_name``: the
    name the cloud's certificate must carry when ``cfg.cloud_server_name`` does not say (a replica
    found by DNS is dialled by address and checked against the name it was found by)."""
    creds = (
        channel_credentials(cfg.cloud_ca_file, cfg.cloud_cert_file, cfg.cloud_key_file) if cfg.cloud_uses_tls else None
    )
    return GrpcCloudLink(
        target,
        cfg.keepalive_time_s,
        cfg.keepalive_timeout_s,
        credentials=creds,
        server_name=cfg.cloud_server_name or server_name,
        api_key=cfg.cloud_api_key,
    )


async def discover_targets(
    cfg: EdgeConfig, resolvers: Mapping[str, DnsResolver], found_by: dict[str, str]
) -> list[str]:
    """The cloud's targets now: each static ``host:port`` target as it is, each ``dns:`` target
    (a key of ``resolvers``) as the addresses it resolves to; ``found_by`` gets each resolved
    target's DNS name.

    Raises:
        EngineError: a DNS server did not answer.
    """
    out: list[str] = []
    for t in cfg.cloud_targets:
        if t not in resolvers:
            out.append(t)
            continue
        found = await resolvers[t].resolve()
        found_by.update((f, resolvers[t].name.host) for f in found)
        out += found
    return list(dict.fromkeys(out))


async def connect_cloud(
    cfg: EdgeConfig, offer: NegotiateOffer, zstd: tuple[float, float, float]
) -> tuple[list[GrpcCloudLink], CloudTarget]:
    """A link and a ``CloudConnection`` per cloud target (a ``ReplicaSet`` of them for several, or
    for a ``dns:`` target: one per address it resolves to, kept current every
    ``cfg.cloud_resolve_s``), started and given ``cfg.connect_timeout_s`` to negotiate; ``zstd``:
    ``measure_zstd``'s numbers, from which each link's codec order follows its goodput. A ``dns:``
    target that does not resolve at start-up is dialled as it is (gRPC resolves it) until it does.

    Raises:
        IncompatibleModel: the cloud answered that the heads are not cut from its model.
    """
    ratio, c_mbps, d_mbps = zstd
    resolvers = {t: DnsResolver(n) for t in cfg.cloud_targets if (n := parse_dns_target(t)) is not None}
    found_by: dict[str, str] = {}  # resolved target -> the DNS name it was found by

    def connect(target: str, link: GrpcCloudLink | None = None) -> CloudConnection:
        return CloudConnection(
            link or cloud_link(cfg, target, found_by.get(target)),
            offer,
            poll_s=cfg.poll_s,
            probe_bytes=cfg.probe_bytes,
            zstd_pays=lambda g: zstd_pays(ratio, c_mbps, d_mbps, g),
        )

    targets = list(cfg.cloud_targets)
    if resolvers:
        try:
            targets = await discover_targets(cfg, resolvers, found_by) or targets
        except TandemError as e:
            log.warning("cloud replica discovery failed at start-up (%s): dialling %s as named", e, targets)
    links = [cloud_link(cfg, t, found_by.get(t)) for t in targets]
    conns = [connect(t, link) for t, link in zip(targets, links, strict=True)]
    cloud: CloudTarget
    if resolvers:
        cloud = ReplicaSet(
            conns,
            targets,
            discover=lambda: discover_targets(cfg, resolvers, found_by),
            connect=connect,
            resolve_s=cfg.cloud_resolve_s,
        )
    else:
        cloud = conns[0] if len(conns) == 1 else ReplicaSet(conns, targets)
    cloud.start()
    if not await cloud.wait_connected(cfg.connect_timeout_s):
        wrong = next((m.last_exc for m in conns if isinstance(m.last_exc, IncompatibleModel)), None)
        if wrong is not None:
            await cloud.stop()
            raise wrong
        log.warning(
            "cloud %s not answering yet (%s): starting degraded",
            ", ".join(cfg.cloud_targets),
            cloud.current().last_error or "no reply",
        )
    return links, cloud


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

    manifests = load_manifests(cfg)
    manifest = manifests[0]
    tok_dir = manifest.tokenizer_dir(cfg.split_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    eos = eos_token_ids(tokenizer, tok_dir)
    cost = cost_model(cfg)
    heads, sample = await load_heads(cfg, manifests, cost)
    local = await load_local(cfg, manifest.shape, eos, manifest.agreement.max_model_len_max_tokens)
    zstd = measure_zstd(sample, 3)
    links, cloud = await connect_cloud(cfg, edge_offer(cfg, manifest, heads), zstd)
    node = build_node(
        cfg,
        tokenizer,
        heads,
        cloud,
        local=local,
        shape=manifest.shape,
        cost=cost,
        eos_token_ids=frozenset(eos),
        codec_ratio=zstd[0],
        model_key=full_model_key(manifest),
    )
    return await serve_node(cfg, node, manifest.model_id, links)


def cost_model(cfg: EdgeConfig) -> CostModel:
    """The TTFT cost model with the configured choice (hysteresis, exploration) and head pieces."""
    return CostModel(cfg.hysteresis, cfg.explore_every, pipeline_tokens=cfg.pipeline_tokens)


def build_node(
    cfg: EdgeConfig,
    tokenizer: Any,
    heads: Sequence[Head],
    cloud: CloudTarget | None,
    *,
    local: LocalEngine | None = None,
    shape: ModelShape | None = None,
    sessions: EdgeSessions | None = None,
    cost: CostModel | None = None,
    eos_token_ids: frozenset[int] | None = None,
    codec_ratio: float = 1.0,
    model_key: str = "",
) -> EdgeNode:
    """The ``EdgeNode`` over ``heads``, the whole model ``local`` and ``cloud`` (None: none), its
    parts built from ``cfg``: the sessions (``sessions`` when given), the cost model (``cost`` when
    given: ``cost_model(cfg)``), the router, the cloud calls and the turn's bounds; the edge's
    metrics watch them. ``shape``: the model's (its vocabulary and positions bound requests; the
    cost model's wire bytes per token); ``eos_token_ids``: default the tokenizer's;
    ``codec_ratio``: zstd's compressed / raw size of this model's wire bytes; ``model_key``: the
    whole model's identity (``common.wire.kvdown.full_model_key``; "": no remote prefill).

    Raises:
        ValueError: nothing to serve (no head, no local model, no cloud).
    """
    by_k = {h.k: h for h in heads}
    if sessions is None:
        sessions = EdgeSessions(cfg.max_sessions, cfg.session_bytes, cfg.session_idle_s)
    router = Router(
        by_k,
        cloud,
        sessions,
        cost if cost is not None else cost_model(cfg),
        local=local,
        shape=shape,
        remote_prefill=bool(model_key),
        head_pending_tokens=lambda: {k: h.batcher.pending_tokens for k, h in by_k.items()},
        codec_ratio=codec_ratio,
        cloud_budget_ms=cfg.cloud_budget_s * 1e3,
        prompt_kv=PromptKV(cfg.remote_prefill_prompt_kv),
    )
    if eos_token_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        eos_token_ids = frozenset([eos] if isinstance(eos, int) else [])
    limits = RequestLimits(
        vocab_size=shape.vocab_size if shape else 0,
        max_prompt_tokens=cfg.max_prompt_tokens,
        max_new_tokens=cfg.max_new_tokens,
        max_model_len_tokens=shape.max_position_embeddings if shape else 0,
    )
    node = EdgeNode(
        EdgeCompute(tokenizer, by_k, eos_token_ids, model_key),
        router,
        CloudCalls(cloud, by_k, sessions, router, resume_wait_s=cfg.resume_wait_s),
        limits,
        cfg.turn_timeout_s,
    )
    metrics.watch_edge_sessions(sessions)
    if cloud is not None:
        metrics.watch_link(cloud)
    return node


def load_manifests(cfg: EdgeConfig) -> list[SplitManifest]:
    """The manifests of ``cfg.split_dir`` and the extra split directories, in that order.

    Raises:
        FileNotFoundError: no manifest in a split directory.
        ValueError: split directories of different models.
    """
    manifest = SplitManifest.load(cfg.split_dir)
    manifests = [manifest, *(SplitManifest.load(d) for d in cfg.extra_split_dirs)]
    if any(m.weights_blake3 != manifest.weights_blake3 or m.shape != manifest.shape for m in manifests):
        raise ValueError("every split directory must hold the same model (weights and shape)")
    return manifests


async def serve_node(cfg: EdgeConfig, node: EdgeNode, model_id: str, links: list[GrpcCloudLink]) -> EdgeDaemon:
    """Start the Edge gRPC server over ``node`` (its health following what the node can serve)
    and, with ``cfg.http_port``, the OpenAI-compatible API."""
    auth = Authenticator(ApiKeys(cfg.api_keys), client_certs=cfg.tls_client_ca_file is not None)
    servicer = EdgeServicer(node, model_id, auth)
    server, port, hs = await start_server(
        [lambda s: add_service(s, servicer, "Edge")],
        [EDGE_SERVICE],
        cfg.host,
        cfg.port,
        MAX_MESSAGE_BYTES,
        tls_credentials(cfg),
    )
    daemon = EdgeDaemon(server, port, node, servicer, links, hs, asyncio.create_task(follow_link(node, hs)))
    sweep_s = min(60.0, cfg.session_idle_s / 4)
    daemon.sweeper = asyncio.create_task(node.lifetime.sweep_loop(sweep_s), name="session-sweeper")
    if cfg.http_port is not None:
        from tandem.edge.api.http_api import create_openai_app, serve_openai

        app = create_openai_app(node, model_id, [*cfg.api_keys, *cfg.http_api_keys])
        tls = (cfg.tls_cert_file, cfg.tls_key_file) if cfg.tls_cert_file and cfg.tls_key_file else None
        try:
            daemon.http = await serve_openai(app, cfg.http_host, cfg.http_port, tls=tls)
        except BaseException:  # the gRPC server and the tasks started above stop with it
            await daemon.stop(0.0)
            raise
    return daemon


def edge_offer(cfg: EdgeConfig, manifest: SplitManifest, heads: list[Head]) -> NegotiateOffer:
    """What this edge offers the cloud in ``Negotiate``: its model, heads, batch limit, SLOs and wire dtypes."""
    return NegotiateOffer(
        edge_id=cfg.edge_id,
        model_id=manifest.model_id,
        head_keys={h.k: h.compatibility_key for h in heads},
        edge_max_batch=cfg.max_batch,
        ttft_slo_ms=cfg.ttft_slo_ms,
        itl_p99_slo_ms=cfg.itl_p99_slo_ms,
        wire_dtypes=tuple(cfg.wire_dtypes),
        kv_wire_dtypes=tuple(cfg.kv_wire_dtypes),
    )
