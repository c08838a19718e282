"""gRPC adapter of the edge: decode messages, call ``EdgeNode``, encode events; and the edge's
health, kept current from what it can serve.

``EdgeServicer.Chat`` is ``ChatTurn.from_pb`` -> ``EdgeNode.chat`` -> ``to_pb``; every domain
error becomes a status in ``common.protocol.grpc_errors``. The edge's health is SERVING while some mode
can serve (``follow_link``): local mode needs no cloud, so an edge with the whole model stays
SERVING (degraded, see ``GetInfo``) while the cloud is down; an edge with heads only is
NOT_SERVING until its link to the cloud is negotiated.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
from grpc_health.v1 import health

from tandem import __version__
from tandem.common.protocol.errors import EngineError, TandemError
from tandem.common.protocol.grpc_errors import abort
from tandem.common.protocol.limits import check_session_id
from tandem.common.protocol.params import MAX_STOP_TOKENS
from tandem.common.runtime.grpc_setup import set_health
from tandem.common.runtime.logs import new_request_id, set_caller, set_ids
from tandem.common.runtime.security import Authenticator, Principal, scoped
from tandem.edge.detok import MAX_STOP_STRINGS
from tandem.edge.events import ChatTurn
from tandem.edge.node import EdgeNode
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

log = logging.getLogger("tandem.edge")
EDGE_SERVICE = pb.DESCRIPTOR.services_by_name["Edge"].full_name


class EdgeServicer(pb_grpc.EdgeServicer):
    """``auth`` says who each call comes from (API keys, client certificates); when it requires
    credentials, each caller's session ids are its own (``common.runtime.security.scoped``): another key
    sending the same id starts another session."""

    def __init__(self, node: EdgeNode, model_id: str, auth: Authenticator | None = None) -> None:
        self.node, self.model_id = node, model_id
        self.auth = auth or Authenticator()
        self.draining = False  # set on SIGTERM: new turns are refused, turns in flight finish

    def _identify(self, context: grpc.aio.ServicerContext) -> Principal:
        """The caller, bound for the call's log lines (``caller``). Raises Unauthenticated."""
        caller = self.auth.identify(context.invocation_metadata(), context.auth_context(), context.peer() or "")
        set_caller(caller)  # the handler's own task: every line of this call names it
        return caller

    def _session_id(self, session_id: str, caller: Principal) -> str:
        """A client's session id as this edge keeps it: in the caller's namespace when credentials
        are required. Raises InvalidRequest for one that ``check_session_id`` refuses (the same
        verdict for ``Chat`` and ``EndSession``, and in every mode)."""
        check_session_id(session_id)
        return scoped(caller, session_id) if self.auth.required else session_id

    async def Chat(self, request: pb.ChatRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ChatEvent]:
        set_ids(new_request_id(), request.session_id)  # this call's own task; EdgeNode.chat takes the id
        try:
            caller = self._identify(context)
            if self.draining:
                raise EngineError("this edge is draining (shutting down); retry on another")
            session_id = self._session_id(request.session_id, caller)
            turn = replace(ChatTurn.from_pb(request), session_id=session_id)
            async for ev in self.node.chat(turn, context.time_remaining()):
                yield ev.to_pb()
        except TandemError as e:
            await abort(context, e)
        except Exception:
            log.exception("Chat failed")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error in the edge daemon (see its log)")

    async def EndSession(self, request: pb.EndSessionRequest, context: grpc.aio.ServicerContext) -> pb.EndSessionReply:
        try:
            caller = self._identify(context)
            found = await self.node.end_session(self._session_id(request.session_id, caller), context.time_remaining())
        except TandemError as e:
            await abort(context, e)
        return pb.EndSessionReply(found=found)

    async def GetInfo(self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext) -> pb.EdgeInfo:
        try:
            self._identify(context)
        except TandemError as e:
            await abort(context, e)
        node = self.node
        return pb.EdgeInfo(
            model_id=self.model_id,
            split_layer=max(node.split_layers, default=0),
            max_prompt_tokens=node.max_prompt_tokens,
            max_new_tokens=node.max_new_tokens,
            max_stop_strings=MAX_STOP_STRINGS,
            max_stop_token_ids=MAX_STOP_TOKENS,
            default_timeout_s=node.turn_timeout_s,
            version=__version__,
            modes=sorted({r.mode.value for r in node.routes()}),
            split_layers=list(node.split_layers),
            cloud_connected=node.cloud_connected,
            degraded=node.degraded(),
        )


async def follow_link(node: EdgeNode, hs: health.aio.HealthServicer, period_s: float = 0.5) -> None:
    """Keep this server's health current until cancelled: SERVING while some mode can serve (local
    mode, or the cloud connected), NOT_SERVING otherwise. Degraded service (local only) is SERVING;
    ``GetInfo`` says what is missing."""
    last: bool | None = None
    while True:
        serving = bool(node.routes())
        if serving != last:
            await set_health(hs, serving, ["", EDGE_SERVICE])
            if last is not None:
                log.warning("edge health: %s (%s)", "SERVING" if serving else "NOT_SERVING", node.degraded() or "ok")
            last = serving
        await asyncio.sleep(period_s)
