"""tandem's vLLM general plugin: how long an idle vLLM worker busy-polls for its next step, and
how vLLM's engine processes end (:func:`install_fast_exit`).

vLLM runs each CPU engine's model in a worker process that reads its steps from a shared-memory
queue (``vllm/distributed/device_communicators/shm_broadcast.py``). Its reader waits with
``SpinCondition``: after each read it busy-loops (``sched_yield``) for ``busy_loop_s`` seconds,
1 s in vLLM 0.32, before it sleeps on a socket, so after a request ends each worker keeps a core
busy for a second. What that costs on a host whose cores do other work, and why the window can be
short: docs/design-decisions.md, "The connector and vLLM".

vLLM loads the entry points of its ``vllm.general_plugins`` group in every process it starts
(``vllm.plugins.load_general_plugins``: the engine core, and each worker before it opens its
queues). ``register`` sets the reader's default ``busy_loop_s`` to the value in
``TANDEM_VLLM_WORKER_BUSY_POLL_S``, which ``cloud.engines.vllm_engines.VllmEngines`` sets from
``EngineConfig.worker_busy_poll_s`` before it starts its engines. With the variable unset (any
other use of vLLM in the same environment) it changes nothing. A vLLM whose ``SpinCondition``
has no ``busy_loop_s`` parameter is left alone, with a warning.

With ``TANDEM_VLLM_FAST_EXIT=1`` (also set by ``cloud.engines.vllm_engines``) it also installs
:func:`install_fast_exit` in each engine process, so that an engine stops in about 2 s (9 s
with the interpreter's teardown); unset, nothing changes there either.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

log = logging.getLogger("tandem.vllm_plugin")

ENV = "TANDEM_VLLM_WORKER_BUSY_POLL_S"
FAST_EXIT_ENV = "TANDEM_VLLM_FAST_EXIT"


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (called once per vLLM process). Never
    raises: vLLM calls plugins unguarded, and a vLLM this plugin does not fit must still start."""
    try:
        _register()
    except Exception:  # noqa: BLE001 - see the docstring
        log.warning("tandem's vLLM plugin failed; vLLM's worker polling left as is", exc_info=True)


def _register() -> None:
    if os.environ.get(FAST_EXIT_ENV) == "1":
        install_fast_exit()
    raw = os.environ.get(ENV)
    if raw is None:
        return
    try:
        busy_s = float(raw)
    except ValueError:
        log.warning("%s=%r is not a number of seconds; vLLM's worker polling left as is", ENV, raw)
        return
    if busy_s < 0:
        log.warning("%s=%r is negative; vLLM's worker polling left as is", ENV, raw)
        return
    set_worker_busy_poll_s(busy_s)


def set_worker_busy_poll_s(busy_s: float) -> bool:
    """Make ``busy_s`` the default ``busy_loop_s`` of vLLM's ``SpinCondition`` in this process;
    False (and a warning) when this vLLM has no such parameter."""
    from vllm.distributed.device_communicators import shm_broadcast

    cls = getattr(shm_broadcast, "SpinCondition", None)
    init: Any = getattr(cls, "__init__", None)
    params = list(inspect.signature(init).parameters) if init is not None else []
    old = getattr(init, "__defaults__", None)
    if "busy_loop_s" not in params or old is None:
        log.warning("this vLLM's shared-memory queue has no busy_loop_s; worker polling left as is")
        return False
    # keyword-or-positional defaults are __defaults__, aligned to the last parameters
    names = params[len(params) - len(old) :]
    if "busy_loop_s" not in names:
        log.warning("busy_loop_s has no default in this vLLM; worker polling left as is")
        return False
    defaults = list(old)
    defaults[names.index("busy_loop_s")] = busy_s
    init.__defaults__ = tuple(defaults)
    return True


class _SysForSpawn:
    """``sys`` as ``multiprocessing.spawn`` sees it: every attribute read and write goes to the real
    module, except ``exit``, which ends the process at once (:func:`exit_now`)."""

    def __init__(self, real: Any) -> None:
        object.__setattr__(self, "_real", real)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._real, name, value)

    @staticmethod
    def exit(code: object = None) -> None:
        exit_now(code)


def exit_now(code: object = None) -> None:
    """End this process at once: run the ``atexit`` handlers, flush stdout and stderr, then
    ``os._exit``, without the interpreter's finalization (module teardown and its final garbage
    collection). A forked ``multiprocessing`` child ends with ``os._exit`` too, right after
    ``_bootstrap`` (``multiprocessing/popen_fork.py``); this also runs the ``atexit`` handlers
    (logging's flush, OpenTelemetry's). ``code`` is read as ``sys.exit`` reads it (None is 0;
    anything but an int is printed and is 1)."""
    import atexit
    import sys

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - a closed stream must not stop the exit
                pass
        os._exit(status & 0xFF)


def install_fast_exit() -> bool:
    """In a process that ``multiprocessing`` spawned (vLLM's EngineCore and its workers), end it with
    :func:`exit_now` once its target has returned; False (nothing changed) in any other process.

    Why: a vLLM CPU worker spends 5-7 s after its shutdown in the interpreter's final garbage
    collection (``gc_collect_main`` under ``Py_FinalizeEx``, seen with ``py-spy dump --native``).
    vLLM's executor waits ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (5 s) for it, then sends
    SIGTERM (which a worker already shutting down ignores), then SIGKILL 4 s later
    (``vllm/v1/executor/multiproc_executor.py``, ``_ensure_worker_termination``). So each engine
    took about 9 s to stop. By the time ``spawn_main`` calls ``sys.exit(exitcode)``
    (``multiprocessing/spawn.py``), the target has returned (vLLM's ``WorkerProc.shutdown`` or the
    EngineCore's shutdown ran: queues shut down, the last ZMQ message sent under its linger, the
    KV connector's writer drained) and ``BaseProcess._bootstrap`` has run ``multiprocessing``'s
    finalizers, joined the process's threads and flushed its streams. vLLM's shared-memory queues
    unlink their segments when that shutdown drops them (``ShmRingBuffer.__del__``): a stop left no
    ``/dev/shm`` segment behind, and ``tests/engines/test_cloud_drain.py`` fails if the resource tracker
    finds one. What is left is the interpreter's teardown.

    Only ``multiprocessing.spawn``'s ``sys.exit`` changes: it sees ``sys`` through
    :class:`_SysForSpawn`.
    """
    import multiprocessing
    import sys
    from multiprocessing import spawn

    if multiprocessing.parent_process() is None:
        return False
    if not isinstance(getattr(spawn, "sys", None), _SysForSpawn):
        setattr(spawn, "sys", _SysForSpawn(sys))  # noqa: B010 - typeshed does not declare spawn.sys
    return True
