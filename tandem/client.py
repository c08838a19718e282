"""tandem client SDK (sync and asyncio). Needs only grpcio and protobuf.

Both clients talk to a ``tandem-edge`` daemon's ``Edge.Chat`` RPC and yield
``Delta`` objects (text as it is decoded), then keep the final ``ChatResult``
(usage, per-stage timings in ms, bytes sent per stream kind) on the iterator.

One core serves both: ``build_request`` turns ``chat()``'s arguments into the
``ChatRequest``, ``_Accumulator`` turns the ``ChatEvent`` stream into ``Delta``s and
the ``ChatResult``, and ``_ClientCore.chat`` starts the call; ``Client`` /
``ChatStream`` and ``AsyncClient`` / ``AsyncChatStream`` only add the blocking or
asyncio iteration and channel handling. Leaving a stream early (``break``, closing
the iterator) cancels the call, so the edge and the cloud stop working on it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc

from tandem.pbconv import from_pb
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

Message = Mapping[str, str]  # {"role": "user", "content": "..."}

_MODES = {"auto": pb.MODE_UNSPECIFIED, "split": pb.MODE_SPLIT, "direct": pb.MODE_DIRECT}


class TandemClientError(Exception):
    """The edge refused or failed a request; ``code`` is the gRPC status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ChatResult:
    """Final summary of a turn (units in names). ``timings_ms`` is keyed by the wire's stage
    names (``tandem.stages.Stage`` values, e.g. ``"ttft_ms"``; a ``Stage`` member works as key too)."""

    text: str
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    head_tokens: int
    external_tokens: int
    split_layer: int
    output_token_ids: tuple[int, ...]
    timings_ms: dict[str, float] = field(default_factory=dict)
    sent_bytes: dict[str, int] = field(default_factory=dict)


def build_request(
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
    ignore_eos: bool = False,
) -> pb.ChatRequest:
    """The ``ChatRequest`` of one turn; ``Client.chat`` / ``AsyncClient.chat`` take the same arguments.

    Args:
        messages: the whole conversation so far, ``[{"role": "system"|"user"|"assistant", "content": ...}]``;
            the edge applies the model's chat template and appends the generation prompt.
        prompt: a raw prompt instead of ``messages``, tokenized as is (no chat template).
        max_new_tokens: the most tokens to generate.
        temperature: sampling temperature; 0 = greedy.
        top_p: nucleus sampling probability mass; 1.0 = off.
        top_k: sample among the ``top_k`` most likely tokens; 0 = off.
        seed: sampling seed; ``None`` = unseeded.
        session_id: name of a multi-turn conversation; reuse it on each turn so the edge and the
            cloud keep the conversation's prefix and only new tokens travel. ``None`` = stateless.
        mode: ``"auto"`` (as negotiated with the cloud), ``"split"`` (edge head, cloud tail) or
            ``"direct"`` (token ids up, the cloud runs every layer).
        ignore_eos: keep generating past end-of-sequence, up to ``max_new_tokens`` (benchmarks).

    Raises:
        ValueError: neither or both of ``messages`` and ``prompt``, or an unknown ``mode``.
    """
    if (messages is None) == (prompt is None):
        raise ValueError("pass exactly one of messages= or prompt=")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {sorted(_MODES)}")
    sp = pb.SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=ignore_eos
    )
    if seed is not None:
        sp.seed = seed
    return pb.ChatRequest(
        session_id=session_id or "",
        prompt=prompt or "",
        sampling=sp,
        mode=_MODES[mode],
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in (messages or [])],
    )


class _Accumulator:
    """``ChatEvent``s in, ``Delta``s out; the ``ChatDone`` becomes the ``ChatResult``."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self.result: ChatResult | None = None

    def feed(self, ev: pb.ChatEvent) -> Delta | None:
        """The ``Delta`` of a text event, else ``None`` (the final event, or one this version does not know)."""
        kind = ev.WhichOneof("event")
        if kind == "delta":
            self._parts.append(ev.delta.text)
            return Delta(ev.delta.text, tuple(ev.delta.token_ids))
        if kind == "done":
            d = ev.done
            self.result = from_pb(ChatResult, d, text="".join(self._parts))
        return None

    def finish(self) -> None:
        """The stream ended without an error. Raises TandemClientError if it carried no ``ChatDone``."""
        if self.result is None:
            raise TandemClientError(grpc.StatusCode.UNKNOWN, "the edge ended the stream without a final event")


def _client_error(e: Any) -> TandemClientError:
    return TandemClientError(e.code(), e.details() or "")


class _StreamBase:
    def __init__(self, call: Any) -> None:
        self._call, self._acc = call, _Accumulator()

    @property
    def result(self) -> ChatResult:
        """The turn's ``ChatResult``. Raises RuntimeError before the stream has been iterated to its end."""
        if self._acc.result is None:
            raise RuntimeError("iterate the stream to its end first")
        return self._acc.result


class ChatStream(_StreamBase):
    """Iterator of ``Delta``; ``.result`` holds the ``ChatResult`` once exhausted.

    Iteration raises ``TandemClientError`` if the edge fails the call; leaving the loop early cancels it.
    """

    def __iter__(self) -> Iterator[Delta]:
        try:
            for ev in self._call:
                if (d := self._acc.feed(ev)) is not None:
                    yield d
            self._acc.finish()
        except grpc.RpcError as e:
            raise _client_error(e) from e
        finally:
            self._call.cancel()  # a no-op once the call has ended


class AsyncChatStream(_StreamBase):
    """Async iterator of ``Delta``; ``.result`` holds the ``ChatResult`` once exhausted.

    Iteration raises ``TandemClientError`` if the edge fails the call; leaving the loop early cancels
    it (when the event loop finalizes the iterator, right after the loop).
    """

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            async for ev in self._call:
                if (d := self._acc.feed(ev)) is not None:
                    yield d
            self._acc.finish()
        except grpc.aio.AioRpcError as e:
            raise _client_error(e) from e
        finally:
            self._call.cancel()  # a no-op once the call has ended


S = TypeVar("S", bound=_StreamBase)


class _ClientCore(Generic[S]):
    """``chat()`` for both clients; a subclass supplies the stub and wraps the call in its stream."""

    _stub: pb_grpc.EdgeStub

    def _stream(self, call: Any) -> S:
        raise NotImplementedError

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
    ) -> S:
        """Start a chat turn; iterate the returned stream for text deltas, then read its ``.result``.

        ``timeout_s`` is the deadline of the whole call in seconds (``None``: none); the other
        arguments are ``build_request``'s, documented there.

        Raises:
            ValueError: invalid arguments (before anything is sent).
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
        )
        return self._stream(self._stub.Chat(req, timeout=timeout_s))


class Client(_ClientCore[ChatStream]):
    """Blocking client. ``with Client("host:port") as c: for d in c.chat(...): ...``"""

    def __init__(self, target: str) -> None:
        self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.EdgeStub(self._channel)

    def _stream(self, call: Any) -> ChatStream:
        return ChatStream(call)

    def complete(self, messages: Sequence[Message] | None = None, **kw: Any) -> ChatResult:
        """Run a turn to the end and return its ``ChatResult`` (arguments as ``chat``)."""
        s = self.chat(messages, **kw)
        for _ in s:
            pass
        return s.result

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_ClientCore[AsyncChatStream]):
    """asyncio client. ``async with AsyncClient(target) as c: async for d in c.chat(...): ...``"""

    def __init__(self, target: str) -> None:
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = pb_grpc.EdgeStub(self._channel)

    def _stream(self, call: Any) -> AsyncChatStream:
        return AsyncChatStream(call)

    async def complete(self, messages: Sequence[Message] | None = None, **kw: Any) -> ChatResult:
        """Run a turn to the end and return its ``ChatResult`` (arguments as ``chat``)."""
        s = self.chat(messages, **kw)
        async for _ in s:
            pass
        return s.result

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
