"""``tandem-edge``: the edge daemon (ONNX head, sessions, link to the cloud)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated

import typer
from tandem.edge.config import EdgeConfig

app = typer.Typer(add_completion=False, help="tandem edge daemon.")


async def serve(cfg: EdgeConfig, ready_file: Path | None) -> None:
    from tandem.common.grpcsetup import install_stop_signals
    from tandem.edge.server import create_edge

    daemon = await create_edge(cfg)
    p = daemon.service.params
    logging.getLogger("tandem.edge").info(
        "tandem-edge serving on %s:%d; cloud %s; split layer %d, block %d tokens, chunk %d tokens",
        cfg.host,
        daemon.port,
        cfg.cloud_target,
        p.split_layer,
        p.kv_block_size_tokens,
        p.chunk_tokens,
    )
    if ready_file:
        ready_file.write_text(str(daemon.port))
    await install_stop_signals().wait()
    await daemon.stop()


@app.command()
def main(
    split_dir: Annotated[Path, typer.Option(help="split directory with head.onnx and manifest.json")] = Path(
        "models/smollm2-135m/split-k4"
    ),
    cloud: Annotated[str, typer.Option(help="tandem-cloud address host:port")] = "localhost:50051",
    host: str = "0.0.0.0",
    port: int = 50061,
    max_batch: int = 8,
    ready_file: Annotated[Path | None, typer.Option(help="write the bound port here when serving")] = None,
) -> None:
    """Serve the Edge gRPC service for the client SDK."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(
        serve(
            EdgeConfig(split_dir=split_dir, cloud_target=cloud, host=host, port=port, max_batch=max_batch), ready_file
        )
    )


if __name__ == "__main__":
    app()
