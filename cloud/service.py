"""gRPC adapter of the gateway: decode messages, call ``Gateway``, encode events.

Servicer methods stay thin; every domain error becomes a status in
``common.protocol.grpc_errors``. A refused turn is answered with its verdict as a
``Downlink.error`` message first, then the servicer reads (and drops) what the
edge still had in flight until it half-closes (at most ``drain_timeout_s``), and
only then ends the call with the matching status. A client that is still writing
when the server finishes can otherwise see ``INTERNAL`` instead of the real
status (grpc's asyncio client); with the verdict in a message it never matters.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from tandem.cloud.gateway import Gateway
from tandem.cloud.turn import UplinkBody
from tandem.common.protocol.errors import EngineError, InvalidRequest, TandemError, UploadTimeout
from tandem.common.protocol.grpc_errors import abort
from tandem.common.protocol.params import NegotiateOffer, SyncRequest
from tandem.common.runtime.grpc_setup import Malformed
from tandem.common.runtime.logs import set_caller, set_ids
from tandem.common.runtime.security import Authenticator, Principal
from tandem.common.wire.messages import TurnError, TurnHeader, downlink_to_pb, uplink_from_pb
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

log = logging.getLogger("tandem.cloud")


def parsed(m: pb.Uplink | Malformed) -> pb.Uplink:
    """``m`` unless it did not parse (``common.runtime.grpc_setup.add_service``). Raises InvalidRequest."""
    if isinstance(m, Malformed):
        raise InvalidRequest(str(m))
    return m


async def uplink_body(it: AsyncIterator[pb.Uplink | Malformed]) -> AsyncIterator[UplinkBody]:
    """Decode uplink messages after the header. Raises InvalidRequest on a second header, an empty
    one, or a message that does not parse."""
    async for m in it:
        item = uplink_from_pb(parsed(m))
        if isinstance(item, TurnHeader):
            raise InvalidRequest("a second header in one turn")
        yield item


def peer_host(context: grpc.aio.ServicerContext) -> str:
    """The edge's address without the port (``ipv4:127.0.0.1:5432`` -> ``ipv4:127.0.0.1``)."""
    peer = context.peer() or ""
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    """The call's deadline in event-loop time, or None when the client set none."""
    remaining = context.time_remaining()
    return None if remaining is None else asyncio.get_running_loop().time() + remaining


async def drain(it: AsyncIterator[pb.Uplink | Malformed], timeout_s: float) -> None:
    """Read and drop uplink messages (parsed or not) until the edge half-closes, at most ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            async for _ in it:
                pass
    except (TimeoutError, grpc.RpcError, asyncio.CancelledError, StopAsyncIteration):
        pass


def identify(auth: Authenticator, context: grpc.aio.ServicerContext) -> Principal:
    """The calling edge's principal (``common.runtime.security``), bound for the call's log lines (``caller``).

    Raises:
        Unauthenticated: credentials required and missing or wrong.
    """
    caller = auth.identify(context.invocation_metadata(), context.auth_context(), peer_host(context))
    set_caller(caller)  # the handler's own task: every line of this call names it
    return caller


class CloudServicer(pb_grpc.CloudServicer):
    """``auth`` says who each call comes from; without API keys or client certificates every
    edge is named by its host."""

    def __init__(self, gateway: Gateway, cloud_id: str, auth: Authenticator | None = None) -> None:
        self.gateway, self.cloud_id = gateway, cloud_id
        self.auth = auth or Authenticator()
        self.draining = False  # set on stop: new turns get UNAVAILABLE, turns in flight finish
        self.in_flight = 0  # Generate calls running

    async def Negotiate(self, request: pb.NegotiateRequest, context: grpc.aio.ServicerContext):
        try:
            caller = identify(self.auth, context)
            return self.gateway.negotiate(NegotiateOffer.from_pb(request), caller).to_pb()
        except TandemError as e:
            await abort(context, e)

    async def GetServerInfo(self, request: pb.ServerInfoRequest, context: grpc.aio.ServicerContext):
        try:
            caller = identify(self.auth, context)
            return self.gateway.server_info(request.link_id, caller).to_pb()
        except TandemError as e:
            await abort(context, e)

    async def SyncSession(self, request: pb.SyncSessionRequest, context: grpc.aio.ServicerContext):
        try:
            caller = identify(self.auth, context)
            reply = await self.gateway.sync_session(SyncRequest.from_pb(request), caller)
        except TandemError as e:
            await abort(context, e)
        return reply.to_pb()

    async def EndSession(self, request: pb.EndSessionRequest, context: grpc.aio.ServicerContext):
        try:
            caller = identify(self.auth, context)
            found = await self.gateway.end_session(request.session_id, caller)
        except TandemError as e:
            await abort(context, e)
        return pb.EndSessionReply(found=found)

    async def Generate(self, request_iterator: AsyncIterator[pb.Uplink], context: grpc.aio.ServicerContext):
        try:
            caller = identify(self.auth, context)
            if self.draining:
                raise EngineError("this cloud is draining (shutting down); retry on another replica")
        except TandemError as err:  # the verdict in a message, then the status, as for every refused turn
            yield downlink_to_pb(TurnError(error=err))
            await drain(request_iterator.__aiter__(), self.gateway.cfg.drain_timeout_s)
            await abort(context, err)
        self.in_flight += 1
        try:
            async for m in self._generate(request_iterator, context, caller):
                yield m
        finally:
            self.in_flight -= 1

    async def _generate(
        self, request_iterator: AsyncIterator[pb.Uplink], context: grpc.aio.ServicerContext, caller: Principal
    ):
        it = request_iterator.__aiter__()
        try:
            try:
                async with asyncio.timeout(self.gateway.cfg.upload_timeout_s):
                    first = uplink_from_pb(parsed(await it.__anext__()))
            except TimeoutError:
                raise UploadTimeout("no request header within the upload timeout") from None
            if not isinstance(first, TurnHeader):
                raise InvalidRequest("the first uplink message must be a header")
            set_ids(first.request_id, first.session_id)  # this call's own task: every line of it carries them
            turn = self.gateway.run_turn(first, uplink_body(it), caller, deadline_of(context))
            async for ev in turn:
                yield downlink_to_pb(ev)
        except StopAsyncIteration:
            await abort(context, InvalidRequest("empty uplink"))
        except TandemError as e:
            yield downlink_to_pb(TurnError(error=e))
            await drain(it, self.gateway.cfg.drain_timeout_s)
            await abort(context, e)
        except Exception:
            log.exception("Generate failed")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error in the cloud gateway (see its log)")
