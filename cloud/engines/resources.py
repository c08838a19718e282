"""What a vLLM engine leaves behind when it dies, and its release when the engine is replaced.

A vLLM engine (``AsyncLLM``) runs an EngineCore process and, on the multiprocess executor, a
worker process under it. They talk through shared-memory ring buffers
(``vllm/distributed/device_communicators/shm_broadcast.py``: ``/dev/shm/psm_*`` segments made with
``multiprocessing.shared_memory``), which the process that made a segment unlinks when it shuts
down. An engine killed with ``kill -9`` (an OOM kill, a crash) never does; and since vLLM spawns
its processes from the cloud's own process, they register their segments with the cloud's
``multiprocessing`` resource tracker, which unlinks leftovers only when the cloud itself exits. So
without help a dead engine's segments (tens of MB each) stay in ``/dev/shm`` until the cloud
stops, one set per engine death.

:func:`capture` records, once an engine has started, its processes (EngineCore and descendants,
with their start times against pid reuse) and the segments they map; :meth:`EngineResources.release`,
called when the dead engine is replaced, kills any of its processes still running and unlinks each
of its segments that no live process maps any more (which also takes the segment off the resource
tracker's list, so the cloud's exit reports no leak). What this module does not do: touch segments
it did not see mapped by the engine's own processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from typing import Any

import psutil

log = logging.getLogger("tandem.engines")
SHM_DIR = "/dev/shm"


def _mapped_segments(proc: psutil.Process) -> set[str]:
    """Names of the ``/dev/shm`` segments ``proc`` maps (empty if it is gone or unreadable)."""
    try:
        paths = {m.path for m in proc.memory_maps(grouped=True)}
    except (psutil.Error, OSError):
        return set()
    return {os.path.basename(p) for p in paths if p.startswith(SHM_DIR + "/")}


def _tree(pids: Iterable[int]) -> list[psutil.Process]:
    """The processes ``pids`` and all their descendants that are alive now."""
    out: list[psutil.Process] = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            out += [p, *p.children(recursive=True)]
    return out


def engine_pids(engine: Any) -> list[int]:
    """Process ids of ``engine``'s EngineCore processes (vLLM's ``CoreEngineProcManager``; 0.26 to
    0.32 keep them at ``engine_core.resources.engine_manager.processes``); empty for an engine that
    runs in this process or a vLLM that keeps them elsewhere."""
    manager = getattr(getattr(getattr(engine, "engine_core", None), "resources", None), "engine_manager", None)
    return [p.pid for p in getattr(manager, "processes", []) if p.pid is not None]


@dataclass
class EngineResources:
    """One engine's processes (pid -> start time) and the shared-memory segments they map."""

    processes: dict[int, float] = field(default_factory=dict)
    segments: set[str] = field(default_factory=set)

    def add(self, procs: Iterable[psutil.Process]) -> None:
        for p in procs:
            with contextlib.suppress(psutil.Error):
                self.processes[p.pid] = p.create_time()
                self.segments |= _mapped_segments(p)

    def _alive(self) -> list[psutil.Process]:
        out = []
        for pid, started in self.processes.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
        return out

    def release(self, live_pids: Iterable[int] = ()) -> list[str]:
        """Kill this engine's processes still running, then unlink each of its segments that no
        process in ``live_pids`` (and their descendants) maps. Returns the segments unlinked.
        Never raises."""
        survivors = self._alive()
        for p in survivors:
            self.segments |= _mapped_segments(p)
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(survivors, timeout=5)
        in_use: set[str] = set()
        for p in _tree(live_pids):
            in_use |= _mapped_segments(p)
        released = []
        for name in sorted(self.segments - in_use):
            if not os.path.exists(os.path.join(SHM_DIR, name)):
                continue  # its maker unlinked it
            try:
                seg = shared_memory.SharedMemory(name=name)
                seg.close()
                seg.unlink()  # also unregisters it from this process's resource tracker
                released.append(name)
            except (FileNotFoundError, OSError) as e:
                log.warning("could not release shared memory %s of a dead engine: %s", name, e)
        if survivors or released:
            log.warning(
                "released a dead engine's leftovers: %d processes killed, %d shared-memory segments unlinked",
                len(survivors),
                len(released),
            )
        return released


def capture(engine: Any) -> EngineResources:
    """``engine``'s processes and the segments they map, read now (after its start). Never raises."""
    res = EngineResources()
    try:
        res.add(_tree(engine_pids(engine)))
    except Exception:  # noqa: BLE001 - bookkeeping must never fail an engine start
        log.warning("could not read an engine's processes", exc_info=True)
    return res
