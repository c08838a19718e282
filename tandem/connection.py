"""One connection to a tandem edge, the one both SDK clients hold (``Client`` a blocking channel of
it, ``AsyncClient`` an asyncio one): the target, TLS credentials, the API key's call metadata, the
channel options (keepalive, reconnect backoff, gRPC's service config with its retry policy) and the
default deadline of a call. Built once from the clients' arguments (``Connection.of``), checked
before any channel exists; it opens channels and gives each call its deadline and metadata
(``call_options``). It does not start calls or translate their errors (the clients do).

Needs only grpcio.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tandem.chat_request import _deadline_s
from tandem.security import channel_security

DEFAULT_TIMEOUT_S = 300.0  # a client's default deadline per call

# Keepalive to the edge: a stopped or unreachable edge fails the call with UNAVAILABLE within
# about 10 s instead of leaving it silent until its deadline; quick reconnects once it is back.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.http2.ping_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

# gRPC's service config for the channel (https://github.com/grpc/grpc/blob/master/doc/service_config.md):
# ``GetInfo`` only reads, so gRPC itself retries it when the edge is unavailable (a restart, a
# connection reset), up to 3 attempts with backoff, within the call's deadline. ``Chat`` (a turn
# changes a session) and ``EndSession`` (its answer says whether the session was held) are not
# retried: the caller sees ``Unavailable`` and decides.
SERVICE_CONFIG: dict[str, Any] = {
    "methodConfig": [
        {
            "name": [{"service": "tandem.v1.Edge", "method": "GetInfo"}],
            "retryPolicy": {
                "maxAttempts": 3,
                "initialBackoff": "0.1s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
        }
    ]
}


@dataclass(frozen=True)
class Connection:
    """Everything a channel to one edge and each call on it need.

    ``target``: the edge's gRPC address (``"host:port"``); ``credentials``: TLS channel
    credentials, ``None`` for plaintext; ``metadata``: sent with every call (``authorization:
    Bearer <api_key>``, or empty); ``options``: the channel's options; ``timeout_s``: the deadline
    in seconds of a call that passes none (``None``: no client-side deadline).
    """

    target: str
    credentials: grpc.ChannelCredentials | None
    metadata: tuple[tuple[str, str], ...]
    options: tuple[tuple[str, Any], ...]
    timeout_s: float | None

    @classmethod
    def of(
        cls,
        target: str,
        *,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        tls: bool | None = None,
        ca_file: str | Path | None = None,
        cert_file: str | Path | None = None,
        key_file: str | Path | None = None,
        server_name: str | None = None,
        insecure: bool = False,
    ) -> Connection:
        """The connection the clients' arguments describe (see ``Client``).

        Raises:
            ValueError: ``timeout_s`` not > 0; plaintext to another host without ``insecure=True``;
                only one of ``cert_file`` and ``key_file``; a file that cannot be read.
        """
        deadline_s = _deadline_s(timeout_s, "timeout_s")
        creds, security_options, metadata = channel_security(
            target,
            api_key=api_key,
            tls=tls,
            ca_file=ca_file,
            cert_file=cert_file,
            key_file=key_file,
            server_name=server_name,
            insecure=insecure,
        )
        options = (
            *CHANNEL_OPTIONS,
            ("grpc.enable_retries", 1),
            ("grpc.service_config", json.dumps(SERVICE_CONFIG)),
            *security_options,
        )
        return cls(target, creds, metadata, tuple(options), deadline_s)

    def channel(self) -> grpc.Channel:
        """A new blocking channel to the edge; the caller closes it."""
        return self._open(grpc)

    def aio_channel(self) -> grpc.aio.Channel:
        """A new asyncio channel to the edge, bound to the running event loop; the caller closes it."""
        return self._open(grpc.aio)

    def _open(self, grpc_module: Any) -> Any:
        options = list(self.options)
        if self.credentials is None:
            return grpc_module.insecure_channel(self.target, options=options)
        return grpc_module.secure_channel(self.target, self.credentials, options=options)

    def call_options(self, timeout_s: float | None = None) -> dict[str, Any]:
        """``timeout`` and ``metadata`` keyword arguments of one call: the call's ``timeout_s``
        (``math.inf``: none), else the connection's.

        Raises:
            ValueError: ``timeout_s`` not > 0.
        """
        deadline_s = self.timeout_s if timeout_s is None else _deadline_s(timeout_s, "timeout_s")
        return {"timeout": deadline_s, "metadata": self.metadata or None}
