"""``CloudLink`` over gRPC: the edge's channel to ``tandem-cloud`` (channel set-up and the
``Generate`` call; the only edge module besides the servicer that imports grpc).

The channel sends HTTP/2 keepalive PINGs after ``keepalive_time_s`` of silence, also
on a silent stream (a long prefill); a PING not acknowledged within
``keepalive_timeout_s`` closes the transport, so a cloud that stops answering
(process stopped, link cut) fails the call with UNAVAILABLE within about
``keepalive_time_s + keepalive_timeout_s`` instead of hanging. Every call also
carries a deadline.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

import grpc

from tandem.common.protocol.errors import LinkLost
from tandem.common.protocol.grpc_errors import error_from_status
from tandem.common.protocol.params import Negotiated, NegotiateOffer, ServerInfo, SyncReply, SyncRequest
from tandem.common.runtime.grpc_setup import channel_options
from tandem.common.wire.messages import DownEvent, TurnError, UplinkItem, downlink_from_pb, uplink_to_pb
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 64 << 20  # the edge's own bound; the cloud enforces the negotiated one
NEGOTIATE_TIMEOUT_S = 30.0


class GrpcTurnCall:
    """One ``Cloud.Generate`` call (see ``edge.link.base.TurnCall``)."""

    def __init__(
        self, stub: pb_grpc.CloudStub, timeout_s: float | None, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self._q: deque[pb.Uplink] = deque()
        self._wake = asyncio.Event()
        self._closed = self._stopped = False
        self._call = stub.Generate(self._requests(), timeout=timeout_s, metadata=metadata or None)

    async def _requests(self) -> AsyncIterator[pb.Uplink]:
        while not self._stopped:
            if self._q:
                yield self._q.popleft()
                continue
            if self._closed:
                return
            self._wake.clear()
            await self._wake.wait()

    def send(self, item: UplinkItem) -> int:
        m = uplink_to_pb(item)
        if not self._stopped:
            self._q.append(m)
            self._wake.set()
        return m.ByteSize()

    def close_send(self) -> None:
        self._closed = True
        self._wake.set()

    def _stop_sending(self) -> None:
        self._stopped = True
        self._q.clear()
        self._wake.set()

    async def events(self) -> AsyncIterator[DownEvent]:
        try:
            async for m in self._call:
                ev = downlink_from_pb(m)
                if isinstance(ev, TurnError):  # the verdict, before the status: stop writing now
                    self._stop_sending()
                    raise ev.error
                yield ev
        except grpc.aio.AioRpcError as e:
            self._stop_sending()
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                # no verdict message came first: the connection broke, not a refusal
                raise LinkLost(f"{e.code().name}: {e.details() or 'connection lost'}") from e
            raise error_from_status(e.code(), e.details() or "") from e

    def cancel(self) -> None:
        self._stop_sending()
        self._call.cancel()


class GrpcCloudLink:
    """The edge's channel to one cloud target (``host:port``).

    Args:
        credentials: TLS (``common.runtime.grpc_setup.channel_credentials``: the CA the cloud's certificate
            must chain to, and this edge's client certificate for mutual TLS); None = plaintext.
        server_name: the name the cloud's certificate must carry, when not the target's host.
        api_key: bearer token sent with every call (the cloud's ``edge_keys``).
    """

    def __init__(
        self,
        target: str,
        keepalive_time_s: float,
        keepalive_timeout_s: float,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        server_name: str | None = None,
        api_key: str | None = None,
    ) -> None:
        self.target = target
        options: list[tuple[str, int | str]] = [
            *channel_options(keepalive_time_s, keepalive_timeout_s, MAX_MESSAGE_BYTES)
        ]
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(target, options=options)
        else:
            if server_name:
                options.append(("grpc.ssl_target_name_override", server_name))
            self.channel = grpc.aio.secure_channel(target, credentials, options=options)
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.stub = pb_grpc.CloudStub(self.channel)

    async def negotiate(self, offer: NegotiateOffer) -> Negotiated:
        try:
            resp = await self.stub.Negotiate(offer.to_pb(), timeout=NEGOTIATE_TIMEOUT_S, metadata=self.metadata or None)
        except grpc.aio.AioRpcError as e:
            raise error_from_status(e.code(), e.details() or "") from e
        return Negotiated.from_pb(resp)

    async def server_info(self, link_id: str, padding_bytes: int = 0, timeout_s: float = 5.0) -> ServerInfo:
        req = pb.ServerInfoRequest(link_id=link_id, padding=bytes(padding_bytes))
        try:
            return ServerInfo.from_pb(
                await self.stub.GetServerInfo(req, timeout=timeout_s, metadata=self.metadata or None)
            )
        except grpc.aio.AioRpcError as e:
            raise error_from_status(e.code(), e.details() or "") from e

    async def sync_session(self, req: SyncRequest, timeout_s: float = 5.0) -> SyncReply:
        try:
            resp = await self.stub.SyncSession(req.to_pb(), timeout=timeout_s, metadata=self.metadata or None)
        except grpc.aio.AioRpcError as e:
            raise error_from_status(e.code(), e.details() or "") from e
        return SyncReply.from_pb(resp)

    async def end_session(self, session_id: str, timeout_s: float = 5.0) -> bool:
        req = pb.EndSessionRequest(session_id=session_id)
        try:
            resp = await self.stub.EndSession(req, timeout=timeout_s, metadata=self.metadata or None)
        except grpc.aio.AioRpcError as e:
            raise error_from_status(e.code(), e.details() or "") from e
        return bool(resp.found)

    def open(self, timeout_s: float | None) -> GrpcTurnCall:
        return GrpcTurnCall(self.stub, timeout_s, self.metadata)

    async def close(self) -> None:
        await self.channel.close()
