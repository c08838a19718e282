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
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.common.protocol.errors import InvalidRequest
from tandem.common.runtime.security import read_file
from tandem.v1 import tandem_pb2 as pb

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


@dataclass(frozen=True)
class Malformed:
    """A request message that did not parse (``add_service``): a unary method answers
    INVALID_ARGUMENT for it; a streaming method finds it in its request stream and decides."""

    method: str
    error: str

    def __str__(self) -> str:
        return f"a {self.method} request message does not parse: {self.error}"


def _lenient(parse: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as e:
            return Malformed(method, str(e)[:200])

    return deserialize


def _unary(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"InvalidRequest: {request}")
        return await behavior(request, context)

    return handler


def _unary_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"InvalidRequest: {request}")
        async for response in behavior(request, context):
            yield response

    return handler


def add_service(server: grpc.aio.Server, servicer: Any, service_name: str) -> None:
    """Register ``servicer`` for ``tandem.v1.<service_name>`` as the generated
    ``add_<Service>Servicer_to_server`` does, except that a request message that does not parse
    never surfaces as an exception (gRPC would answer UNKNOWN or INTERNAL): a unary request
    method answers INVALID_ARGUMENT; a client-streaming method gets a ``Malformed`` item in its
    request stream (``Cloud.Generate`` sends its verdict, drains and answers INVALID_ARGUMENT).

    Raises:
        KeyError: no such service in ``tandem.v1``.
    """
    service = pb.DESCRIPTOR.services_by_name[service_name]
    handlers = {}
    for m in service.methods:
        request_cls, response_cls = getattr(pb, m.input_type.name), getattr(pb, m.output_type.name)
        behavior = getattr(servicer, m.name)
        if m.client_streaming:
            make = grpc.stream_stream_rpc_method_handler if m.server_streaming else grpc.stream_unary_rpc_method_handler
        else:
            make = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
            behavior = _unary_stream(behavior) if m.server_streaming else _unary(behavior)
        handlers[m.name] = make(
            behavior,
            request_deserializer=_lenient(request_cls.FromString, m.name),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def server_credentials(cert_file: Path, key_file: Path, client_ca_file: Path | None) -> grpc.ServerCredentials:
    """TLS for a server: its certificate chain and key (PEM); with ``client_ca_file`` the server
    requires a client certificate signed by that CA (mutual TLS, checked in the handshake).

    Raises:
        InvalidRequest: a file cannot be read (the message names it).
    """
    pair = (read_file(key_file, "tls_key_file"), read_file(cert_file, "tls_cert_file"))
    ca = read_file(client_ca_file, "tls_client_ca_file") if client_ca_file else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


def channel_credentials(
    ca_file: Path | None, cert_file: Path | None = None, key_file: Path | None = None
) -> grpc.ChannelCredentials:
    """TLS for a client channel: the server is verified against ``ca_file`` (None: the system's
    roots); ``cert_file``/``key_file`` are this client's certificate for mutual TLS.

    Raises:
        InvalidRequest: only one of cert and key given, or a file cannot be read.
    """
    if (cert_file is None) != (key_file is None):
        raise InvalidRequest("a client certificate needs both its cert file and its key file")
    return grpc.ssl_channel_credentials(
        root_certificates=read_file(ca_file, "CA file") if ca_file else None,
        private_key=read_file(key_file, "client key file") if key_file else None,
        certificate_chain=read_file(cert_file, "client cert file") if cert_file else None,
    )


def tls_credentials(cfg: Any) -> grpc.ServerCredentials | None:
    """A daemon's server credentials from its settings (``tls_cert_file``, ``tls_key_file``,
    ``tls_client_ca_file`` of ``common.runtime.settings.DaemonSettings``), or None for plaintext.

    Raises:
        InvalidRequest: a file cannot be read.
    """
    if cfg.tls_cert_file is None or cfg.tls_key_file is None:
        return None
    return server_credentials(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file)


async def start_server(
    servicers: list[Callable[[grpc.aio.Server], None]],
    service_names: list[str],
    host: str,
    port: int,
    max_message_bytes: int,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """Create, bind and start a grpc.aio server (port 0 = any free port), with TLS when
    ``credentials`` are given (``server_credentials``), else plaintext (the caller checks that
    plaintext is allowed on ``host``: ``common.runtime.security.check_plaintext``).

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
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        await server.stop(None)
        raise RuntimeError(f"could not bind {host}:{port} (in use, or not an address of this machine)")
    await server.start()
    return server, bound, hs


LIVENESS_SERVICE = "liveness"  # health name SERVING while the process answers (draining or not)


async def start_health_server(hs: health.aio.HealthServicer, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """A plaintext grpc.aio server on ``host:port`` with only ``grpc.health.v1.Health``, answered by
    ``hs`` (the main server's servicer, so every name reads as it does there), and
    ``LIVENESS_SERVICE`` SERVING: for Kubernetes' native gRPC probes, which speak no TLS. It
    carries no data, only serving states. Returns (server, bound port).

    Raises:
        RuntimeError: ``host:port`` could not be bound.
    """
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    await set_health(hs, True, [LIVENESS_SERVICE])
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    bound = server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"could not bind the health port {host}:{port}")
    await server.start()
    return server, bound


class StopSignal(asyncio.Event):
    """Set by the first SIGINT or SIGTERM; ``name`` is that signal's ("" until then)."""

    def __init__(self) -> None:
        super().__init__()
        self.name = ""

    def received(self, sig: signal.Signals) -> None:
        if not self.is_set():
            self.name = sig.name
        self.set()


def install_stop_signals(loop: asyncio.AbstractEventLoop | None = None) -> StopSignal:
    """An event set on SIGINT or SIGTERM (handlers on ``loop``, default the running loop), naming
    the signal that set it."""
    loop = loop or asyncio.get_running_loop()
    stop = StopSignal()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.received, sig)
    return stop
