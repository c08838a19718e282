"""tandem client SDK (sync and asyncio). Needs only grpcio and protobuf.

Both clients talk to a ``tandem-edge`` daemon's ``Edge.Chat`` RPC and yield
``Delta`` objects (text as it is decoded), then keep the final ``ChatResult``
(usage, per-stage timings in ms, bytes sent per stream kind) on the iterator.
``info()`` asks the edge (``Edge.GetInfo``) what it serves and its limits, as an
``EdgeInfo`` whose ``check(...)`` validates a request before it is sent.

One core serves both: ``build_request`` turns ``chat()``'s arguments into the
``ChatRequest``, ``_Accumulator`` turns the ``ChatEvent`` stream into ``Delta``s and
the ``ChatResult``, and ``_ClientCore.chat`` starts the call; ``Client`` /
``ChatStream`` and ``AsyncClient`` / ``AsyncChatStream`` only add the blocking or
asyncio iteration and channel handling.

Every call has a deadline: the call's ``timeout_s``, else the client's (300 s unless
``Client(target, timeout_s=...)`` says otherwise; ``None`` there means no deadline).
A call ends early, and the edge and the cloud stop working on it, when the stream is
left early (``break``, closing the iterator) or cancelled with ``stream.cancel()``
(from any thread or task). Failed calls raise one ``TandemClientError`` subclass per
gRPC status (``tandem.errors``).
"""

from __future__ import annotations

import asyncio
import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypedDict, TypeVar, Unpack

import grpc

from tandem.errors import Cancelled, TandemClientError, Unknown, error_from_rpc
from tandem.pbconv import from_pb
from tandem.security import channel_security
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

Message = Mapping[str, str]  # {"role": "user", "content": "..."}

DEFAULT_TIMEOUT_S = 300.0  # a client's default deadline per call
# "auto" travels as MODE_UNSPECIFIED (its equivalent), which edges older than MODE_AUTO also accept
_MODES = {
    "auto": pb.MODE_UNSPECIFIED,
    "split": pb.MODE_SPLIT,
    "direct": pb.MODE_DIRECT,
    "local": pb.MODE_LOCAL,
    "remote_prefill": pb.MODE_REMOTE_PREFILL,
}
_UINT32 = 1 << 32
_INT32 = 1 << 31
_INT64 = 1 << 63
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


# --- argument checks (before anything is sent) --------------------------------------------------


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _stop_strings(stop: str | Iterable[str] | None) -> tuple[str, ...]:
    """``chat``'s ``stop`` as a tuple: one string, or a sequence of them, each non-empty.

    Raises:
        TypeError: not a string or strings.
        ValueError: an empty stop string.
    """
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in items:
        if not isinstance(s, str):
            raise TypeError(f"stop strings must be str, got {type(s).__name__}")
        if not s:
            raise ValueError("stop strings must not be empty")
    return items


def _stop_token_ids(ids: Iterable[int] | None) -> tuple[int, ...]:
    """``chat``'s ``stop_token_ids`` as a tuple of ints in ``[0, 2**32)``.

    Raises:
        TypeError: an id that is not an int (bools are not ids).
        ValueError: a negative id or one that does not fit the wire's uint32.
    """
    out = tuple(ids or ())
    for t in out:
        if not _is_int(t):
            raise TypeError(f"stop token ids must be int, got {type(t).__name__}")
        if not 0 <= t < _UINT32:
            raise ValueError(f"stop token id {t} out of range [0, 2**32)")
    return out


def _end_session_request(session_id: str) -> pb.EndSessionRequest:
    """``end_session``'s request. Raises ValueError for an empty or non-str ``session_id``."""
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"session_id must be a non-empty str, got {session_id!r}")
    return pb.EndSessionRequest(session_id=session_id)


def _deadline_s(timeout_s: float | None, what: str) -> float | None:
    """A deadline in seconds for grpc (``inf`` = none); raises ValueError unless > 0."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
        raise ValueError(f"{what} must be a number of seconds > 0 (math.inf: no deadline), got {timeout_s!r}")
    return None if math.isinf(timeout_s) else float(timeout_s)


# Keepalive to the edge: a stopped or unreachable edge fails the call with UNAVAILABLE within
# about 10 s instead of leaving it silent until its deadline; quick reconnects once it is back.
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.http2.ping_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


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
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    split_layer: int = 0,
) -> pb.ChatRequest:
    """The ``ChatRequest`` of one turn. ``Client.chat`` / ``AsyncClient.chat`` take the same
    arguments (plus ``timeout_s``) and document them.

    Raises:
        ValueError: neither or both of ``messages`` and ``prompt``, an unknown ``mode``, a
            message without ``role`` / ``content``, or a value out of its range
            (``max_new_tokens < 1``, ``temperature < 0``, ``top_p`` outside ``(0, 1]``,
            ``top_k < 0``, an empty stop string, a negative stop token id, ...).
        TypeError: a value of the wrong type (a non-int token count or id, a non-str stop string).
    """
    if (messages is None) == (prompt is None):
        raise ValueError("pass exactly one of messages= or prompt=")
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {sorted(_MODES)}, got {mode!r}")
    if not _is_int(split_layer) or not 0 <= split_layer < _UINT32 or (split_layer and mode != "split"):
        raise ValueError(f"split_layer must be an int >= 0, given with mode='split' only; got {split_layer!r}")
    if not _is_int(max_new_tokens) or not 1 <= max_new_tokens < _UINT32:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if not 0 <= temperature <= 2:  # NaN fails too; vLLM's (and OpenAI's) range
        raise ValueError(f"temperature must be in [0, 2], got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not _is_int(top_k) or not 0 <= top_k < _INT32:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if seed is not None and (not _is_int(seed) or not -_INT64 <= seed < _INT64):
        raise ValueError(f"seed must be a 64-bit int or None, got {seed!r}")
    try:
        msgs = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in (messages or [])]
    except KeyError as e:
        raise ValueError(f"each message needs 'role' and 'content'; one lacks {e}") from None
    sp = pb.SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        ignore_eos=ignore_eos,
        stop_token_ids=_stop_token_ids(stop_token_ids),
    )
    if seed is not None:
        sp.seed = seed
    return pb.ChatRequest(
        session_id=session_id or "",
        prompt=prompt or "",
        sampling=sp,
        mode=_MODES[mode],
        messages=msgs,
        stop=_stop_strings(stop),
        split_layer=split_layer,
    )


class ChatOptions(TypedDict, total=False):
    """``chat``'s keyword arguments (for ``complete(**kw)``); documented on ``Client.chat``."""

    prompt: str | None
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    session_id: str | None
    mode: str
    timeout_s: float | None
    ignore_eos: bool
    stop: str | Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    split_layer: int


# --- what the edge serves -------------------------------------------------------------------------


@dataclass(frozen=True)
class EdgeInfo:
    """What an edge serves and its limits (``Client.info()``; units in names). A limit of 0 means
    the edge did not say (an older edge): ``check`` does not check it.

    Attributes:
        model_id: the model the edge serves.
        split_layer: the deepest split layer ``k`` usable now; 0 = none (local or direct only).
        max_prompt_tokens: the longest prompt (after the chat template) the edge accepts, in tokens.
        max_new_tokens: the largest ``max_new_tokens`` a turn may ask for.
        max_stop_strings: the most ``stop`` strings a turn may name.
        max_stop_token_ids: the most ``stop_token_ids`` a turn may name.
        default_timeout_s: the deadline the edge gives a turn whose client set none, in seconds.
        version: the edge's tandem version.
        modes: the modes servable now (``"local"``, ``"split"``, ``"direct"``, ``"remote_prefill"``).
        split_layers: every split layer usable now (the edge holds the head, the cloud the tail).
        cloud_connected: whether the edge's link to the cloud is up.
        degraded: why not every mode the edge was built for is available ("" = all are).
    """

    model_id: str
    split_layer: int
    max_prompt_tokens: int
    max_new_tokens: int
    max_stop_strings: int
    max_stop_token_ids: int
    default_timeout_s: float
    version: str
    modes: tuple[str, ...] = ()
    split_layers: tuple[int, ...] = ()
    cloud_connected: bool = False
    degraded: str = ""

    @classmethod
    def from_pb(cls, m: pb.EdgeInfo) -> EdgeInfo:
        return from_pb(cls, m)

    def problems(
        self,
        *,
        max_new_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        prompt_tokens: int | None = None,
        mode: str | None = None,
    ) -> list[str]:
        """What in a request this edge would refuse (empty: nothing); arguments as ``check``."""
        out: list[str] = []
        lim = (
            ("max_new_tokens", max_new_tokens, self.max_new_tokens),
            ("prompt tokens", prompt_tokens, self.max_prompt_tokens),
            ("stop strings", None if stop is None else len(_stop_strings(stop)), self.max_stop_strings),
            ("stop token ids", None if stop_token_ids is None else len(_stop_token_ids(stop_token_ids)),
             self.max_stop_token_ids),
        )  # fmt: skip
        for what, n, most in lim:
            if n is not None and most and n > most:
                out.append(f"{what}: {n} > {most}, this edge's limit")
        if mode in _MODES and mode != "auto" and self.modes and mode not in self.modes:
            out.append(f"mode {mode!r}: this edge serves {list(self.modes)} now ({self.degraded or 'by design'})")
        return out

    def check(
        self,
        *,
        max_new_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        prompt_tokens: int | None = None,
        mode: str | None = None,
    ) -> None:
        """Check a request against this edge's limits before sending it: the same values as
        ``chat``'s arguments (``prompt_tokens``: the prompt's length in tokens, if the app knows
        it); ``None`` skips a value. For example::

            info = client.info()
            info.check(max_new_tokens=n, stop=stops)  # before client.chat(..., max_new_tokens=n, stop=stops)

        Raises:
            ValueError: naming every limit the request exceeds (the edge would answer
                ``InvalidArgument``), or an invalid stop string or id.
        """
        p = self.problems(
            max_new_tokens=max_new_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
            prompt_tokens=prompt_tokens,
            mode=mode,
        )
        if p:
            raise ValueError("; ".join(p))


# --- the stream of one turn -----------------------------------------------------------------------


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

    @property
    def result(self) -> ChatResult:
        """The turn's ``ChatResult``. Raises RuntimeError before the stream has been iterated to its end."""
        if self._acc.result is None:
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
        if self._cancelled:  # whatever the transport says of a call we cancelled
            return Cancelled(grpc.StatusCode.CANCELLED, _CANCELLED)
        return error_from_rpc(e)


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


# --- the clients ------------------------------------------------------------------------------------


S = TypeVar("S", bound=_StreamBase)


class _ClientCore(ABC, Generic[S]):
    """``chat()`` for both clients; a subclass supplies the stub and wraps the call in its stream."""

    _stub: pb_grpc.EdgeStub
    _timeout_s: float | None
    _metadata: tuple[tuple[str, str], ...] = ()

    @abstractmethod
    def _stream(self, call: Any) -> S:
        """Wrap a started call in this client's (sync or async) stream."""

    @property
    def timeout_s(self) -> float | None:
        """The deadline in seconds of a call that sets none; ``None``: no deadline."""
        return self._timeout_s

    def _connect(
        self,
        grpc_module: Any,
        target: str,
        timeout_s: float | None,
        api_key: str | None,
        tls: bool | None,
        ca_file: str | Path | None,
        cert_file: str | Path | None,
        key_file: str | Path | None,
        server_name: str | None,
        insecure: bool,
    ) -> Any:
        """Set the deadline, the call metadata and the stub; returns the channel (``grpc_module`` is
        ``grpc`` or ``grpc.aio``). Arguments and errors as ``Client``'s."""
        self._timeout_s = _deadline_s(timeout_s, "timeout_s")
        creds, extra, self._metadata = channel_security(
            target,
            api_key=api_key,
            tls=tls,
            ca_file=ca_file,
            cert_file=cert_file,
            key_file=key_file,
            server_name=server_name,
            insecure=insecure,
        )
        options = [*CHANNEL_OPTIONS, *extra]
        if creds is None:
            channel = grpc_module.insecure_channel(target, options=options)
        else:
            channel = grpc_module.secure_channel(target, creds, options=options)
        self._stub = pb_grpc.EdgeStub(channel)
        return channel

    def _call_timeout(self, timeout_s: float | None) -> float | None:
        if timeout_s is None:
            return self._timeout_s
        return _deadline_s(timeout_s, "timeout_s")

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
            top_k: sample among the ``top_k`` most likely tokens, >= 0; default 0 = off.
            seed: sampling seed (a 64-bit int); default ``None`` = unseeded.
            session_id: name of a multi-turn conversation (at most 128 bytes); reuse it on each
                turn so the edge and the cloud keep the conversation's prefix and only new tokens
                travel. Sessions are per API key: another key's same id is another session.
                Default ``None`` = stateless.
            mode: ``"auto"`` (default: the edge picks, per request, the mode with the lowest
                predicted time to first token), ``"local"`` (the whole model on the edge),
                ``"split"`` (edge head, cloud tail), ``"direct"`` (token ids up, the cloud runs
                every layer) or ``"remote_prefill"`` (token ids up, the cloud prefills and streams
                the first tokens while the prompt's KV comes down, then the edge decodes the
                rest with its whole model). An explicit mode the edge cannot serve now is refused:
                ``FailedPrecondition`` (no model for it on the edge) or ``Unavailable`` (no cloud).
            split_layer: with ``mode="split"``, the split layer ``k`` to use (one of
                ``EdgeInfo.split_layers``); default 0 = the edge's choice.
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
            ValueError: invalid arguments (before anything is sent; see ``build_request``).
            TypeError: arguments of the wrong type (before anything is sent).

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
        )
        call = self._stub.Chat(req, timeout=self._call_timeout(timeout_s), metadata=self._metadata or None)
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
        self._channel = self._connect(
            grpc, target, timeout_s, api_key, tls, ca_file, cert_file, key_file, server_name, insecure
        )

    def _stream(self, call: Any) -> ChatStream:
        return ChatStream(call)

    def complete(self, messages: Sequence[Message] | None = None, **kw: Unpack[ChatOptions]) -> ChatResult:
        """Run a turn to the end and return its ``ChatResult`` (arguments and errors as ``chat``)."""
        s = self.chat(messages, **kw)
        for _ in s:
            pass
        return s.result

    def info(self, *, timeout_s: float | None = None) -> EdgeInfo:
        """What the edge serves and its limits (``Edge.GetInfo``).

        Args:
            timeout_s: deadline in seconds; ``None`` = the client's.

        Raises:
            TandemClientError: its subclass for the status, e.g. ``Unavailable`` (edge not
                reachable) or ``Unimplemented`` (an edge older than ``GetInfo``).
        """
        try:
            m = self._stub.GetInfo(
                pb.GetInfoRequest(), timeout=self._call_timeout(timeout_s), metadata=self._metadata or None
            )
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
            ValueError: an empty ``session_id``.
            TandemClientError: its subclass for the status, e.g. ``DeadlineExceeded`` (a turn of the
                session ran past the deadline) or ``Unimplemented`` (an edge older than ``EndSession``).
        """
        req = _end_session_request(session_id)
        try:
            m = self._stub.EndSession(req, timeout=self._call_timeout(timeout_s), metadata=self._metadata or None)
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
        self._channel = self._connect(
            grpc.aio, target, timeout_s, api_key, tls, ca_file, cert_file, key_file, server_name, insecure
        )

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
            m = await self._stub.GetInfo(
                pb.GetInfoRequest(), timeout=self._call_timeout(timeout_s), metadata=self._metadata or None
            )
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e) from e
        return EdgeInfo.from_pb(m)

    async def end_session(self, session_id: str, *, timeout_s: float | None = None) -> bool:
        """End the chat session ``session_id`` (``Edge.EndSession``); as ``Client.end_session``."""
        req = _end_session_request(session_id)
        try:
            m = await self._stub.EndSession(req, timeout=self._call_timeout(timeout_s), metadata=self._metadata or None)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e) from e
        return bool(m.found)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
