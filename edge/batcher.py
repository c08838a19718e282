"""Batch concurrent head requests into one ONNX Runtime call.

Who calls: the edge service, once per request (``await batcher.run(row)``).
The batcher's loop takes the first waiting row, then every row already queued
(up to ``max_batch``), and runs them together in a worker thread: no timer, so a
lone request waits for nothing, and concurrent ones share one call.
"""

from __future__ import annotations

import asyncio

from tandem.edge.head_runner import HeadInput, HeadOutput, HeadRunner


class HeadBatcher:
    def __init__(self, head: HeadRunner, max_batch: int) -> None:
        self.head, self.max_batch = head, max_batch
        self._queue: asyncio.Queue[tuple[HeadInput, asyncio.Future]] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.batches_run = 0
        self.rows_run = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def run(self, row: HeadInput) -> HeadOutput:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        await self._queue.put((row, fut))
        return await fut

    async def _loop(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self.max_batch and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                outs = await asyncio.to_thread(self.head.run, [r for r, _ in batch])
            except Exception as e:  # a bad row fails its batch; each caller gets the error
                for _, f in batch:
                    if not f.done():
                        f.set_exception(e)
                continue
            self.batches_run += 1
            self.rows_run += len(batch)
            for (_, f), o in zip(batch, outs, strict=True):
                if not f.done():
                    f.set_result(o)
