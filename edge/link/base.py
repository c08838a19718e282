"""The edge's seam to the cloud: ``CloudLink`` (negotiate, open one ``Generate`` call) and
``TurnCall`` (one call in flight), with an in-process implementation for unit tests.

Calling contract (who calls: ``edge.link.uplink.stream_turn``, once per turn):
``open(timeout_s)`` starts a call; ``send(item)`` queues one uplink item without
blocking and returns the bytes it puts on the wire; ``close_send()`` half-closes;
``events()`` yields downlink events and raises the cloud's verdict as a
``TandemError`` (the ``Downlink.error`` message or the call's status, mapped back);
after it raises, nothing more is sent. ``cancel()`` ends the call (idempotent).
The gRPC implementation is ``edge.link.grpc_link.GrpcCloudLink``; test hooks (fault
injection, link emulation) wrap a ``CloudLink``, never production constructors.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.params import Negotiated, NegotiateOffer, ServerInfo, SyncReply, SyncRequest
from tandem.common.wire.messages import DownEvent, TurnHeader, UplinkItem, uplink_to_pb


class TurnCall(Protocol):
    def send(self, item: UplinkItem) -> int: ...

    def close_send(self) -> None: ...

    def events(self) -> AsyncIterator[DownEvent]: ...

    def cancel(self) -> None: ...


class CloudLink(Protocol):
    async def negotiate(self, offer: NegotiateOffer) -> Negotiated:
        """Raises TandemError (IncompatibleModel, EngineError when the cloud is unreachable)."""
        ...

    async def server_info(self, link_id: str, padding_bytes: int = 0, timeout_s: float = 5.0) -> ServerInfo:
        """``GetServerInfo``; ``padding_bytes`` of padding make it a goodput probe.
        Raises TandemError (EngineError when the cloud is unreachable)."""
        ...

    def open(self, timeout_s: float | None) -> TurnCall: ...

    async def sync_session(self, req: SyncRequest, timeout_s: float = 5.0) -> SyncReply:
        """``SyncSession`` (see the proto). Raises the cloud's verdict as a ``TandemError``."""
        ...

    async def end_session(self, session_id: str, timeout_s: float = 5.0) -> bool:
        """``EndSession`` (see the proto): True if the cloud held the session. Raises the cloud's
        verdict as a ``TandemError`` (EngineError when the cloud is unreachable)."""
        ...

    async def close(self) -> None: ...


class InProcessCall:
    """A ``TurnCall`` straight into a gateway object in the same event loop (no network)."""

    def __init__(self, gateway: Any, timeout_s: float | None, caller: Any = "in-process") -> None:
        self._gateway, self._timeout_s, self._caller = gateway, timeout_s, caller
        self._q: asyncio.Queue[UplinkItem | None] = asyncio.Queue()

    def send(self, item: UplinkItem) -> int:
        self._q.put_nowait(item)
        return uplink_to_pb(item).ByteSize()

    def close_send(self) -> None:
        self._q.put_nowait(None)

    def cancel(self) -> None:
        self._q.put_nowait(None)

    async def _body(self) -> AsyncIterator[Any]:
        while (item := await self._q.get()) is not None:
            yield item

    async def events(self) -> AsyncIterator[DownEvent]:
        header = await self._q.get()
        if not isinstance(header, TurnHeader):
            raise InvalidRequest("the first uplink message must be a header")
        loop = asyncio.get_running_loop()
        deadline = None if self._timeout_s is None else loop.time() + self._timeout_s
        # closed with this stream, so the gateway's turn ends (and frees its slot) when the edge stops reading
        async with contextlib.aclosing(self._gateway.run_turn(header, self._body(), self._caller, deadline)) as turn:
            async for ev in turn:
                yield ev


class InProcessLink:
    """A ``CloudLink`` to a gateway in this process: the unit-test double of the gRPC link.
    ``caller`` is the identity the gateway sees (a ``common.runtime.security.Principal`` or a peer name)."""

    def __init__(self, gateway: Any, caller: Any = "in-process") -> None:
        self.gateway, self.caller = gateway, caller

    async def negotiate(self, offer: NegotiateOffer) -> Negotiated:
        return self.gateway.negotiate(offer, self.caller)

    async def server_info(self, link_id: str, padding_bytes: int = 0, timeout_s: float = 5.0) -> ServerInfo:
        return self.gateway.server_info(link_id, self.caller)

    def open(self, timeout_s: float | None) -> TurnCall:
        return InProcessCall(self.gateway, timeout_s, self.caller)

    async def sync_session(self, req: SyncRequest, timeout_s: float = 5.0) -> SyncReply:
        return await self.gateway.sync_session(req, self.caller)

    async def end_session(self, session_id: str, timeout_s: float = 5.0) -> bool:
        return await self.gateway.end_session(session_id, self.caller)

    async def close(self) -> None:
        return None
