"""One request in flight on the cloud (``Turn``) and the small pieces every stage of it shares:
the uplink's item types, a deadline on an async stream, the caller's principal, and the work
a turn leaves running after it ends (``Background``).

Pure asyncio and domain types; no grpc, no engines, no store.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tandem.common.protocol.params import LinkParams
from tandem.common.runtime.security import ANONYMOUS_PEER, Principal, scoped
from tandem.common.wire import chunks as wire
from tandem.common.wire.kvdown import KVDownAck, Takeover
from tandem.common.wire.messages import Commit, KVBlock, TurnHeader
from tandem.stages import Stage, Timings

UplinkBody = wire.Chunk | KVBlock | Commit | KVDownAck | Takeover  # the last two: remote prefill only
T = TypeVar("T")


def as_principal(caller: Principal | str) -> Principal:
    """A caller given as a plain string (in-process links, tests) is a ``peer`` principal."""
    return caller if isinstance(caller, Principal) else Principal("peer", caller)


async def bounded(
    it: AsyncIterator[T], deadline: float | None, on_timeout: Callable[[], Exception]
) -> AsyncIterator[T]:
    """Items of ``it``, each awaited no later than ``deadline`` (event-loop time; None = no bound).
    The bound applies to waiting for the next item only, never to the consumer's time between items.

    Raises:
        ``on_timeout()``: the deadline passed while waiting.
    """
    ait = it.__aiter__()
    while True:
        try:
            async with asyncio.timeout_at(deadline):
                item = await ait.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise on_timeout() from None
        yield item


@dataclass
class Turn:
    """One request in flight: its header, deadline (event-loop time, None = none) and timings."""

    header: TurnHeader
    deadline: float | None
    t_start: float = field(default_factory=time.perf_counter)
    timings: Timings = field(default_factory=dict)
    received_bytes: dict[str, int] = field(default_factory=dict)
    external_tokens: int = 0  # prompt tokens the decode engine loaded, not computed (its first step says)
    t_engine: float | None = None  # when its first engine request started (queue time)
    # the engines' request id: the cloud's own, so that an id from the wire can never name (and
    # collide with or abort) another edge's request inside vLLM; logs carry both
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    params: LinkParams | None = None  # the link params it runs under (its header's version)
    caller: Principal = ANONYMOUS_PEER  # who sent it (the edge's identity)
    pinned: set[str] = field(default_factory=set)  # block-store keys pinned for it (owner: engine_id)
    ended: bool = False  # its call is over (a pin that finishes later releases its own keys: ``Pins.pin``)
    # its ``TurnFinal`` went to the caller: the turn completed, and a cancel after it (the edge ends
    # a remote-prefill call as soon as it has the final) does not make it a cancelled turn
    final_sent: bool = False

    @property
    def session_key(self) -> str:
        """The session's key here: its id in the caller's namespace ("" when stateless)."""
        return scoped(self.caller, self.header.session_id)

    @property
    def link_params(self) -> LinkParams:
        """The params it runs under (set once its link's version was looked up, before any stage)."""
        if self.params is None:
            raise RuntimeError("the turn's link params are not known yet")
        return self.params

    def time(self, stage: Stage, t0: float) -> None:
        self.timings[stage] = (time.perf_counter() - t0) * 1e3

    def engine_start(self) -> None:
        if self.t_engine is None:
            self.t_engine = time.perf_counter()


class Background:
    """Work that outlives the turn that started it: a cut upload's kept prefix, a stateless turn's
    drop after the tail engine's late writes. Who calls: the pins and the prefix keeper
    (``spawn``), the server at shutdown (``finish``). Single event loop."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task:
        """Run ``coro`` past the turn that started it; ``finish`` awaits what is left."""
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def finish(self, timeout_s: float) -> None:
        """At shutdown: wait up to ``timeout_s`` for the background work of finished turns (kept
        prefixes, late drops), then cancel what is left (its blocks age out of the store)."""
        if not self.tasks:
            return
        _, pending = await asyncio.wait(set(self.tasks), timeout=timeout_s)
        for task in pending:
            task.cancel()
