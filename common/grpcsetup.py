"""gRPC set-up shared by the cloud gateway and the edge daemon: server options, health,
reflection, stop signals, and client channel options.

Keepalive, as gRPC core defines its channel arguments (doc/keepalive.md):

* server side, accepting client pings (a client may ping every second during a long
  silent prefill or upload without the server closing the connection):

  - ``grpc.keepalive_permit_without_calls=1``: a ping on a connection with no call in
    flight is not a "bad ping" (default 0: it is one);
  - ``grpc.http2.min_ping_interval_without_data_ms=1000``: while the server sends no
    data or header frame, pings closer together than this count as bad pings ("ping
    strikes"; default 5 minutes, so a client pinging every few seconds on a silent
    stream gets GOAWAY ``too_many_pings`` after a few pings);
  - ``grpc.http2.max_ping_strikes=0``: bad pings tolerated before GOAWAY; 0 = no limit
    (default 2). Pings cost the server next to nothing; the limit guards against
    floods, which a trusted edge link does not send.

* client side (``channel_options``): ``grpc.keepalive_time_ms`` (ping after this much
  silence), ``grpc.keepalive_timeout_ms`` (close the transport when the ping's ack does
  not come within it), ``grpc.keepalive_permit_without_calls=1`` (ping also with no call
  in flight) and ``grpc.http2.max_pings_without_data=0`` (keep pinging on a stream that
  carries no data frames; default 2, after which core stops pinging a silent stream and
  a dead peer goes unnoticed).

Message size: both directions are bounded by ``max_message_bytes``, which each server
derives from the largest message that is legal under its negotiated limits.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

SERVER_KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]


def server_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """grpc.aio server options: message size limit both ways, and keepalive acceptance."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # a port already in use is an error, never silently shared with another process (gRPC
        # sets SO_REUSEPORT by default: two daemons on one port would split the connections)
        ("grpc.so_reuseport", 0),
        *SERVER_KEEPALIVE_OPTIONS,
    ]


def channel_options(
    keepalive_time_s: float, keepalive_timeout_s: float, max_message_bytes: int
) -> list[tuple[str, int]]:
    """Client channel options: message size limit both ways and keepalive pings every
    ``keepalive_time_s`` of silence, also on silent streams and with no call in flight."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", max(1, round(keepalive_time_s * 1e3))),
        ("grpc.keepalive_timeout_ms", max(1, round(keepalive_timeout_s * 1e3))),
        # any ping in flight (a BDP probe too) must be acked within the same bound, or keepalive
        # waits behind it for the 60 s default before it can send its own
        ("grpc.http2.ping_timeout_ms", max(1, round(keepalive_timeout_s * 1e3))),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # reconnect within about a second once the peer is back (gRPC's default backoff grows to 120 s)
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.min_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


async def set_health(hs: health.aio.HealthServicer, serving: bool, names: Iterable[str]) -> None:
    """Set every name in ``names`` (use "" for the whole server) to SERVING or NOT_SERVING."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in names:
        await hs.set(name, status)


async def start_server(
    servicers: list[Callable[[grpc.aio.Server], None]],
    service_names: list[str],
    host: str,
    port: int,
    max_message_bytes: int,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Create, bind and start a grpc.aio server (port 0 = any free port).

    ``servicers`` are callables that add one servicer each (e.g.
    ``lambda s: pb_grpc.add_CloudServicer_to_server(servicer, s)``); ``service_names``
    are their full names (``tandem.v1.Cloud``). Health is registered with "" and every
    service name SERVING; reflection lists the services, health and reflection.
    Returns (server, bound port, health servicer).

    Raises:
        RuntimeError: ``host:port`` could not be bound.
    """
    server = grpc.aio.server(options=server_options(max_message_bytes))
    for add in servicers:
        add(server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    await set_health(hs, True, ["", *service_names])
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind {host}:{port}")
    await server.start()
    return server, bound, hs


def install_stop_signals(loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Event:
    """An event set on SIGINT or SIGTERM (handlers on ``loop``, default the running loop)."""
    loop = loop or asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
