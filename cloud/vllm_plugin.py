"""tandem's vLLM general plugin: how long an idle vLLM worker busy-polls for its next step.

vLLM runs each CPU engine's model in a worker process that reads its steps from a
shared-memory queue (``vllm/distributed/device_communicators/shm_broadcast.py``). Its reader
waits with ``SpinCondition``: after each read it busy-loops (``sched_yield``) for
``busy_loop_s`` seconds, 1 s in vLLM 0.32, before it sleeps on a socket. So after a request
ends, each worker keeps a core busy for a second. On a GPU host with spare cores that is
free. On a host whose cores do other work it is not: measured on this 2-core machine, the
edge head right after a request ran 1.9x slower (636 ms against 332 ms at 1024 tokens), and
the next prefill on the other engine slowed too (``README.md``, design notes).

vLLM loads the entry points of its ``vllm.general_plugins`` group in every process it starts
(``vllm.plugins.load_general_plugins``: the engine core, and each worker before it opens its
queues). ``register`` sets the reader's default ``busy_loop_s`` to the value in
``TANDEM_VLLM_WORKER_BUSY_POLL_S``, which ``cloud.engines.VllmEngines`` sets from
``EngineConfig.worker_busy_poll_s`` before it starts its engines. With the variable unset (any
other use of vLLM in the same environment) it changes nothing. A vLLM whose ``SpinCondition``
has no ``busy_loop_s`` parameter is left alone, with a warning.

The window counts from the worker's last read of a step, so with steps longer than it (decode
steps on CPU take 50-70 ms) the worker also sleeps between the steps of a request, and each
step then waits for a socket wake-up (tens of microseconds). ``tandem-bench``'s inter-token
latency at 256 and 1024 prompt tokens was the same before and after (README, *Hot path*).
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

log = logging.getLogger("tandem.vllm_plugin")

ENV = "TANDEM_VLLM_WORKER_BUSY_POLL_S"


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (called once per vLLM process). Never
    raises: vLLM calls plugins unguarded, and a vLLM this plugin does not fit must still start."""
    try:
        _register()
    except Exception:  # noqa: BLE001 - see the docstring
        log.warning("tandem's vLLM plugin failed; vLLM's worker polling left as is", exc_info=True)


def _register() -> None:
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
