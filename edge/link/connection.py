"""The edge's connection to its cloud: negotiation that never blocks start-up, measurement of
the link, and the cloud's load.

``CloudConnection.run`` (a background task) keeps the link negotiated:

* not negotiated: ``Negotiate`` with exponential backoff (``backoff_s`` doubling up to
  ``max_backoff_s``) while the edge serves ``local`` and reports itself degraded;
* negotiated: ``GetServerInfo`` every ``poll_s``: each call's round trip is an RTT sample and its
  answer the cloud's load and the link's current params (a new ``params_version`` is adopted for
  new requests; requests in flight finish under theirs). An unknown link or another
  ``instance_id`` (the cloud restarted) means renegotiating at once;
* measurement: at connect, ``PROBE_SMALL`` small calls (RTT: their minimum) and ``PROBE_PADDED``
  calls padded with ``probe_bytes`` (uplink goodput: padding over the extra time); afterwards every
  split upload of at least ``MIN_GOODPUT_SAMPLE_BYTES`` is a goodput sample (bytes over the time
  the cloud took to receive and verify them, on its clock). Both estimates are exponentially weighted
  (alpha 0.3), so they follow a changed link within a few requests. When goodput falls below
  ``1 / RENEGOTIATE_RATIO`` (1.5) or rises above ``RENEGOTIATE_UP_RATIO`` times the value last offered, the
  link is renegotiated (chunk size, window, codec follow the link). The band is narrow because
  the window the cloud grants is sized from the offered goodput: a long upload is guaranteed only
  about 1.5x the offer (``cloud.links.negotiation.ack_threshold_bytes``), so a wider band could leave an
  edge whose link got faster on its old, window-limited estimate for good.

``CloudTarget`` is what the edge's domain code sees of its cloud: one ``CloudConnection``, or an
``edge.link.replicas.ReplicaSet`` of several. A turn pins itself to one connection and reads params,
load and measurements from that connection only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Protocol

from tandem.common.protocol.errors import QuotaExceeded, TandemError
from tandem.common.protocol.params import LinkParams, Negotiated, NegotiateOffer, ServerLoad
from tandem.common.runtime.ewma import Ewma
from tandem.edge.link.base import CloudLink
from tandem.stages import Stage

log = logging.getLogger("tandem.edge")

PROBE_SMALL = 3
PROBE_PADDED = 2
MIN_GOODPUT_SAMPLE_BYTES = 32 << 10
RENEGOTIATE_RATIO = 1.5  # down: below offered / 1.5
RENEGOTIATE_UP_RATIO = 1.25  # up: above offered x 1.25
LINK_ALPHA = 0.3


def upload_receive_ms(timings_ms: Mapping[Stage, float] | Mapping[str, float]) -> float:
    """A finished split upload's receive interval on the cloud's clock (``cloud_upload_wait_ms``, the
    header's arrival to the last item verified, less ``cloud_queue_ms``), or 0.0 when it waited for
    admission for a tenth of that or more (its bytes arrived into buffers meanwhile, so the interval
    would understate the transfer) or has no such timing. The interval of a goodput sample here and
    in ``tandem-bench modes``'s goodput table."""
    wait, queued = timings_ms.get(Stage.CLOUD_UPLOAD_WAIT, 0.0), timings_ms.get(Stage.CLOUD_QUEUE, 0.0)
    return wait - queued if queued < 0.1 * wait else 0.0


class CloudTarget(Protocol):
    """The cloud an edge talks to. The edge's domain code calls ``pin`` when a turn (or one leg of
    it) starts, from the turn's task; ``current`` wherever it needs the cloud's state (inside a
    turn: the turn's connection, else the first that answers); ``fail_over`` when a turn's call
    failed on its connection before any token; ``start``/``stop`` once, from the daemon."""

    def start(self) -> None:
        """Start keeping every connection negotiated in the background."""

    async def stop(self) -> None:
        """Stop the background work (connections stay as they are)."""

    async def wait_connected(self, timeout_s: float) -> bool:
        """True as soon as some connection is negotiated and answering, False after ``timeout_s``."""

    def pin(self, key: str) -> CloudConnection:
        """Pin the calling task's turn, keyed by its session id (else its request id), to one
        connection; returns it."""

    def current(self) -> CloudConnection:
        """The calling task's pinned connection, else the first that answers (else the first)."""

    def fail_over(self, failed: CloudConnection, key: str, cause: Exception) -> CloudConnection | None:
        """A turn keyed ``key`` failed on ``failed`` (``cause``): the connection it moves to (pinned),
        or None when there is no other that answers."""


class CloudConnection:
    """Negotiated params, link estimates and the cloud's load, kept current in the background.
    A ``CloudTarget`` of one connection."""

    def __init__(
        self,
        link: CloudLink,
        offer: NegotiateOffer,
        *,
        poll_s: float = 2.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        probe_bytes: int = 256 << 10,
        zstd_pays=None,
    ) -> None:
        self.link, self.base_offer = link, offer
        self.poll_s, self.backoff_s, self.max_backoff_s, self.probe_bytes = (
            poll_s,
            backoff_s,
            max_backoff_s,
            probe_bytes,
        )
        self._zstd_pays = zstd_pays  # goodput_mbps -> bool, or None: keep the offer's codec order
        self.negotiated: Negotiated | None = None
        self.load = ServerLoad()
        self.rtt_ms = Ewma(LINK_ALPHA)
        self.goodput_mbps = Ewma(LINK_ALPHA)
        self.offered_goodput_mbps = 0.0
        self.last_error = ""
        self.last_exc: TandemError | None = None  # the last failure, for start-up to report
        self.connected = asyncio.Event()  # set while negotiated and the last call answered
        self.renegotiations = 0
        self._wake = asyncio.Event()
        self._force = False  # renegotiate at the next turn of the loop
        self._connecting = False
        self._paused = False  # the cloud answered "not serving" at the last poll
        self._uploads = 0  # uploads in flight (polls are no RTT samples meanwhile)
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ state

    def params(self, k: int) -> LinkParams | None:
        """The current params for split layer ``k`` (0 = direct), or None (not negotiated / no such k)."""
        n = self.negotiated
        return None if n is None or not self.connected.is_set() else n.params_by_split.get(k)

    @property
    def split_layers(self) -> tuple[int, ...]:
        """Split layers usable now (the edge holds the head and the cloud the tail)."""
        n = self.negotiated
        if n is None or not self.connected.is_set():
            return ()
        return tuple(sorted(k for k in n.params_by_split if k > 0))

    def offer(self) -> NegotiateOffer:
        """The offer with the current measurements and the codec order they call for."""
        g = self.goodput_mbps.value
        codecs = self.base_offer.codecs
        if self._zstd_pays is not None:
            from tandem.common.protocol.params import Codec

            codecs = (Codec.ZSTD, Codec.NONE) if self._zstd_pays(g) else (Codec.NONE, Codec.ZSTD)
        link_id = self.link_id
        return replace(self.base_offer, rtt_ms=self.rtt_ms.value, goodput_mbps=g, codecs=codecs, link_id=link_id)

    # ------------------------------------------------------------------ background loop

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="cloud-connection")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    def pin(self, key: str) -> CloudConnection:
        """The connection a turn keyed ``key`` uses: this one (``edge.link.replicas.ReplicaSet`` picks)."""
        return self

    def current(self) -> CloudConnection:
        return self

    def fail_over(self, failed: CloudConnection, key: str, cause: Exception) -> CloudConnection | None:
        """None: one cloud, nowhere to move (the turn waits for it or fails)."""
        return None

    @property
    def link_id(self) -> str:
        """The negotiated link's id ("" before ``Negotiate`` answered)."""
        return self.negotiated.link_id if self.negotiated is not None else ""

    @property
    def instance_id(self) -> str:
        """The instance id of the cloud this link is negotiated with ("" before ``Negotiate`` answered)."""
        return self.negotiated.instance_id if self.negotiated is not None else ""

    @property
    def healthy(self) -> bool:
        """Negotiated, answering, and serving (not draining or restarting its engines)."""
        return self.connected.is_set() and not self._paused

    def renegotiate_soon(self, reason: str) -> None:
        """Ask the loop to renegotiate now (e.g. the cloud refused a request's params version)."""
        log.info("renegotiating with the cloud: %s", reason)
        self.connected.clear()
        self._force = True
        self._wake.set()

    @property
    def reconnecting(self) -> bool:
        """A renegotiation is due or under way, or the cloud answers but said it is not serving
        (draining for a restart, engines restarting): worth a short wait before refusing a turn."""
        return self._force or self._connecting or self._paused

    async def wait_connected(self, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                await self.connected.wait()
            return True
        except TimeoutError:
            return False

    async def run(self) -> None:
        """Negotiate (with backoff), probe, then poll until cancelled."""
        delay = self.backoff_s
        while True:
            try:
                if self.negotiated is None or self._force:
                    self._force = False
                    await self.connect()
                    delay = self.backoff_s
                await self._poll()
                if self._should_renegotiate():
                    await self._negotiate()
                self._wake.clear()
                try:
                    # while the cloud says it is not serving, poll often: a drain for a restart is over in seconds
                    async with asyncio.timeout(min(self.poll_s, 0.25) if self._paused else self.poll_s):
                        await self._wake.wait()
                except TimeoutError:
                    pass
            except asyncio.CancelledError:
                raise
            except TandemError as e:
                self.connected.clear()
                self.last_exc = e
                self._force = self._force or self.negotiated is None
                if str(e) != self.last_error:
                    log.warning("cloud link down (%s: %s); serving what needs no cloud, retrying", type(e).__name__, e)
                self.last_error = str(e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)
            except Exception:
                self.connected.clear()
                log.exception("cloud connection loop failed; retrying")
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.max_backoff_s)

    async def _negotiate(self) -> None:
        offer = self.offer()
        n = await self.link.negotiate(offer)
        first = self.negotiated is None
        self.negotiated = n
        self.offered_goodput_mbps = offer.goodput_mbps
        self.renegotiations += 0 if first else 1
        if n.note:
            log.warning("cloud: %s", n.note)
        log.info(
            "negotiated link %s with %s (params v%d, split layers %s)",
            n.link_id,
            n.cloud_id,
            n.params_version,
            sorted(k for k in n.params_by_split if k),
        )

    async def connect(self) -> None:
        """Negotiate, measure RTT and goodput over the channel, renegotiate with the measurements."""
        previous = self.negotiated
        self._connecting = True
        try:
            await self._negotiate()
            await self.probe()
            await self._negotiate()
        finally:
            self._connecting = False
        if previous is not None and previous.instance_id != self.negotiated.instance_id:  # type: ignore[union-attr]
            log.warning("the cloud restarted (instance %s): renegotiated", self.negotiated.instance_id)  # type: ignore[union-attr]
        self.connected.set()
        self.last_error, self.last_exc = "", None

    async def probe(self) -> None:
        """RTT and goodput probes over the real channel (see module doc)."""
        link_id = self.link_id
        small = []
        for _ in range(PROBE_SMALL):
            t0 = time.perf_counter()
            await self.link.server_info(link_id)
            small.append((time.perf_counter() - t0) * 1e3)
        rtt = min(small)
        self.rtt_ms.add(rtt)
        if self.probe_bytes <= 0:
            return
        for _ in range(PROBE_PADDED):
            t0 = time.perf_counter()
            try:
                await self.link.server_info(link_id, self.probe_bytes)
            except QuotaExceeded as e:  # a cloud with a smaller message bound: measure from uploads only
                log.warning("goodput probe of %d bytes refused (%s); measuring from uploads", self.probe_bytes, e)
                self.probe_bytes = 0
                return
            extra_ms = (time.perf_counter() - t0) * 1e3 - rtt
            if extra_ms > 0.05:
                self.goodput_mbps.add(self.probe_bytes * 8 / (extra_ms / 1e3) / 1e6)

    async def _poll(self) -> None:
        n = self.negotiated
        if n is None:
            return
        t0, quiet = time.perf_counter(), self._uploads == 0
        info = await self.link.server_info(n.link_id)
        if quiet and self._uploads == 0:
            self.rtt_ms.add((time.perf_counter() - t0) * 1e3)
        if not info.link_known or info.instance_id != n.instance_id:
            self.connected.clear()
            reason = "the cloud restarted" if info.instance_id != n.instance_id else "the cloud forgot this link"
            log.warning("%s: renegotiating", reason)
            self._force = True
            return
        self.load = info.load
        if not info.serving:
            if self.connected.is_set():
                log.warning("the cloud is not serving (engines restarting or draining): cloud modes paused")
            self.connected.clear()
            self._paused = True
            self.last_error = "the cloud is not serving"
            return
        self._paused = False
        if info.params_by_split and info.params_by_split != n.params_by_split:
            self.negotiated = replace(n, params_by_split=dict(info.params_by_split))
            log.info("link params now v%d (the cloud changed this link's share)", self.negotiated.params_version)
        self.connected.set()

    def _should_renegotiate(self) -> bool:
        g, offered = self.goodput_mbps.value, self.offered_goodput_mbps
        if g <= 0:
            return False
        return offered <= 0 or not (1 / RENEGOTIATE_RATIO <= g / offered <= RENEGOTIATE_UP_RATIO)

    # ------------------------------------------------------------------ passive measurement

    @contextlib.contextmanager
    def uploading(self) -> Iterator[Callable[[], None]]:
        """Mark an upload in flight for the ``with`` block or until the yielded ``done()``: polls
        meanwhile wait behind its bytes in the link's queues, so they are no RTT samples."""
        self._uploads += 1
        ended = False

        def done() -> None:
            nonlocal ended
            if not ended:
                ended = True
                self._uploads -= 1

        try:
            yield done
        finally:
            done()

    def observe_upload(self, nbytes: int, cloud_receive_ms: float) -> None:
        """A finished split upload of ``nbytes`` bytes that the cloud received in ``cloud_receive_ms``
        (from its header's arrival to the last item verified, the cloud's own clock: no RTT in it):
        a goodput sample when large enough. The cloud verifies while bytes arrive, so the interval
        is the transfer time plus the last item's check."""
        if nbytes >= MIN_GOODPUT_SAMPLE_BYTES and cloud_receive_ms > 0.05:
            self.goodput_mbps.add(nbytes * 8 / (cloud_receive_ms / 1e3) / 1e6)

    def observe_load(self, load: ServerLoad | None) -> None:
        if load is not None:
            self.load = load
