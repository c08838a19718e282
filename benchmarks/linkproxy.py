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

A ``Tap`` (``LinkProxy.tap``) sees the gRPC messages of each direction as they pass: the proxy
reads plaintext HTTP/2 frame by frame (RFC 9113 section 4.1: a 9-byte header, then the payload;
DATA frames carry gRPC's length-prefixed messages, section "Length-Prefixed-Message" of gRPC's
PROTOCOL-HTTP2.md) and forwards whole frames. A tap may change a message's bytes in place (a
corrupted link) or raise ``CutLink`` (the connection is reset, both ways, at that point); new
connections go through as usual.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tandem.benchmarks.links import PROFILES, LinkProfile

MSS_BYTES = 1448
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # the client's first bytes (RFC 9113 section 3.4)
H2_FRAME_HEADER_BYTES = 9
H2_DATA, H2_HEADERS = 0x0, 0x1
H2_END_STREAM, H2_PADDED = 0x1, 0x8
GRPC_PREFIX_BYTES = 5  # compressed flag (1 byte), message length (4 bytes, big-endian)


class CutLink(Exception):
    """Raised by a ``Tap``: the proxy resets the connection (both directions) there."""


@dataclass
class GrpcMessage:
    """One gRPC message on an HTTP/2 stream: ``length`` bytes of protobuf; ``tag`` is its first byte
    (for a message that is a oneof of submessages: ``field_number << 3 | 2``), -1 while unseen or
    for an empty message; ``index`` counts the stream's messages from 0."""

    stream_id: int
    index: int
    length: int
    tag: int = -1


class Tap:
    """What a test sees of the link, message by message. ``up`` is the client -> server direction."""

    def data(self, up: bool, msg: GrpcMessage, offset: int, body: memoryview) -> None:
        """Bytes ``[offset, offset + len(body))`` of ``msg``, writable in place; may raise ``CutLink``."""

    def end_stream(self, up: bool, stream_id: int) -> None:
        """A frame that ends ``stream_id`` in that direction (gRPC's trailers, downward); may raise ``CutLink``."""


@dataclass
class _Stream:
    prefix: bytearray = field(default_factory=bytearray)
    msg: GrpcMessage | None = None
    left: int = 0  # body bytes of ``msg`` still to come
    count: int = 0


class H2Reader:
    """One direction of a plaintext HTTP/2 connection, cut into whole frames whose gRPC message
    bytes pass through the tap ``tap_of()`` returns at that moment (none: they only pass)."""

    def __init__(self, tap_of: Callable[[], Tap | None], up: bool) -> None:
        self.tap_of, self.up = tap_of, up
        self.buf = bytearray()
        self.preface = len(H2_PREFACE) if up else 0
        self.streams: dict[int, _Stream] = {}

    def feed(self, data: bytes) -> bytes:
        """The whole frames ``data`` completes (changed in place by the tap); the rest waits.

        Raises:
            CutLink: the tap cut the link.
        """
        self.buf += data
        out = bytearray()
        if self.preface:
            n = min(self.preface, len(self.buf))
            out += self.buf[:n]
            del self.buf[:n]
            self.preface -= n
        while len(self.buf) >= H2_FRAME_HEADER_BYTES:
            length = int.from_bytes(self.buf[:3], "big")
            end = H2_FRAME_HEADER_BYTES + length
            if len(self.buf) < end:
                break
            kind, flags = self.buf[3], self.buf[4]
            sid = int.from_bytes(self.buf[5:9], "big") & 0x7FFFFFFF
            frame = bytearray(self.buf[:end])
            del self.buf[:end]
            if kind == H2_DATA and length:
                lo, hi = H2_FRAME_HEADER_BYTES, end
                if flags & H2_PADDED:  # a pad-length byte, then the data, then that many padding bytes
                    lo, hi = lo + 1, hi - frame[lo]
                self._data(sid, memoryview(frame)[lo:hi])
            if kind in (H2_DATA, H2_HEADERS) and flags & H2_END_STREAM:
                self.streams.pop(sid, None)
                if (tap := self.tap_of()) is not None:
                    tap.end_stream(self.up, sid)
            out += frame
        return bytes(out)

    def _data(self, sid: int, payload: memoryview) -> None:
        s = self.streams.setdefault(sid, _Stream())
        i = 0
        while i < len(payload):
            if s.msg is None:
                take = min(GRPC_PREFIX_BYTES - len(s.prefix), len(payload) - i)
                s.prefix += payload[i : i + take]
                i += take
                if len(s.prefix) == GRPC_PREFIX_BYTES:
                    s.msg = GrpcMessage(sid, s.count, int.from_bytes(s.prefix[1:], "big"))
                    s.left, s.prefix = s.msg.length, bytearray()
                    s.count += 1
                    if not s.left:
                        s.msg = None
                continue
            take = min(s.left, len(payload) - i)
            offset = s.msg.length - s.left
            if offset == 0:
                s.msg.tag = payload[i]
            s.left -= take
            msg = s.msg
            if not s.left:
                s.msg = None
            if (tap := self.tap_of()) is not None:
                tap.data(self.up, msg, offset, payload[i : i + take])
            i += take


@dataclass
class Direction:
    rate_mbps: float | None = None
    busy_until: float = 0.0
    last_arrival: float = 0.0
    bytes: int = 0


class LinkProxy:
    """The link (see module doc). ``h2``: read each connection as HTTP/2 so that ``tap`` sees its
    gRPC messages (set or replace ``tap`` at any time; None: they pass untouched)."""

    def __init__(
        self, upstream_host: str, upstream_port: int, shape_rate: bool = True, seed: int = 0, h2: bool = False
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.shape_rate = shape_rate
        self.profile = PROFILES["loopback"]
        self.rng = random.Random(seed)
        self.up, self.down = Direction(), Direction()
        self.h2 = h2
        self.tap: Tap | None = None

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

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, d: Direction, h2: H2Reader | None = None
    ) -> None:
        """Bytes from ``reader`` to ``writer`` on the link's schedule; raises ``CutLink`` where the tap cut it."""
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
                if h2 is not None:
                    data = h2.feed(data)
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

        def tap() -> Tap | None:
            return self.tap

        up, down = (H2Reader(tap, True), H2Reader(tap, False)) if self.h2 else (None, None)
        pipes = [
            asyncio.ensure_future(self._pipe(c_reader, u_writer, self.up, up)),
            asyncio.ensure_future(self._pipe(u_reader, c_writer, self.down, down)),
        ]
        for done in asyncio.as_completed(pipes):
            try:
                await done
            except CutLink:  # a reset, both ways, with nothing more delivered
                for w in (c_writer, u_writer):
                    w.transport.abort()
                for p in pipes:
                    p.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
                return
            except Exception:  # noqa: BLE001 - one direction's error ends only that direction
                pass


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
