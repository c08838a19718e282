"""Client-side channel security of the SDK (no dependencies beyond grpcio): TLS to the edge,
its API key, and the rule that plaintext goes only to this host unless asked for."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import grpc


def is_loopback(host: str) -> bool:
    """True when every address of ``host`` stays on this host: ``localhost``, 127.0.0.0/8, ``::1``
    (also as ``::ffff:127.x``) and ``unix:`` targets. ``host`` may carry a port and a gRPC scheme,
    including gRPC's multi-address ``ipv4:a:p,b:p`` / ``ipv6:[a]:p,[b]:p`` form (all must be loopback)."""
    h = host.strip()
    if h.startswith(("unix:", "unix-abstract:")):
        return True
    for prefix in ("ipv4:", "ipv6:", "dns:///", "dns:"):
        if h.startswith(prefix):
            h = h[len(prefix) :]
            break
    parts = h.split(",")
    return bool(parts) and all(_one_is_loopback(p) for p in parts)


def _one_is_loopback(h: str) -> bool:
    h = h.strip()
    if h.startswith("["):
        h = h[1 : h.index("]")] if "]" in h else h[1:]
    elif h.count(":") == 1:
        h = h.rsplit(":", 1)[0]
    if h in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


def _read(path: str | Path | None, what: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror or e}") from None


def channel_security(
    target: str,
    *,
    api_key: str | None = None,
    tls: bool | None = None,
    ca_file: str | Path | None = None,
    cert_file: str | Path | None = None,
    key_file: str | Path | None = None,
    server_name: str | None = None,
    insecure: bool = False,
) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, str]], tuple[tuple[str, str], ...]]:
    """What a channel to ``target`` needs: (TLS credentials or None for plaintext, extra channel
    options, call metadata carrying ``authorization: Bearer <api_key>``).

    ``tls`` None = TLS when a CA or client certificate is given, else plaintext, which is
    allowed only to a loopback target (``localhost``, 127.0.0.0/8, ``::1``, ``unix:``) unless
    ``insecure=True``: an API key or a conversation never crosses a network in the clear
    by accident.

    Raises:
        ValueError: plaintext to another host without ``insecure``; only one of cert and key; a
            file that cannot be read.
    """
    use_tls = tls if tls is not None else (ca_file is not None or cert_file is not None)
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs both cert_file and key_file")
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    if not use_tls:
        if not insecure and not is_loopback(target):
            raise ValueError(
                f"{target!r} is not a loopback address: pass tls=True (and ca_file) to speak TLS, or "
                "insecure=True to send requests in plaintext"
            )
        return None, [], metadata
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file, "ca_file"),
        private_key=_read(key_file, "key_file"),
        certificate_chain=_read(cert_file, "cert_file"),
    )
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    return creds, options, metadata
