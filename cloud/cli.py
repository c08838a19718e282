"""``tandem-cloud``: the cloud gateway with its tail-prefill and decode vLLM engines.

Every setting of ``CloudConfig`` is a flag (``--store-bytes 8GiB``, ``--engine.max-num-seqs 4``), an
environment variable (``TANDEM_CLOUD_...``) and a key of the TOML file given by ``--config``;
flags > environment > config file > defaults. ``--version`` prints the version; ``--ready-file PATH``
writes the bound port once serving. A user error is one line on stderr and exit code 2.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from tandem.cloud.config import CloudConfig, check_engines_fit
from tandem.common.protocol.errors import InvalidRequest, TandemError
from tandem.common.runtime.cli import parse_command_line, run_cli, setup_observability
from tandem.common.runtime.grpc_setup import install_stop_signals
from tandem.common.runtime.startup import Check, check_start

PROG = "tandem-cloud"
SPLIT_PARTS = ("tail_checkpoint", "full_checkpoint")  # what the engines load of each split directory


async def serve(cfg: CloudConfig, ready_file: Path | None = None, grace_s: float = 5.0) -> int:
    """Start engines and server; run until SIGINT/SIGTERM or until the engines cannot be restarted.

    Stopping: health NOT_SERVING, ``server.stop(grace_s)`` (calls in flight may finish), then
    the engines shut down (SIGTERM to their processes, SIGKILL only if they hang). Returns the
    exit code: 0 after a signal, 1 when the supervisor gave up restarting a dead engine.
    """
    from tandem.cloud.engines.vllm_engines import VllmEngines
    from tandem.cloud.server import create_cloud

    log = logging.getLogger("tandem.cloud")
    engines = VllmEngines(cfg)
    engines.start()
    try:
        cloud = await create_cloud(cfg, engines)
        log.info("tandem-cloud serving on %s:%d", cfg.host, cloud.port)
        if ready_file:
            ready_file.write_text(str(cloud.port))
        stop = install_stop_signals(asyncio.get_running_loop())
        waits = [asyncio.create_task(stop.wait())]
        if cloud.supervisor is not None:
            waits.append(asyncio.create_task(cloud.supervisor.gave_up.wait()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        gave_up = cloud.supervisor is not None and cloud.supervisor.gave_up.is_set()
        await cloud.stop(grace_s, "engines cannot be restarted" if gave_up else stop.name)
    finally:
        await asyncio.to_thread(engines.shutdown)
    log.info("tandem-cloud stopped")
    return 1 if gave_up else 0


def start_checks(cfg: CloudConfig) -> list[Check]:
    """The cloud's own start-up checks, after ``check_start``'s files and binds: the engines' bounds
    against the manifests, the fidelity tables parse, the shared block store answers."""

    def fidelity_tables() -> None:
        from tandem.cloud.links.fidelity import FidelityTable

        for path in cfg.fidelity_tables:
            try:
                FidelityTable.load(path)
            except ValueError as e:
                raise InvalidRequest(f"fidelity_tables: {path}: {e}") from None

    def store() -> None:
        from tandem.cloud.store.redis_store import check_store_reachable

        check_store_reachable(cfg.store_url)

    return [lambda: check_engines_fit(cfg), fidelity_tables, *([store] if cfg.store_url else [])]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, then check everything it names before the engines start (a minute):
    ``check_start`` opens every file, checks the split directories against their manifests, binds
    every port and runs ``start_checks``; each problem is a ``UserError``. Then serve: a failure to
    start after that (the port taken since, the engines refusing) is one line and exit code 1."""
    run = parse_command_line(CloudConfig, PROG, argv, description=__doc__ or "")
    cfg = run.settings
    check_start(cfg, split_parts=SPLIT_PARTS, ready_file=run.ready_file, extra=start_checks(cfg))
    if run.ready_file is not None:  # one left by an earlier run: present again once this process serves
        run.ready_file.unlink(missing_ok=True)
    setup_observability(cfg, PROG)
    try:
        return asyncio.run(serve(cfg, run.ready_file, cfg.drain_grace_s))
    except (TandemError, OSError, RuntimeError) as e:
        print(f"{PROG}: error: cannot start: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        return 1


def app(argv: Sequence[str] | None = None) -> int:
    """The ``tandem-cloud`` console script: exit code 0, 1 (could not start, or the engines gave up) or 2
    (user error)."""
    return run_cli(PROG, lambda: main(argv))


if __name__ == "__main__":
    sys.exit(app())
