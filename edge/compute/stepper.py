"""The one worker thread that runs every model run of the edge's local engine
(``edge.compute.local.LocalEngine``), and hands what it computed back to the event loops that asked.

The thread's loop (``Stepper._main``), while there is work: give back the KV of dropped sessions
(``before``), run at most one queued job (a prefill, a KV read or write), then one decode step over
every decoding turn (``step``), handing each one's results back to the event loop with one
``loop.call_soon_threadsafe`` (``flush``). So a prefill runs between two decode steps, one per step:
however many are queued, the decoding turns step after each, and a new turn joins the batch at the
step after its prefill. Jobs run in the order they came (FIFO). With no work, the thread waits
``linger_s`` for more, then ends; the next job starts a new one. A model that replays CUDA graphs
must be run from one thread for its whole life (ONNX Runtime keeps captured graphs per thread:
``edge.compute.decoder.GraphThread``): with ``linger_s`` None the thread, once started, waits for
work until ``close``.

Who touches what: ``submit`` is called from any thread (the event loop); ``decoding`` and the
outbox are the thread's alone (a job or ``step`` adds and removes turns; ``deliver`` queues a
result); a ``Mailbox``'s ``push`` runs on its event loop, and its ``cancelled`` flag is set there
and read by the thread, which then drops the mailbox's work (not yet started) and results.

Not here: what a job or a step computes, sessions, sampling (``edge.compute.local``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from tandem.common.protocol.errors import EngineError

log = logging.getLogger(__name__)

T = TypeVar("T", bound="Mailbox")

LINGER_S = 0.1  # an idle thread waits this long for work before it ends


class Mailbox(ABC):
    """Where results for one caller on one event loop go: ``push(item)`` runs on ``loop``, once per
    result the thread delivers, in order. ``cancelled``: set on ``loop`` when the caller is gone;
    the thread then runs no more of its work and its results are dropped (also set by the thread
    when ``loop`` is closed)."""

    __slots__ = ("cancelled", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.cancelled = False

    @abstractmethod
    def push(self, item: Any) -> None:
        """Take one result the thread delivered (runs on ``loop``)."""


class Stepper(Generic[T]):
    """The worker thread and its queues (module doc).

    ``step(decoding)``: one decode step over the turns of ``decoding`` (the list itself, which it
    may shorten: finished, failed and cancelled turns leave it), called by the thread alone.
    ``before()``: called by the thread before each job and step (the engine gives back released KV).
    Neither may raise; an exception is logged and, from ``step``, ends every decoding turn.
    """

    def __init__(
        self, step: Callable[[list[T]], None], before: Callable[[], None], linger_s: float | None = LINGER_S
    ) -> None:
        """``linger_s``: how long an idle thread waits for work before it ends; None: it never ends
        by itself (a daemon thread, ended by ``close``)."""
        self._step, self._before, self.linger_s = step, before, linger_s
        self.threads_started = 0
        self._closed = False
        self.decoding: list[T] = []  # the thread's: turns that take part in the next decode step
        self._jobs: deque[Callable[[], None]] = deque()
        self._outbox: list[tuple[Mailbox, Any]] = []  # the thread's: results not yet handed back
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def idle(self) -> bool:
        """No job queued and no turn decoding."""
        return not self._jobs and not self.decoding

    def submit(self, job: Callable[[], None]) -> None:
        """Queue ``job`` (it must not raise) to run in the thread, after the jobs queued before it;
        starts the thread if it is not running. Any thread may call it.

        Raises:
            EngineError: the stepper was closed."""
        with self._cond:
            if self._closed:
                raise EngineError("the local engine is closed")
            self._jobs.append(job)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._main, name="tandem-local-stepper", daemon=self.linger_s is None
                )
                self.threads_started += 1
                self._thread.start()
            else:
                self._cond.notify()

    def close(self, timeout_s: float | None = None) -> None:
        """Take no more jobs; the thread ends once the queued jobs and decoding turns are done.
        Waits up to ``timeout_s`` for it (None: until it ends). Blocks: from an event loop, call it
        in a worker thread. Closing twice does nothing more."""
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def deliver(self, box: Mailbox, item: Any) -> None:
        """From the thread: hand ``item`` to ``box.push`` on its loop at the next ``flush``."""
        self._outbox.append((box, item))

    def flush(self) -> None:
        """From the thread: hand every delivered item back, one ``call_soon_threadsafe`` per event
        loop. A mailbox whose loop is closed is cancelled."""
        out = self._outbox
        if not out:
            return
        self._outbox = []
        loop = out[0][0].loop
        if all(box.loop is loop for box, _ in out):
            self._send(loop, out)
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Mailbox, Any]]] = {}
        for box, item in out:
            by_loop.setdefault(box.loop, []).append((box, item))
        for lp, items in by_loop.items():
            self._send(lp, items)

    @staticmethod
    def _send(loop: asyncio.AbstractEventLoop, items: list[tuple[Mailbox, Any]]) -> None:
        try:
            loop.call_soon_threadsafe(_push_all, items)
        except RuntimeError:  # the loop is closed: nobody waits for these any more
            for box, _ in items:
                box.cancelled = True

    def _main(self) -> None:
        while self._wait_for_work():
            job = self._jobs.popleft() if self._jobs else None
            if job is not None:
                self._guarded(job)
                self.flush()
            if self.decoding:
                self._guarded(self._step, self.decoding)
                self.flush()

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._before()
            fn(*args)
        except BaseException as e:  # a bug: the thread goes on; turns that were decoding hear it
            log.exception("the local engine's stepper failed")
            for box in self.decoding:
                self.deliver(box, e)
            self.decoding.clear()

    def _wait_for_work(self) -> bool:
        """True once there is work; False when none came within ``linger_s``, or the stepper is
        closed with none left (the thread then ends)."""
        if self._jobs or self.decoding:
            return True
        with self._cond:
            while not self._jobs:
                # wait(None) returns only when notified: an unlimited linger ends by close alone
                if self._closed or (not self._cond.wait(self.linger_s) and not self._jobs):
                    self._thread = None
                    return False
            return True


def _push_all(items: list[tuple[Mailbox, Any]]) -> None:
    """On the event loop: each item to its mailbox (a cancelled one drops it)."""
    for box, item in items:
        if not box.cancelled:
            box.push(item)
