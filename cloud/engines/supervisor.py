"""Engine supervision: a dead vLLM engine makes the cloud NOT_SERVING at once, is restarted
in the background, and the cloud is SERVING again when it runs.

vLLM offers no death callback for its multiprocess client (a monitor thread only sets a
flag that ``AsyncLLM.errored`` reads), so :class:`EngineSupervisor` polls
``engines.is_alive()`` every ``poll_s`` (0.5 s). On death:

1. health NOT_SERVING (through ``set_serving(False)``; the cloud maps it to "" and
   ``tandem.v1.Cloud``), so edges and load balancers stop sending;
2. ``engines.restart()`` (requests meanwhile fail at once with UNAVAILABLE);
3. health SERVING again.

A restart that fails is retried after ``backoff_s``; after ``max_failures`` failed restarts
in a row the supervisor gives up: it sets :attr:`EngineSupervisor.gave_up` and calls
``on_give_up`` (``tandem-cloud`` then exits non-zero, so an external supervisor such as
systemd or Kubernetes restarts the whole process). Pure asyncio; ``engines`` is anything
with ``is_alive()``, ``async restart()`` and ``closed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

from tandem.cloud import metrics

log = logging.getLogger("tandem.supervisor")


@runtime_checkable
class SupervisedEngines(Protocol):
    @property
    def closed(self) -> bool:
        """True when the engines were shut down on purpose (the supervisor then stops)."""
        ...

    def is_alive(self) -> bool: ...

    async def restart(self) -> None: ...


class EngineSupervisor:
    """Watches ``engines``; ``set_serving(bool)`` publishes the health status."""

    def __init__(
        self,
        engines: SupervisedEngines,
        set_serving: Callable[[bool], Awaitable[None]],
        *,
        poll_s: float = 0.5,
        max_failures: int = 3,
        backoff_s: float = 2.0,
        on_give_up: Callable[[], None] | None = None,
    ) -> None:
        self.engines, self.set_serving = engines, set_serving
        self.poll_s, self.max_failures, self.backoff_s = poll_s, max_failures, backoff_s
        self.on_give_up = on_give_up
        self.gave_up = asyncio.Event()
        self.restarts = 0  # successful restarts so far
        self._task: asyncio.Task[None] | None = None

    def start(self) -> asyncio.Task[None]:
        """Start watching (idempotent); returns the watching task."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name="tandem-engine-supervisor")
        return self._task

    async def stop(self) -> None:
        """Stop watching (cancels a restart in progress)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def run(self) -> None:
        """Poll until the engines are closed or the supervisor gives up."""
        while not self.engines.closed:
            if not self.engines.is_alive():
                if not await self._recover():
                    return
            await asyncio.sleep(self.poll_s)

    async def _recover(self) -> bool:
        """NOT_SERVING, restart until alive; SERVING. False if it gave up or the engines closed."""
        await self.set_serving(False)
        log.error("a vLLM engine died: health NOT_SERVING, restarting the engine(s)")
        failures = 0
        while not self.engines.closed:
            try:
                await self.engines.restart()
                ok = self.engines.is_alive()
            except Exception:
                if self.engines.closed:
                    return False
                log.exception("engine restart failed")
                ok = False
            if ok:
                self.restarts += 1
                metrics.record_engine_restart()
                await self.set_serving(True)
                log.warning("engines restarted: health SERVING")
                return True
            failures += 1
            if failures >= self.max_failures:
                log.critical("giving up after %d failed engine restarts", failures)
                self.gave_up.set()
                if self.on_give_up is not None:
                    self.on_give_up()
                return False
            log.error("engine restart %d/%d failed; retrying in %.1f s", failures, self.max_failures, self.backoff_s)
            await asyncio.sleep(self.backoff_s)
        return False
