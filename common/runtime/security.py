"""Transport security and caller identity, shared by the cloud gateway and the edge daemon.

Two hops, the same rules:

* **TLS.** A server with ``tls_cert_file``/``tls_key_file`` listens with TLS; with
  ``tls_client_ca_file`` as well it requires a client certificate signed by that CA
  (mutual TLS): a peer without one fails the handshake and never reaches a servicer.
  A client (the edge towards the cloud, the SDK towards the edge) verifies the server's
  certificate against its CA file and the target's host name (or ``server_name``).
* **Plaintext only when asked for.** A server binds plaintext only on a loopback address
  unless its config says ``insecure = true``; a client speaks plaintext only to a
  loopback target unless told so (``check_plaintext``).
* **Bearer tokens** (API keys, as vLLM's ``--api-key``): ``authorization: Bearer <key>``
  in the call's metadata, compared with every configured key in constant time
  (``hmac.compare_digest``, RFC 6750 for the header).
* **Identity** (``Principal``): the key's name, else the client certificate's subject,
  else, where neither is configured, the peer's host (one anonymous principal per
  host). State is scoped by it: a session id or link id of one principal is not
  visible to another (``scoped``).
* **One identity per caller.** With both API keys and mutual TLS configured, a key's name must
  equal the subject of the certificate the call came with, else ``Unauthenticated``; keys given as
  a list carry no name to bind and are refused together with mutual TLS (docs/security.md, "Keys
  and identities").

Domain code never sees grpc: servicers call ``Authenticator.identify`` with the call's
metadata and auth context and get a ``Principal`` or ``Unauthenticated``.
"""

from __future__ import annotations

import hashlib
import hmac
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.common.protocol.errors import InvalidRequest, Unauthenticated
from tandem.security import is_loopback

__all__ = [
    "ANONYMOUS_PEER",
    "ApiKeys",
    "Authenticator",
    "Principal",
    "check_key",
    "check_target",
    "check_tls_files",
    "is_loopback",
    "scoped",
]

BEARER = "bearer "
ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class Principal:
    """Who is calling: ``kind`` is ``key`` (an API key's name), ``cert`` (a client
    certificate's subject common name, or its first subject alternative name), or ``peer``
    (no authentication configured: the peer's host)."""

    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"

    @property
    def tag(self) -> str:
        """A short, fixed-length, printable tag of the principal (16 hex digits of SHA-256), used
        to scope ids (``scoped``) without leaking the name into keys and logs."""
        return hashlib.sha256(str(self).encode()).hexdigest()[:16]


ANONYMOUS_PEER = Principal("peer", ANONYMOUS)


MAX_SCOPED_BYTES = 128  # what the cloud accepts as a session id (``cloud.uploads.upload.MAX_ID_BYTES``)


def scoped(principal: Principal, ident: str) -> str:
    """``ident`` (a session id, a link id) in ``principal``'s namespace: two principals using the
    same id never meet. The empty id (stateless) stays empty. An id too long to fit
    ``MAX_SCOPED_BYTES`` with its 17-character prefix is replaced by ``#`` and 40 hex digits of its
    SHA-256, so every id a client may send stays usable in every mode."""
    if not ident:
        return ""
    out = f"{principal.tag}/{ident}"
    if len(out.encode()) > MAX_SCOPED_BYTES:
        out = f"{principal.tag}/#{hashlib.sha256(ident.encode()).hexdigest()[:40]}"
    return out


def check_plaintext(address: str, insecure: bool, what: str) -> None:
    """Refuse plaintext on ``address`` (a bind host or a target) unless it is loopback or
    ``insecure`` was set explicitly.

    Raises:
        InvalidRequest: plaintext to or from another host without ``insecure``; the message says
            which setting to add (TLS files, or ``insecure = true``).
    """
    if not insecure and not is_loopback(address):
        raise InvalidRequest(
            f"{what} {address!r} is not a loopback address: configure TLS (tls_cert_file/tls_key_file, "
            f"or the CA file on a client), or set insecure = true to accept plaintext explicitly"
        )


def read_file(path: Path | str, what: str) -> bytes:
    """The bytes of a PEM file, a regular file read without blocking (``files.read_regular``: a
    FIFO or a device is refused by its type, never opened).

    Raises:
        InvalidRequest: the file is missing, unreadable or not a regular file (the message names
            the setting).
    """
    from tandem.common.protocol.files import read_regular

    return read_regular(path, what)


def key_name(key: str) -> str:
    """The name of an unnamed API key: ``key-`` and 8 hex digits of its SHA-256 (32 bits of the hash
    of a secret of at least 16 characters: it names the key in logs without revealing it)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


MIN_KEY_CHARS = 16


def check_key(key: str, name: str) -> str:
    """``key`` if it can be a bearer token: at least ``MIN_KEY_CHARS`` characters (shorter ones are
    guessable), printable ASCII without spaces (it travels in an ``authorization`` header, which
    gRPC metadata and HTTP carry as ASCII).

    Raises:
        InvalidRequest: otherwise; the message names the key by ``name``, never shows it.
    """
    if len(key) < MIN_KEY_CHARS:
        raise InvalidRequest(f"{name} is shorter than {MIN_KEY_CHARS} characters")
    if not all("!" <= c <= "~" for c in key):
        raise InvalidRequest(f"{name} must be printable ASCII without spaces (it is sent in a header)")
    return key


class ApiKeys:
    """Named bearer tokens. ``identify`` compares a presented token with every key in constant
    time (no early exit: the time does not depend on which key, if any, matched).

    Args:
        keys: ``{name: key}``; keys of a list are named by ``key_name`` (stable when the list is
            reordered or grows, so each key's sessions stay its own).

    Raises:
        InvalidRequest: a key ``check_key`` refuses, or an empty name.
    """

    MIN_KEY_CHARS = MIN_KEY_CHARS

    def __init__(self, keys: Mapping[str, str] | Sequence[str]) -> None:
        self.named = isinstance(keys, Mapping)  # names given (identities), not derived from the keys
        named = dict(keys) if isinstance(keys, Mapping) else {key_name(k): k for k in keys}
        for name, key in named.items():
            if not name:
                raise InvalidRequest("an API key's name (the identity it stands for) is empty")
            check_key(key, f"API key {name!r}")
        self._keys = [(name, key.encode()) for name, key in named.items()]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def identify(self, token: str) -> str | None:
        """The name of the key equal to ``token``, or None."""
        presented = token.encode()
        found: str | None = None
        for name, key in self._keys:
            if hmac.compare_digest(presented, key):
                found = name
        return found


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of the ``authorization: Bearer <token>`` entry of gRPC metadata, or None."""
    for k, v in metadata or ():
        if k.lower() == "authorization":
            value = v.decode(errors="replace") if isinstance(v, bytes) else v
            if value[: len(BEARER)].lower() == BEARER:
                return value[len(BEARER) :].strip()
    return None


def cert_subject(auth_context: Mapping[str, Sequence[bytes]] | None) -> str | None:
    """The verified client certificate's subject common name (else its first subject alternative
    name) from a gRPC auth context (``ServicerContext.auth_context()``), or None without one."""
    ctx = auth_context or {}
    for field in ("x509_common_name", "x509_subject_alternative_name"):
        values = ctx.get(field) or []
        if values:
            v = values[0]
            return v.decode(errors="replace") if isinstance(v, bytes) else str(v)
    return None


class Authenticator:
    """Who a call comes from, by the rules in the module docstring.

    Args:
        keys: the API keys; when non-empty, every call must carry one (``Unauthenticated``).
        client_certs: mutual TLS is on (the handshake already checked the certificate); with keys
            too, each key is bound to the certificate subject that is its name.

    Raises:
        InvalidRequest: keys without names (a list) together with ``client_certs``.
    """

    def __init__(self, keys: ApiKeys | None = None, client_certs: bool = False) -> None:
        self.keys = keys or ApiKeys([])
        self.client_certs = client_certs
        if self.keys and client_certs and not self.keys.named:
            raise InvalidRequest(
                "API keys given as a list name no identity to bind to a client certificate: with mutual TLS, "
                "name each key by the certificate subject it is for"
            )

    @property
    def required(self) -> bool:
        return bool(self.keys) or self.client_certs

    def identify(
        self,
        metadata: Sequence[tuple[str, str | bytes]] | None,
        auth_context: Mapping[str, Sequence[bytes]] | None,
        peer_host: str,
    ) -> Principal:
        """The caller's principal.

        Raises:
            Unauthenticated: keys are configured and the call has none or a wrong one; mutual TLS is
                on and the auth context has no certificate subject; or both are on and the key's name
                is not the certificate's subject.
        """
        subject = cert_subject(auth_context) if self.client_certs else None
        if self.client_certs and subject is None:
            raise Unauthenticated("no verified client certificate")
        if self.keys:
            token = bearer_token(metadata)
            if token is None:
                raise Unauthenticated("missing API key: send 'authorization: Bearer <key>'")
            name = self.keys.identify(token)
            if name is None:
                raise Unauthenticated("invalid API key")
            if self.client_certs and name != subject:
                raise Unauthenticated("the API key was not issued for this client certificate's subject")
            return Principal("key", name)
        if subject is not None:
            return Principal("cert", subject)
        return Principal("peer", peer_host or ANONYMOUS)


_TARGET_SCHEMES = ("unix:", "unix-abstract:", "ipv4:", "ipv6:", "dns:")


def check_target(target: str, what: str) -> str:
    """``target`` if gRPC can dial it as meant: ``host:port``, ``[v6]:port``, or a gRPC scheme form
    (``dns:``, ``ipv4:``, ``ipv6:``, ``unix:``). A target without a port is refused: gRPC would dial
    port 443.

    Raises:
        InvalidRequest: otherwise (the message names ``what``).
    """
    t = target.strip()
    if t.startswith(_TARGET_SCHEMES) and t.split(":", 1)[1].strip("/"):
        return target
    host, sep, port = t.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or any(c.isspace() for c in host) or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequest(f"{what} {target!r} is not host:port (or [IPv6]:port) with a port in 1..65535")
    return target


def check_tls_files(cert_file: Path | None, key_file: Path | None, ca_file: Path | None, names: str) -> None:
    """The PEM files of one TLS endpoint load: ``cert_file`` with its ``key_file`` (a certificate
    chain and the private key that matches it) and ``ca_file`` (certificates to verify the peer);
    each may be None. ``names`` are the settings' names, ``cert/key/ca`` (``tls_cert_file/...``).

    Raises:
        InvalidRequest: a file is missing or unreadable, not PEM, or the key is not the certificate's.
    """
    cert_name, key_name_, ca_name = names.split("/")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    if cert_file is not None and key_file is not None:
        read_file(cert_file, cert_name)
        read_file(key_file, key_name_)
        try:
            ctx.load_cert_chain(cert_file, key_file, password=lambda: b"")
        except (ssl.SSLError, OSError) as e:
            raise InvalidRequest(
                f"{cert_name} {cert_file} and {key_name_} {key_file} do not load as a PEM certificate chain and "
                f"its unencrypted private key: {getattr(e, 'reason', None) or e}"
            ) from None
    if ca_file is not None:
        read_file(ca_file, ca_name)
        try:
            ctx.load_verify_locations(cafile=ca_file)
        except (ssl.SSLError, OSError) as e:
            reason = getattr(e, "reason", None) or e
            raise InvalidRequest(f"{ca_name} {ca_file} does not load as PEM certificates: {reason}") from None


def expand_path(path: Path) -> Path:
    """``path`` with ``~`` and ``$VARS`` expanded (``~/.local/state/tandem/kv`` is the XDG Base
    Directory specification's place for state that survives restarts)."""
    import os

    return Path(os.path.expandvars(os.path.expanduser(str(path))))


def private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) readable only by this user (mode 0700), or check an
    existing one: it must be a directory owned by this user; group or other permissions on it are
    removed. Every ancestor (of the resolved path) must be owned by this user or root and not be
    writable by others unless sticky (``/tmp``): otherwise another user could swap the folder for
    one of theirs (the rule of OpenSSH's ``StrictModes``).

    Raises:
        InvalidRequest: ``path`` is not a directory, is a symbolic link, or belongs to another user;
            or an ancestor lets another user replace it.
    """
    import os
    import stat

    path = Path(path)
    uid = os.getuid()
    _check_ancestors(path.parent, uid)
    path.parent.mkdir(parents=True, exist_ok=True)
    _check_ancestors(path.parent, uid)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise InvalidRequest(f"{path} is not a directory (a symbolic link or a file): choose another store_dir")
    if st.st_uid != uid:
        raise InvalidRequest(
            f"{path} belongs to user id {st.st_uid}, not to this user ({uid}): another user could read or "
            f"plant KV blocks there; choose another store_dir"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        path.chmod(0o700)
    return path


def _check_ancestors(parent: Path, uid: int) -> None:
    """Raise InvalidRequest if an existing ancestor of ``parent`` (itself included, resolved) can be
    changed by a user other than ``uid`` and root."""
    import stat

    real = parent.resolve()
    for d in (real, *real.parents):
        try:
            st = d.stat()
        except FileNotFoundError:
            continue
        if st.st_uid not in (0, uid):
            raise InvalidRequest(f"{d} belongs to user id {st.st_uid}: that user could replace the store folder")
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise InvalidRequest(
                f"{d} is writable by others (mode {stat.S_IMODE(st.st_mode):o}) without the sticky bit: another user "
                f"could replace the store folder"
            )
