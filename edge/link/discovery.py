"""Finding a cloud deployment's replicas by DNS: a ``dns:`` target names every replica at once.

A Kubernetes headless Service (``clusterIP: None``) answers its name with one address per ready
pod; so does any DNS zone with several A/AAAA records for one name. The edge is given the name in
gRPC's target form and resolves it itself, so that it holds one link per replica and chooses among
them (``edge.link.replicas.ReplicaSet``: rendezvous hashing of the session id), where gRPC's own
resolver would hand one channel the addresses and pick the first:

* ``dns:///tandem-cloud.default.svc.cluster.local:50051``: the system's DNS servers
  (``/etc/resolv.conf``, with its search domains, so ``dns:///tandem-cloud:50051`` works in a pod);
* ``dns://10.0.0.10:53/tandem-cloud.svc:50051``: the DNS server named in the authority (a port
  there defaults to 53);
* ``dns:tandem-cloud.svc:50051``: as ``dns:///``.

Resolution asks for A and AAAA records (``dnspython``'s asynchronous resolver) and answers
``ip:port`` targets (``[v6]:port`` for IPv6), sorted. It does not read ``/etc/hosts``; a name with no
record resolves to no target, and a DNS server that does not answer raises (the caller keeps the
replicas it had).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from tandem.common.protocol.errors import EngineError, InvalidRequest

DNS_PORT = 53


@dataclass(frozen=True)
class DnsName:
    """A ``dns:`` target's parts: the replicas' ``host`` name and gRPC ``port``, and the DNS server
    to ask (``nameserver``, ``nameserver_port``; None: the system's)."""

    host: str
    port: int
    nameserver: str | None = None
    nameserver_port: int = DNS_PORT

    def target_of(self, address: str) -> str:
        """The gRPC target of one resolved ``address``: ``ip:port`` or ``[v6]:port``."""
        return f"[{address}]:{self.port}" if ":" in address else f"{address}:{self.port}"


def _host_port(text: str, default_port: int | None, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or "]" in port:  # no port (or a bare IPv6 literal in brackets)
        host, port = text, ""
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port and default_port is not None:
        return host, default_port
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidRequest(f"{what} {text!r} is not host:port with a port in 1..65535")
    return host, int(port)


def parse_dns_target(target: str) -> DnsName | None:
    """The parts of a ``dns:`` gRPC target (forms in the module doc), or None for any other target.

    Raises:
        InvalidRequest: a ``dns:`` target without a name or a port, or with a malformed authority.
    """
    t = target.strip()
    if not t.startswith("dns:"):
        return None
    rest, authority = t[len("dns:") :], ""
    if rest.startswith("//"):
        authority, slash, rest = rest[2:].partition("/")
        if not slash:
            raise InvalidRequest(f"cloud target {target!r}: dns://AUTHORITY/NAME:PORT needs the /NAME:PORT part")
    host, port = _host_port(rest, None, f"cloud target {target!r}: name")
    if not authority:
        return DnsName(host, port)
    ns, ns_port = _host_port(authority, DNS_PORT, f"cloud target {target!r}: DNS server")
    try:
        ipaddress.ip_address(ns)
    except ValueError:
        raise InvalidRequest(f"cloud target {target!r}: the DNS server must be an IP address, not {ns!r}") from None
    return DnsName(host, port, ns, ns_port)


class DnsResolver:
    """Resolves one ``DnsName`` to its replicas' targets (see module doc); ``timeout_s`` bounds one
    resolution (both queries, every server tried)."""

    def __init__(self, name: DnsName, timeout_s: float = 2.0) -> None:
        import dns.asyncresolver

        self.name = name
        if name.nameserver is None:
            self._resolver = dns.asyncresolver.Resolver()  # /etc/resolv.conf
        else:
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            self._resolver.nameservers = [name.nameserver]
            self._resolver.port = name.nameserver_port
        self._resolver.lifetime = timeout_s
        self._resolver.cache = None  # each resolution asks: the point is to see changes

    async def resolve(self) -> list[str]:
        """Targets (``ip:port``) of every A and AAAA record of the name, sorted; [] when it has none.

        Raises:
            EngineError: the DNS server did not answer (timeout, refused, no server reachable).
        """
        import dns.exception
        import dns.resolver

        addresses: set[str] = set()
        answered = False
        failure: Exception | None = None
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self._resolver.resolve(self.name.host, rdtype, search=self.name.nameserver is None)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                answered = True
                continue
            except dns.exception.DNSException as e:
                failure = e
                continue
            answered = True
            addresses |= {r.to_text() for r in answer}
        if not answered:
            raise EngineError(f"DNS for {self.name.host}: {failure}")
        return sorted(self.name.target_of(a) for a in addresses)
