"""gRPC adapter of the gateway: decode messages, call ``Gateway``, encode events.

Servicer methods stay thin; every domain error becomes a status in
``common.grpc_errors``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from cloud.gateway import Commit, Event, Gateway, Nack, Repair, TokensOut, TurnFinal, UplinkItem, UploadDone
from common.errors import InvalidRequest, TandemError
from common.grpc_errors import abort
from common.messages import KVBlock, TurnHeader, chunk_from_pb
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

log = logging.getLogger("tandem.cloud")


def event_to_pb(ev: Event) -> pb.Downlink:
    if isinstance(ev, TokensOut):
        return pb.Downlink(tokens=pb.Tokens(token_ids=ev.token_ids, index=ev.index))
    if isinstance(ev, Nack):
        return pb.Downlink(nack=pb.Nack(seq=ev.seq, reason=ev.reason))
    if isinstance(ev, Repair):
        return pb.Downlink(repair=pb.RepairRequest(leaf_indices=ev.leaf_indices, reason=ev.reason))
    if isinstance(ev, UploadDone):
        return pb.Downlink(
            upload_ack=pb.UploadAck(
                verified_tokens=ev.verified_tokens, leaf_count=ev.leaf_count, merkle_root=ev.merkle_root
            )
        )
    assert isinstance(ev, TurnFinal)
    return pb.Downlink(
        final=pb.Final(
            finish_reason=ev.finish_reason,
            prompt_tokens=ev.prompt_tokens,
            output_tokens=ev.output_tokens,
            external_tokens=ev.external_tokens,
            timings_ms=ev.timings_ms,
            received_bytes=ev.received_bytes,
        )
    )


async def uplink_items(it: AsyncIterator[pb.Uplink]) -> AsyncIterator[UplinkItem]:
    """Decode uplink messages after the header. Raises InvalidRequest on a second header or an empty one."""
    async for m in it:
        kind = m.WhichOneof("msg")
        if kind == "chunk":
            yield chunk_from_pb(m.chunk)
        elif kind == "kv_block":
            yield KVBlock.from_pb(m.kv_block)
        elif kind == "commit":
            yield Commit(m.commit.leaf_count, m.commit.merkle_root)
        else:
            raise InvalidRequest(f"unexpected uplink message {kind!r} after the header")


class CloudServicer(pb_grpc.CloudServicer):
    def __init__(self, gateway: Gateway, cloud_id: str) -> None:
        self.gateway, self.cloud_id = gateway, cloud_id

    async def Negotiate(self, request: pb.NegotiateRequest, context: grpc.aio.ServicerContext):
        try:
            params = self.gateway.negotiate(request.compatibility_key, list(request.split_layers))
        except TandemError as e:
            await abort(context, e)
        return pb.NegotiateResponse(
            params=params.to_pb(), cloud_id=self.cloud_id, model_id=self.gateway.manifest.model_id
        )

    async def Generate(self, request_iterator: AsyncIterator[pb.Uplink], context: grpc.aio.ServicerContext):
        try:
            it = request_iterator.__aiter__()
            first = await it.__anext__()
            if first.WhichOneof("msg") != "header":
                raise InvalidRequest("the first uplink message must be a header")
            async for ev in self.gateway.run_turn(TurnHeader.from_pb(first.header), uplink_items(it)):
                yield event_to_pb(ev)
        except StopAsyncIteration:
            await abort(context, InvalidRequest("empty uplink"))
        except TandemError as e:
            await abort(context, e)
        except Exception:
            log.exception("Generate failed")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error in the cloud gateway (see its log)")
