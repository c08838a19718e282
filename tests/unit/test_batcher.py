"""The edge's head batcher (``edge.compute.batcher``): rows queued while a batch runs share the next call;
the queue it holds (``pending_tokens``) and each row's wait and run time are what the cost model reads."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from tandem.common.protocol.errors import InvalidRequest
from tandem.edge.compute.batcher import HeadBatcher
from tandem.edge.compute.head import HeadInput, MemoryHead


class GatedHead(MemoryHead):
    """``MemoryHead`` whose runs each wait for the test to open the gate, then take ``run_s``."""

    def __init__(self, run_s: float) -> None:
        super().__init__(2, 8, 1, 4)
        self.run_s, self.gate, self.batches = run_s, threading.Event(), []

    def run(self, rows):
        self.gate.wait(5)
        time.sleep(self.run_s)
        self.batches.append(len(rows))
        return super().run(rows)


def row(n: int) -> HeadInput:
    return HeadInput(np.arange(1, n + 1, dtype=np.int64))


async def test_rows_waiting_behind_a_batch_are_counted_and_timed():
    head = GatedHead(0.05)
    b = HeadBatcher(head, max_batch=4)
    b.start()
    try:
        first = asyncio.create_task(b.run_timed(row(10)))
        await asyncio.sleep(0.02)  # the first batch holds the runner (its gate still shut)
        later = [asyncio.create_task(b.run_timed(row(n))) for n in (3, 5)]
        await asyncio.sleep(0.02)
        assert b.pending_tokens == 18  # 10 running, 3 + 5 waiting
        head.gate.set()
        a, x, y = await asyncio.gather(first, *later)
        assert head.batches == [1, 2]  # the two waiting rows ran in one call
        assert a.run_ms >= 50 and x.run_ms == y.run_ms >= 50  # a row's run time is its batch's
        assert x.wait_ms >= 50  # it waited for the batch ahead of it (queued while that ran)
        assert a.out.hidden.shape == (10, 8) and x.out.kv.shape == (2, 2, 1, 3, 4)
        assert b.pending_tokens == 0
    finally:
        await b.stop()


async def test_a_failed_batch_leaves_no_queue_behind():
    b = HeadBatcher(MemoryHead(2, 8, 1, 4), max_batch=4)
    b.start()
    try:
        with pytest.raises(InvalidRequest):
            await b.run(HeadInput(np.zeros((0,), np.int64)))
        assert b.pending_tokens == 0
        assert (await b.run(row(4))).hidden.shape == (4, 8)
    finally:
        await b.stop()
