"""Link profiles for the benchmarks (edge -> cloud direction is the uplink).

The numbers are representative round values, not measurements of ours: uplink
rates and latencies as public crowd-sourced speed-test reports put them for
each access technology (Ookla Speedtest Global Index and Opensignal mobile
network reports, 2024-2025: median 5G upload roughly 20-60 Mbit/s at 25-40 ms,
4G LTE upload roughly 5-15 Mbit/s at 40-70 ms, Wi-Fi 6 access a few ms with
hundreds of Mbit/s), gigabit Ethernet for LAN, and a cross-region WAN path
(~80 ms RTT, the Europe <-> US-east ballpark). ``stall_prob`` is the chance per
1448-byte TCP segment of a loss-like stall of one extra RTT (fast retransmit).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LinkProfile:
    name: str
    rtt_ms: float
    uplink_mbps: float | None  # None = unshaped
    downlink_mbps: float | None
    jitter_ms: float = 0.0  # std-dev of the one-way delay
    stall_prob: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


PROFILES: dict[str, LinkProfile] = {
    p.name: p
    for p in [
        LinkProfile("loopback", 0.0, None, None),
        LinkProfile("lan", 0.5, 940.0, 940.0, 0.05),
        LinkProfile("wifi6", 6.0, 300.0, 500.0, 1.5, 1e-4),
        LinkProfile("5g", 30.0, 40.0, 200.0, 5.0, 5e-4),
        LinkProfile("4g", 55.0, 10.0, 40.0, 10.0, 1e-3),
        LinkProfile("wan", 80.0, 100.0, 100.0, 2.0, 1e-4),
    ]
}


def get(names: str) -> list[LinkProfile]:
    """Profiles by comma-separated names. Raises KeyError naming the unknown ones."""
    out = []
    for n in (x.strip() for x in names.split(",") if x.strip()):
        if n not in PROFILES:
            raise KeyError(f"unknown link profile {n!r}; known: {', '.join(PROFILES)}")
        out.append(PROFILES[n])
    return out
