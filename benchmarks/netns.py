"""Kernel rate shaping between network namespaces: the cloud runs in its own
namespace behind a veth pair; ``tc tbf`` on each end shapes one direction
(root-side egress = edge -> cloud uplink, namespace-side egress = downlink).
Delay and jitter still come from ``benchmarks.linkproxy`` (``netem`` is missing here).

Needs root and iproute2. Addresses are a private /30 on the namespace's own
veth pair, reachable only from this machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from tandem.benchmarks.links import LinkProfile


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def available() -> bool:
    """True when this process can create namespaces and shape veth links."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    probe = f"tandem-probe-{os.getpid()}"
    try:
        _ip("ip", "netns", "add", probe)
        _ip("ip", "netns", "del", probe)
        return True
    except (subprocess.CalledProcessError, OSError):
        return False


@dataclass
class CloudNamespace:
    """A namespace for the cloud at ``cloud_ip``; the root side is ``host_ip``."""

    name: str
    host_if: str
    ns_if: str
    host_ip: str = "10.231.7.1"
    cloud_ip: str = "10.231.7.2"

    @classmethod
    def create(cls) -> CloudNamespace:
        """Raises subprocess.CalledProcessError when iproute2 refuses."""
        tag = os.getpid() % 100000
        ns = cls(f"tandem-cloud-{tag}", f"tdh{tag}", f"tdc{tag}")
        _ip("ip", "netns", "add", ns.name)
        _ip("ip", "link", "add", ns.host_if, "type", "veth", "peer", "name", ns.ns_if)
        _ip("ip", "link", "set", ns.ns_if, "netns", ns.name)
        _ip("ip", "addr", "add", f"{ns.host_ip}/30", "dev", ns.host_if)
        _ip("ip", "link", "set", ns.host_if, "up")
        _ip("ip", "addr", "add", f"{ns.cloud_ip}/30", "dev", ns.ns_if, ns=ns.name)
        _ip("ip", "link", "set", ns.ns_if, "up", ns=ns.name)
        _ip("ip", "link", "set", "lo", "up", ns=ns.name)
        return ns

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def shape(self, p: LinkProfile) -> None:
        """Apply the profile's rates with ``tbf`` (burst ~ 10 ms of traffic, queue <= 50 ms)."""
        for dev, ns, rate in ((self.host_if, None, p.uplink_mbps), (self.ns_if, self.name, p.downlink_mbps)):
            subprocess.run(
                (["ip", "netns", "exec", ns] if ns else []) + ["tc", "qdisc", "del", "dev", dev, "root"],
                capture_output=True,
            )
            if rate:
                burst = max(16_000, int(rate * 1e6 / 8 * 0.01))
                _ip(
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    f"{rate}mbit",
                    "burst",
                    str(burst),
                    "latency",
                    "50ms",
                    ns=ns,
                )

    def destroy(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
