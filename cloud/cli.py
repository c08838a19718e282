"""``tandem-cloud``: the cloud gateway with its tail-prefill and decode vLLM engines."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated

import typer
from tandem.cloud.config import CloudConfig, EngineConfig
from tandem.common.grpcsetup import install_stop_signals

app = typer.Typer(add_completion=False, help="tandem cloud: gRPC gateway + vLLM engines.")


async def serve(cfg: CloudConfig, ready_file: Path | None = None, grace_s: float = 5.0) -> int:
    """Start engines and server; run until SIGINT/SIGTERM or until the engines cannot be restarted.

    Stopping: health NOT_SERVING, ``server.stop(grace_s)`` (calls in flight may finish), then
    the engines shut down (SIGTERM to their processes, SIGKILL only if they hang). Returns the
    exit code: 0 after a signal, 1 when the supervisor gave up restarting a dead engine.
    """
    from tandem.cloud.engines import VllmEngines
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
        log.info("tandem-cloud stopping (%s)", "engines cannot be restarted" if gave_up else "signal")
        await cloud.stop(grace_s)
    finally:
        await asyncio.to_thread(engines.shutdown)
    log.info("tandem-cloud stopped")
    return 1 if gave_up else 0


@app.command()
def main(
    split_dir: Annotated[Path, typer.Option(help="split directory with manifest.json")] = Path(
        "models/smollm2-135m/split-k4"
    ),
    host: str = "0.0.0.0",
    port: int = 50051,
    store_dir: Path = Path("/tmp/tandem-kv"),
    store_bytes: int = 4 << 30,
    max_num_seqs: int = 8,
    kv_cache_bytes: int = 1 << 30,
    ready_file: Annotated[Path | None, typer.Option(help="write the bound port here when serving")] = None,
) -> None:
    """Serve the Cloud gRPC service."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = CloudConfig(
        split_dir=split_dir,
        host=host,
        port=port,
        store_dir=store_dir,
        store_bytes=store_bytes,
        engine=EngineConfig(max_num_seqs=max_num_seqs, kv_cache_bytes=kv_cache_bytes),
    )
    code = asyncio.run(serve(cfg, ready_file))
    if code:
        raise typer.Exit(code)


if __name__ == "__main__":
    app()
