"""Bounds on uploads in flight: how many and how many bytes, per edge and in total.

A split turn's header announces its chunks and KV blocks; the gateway reserves the
most bytes that upload may buffer (``upload_bound_bytes``) before any body arrives,
and releases the reservation when the turn's upload ends, verified or not. Past a
bound the turn is refused at once with ``QuotaExceeded`` (RESOURCE_EXHAUSTED), so a
few stalled or oversized streams can never hold the cloud's memory.

``peer`` identifies the edge: its principal (``common.runtime.security.Principal``: key name,
certificate subject, or peer host without authentication). Pure domain code, single event loop.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from tandem.common.protocol.errors import QuotaExceeded, TurnTooLarge


@dataclass
class UploadBudget:
    max_uploads: int
    max_bytes: int
    max_uploads_per_peer: int
    max_bytes_per_peer: int
    uploads: int = 0
    nbytes: int = 0
    _per_peer: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))

    @contextmanager
    def reserve(self, peer: str, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` of upload buffer for ``peer`` for the ``with`` block.

        Raises:
            TurnTooLarge: the upload alone passes the per-edge or the total bound on bytes (never
                fits: no retry hint).
            QuotaExceeded: the upload would pass a bound beside the uploads in flight.
        """
        most = min(self.max_bytes_per_peer, self.max_bytes)
        if nbytes > most:
            raise TurnTooLarge(
                f"an upload of up to {nbytes} bytes passes the cloud's whole bound on uploads in flight, "
                f"{most} bytes (max_upload_bytes_per_peer, max_upload_bytes): it can never be taken; send a shorter "
                "prompt, use direct mode, or raise those bounds",
                param="prompt",
            )
        mine = self._per_peer[peer]
        if mine[0] + 1 > self.max_uploads_per_peer or mine[1] + nbytes > self.max_bytes_per_peer:
            raise QuotaExceeded(
                f"this edge has {mine[0]} uploads ({mine[1]} bytes) in flight; bounds "
                f"{self.max_uploads_per_peer} uploads, {self.max_bytes_per_peer} bytes"
            )
        if self.uploads + 1 > self.max_uploads or self.nbytes + nbytes > self.max_bytes:
            raise QuotaExceeded(
                f"the cloud has {self.uploads} uploads ({self.nbytes} bytes) in flight; bounds "
                f"{self.max_uploads} uploads, {self.max_bytes} bytes"
            )
        mine[0] += 1
        mine[1] += nbytes
        self.uploads += 1
        self.nbytes += nbytes
        try:
            yield
        finally:
            mine[0] -= 1
            mine[1] -= nbytes
            self.uploads -= 1
            self.nbytes -= nbytes
            if mine[0] == 0:
                del self._per_peer[peer]
