"""Batch concurrent head requests into one ONNX Runtime call.

Who calls: the edge service, once per request (``await batcher.run(row)``).
The batcher's loop takes the first waiting row, then every row already queued
(up to ``max_batch``), and runs them together in a worker thread: no timer, so a
lone request waits for nothing, and concurrent ones share one call. ``pending_tokens`` is the
new tokens of the rows waiting or running: the queue a new row joins (the edge's cost model reads
it); ``run_timed`` also returns a row's wait for the batches ahead of it and its batch's run time.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from tandem.edge.compute.head import HeadInput, HeadOutput, HeadRunner


@dataclass(frozen=True)
class TimedHeadOutput:
    """A row's output, its wait from ``run_timed`` to its batch's start and that batch's run time (ms)."""

    out: HeadOutput
    wait_ms: float
    run_ms: float


class HeadBatcher:
    def __init__(self, head: HeadRunner, max_batch: int) -> None:
        self.head, self.max_batch = head, max_batch
        self._queue: asyncio.Queue[tuple[HeadInput, asyncio.Future, float]] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.batches_run = 0
        self.rows_run = 0
        self.pending_tokens = 0  # new tokens of the rows waiting or running

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def run(self, row: HeadInput) -> HeadOutput:
        return (await self.run_timed(row)).out

    async def run_timed(self, row: HeadInput) -> TimedHeadOutput:
        """``row`` in the next batch; raises what the runner raises for that batch."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        n = len(row.token_ids)
        self.pending_tokens += n
        try:
            await self._queue.put((row, fut, time.perf_counter()))
            return await fut
        finally:
            self.pending_tokens -= n

    async def _loop(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            t0 = time.perf_counter()
            try:
                outs = await asyncio.to_thread(self.head.run, [r for r, _, _ in batch])
            except Exception as e:  # a bad row fails its batch; each caller gets the error
                for _, f, _ in batch:
                    if not f.done():
                        f.set_exception(e)
                continue
            run_ms = (time.perf_counter() - t0) * 1e3
            self.batches_run += 1
            self.rows_run += len(batch)
            for (_, f, queued), o in zip(batch, outs, strict=True):
                if not f.done():
                    f.set_result(TimedHeadOutput(o, (t0 - queued) * 1e3, run_ms))
