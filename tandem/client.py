"""tandem client SDK (sync and asyncio). Needs only grpcio and protobuf.

Both clients talk to a ``tandem-edge`` daemon's ``Edge.Chat`` RPC and yield
``Delta`` objects (text as it is decoded), then keep the final ``ChatResult``
(usage, per-stage timings in ms, bytes sent per stream kind) on the iterator.
``info()`` asks the edge (``Edge.GetInfo``) what it serves and its limits, as an
``EdgeInfo`` whose ``check(...)`` validates a request before it is sent.

One core serves both: a ``Connection`` (``tandem.connection``) holds the target, TLS
credentials, the API key's metadata, the channel options (gRPC's service config and retry
policy included) and the default deadline; ``build_request`` (``tandem.chat_request``) turns
``chat()``'s arguments into the ``ChatRequest``, ``_Accumulator`` (``tandem.streams``) turns
the ``ChatEvent`` stream into ``Delta``s and the ``ChatResult``, and ``_ClientCore`` starts
every call on the connection's terms. ``Client`` / ``ChatStream`` and ``AsyncClient`` /
``AsyncChatStream`` only add the blocking or asyncio channel and iteration. ``EdgeInfo`` is in
``tandem.edge_info``; every name of ``__all__`` imports from here.

Every call has a deadline: the call's ``timeout_s``, else the client's (300 s unless
``Client(target, timeout_s=...)`` says otherwise; ``None`` there means no deadline).
A call ends early, and the edge and the cloud stop working on it, when the stream is
left early (``break``, closing the iterator) or cancelled with ``stream.cancel()``
(from any thread or task). Failed calls raise one ``TandemClientError`` subclass per
gRPC status (``tandem.errors``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar, Unpack

import grpc

from tandem.chat_request import (
    ChatOptions,
    Message,
    _end_session_request,
    build_request,
)
from tandem.connection import DEFAULT_TIMEOUT_S, Connection
from tandem.edge_info import EdgeInfo
from tandem.errors import TandemClientError, error_from_rpc
from tandem.streams import AsyncChatStream, ChatResult, ChatStream, _StreamBase
from tandem.streams import Delta as Delta
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "AsyncChatStream",
    "AsyncClient",
    "ChatOptions",
    "ChatResult",
    "ChatStream",
    "Client",
    "Delta",
    "EdgeInfo",
    "Message",
    "TandemClientError",
    "build_request",
]


S = TypeVar("S", bound=_StreamBase)


class _ClientCore(ABC, Generic[S]):
    """What both clients share: the ``Connection`` made from their arguments and ``chat()``; a
    subclass opens the connection's channel (blocking or asyncio) and wraps a call in its stream."""

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        tls: bool | None = None,
        ca_file: str | Path | None = None,
        cert_file: str | Path | None = None,
        key_file: str | Path | None = None,
        server_name: str | None = None,
        insecure: bool = False,
    ) -> None:
        """Arguments and errors as ``Client``'s."""
        self._connection = Connection.of(
            target,
            timeout_s=timeout_s,
            api_key=api_key,
            tls=tls,
            ca_file=ca_file,
            cert_file=cert_file,
            key_file=key_file,
            server_name=server_name,
            insecure=insecure,
        )
        self._channel = self._open(self._connection)
        self._stub = pb_grpc.EdgeStub(self._channel)

    @abstractmethod
    def _open(self, connection: Connection) -> Any:
        """A new channel of ``connection``, of this client's kind."""

    @abstractmethod
    def _stream(self, call: Any) -> S:
        """Wrap a started call in this client's (sync or async) stream."""

    @property
    def timeout_s(self) -> float | None:
        """The deadline in seconds of a call that sets none; ``None``: no deadline."""
        return self._connection.timeout_s

    def chat(
        self,
        messages: Sequence[Message] | None = None,
        *,
        prompt: str | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        session_id: str | None = None,
        mode: str = "auto",
        timeout_s: float | None = None,
        ignore_eos: bool = False,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        split_layer: int = 0,
        whole_reply: bool = False,
    ) -> S:
        """Start a chat turn; iterate the returned stream for text ``Delta``s, then read its ``.result``.

        Nothing is sent until this returns: the call starts here and runs while the stream is
        iterated (``AsyncClient``: ``async for``). ``info()`` tells the edge's limits;
        ``EdgeInfo.check`` validates these arguments against them before sending.

        Args:
            messages: the whole conversation so far, ``[{"role": "system"|"user"|"assistant",
                "content": ...}]``; the edge applies the model's chat template and appends the
                generation prompt. Exactly one of ``messages`` and ``prompt``.
            prompt: a raw prompt instead of ``messages``, tokenized as is (no chat template).
            max_new_tokens: the most tokens to generate, >= 1; default 128. At most the edge's
                ``EdgeInfo.max_new_tokens``.
            temperature: sampling temperature, >= 0; default 0 = greedy.
            top_p: nucleus sampling probability mass in ``(0, 1]``; default 1.0 = off.
            top_k: sample among the ``top_k`` most likely tokens, in ``[-1, 2**31)``; default 0 =
                off, as -1 is (vLLM's).
            seed: sampling seed (a 64-bit int); default ``None`` = unseeded, as is -1 (vLLM's rule).
            session_id: name of a multi-turn conversation (at most 128 bytes); reuse it on each
                turn so the edge and the cloud keep the conversation's prefix and only new tokens
                travel. Sessions are per API key: another key's same id is another session.
                Default ``None`` = stateless.
            mode: ``"auto"`` (default: the edge picks, per request, the mode with the lowest
                predicted time to first token, or end-to-end time with ``whole_reply``),
                ``"local"`` (the whole model on the edge),
                ``"split"`` (edge head, cloud tail), ``"direct"`` (token ids up, the cloud runs
                every layer) or ``"remote_prefill"`` (token ids up, the cloud prefills and streams
                the first tokens while the prompt's KV comes down, then the edge decodes the
                rest with its whole model). An explicit mode the edge cannot serve now is refused:
                ``FailedPrecondition`` (no model for it on the edge) or ``Unavailable`` (no cloud).
            split_layer: with ``mode="split"``, the split layer ``k`` to use (one of
                ``EdgeInfo.split_layers``); default 0 = the edge's choice.
            whole_reply: True where the caller uses the reply only once it is whole, not as it
                streams (a batch job, a tool call; ``complete`` leaves it to the caller): then
                ``mode="auto"`` picks the mode with the lowest predicted end-to-end time instead
                of time to first token, so a cloud that decodes faster than the edge serves long
                replies. Default False.
            timeout_s: deadline of the whole call in seconds (> 0; ``math.inf``: no deadline
                for this call). Default ``None`` = the client's ``timeout_s`` (300 s unless the
                client was made with another; a client made with ``timeout_s=None`` sets none,
                and the edge then applies its own, ``EdgeInfo.default_timeout_s``). When it
                passes, iteration raises ``DeadlineExceeded``.
            ignore_eos: keep generating past end-of-sequence, up to ``max_new_tokens``
                (benchmarks); default False.
            stop: a stop string, or a sequence of them (each non-empty): the output ends before
                the first occurrence of any, which is not included; ``finish_reason`` is then
                ``"stop"``. Default ``None`` = none. At most ``EdgeInfo.max_stop_strings``.
            stop_token_ids: token ids (>= 0) that end the output when sampled; default ``None`` =
                none (the model's end-of-sequence still ends it unless ``ignore_eos``). At most
                ``EdgeInfo.max_stop_token_ids``.

        Returns:
            a ``ChatStream`` (``AsyncChatStream`` from ``AsyncClient``). Leaving its loop early
            or calling its ``cancel()`` cancels the call.

        Raises:
            BadArgument: invalid arguments, before anything is sent (see ``build_request``): an
                ``InvalidArgument`` naming the field (``param``, ``error_code``) as the edge would,
                and a ``ValueError``; ``BadArgumentType`` for the wrong type (a ``TypeError`` too).

        Iterating the stream raises the ``TandemClientError`` subclass of the call's status if
        it fails (``tandem.errors``): ``InvalidArgument`` (the edge refused the request, e.g. over
        its limits), ``DeadlineExceeded``, ``Unavailable`` (edge or cloud down or draining),
        ``ResourceExhausted`` (``.retry_after_s``), ``FailedPrecondition``, ``DataLoss``,
        ``NotFound``, ``Internal``, ``Cancelled`` (after ``cancel()``).
        """
        req = build_request(
            messages,
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            session_id=session_id,
            mode=mode,
            ignore_eos=ignore_eos,
            stop=stop,
            split_layer=split_layer,
            stop_token_ids=stop_token_ids,
            whole_reply=whole_reply,
        )
        call = self._stub.Chat(req, **self._connection.call_options(timeout_s))
        return self._stream(call)


class Client(_ClientCore[ChatStream]):
    """Blocking client. ``with Client("host:port") as c: for d in c.chat(...): ...``

    Args:
        target: the edge's address, ``"host:port"`` (a gRPC target).
        timeout_s: the deadline in seconds of each call that passes none (``chat``, ``complete``,
            ``info``); default 300. ``None``: no client-side deadline (the edge still applies
            its own to a turn, ``EdgeInfo.default_timeout_s``).
        api_key: the edge's API key, sent as ``authorization: Bearer <api_key>`` on every call;
            each key's sessions are its own.
        tls: speak TLS; default ``None`` = when ``ca_file`` or ``cert_file`` is given.
        ca_file: CA (PEM) the edge's certificate must chain to; ``None`` = the system's roots.
        cert_file, key_file: this client's certificate and key (PEM), for an edge that requires
            client certificates.
        server_name: the name the edge's certificate must carry when it is not the target's host.
        insecure: allow plaintext to a target that is not a loopback address.

    Raises:
        ValueError: ``timeout_s`` not > 0; plaintext to another host without ``insecure=True``;
            only one of ``cert_file`` and ``key_file``; a file that cannot be read.
    """

    _channel: grpc.Channel

    def _open(self, connection: Connection) -> grpc.Channel:
        return connection.channel()

    def _stream(self, call: Any) -> ChatStream:
        return ChatStream(call)

    def complete(self, messages: Sequence[Message] | None = None, **kw: Unpack[ChatOptions]) -> ChatResult:
        """Run a turn to the end and return its ``ChatResult`` (arguments and errors as ``chat``)."""
        s = self.chat(messages, **kw)
        for _ in s:
            pass
        return s.result

    def info(self, *, timeout_s: float | None = None) -> EdgeInfo:
        """What the edge serves and its limits (``Edge.GetInfo``). gRPC retries it, up to 3 attempts
        within the deadline, while the edge answers ``UNAVAILABLE`` (``tandem.connection``).

        Args:
            timeout_s: deadline in seconds; ``None`` = the client's.

        Raises:
            TandemClientError: its subclass for the status, e.g. ``Unavailable`` (edge not
                reachable) or ``Unimplemented`` (an edge older than ``GetInfo``).
        """
        try:
            m = self._stub.GetInfo(pb.GetInfoRequest(), **self._connection.call_options(timeout_s))
        except grpc.RpcError as e:
            raise error_from_rpc(e) from e
        return EdgeInfo.from_pb(m)

    def end_session(self, session_id: str, *, timeout_s: float | None = None) -> bool:
        """End the chat session ``session_id`` (``Edge.EndSession``): the edge and the cloud drop
        what they hold of it, after a turn of it in flight; the next turn with that id starts a new
        session. Returns whether either held state of it. Sessions not ended this way end after
        the daemons' ``session_idle_s`` without a turn.

        Args:
            session_id: the ``session_id`` the turns were sent with (non-empty).
            timeout_s: deadline in seconds; ``None`` = the client's.

        Raises:
            BadArgument: an empty ``session_id`` or one that is not text (a ``ValueError`` too).
            TandemClientError: its subclass for the status, e.g. ``DeadlineExceeded`` (a turn of the
                session ran past the deadline) or ``Unimplemented`` (an edge older than ``EndSession``).
        """
        req = _end_session_request(session_id)
        try:
            m = self._stub.EndSession(req, **self._connection.call_options(timeout_s))
        except grpc.RpcError as e:
            raise error_from_rpc(e) from e
        return bool(m.found)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_ClientCore[AsyncChatStream]):
    """asyncio client. ``async with AsyncClient(target) as c: async for d in c.chat(...): ...``

    Arguments as ``Client``'s. Make it, and call ``chat``, inside the event loop that runs it.
    """

    _channel: grpc.aio.Channel

    def _open(self, connection: Connection) -> grpc.aio.Channel:
        return connection.aio_channel()

    def _stream(self, call: Any) -> AsyncChatStream:
        return AsyncChatStream(call)

    async def complete(self, messages: Sequence[Message] | None = None, **kw: Unpack[ChatOptions]) -> ChatResult:
        """Run a turn to the end and return its ``ChatResult`` (arguments and errors as ``chat``)."""
        s = self.chat(messages, **kw)
        async for _ in s:
            pass
        return s.result

    async def info(self, *, timeout_s: float | None = None) -> EdgeInfo:
        """What the edge serves and its limits (``Edge.GetInfo``); as ``Client.info``."""
        try:
            m = await self._stub.GetInfo(pb.GetInfoRequest(), **self._connection.call_options(timeout_s))
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e) from e
        return EdgeInfo.from_pb(m)

    async def end_session(self, session_id: str, *, timeout_s: float | None = None) -> bool:
        """End the chat session ``session_id`` (``Edge.EndSession``); as ``Client.end_session``."""
        req = _end_session_request(session_id)
        try:
            m = await self._stub.EndSession(req, **self._connection.call_options(timeout_s))
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e) from e
        return bool(m.found)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
