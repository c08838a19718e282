"""A dead engine's leftovers: its processes still running are killed and the shared-memory segments
they mapped are unlinked when it is replaced, while segments a live process maps are kept."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from multiprocessing import shared_memory
from types import SimpleNamespace

import psutil
import pytest

from tandem.cloud.engines.resources import capture

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory in /dev/shm")


def _hold(names, ready) -> None:
    """An engine process: make the segments ``names`` (as vLLM's ring buffers do) and hold them mapped."""
    segs = [shared_memory.SharedMemory(name=n, create=True, size=1 << 16) for n in names]
    ready.set()
    time.sleep(60)
    del segs


def _engine(names: list[str]) -> tuple[SimpleNamespace, mp.Process]:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_hold, args=(names, ready), daemon=True)
    proc.start()
    assert ready.wait(30)
    manager = SimpleNamespace(processes=[proc])  # where vLLM keeps an AsyncLLM's EngineCore processes
    return SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(engine_manager=manager))), proc


def _exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def test_a_killed_engines_segments_are_unlinked_when_it_is_replaced():
    tag = f"tandemtest{os.getpid()}"
    dead, dead_proc = _engine([f"{tag}a", f"{tag}b"])
    live, live_proc = _engine([f"{tag}c"])
    try:
        left = capture(dead)
        assert {f"{tag}a", f"{tag}b"} <= left.segments and dead_proc.pid in left.processes
        os.kill(dead_proc.pid, signal.SIGKILL)  # kill -9: nobody unlinks its segments
        dead_proc.join(10)
        assert _exists(f"{tag}a") and _exists(f"{tag}b")
        released = left.release(live_pids=[live_proc.pid])
        assert sorted(released) == [f"{tag}a", f"{tag}b"]
        assert not _exists(f"{tag}a") and not _exists(f"{tag}b") and _exists(f"{tag}c")
        assert left.release() == []  # a second release finds nothing left
    finally:
        for p in (dead_proc, live_proc):
            p.kill()
            p.join(10)
        for n in ("a", "b", "c"):
            if _exists(f"{tag}{n}"):
                shared_memory.SharedMemory(name=f"{tag}{n}").unlink()


def test_a_hung_engine_process_is_killed_and_a_segment_another_process_maps_is_kept():
    """The dead engine's surviving process (a worker that did not follow its EngineCore) is killed;
    a segment it shares with a live engine's process stays."""
    tag = f"tandemtest{os.getpid()}h"
    shared = f"{tag}s"
    dead, dead_proc = _engine([f"{tag}x"])
    live, live_proc = _engine([shared])
    try:
        left = capture(dead)
        left.segments.add(shared)  # as if the dead engine had mapped it too
        released = left.release(live_pids=[live_proc.pid])
        assert released == [f"{tag}x"] and _exists(shared)
        assert not psutil.pid_exists(dead_proc.pid) or psutil.Process(dead_proc.pid).status() == psutil.STATUS_ZOMBIE
    finally:
        for p in (dead_proc, live_proc):
            p.kill()
            p.join(10)
        for n in (f"{tag}x", shared):
            if _exists(n):
                shared_memory.SharedMemory(name=n).unlink()


def test_an_engine_without_processes_of_its_own_leaves_nothing_to_release():
    assert capture(SimpleNamespace()).release() == []
