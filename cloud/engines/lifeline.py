"""No engine process outlives its gateway.

vLLM (CPU build) runs each ``AsyncLLM`` as a process tree below the gateway::

    tandem-cloud (gateway, asyncio + gRPC)
     ├─ VLLM::EngineCore    scheduler; spawned by the gateway (multiprocessing "spawn")
     │   └─ VLLM::Worker    model runner; spawned by the EngineCore (MultiprocExecutor)
     └─ (same for the second engine; plus multiprocessing's resource tracker)

vLLM ties a Worker to its EngineCore (a death pipe) and the gateway notices a dead
EngineCore (a sentinel monitor thread), but nothing ties an EngineCore to the gateway:
without this, after ``kill -9`` of the gateway both engines keep running and hold their memory.

Both the EngineCore (scheduler-side connector) and the Worker (worker-side connector)
instantiate ``TandemConnector``, so the connector starts :func:`watch_parent` once per
process: a daemon thread that, every ``interval_s``, checks

* that its parent is still the process that started it (``os.getppid()`` changes the
  moment the parent exits, before it is reaped, so this never mistakes a zombie or a
  reused pid for a live parent), and
* that the gateway (pid and start time recorded when the thread starts; the gateway
  passes its pid in ``kv_connector_extra_config["gateway_pid"]``) is alive and no zombie,

and otherwise kills its own children and ``os._exit``s. ``prctl(PR_SET_PDEATHSIG)`` is
not used: it fires when the *thread* that spawned the child exits, and the gateway
starts replacement engines from a worker thread (``VllmEngines.restart``); it would also
be set only after the connector loads, leaving the same window this poll has.
"""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger("tandem.lifeline")
EXIT_CODE = 70  # EX_SOFTWARE: killed because the gateway is gone
_started = False
_lock = threading.Lock()


def _gateway_alive(pid: int, create_time: float | None) -> bool:
    import psutil

    try:
        p = psutil.Process(pid)
        if create_time is not None and abs(p.create_time() - create_time) > 0.01:
            return False  # the pid was reused
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # cannot tell (e.g. access denied): do not kill


def _die(reason: str) -> None:
    import psutil

    log.error("pid %d: %s; exiting", os.getpid(), reason)
    try:
        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
    finally:
        os._exit(EXIT_CODE)


def watch_parent(gateway_pid: int | None = None, interval_s: float = 1.0) -> bool:
    """Start (once per process) the daemon thread that exits this process when its parent
    or the gateway ``gateway_pid`` dies. A no-op in the gateway itself. Returns whether a
    thread was started by this call."""
    global _started
    gateway = int(gateway_pid) if gateway_pid else None
    if gateway == os.getpid():
        return False
    with _lock:
        if _started:
            return False
        _started = True
    parent = os.getppid()
    create_time: float | None = None
    if gateway is not None:
        import psutil

        try:
            create_time = psutil.Process(gateway).create_time()
        except psutil.Error:
            _die(f"gateway {gateway} is already gone")

    def run() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                _die(f"parent {parent} exited")
            if gateway is not None and not _gateway_alive(gateway, create_time):
                _die(f"gateway {gateway} exited")

    threading.Thread(target=run, name="tandem-lifeline", daemon=True).start()
    return True
