"""The SDK's streams: ``Delta`` (text as it is decoded), ``ChatResult`` (the turn's usage, per-stage
timings in ms and bytes sent per stream kind), ``_Accumulator`` (``ChatEvent``s into both) and the
blocking / asyncio iterators over one ``Edge.Chat`` call, with ``cancel()`` from any thread or task."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from tandem.errors import Cancelled, TandemClientError, Unknown, error_from_rpc
from tandem.pbconv import from_pb
from tandem.v1 import tandem_pb2 as pb

_CANCELLED = "cancelled by the client (cancel())"


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
    mode: str = ""  # the mode that served the turn: "local" | "split" | "direct" | "remote_prefill"
    predicted_ttft_ms: float = 0.0  # the edge's cost-model prediction for that mode (0 = none made)
    ttft_ms: float = 0.0  # measured at the edge
    params_version: int = 0  # link params the turn ran under (0 = local)
    mode_reason: str = ""  # why this mode (auto's choice, requested, a fallback)
    resumes: int = 0  # times the turn continued after its cloud failed mid-stream (no token repeated)
    session_expired: bool = False  # the edge had evicted this session (its state bound): it started again
    received_bytes: dict[str, int] = field(default_factory=dict)  # from the cloud, per kind: "kv"
    edge_decoded_tokens: int = 0  # remote prefill: output tokens the edge decoded after it took over (0: the cloud did)


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
        """The stream ended without an error. Raises ``Unknown`` if it carried no ``ChatDone``."""
        if self.result is None:
            raise Unknown(grpc.StatusCode.UNKNOWN, "the edge ended the stream without a final event")


class _StreamBase:
    def __init__(self, call: Any) -> None:
        self._call, self._acc = call, _Accumulator()
        self._cancelled = False
        self._failure: TandemClientError | None = None  # what iterating the stream raised

    @property
    def result(self) -> ChatResult:
        """The turn's ``ChatResult``. Raises RuntimeError while there is none, saying why: the stream
        has not been iterated to its end, was cancelled, or failed (naming the error it raised)."""
        if self._acc.result is None:
            if self._failure is not None:
                f = self._failure
                raise RuntimeError(f"the turn has no result: its stream raised {type(f).__name__}: {f}")
            if self._cancelled:
                raise RuntimeError("the turn has no result: its stream was cancelled (cancel())")
            raise RuntimeError("iterate the stream to its end first")
        return self._acc.result

    @property
    def cancelled(self) -> bool:
        """Whether ``cancel()`` was called."""
        return self._cancelled

    def _raise_if_cancelled(self) -> None:
        if self._cancelled:
            raise Cancelled(grpc.StatusCode.CANCELLED, _CANCELLED)

    def _error(self, e: Any) -> TandemClientError:
        """The SDK error of the failed call ``e``, kept for ``result``'s message."""
        if self._cancelled:  # whatever the transport says of a call we cancelled
            self._failure = Cancelled(grpc.StatusCode.CANCELLED, _CANCELLED)
        else:
            self._failure = error_from_rpc(e)
        return self._failure


class ChatStream(_StreamBase):
    """Iterator of ``Delta``; ``.result`` holds the ``ChatResult`` once exhausted.

    Iteration raises a ``TandemClientError`` subclass if the call fails (``tandem.errors``).
    Leaving the loop early cancels the call; so does ``cancel()``, from any thread.
    """

    def __iter__(self) -> Iterator[Delta]:
        try:
            self._raise_if_cancelled()
            for ev in self._call:
                self._raise_if_cancelled()
                if (d := self._acc.feed(ev)) is not None:
                    yield d
            self._acc.finish()
        except TandemClientError as e:  # cancelled meanwhile, or a stream without its final event
            self._failure = e
            raise
        except grpc.RpcError as e:
            raise self._error(e) from e
        finally:
            self._call.cancel()  # a no-op once the call has ended

    def cancel(self) -> None:
        """Cancel the call (safe from any thread, idempotent): the edge and the cloud stop working
        on it, and iterating the stream, now or later (a loop blocked in another thread included),
        raises ``Cancelled``. ``result`` stays available if the turn had already finished."""
        self._cancelled = True
        self._call.cancel()


class AsyncChatStream(_StreamBase):
    """Async iterator of ``Delta``; ``.result`` holds the ``ChatResult`` once exhausted.

    Iteration raises a ``TandemClientError`` subclass if the call fails (``tandem.errors``).
    Leaving the loop early cancels the call (when the event loop finalizes the iterator, right
    after the loop); so does ``cancel()``, from any task or thread.
    """

    def __init__(self, call: Any) -> None:
        super().__init__(call)
        self._loop = _running_loop()

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            self._raise_if_cancelled()
            async for ev in self._call:
                self._raise_if_cancelled()
                if (d := self._acc.feed(ev)) is not None:
                    yield d
            self._acc.finish()
        except TandemClientError as e:  # cancelled meanwhile, or a stream without its final event
            self._failure = e
            raise
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from e
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError in the reader of a call cancelled locally; that is
            # ``Cancelled`` unless this task itself is being cancelled.
            task = asyncio.current_task()
            if self._cancelled and (task is None or not task.cancelling()):
                raise Cancelled(grpc.StatusCode.CANCELLED, _CANCELLED) from None
            raise
        finally:
            self._call.cancel()  # a no-op once the call has ended

    def cancel(self) -> None:
        """Cancel the call (safe from any task or thread, idempotent): the edge and the cloud stop
        working on it, and iterating the stream, now or later, raises ``Cancelled`` (not
        ``asyncio.CancelledError``: the iterating task is not cancelled). ``result`` stays
        available if the turn had already finished."""
        self._cancelled = True
        loop = self._loop
        if loop is None or _running_loop() is loop:
            self._call.cancel()
        elif not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._call.cancel)
            except RuntimeError:  # the loop closed meanwhile: the call is gone with it
                pass


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
