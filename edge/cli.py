"""``tandem-edge``: the edge daemon (ONNX head, sessions, link to the cloud).

Every setting of ``EdgeConfig`` is a flag (``--cloud HOST:PORT``, ``--session-bytes 1GiB``), an
environment variable (``TANDEM_EDGE_...``) and a key of the TOML file given by ``--config``;
flags > environment > config file > defaults. ``--version`` prints the version; ``--ready-file PATH``
writes the bound port once serving. A user error is one line on stderr and exit code 2.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from tandem.common.protocol.errors import TandemError
from tandem.common.runtime.cli import parse_command_line, run_cli, setup_observability
from tandem.common.runtime.startup import check_start
from tandem.edge.config import EdgeConfig

PROG = "tandem-edge"
SPLIT_PARTS = ("head_onnx", "tokenizer_path")  # what the edge loads of each split directory


async def serve(cfg: EdgeConfig, ready_file: Path | None, grace_s: float | None = None) -> None:
    """Serve until SIGINT/SIGTERM, then drain: turns in flight get ``grace_s`` (default ``cfg.drain_grace_s``)."""
    from tandem.common.runtime.grpc_setup import install_stop_signals
    from tandem.edge.server import create_edge

    daemon = await create_edge(cfg)
    svc = daemon.node
    logging.getLogger("tandem.edge").info(
        "tandem-edge serving on %s:%d; cloud %s; modes %s; split layers %s%s",
        cfg.host,
        daemon.port,
        cfg.cloud_target,
        sorted({r.mode.value for r in svc.routes()}),
        list(svc.split_layers),
        f"; degraded: {svc.degraded()}" if svc.degraded() else "",
    )
    if daemon.http_port is not None:
        logging.getLogger("tandem.edge").info(
            "OpenAI-compatible API on %s://%s:%d/v1",
            "https" if cfg.tls_cert_file else "http",
            cfg.http_host,
            daemon.http_port,
        )
    if ready_file:
        ready_file.write_text(str(daemon.port))
    stop = install_stop_signals()
    await stop.wait()
    await daemon.stop(cfg.drain_grace_s if grace_s is None else grace_s, stop.name)


def default_local_models(cfg: EdgeConfig) -> None:
    """The whole models local mode would look for beside the split directory (``local_model``
    unset), each one there a regular file or a folder of regular files (``check_model``): its
    check is read before it loads.

    Raises:
        InvalidRequest: one is a FIFO, a device, or a folder holding one.
    """
    from tandem.common.protocol.manifest import FULL_DECODER, FULL_ONNX
    from tandem.common.runtime.startup import check_model

    if not cfg.local or cfg.local_model is not None:
        return
    for path in (cfg.split_dir.parent / FULL_DECODER, cfg.split_dir.parent / FULL_ONNX):
        if path.exists() or path.is_symlink():
            check_model(path, "local model")


def builder_heads(cfg: EdgeConfig) -> None:
    """The builder heads the split directories' manifests name (``builder_head`` on), each one there
    a folder of regular files (``check_model``): its check is read before it loads.

    Raises:
        InvalidRequest: one is a FIFO, a device, or a folder holding one.
    """
    from tandem.common.protocol.manifest import SplitManifest
    from tandem.common.runtime.startup import check_model
    from tandem.edge.compute.builder_head import builder_head_path

    if not cfg.builder_head:
        return
    for d in (cfg.split_dir, *cfg.extra_split_dirs):
        path = builder_head_path(d, SplitManifest.load(d))
        if path is not None and (path.exists() or path.is_symlink()):
            check_model(path, f"split dir {d}: builder head")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, then check everything it names before any model loads
    (``check_start``: every file opened, the split directories against their manifests, every port
    bound); ``UserError`` for any. Then serve: a failure to start after that (a port taken since,
    the cloud refusing the heads) is one line and exit code 1."""
    run = parse_command_line(EdgeConfig, PROG, argv, description=__doc__ or "")
    cfg = run.settings
    check_start(
        cfg,
        split_parts=SPLIT_PARTS,
        ready_file=run.ready_file,
        extra=[lambda: default_local_models(cfg), lambda: builder_heads(cfg)],
    )
    if run.ready_file is not None:  # one left by an earlier run: present again once this process serves
        run.ready_file.unlink(missing_ok=True)
    setup_observability(cfg, PROG)
    try:
        asyncio.run(serve(cfg, run.ready_file, cfg.drain_grace_s))
    except (TandemError, OSError, RuntimeError) as e:  # start-up: cloud unreachable or refused, port in use
        print(f"{PROG}: error: cannot start: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        return 1
    return 0


def app(argv: Sequence[str] | None = None) -> int:
    """The ``tandem-edge`` console script: exit code 0, 1 (could not start) or 2 (user error)."""
    return run_cli(PROG, lambda: main(argv))


if __name__ == "__main__":
    sys.exit(app())
