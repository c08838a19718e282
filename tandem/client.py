"""tandem client SDK (sync and asyncio). Needs only grpcio and protobuf.

Both clients talk to a ``tandem-edge`` daemon's ``Edge.Chat`` RPC and yield
``Delta`` objects (text as it is decoded), then keep the final ``ChatResult``
(usage, per-stage timings in ms, bytes sent per stream kind) on the iterator.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

Message = Mapping[str, str]  # {"role": "user", "content": "..."}


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
    """Final summary of a turn (units in names)."""

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
    messages: Sequence[Message] | None,
    prompt: str | None,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    session_id: str | None,
    mode: str,
    ignore_eos: bool = False,
) -> pb.ChatRequest:
    """Raises ValueError for neither or both of messages and prompt, or an unknown mode."""
    if (messages is None) == (prompt is None):
        raise ValueError("pass exactly one of messages= or prompt=")
    modes = {"auto": pb.MODE_UNSPECIFIED, "split": pb.MODE_SPLIT, "direct": pb.MODE_DIRECT}
    if mode not in modes:
        raise ValueError(f"mode must be one of {sorted(modes)}")
    sp = pb.SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=ignore_eos
    )
    if seed is not None:
        sp.seed = seed
    return pb.ChatRequest(
        session_id=session_id or "",
        prompt=prompt or "",
        sampling=sp,
        mode=modes[mode],
        messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in (messages or [])],
    )


class _Accumulator:
    def __init__(self) -> None:
        self.parts: list[str] = []
        self.result: ChatResult | None = None

    def feed(self, ev: pb.ChatEvent) -> Delta | None:
        if ev.WhichOneof("event") == "delta":
            self.parts.append(ev.delta.text)
            return Delta(ev.delta.text, tuple(ev.delta.token_ids))
        d = ev.done
        self.result = ChatResult(
            "".join(self.parts),
            d.finish_reason,
            d.prompt_tokens,
            d.output_tokens,
            d.head_tokens,
            d.external_tokens,
            d.split_layer,
            tuple(d.output_token_ids),
            dict(d.timings_ms),
            dict(d.sent_bytes),
        )
        return None


class ChatStream:
    """Iterator of ``Delta``; ``.result`` holds the ``ChatResult`` once exhausted."""

    def __init__(self, call) -> None:
        self._call, self._acc = call, _Accumulator()

    def __iter__(self) -> Iterator[Delta]:
        try:
            for ev in self._call:
                d = self._acc.feed(ev)
                if d is not None:
                    yield d
        except grpc.RpcError as e:
            raise TandemClientError(e.code(), e.details()) from e

    @property
    def result(self) -> ChatResult:
        if self._acc.result is None:
            raise RuntimeError("iterate the stream to its end first")
        return self._acc.result


class Client:
    """Blocking client. ``with Client("host:port") as c: for d in c.chat(...): ...``"""

    def __init__(self, target: str) -> None:
        self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.EdgeStub(self._channel)

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
    ) -> ChatStream:
        """Start a chat turn; iterate the returned stream for text deltas."""
        req = build_request(
            messages, prompt, max_new_tokens, temperature, top_p, top_k, seed, session_id, mode, ignore_eos
        )
        return ChatStream(self._stub.Chat(req, timeout=timeout_s))

    def complete(self, messages: Sequence[Message] | None = None, **kw) -> ChatResult:
        """Run a turn to the end and return its ``ChatResult``."""
        s = self.chat(messages, **kw)
        for _ in s:
            pass
        return s.result

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncChatStream:
    def __init__(self, call) -> None:
        self._call, self._acc = call, _Accumulator()

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            async for ev in self._call:
                d = self._acc.feed(ev)
                if d is not None:
                    yield d
        except grpc.aio.AioRpcError as e:
            raise TandemClientError(e.code(), e.details() or "") from e

    @property
    def result(self) -> ChatResult:
        if self._acc.result is None:
            raise RuntimeError("iterate the stream to its end first")
        return self._acc.result


class AsyncClient:
    """asyncio client. ``async with AsyncClient(target) as c: async for d in c.chat(...): ...``"""

    def __init__(self, target: str) -> None:
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = pb_grpc.EdgeStub(self._channel)

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
    ) -> AsyncChatStream:
        req = build_request(
            messages, prompt, max_new_tokens, temperature, top_p, top_k, seed, session_id, mode, ignore_eos
        )
        return AsyncChatStream(self._stub.Chat(req, timeout=timeout_s))

    async def complete(self, messages: Sequence[Message] | None = None, **kw) -> ChatResult:
        s = self.chat(messages, **kw)
        async for _ in s:
            pass
        return s.result

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
