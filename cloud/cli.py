"""``tandem-cloud``: the cloud gateway with its tail-prefill and decode vLLM engines."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Annotated

import typer

from cloud.config import CloudConfig, EngineConfig

app = typer.Typer(add_completion=False, help="tandem cloud: gRPC gateway + vLLM engines.")


async def serve(cfg: CloudConfig, ready_file: Path | None = None) -> None:
    """Start engines and server; run until SIGINT/SIGTERM; stop with a grace period."""
    from cloud.engines import VllmEngines
    from cloud.server import create_server

    engines = VllmEngines(cfg)
    engines.start()
    server, port, _ = await create_server(cfg, engines)
    logging.getLogger("tandem.cloud").info("tandem-cloud serving on %s:%d", cfg.host, port)
    if ready_file:
        ready_file.write_text(str(port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=5)
    engines.shutdown()


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
    asyncio.run(serve(cfg, ready_file))


if __name__ == "__main__":
    app()
