"""A user-space TCP proxy that emulates a link: one-way delay (RTT/2), jitter,
loss-like stalls and, where no kernel shaper is used, rate limits per direction.

Why user space: ``netem`` is missing on these machines ("qdisc kind is unknown"),
so delay and jitter cannot come from ``tc``. Rate can (``tbf`` on a veth pair,
see ``benchmarks.netns``); then the proxy runs with ``shape_rate=False``.

Model per direction: a read of ``n`` bytes leaves the sender's queue at
``max(now, busy_until) + n*8/rate`` (serialisation; the queue is shared by all
connections of that direction, like one bottleneck link), and arrives one-way
delay + |N(0, jitter)| later, never before the previous arrival (TCP is in order).
With probability ``1-(1-p)^segments`` the read also waits one extra RTT.

Run as a process: ``python -m benchmarks.linkproxy LISTEN_PORT UPSTREAM_HOST:PORT [rate|no-rate]
[--ready-file PATH]``; it prints its port (and writes it to the ready file, as the tandem
daemons do), then reads JSON ``LinkProfile`` lines on stdin and answers ``ok``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tandem.benchmarks.links import PROFILES, LinkProfile

MSS_BYTES = 1448


@dataclass
class Direction:
    rate_mbps: float | None = None
    busy_until: float = 0.0
    last_arrival: float = 0.0
    bytes: int = 0


class LinkProxy:
    def __init__(self, upstream_host: str, upstream_port: int, shape_rate: bool = True, seed: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.shape_rate = shape_rate
        self.profile = PROFILES["loopback"]
        self.rng = random.Random(seed)
        self.up, self.down = Direction(), Direction()

    def set_profile(self, p: LinkProfile) -> None:
        self.profile = p
        self.up.rate_mbps = p.uplink_mbps if self.shape_rate else None
        self.down.rate_mbps = p.downlink_mbps if self.shape_rate else None

    def _arrival(self, d: Direction, n: int) -> float:
        p, now = self.profile, time.perf_counter()
        start = max(now, d.busy_until)
        d.busy_until = start + (n * 8 / (d.rate_mbps * 1e6) if d.rate_mbps else 0.0)
        delay = p.rtt_ms / 2e3 + abs(self.rng.gauss(0, p.jitter_ms / 1e3)) if p.jitter_ms else p.rtt_ms / 2e3
        segs = -(-n // MSS_BYTES)
        if p.stall_prob and self.rng.random() < 1 - (1 - p.stall_prob) ** segs:
            delay += p.rtt_ms / 1e3
        d.last_arrival = max(d.last_arrival, d.busy_until + delay)
        d.bytes += n
        return d.last_arrival

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, d: Direction) -> None:
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def deliver() -> None:
            while (item := await queue.get()) is not None:
                at, data = item
                wait = at - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            writer.close()

        task = asyncio.create_task(deliver())
        try:
            while data := await reader.read(65536):
                queue.put_nowait((self._arrival(d, len(data)), data))
        except ConnectionError:
            pass
        finally:
            queue.put_nowait(None)
            await asyncio.gather(task, return_exceptions=True)

    async def handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            u_reader, u_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            c_writer.close()
            return
        await asyncio.gather(
            self._pipe(c_reader, u_writer, self.up), self._pipe(u_reader, c_writer, self.down), return_exceptions=True
        )


async def _control(proxy: LinkProxy) -> None:
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        line = line.strip()
        if not line:
            continue
        if line == "stats":
            print(json.dumps({"up_bytes": proxy.up.bytes, "down_bytes": proxy.down.bytes}), flush=True)
            continue
        proxy.set_profile(LinkProfile(**json.loads(line)))
        print("ok", flush=True)


async def main(listen_port: int, upstream: str, shape_rate: bool, ready_file: Path | None = None) -> None:
    host, port = upstream.rsplit(":", 1)
    proxy = LinkProxy(host, int(port), shape_rate)
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", listen_port)
    bound = server.sockets[0].getsockname()[1]
    print(bound, flush=True)
    if ready_file is not None:
        ready_file.write_text(str(bound))
    async with server:
        await _control(proxy)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="link-emulating TCP proxy")
    ap.add_argument("listen_port", type=int)
    ap.add_argument("upstream", help="HOST:PORT")
    ap.add_argument("rate", nargs="?", default="rate", choices=["rate", "no-rate"], help="shape rates here or not")
    ap.add_argument("--ready-file", type=Path)
    a = ap.parse_args()
    asyncio.run(main(a.listen_port, a.upstream, a.rate == "rate", a.ready_file))
