"""The GPU tier's stacks: a cloud on real CUDA engines and an edge at its defaults, on loopback."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any


@contextlib.asynccontextmanager
async def cloud_and_edge(cfg: Any, split_dir: Path) -> AsyncIterator[dict[str, Any]]:
    """The cloud of ``cfg`` (a ``CloudConfig``; its vLLM engines started here) and an edge on
    ``split_dir`` with the edge's defaults, joined on loopback; yields ``engines`` and an SDK
    ``client`` of the edge, and stops all three at the end."""
    from tandem import AsyncClient
    from tandem.cloud.engines.vllm_engines import VllmEngines
    from tandem.cloud.server import create_cloud
    from tandem.edge.config import EdgeConfig
    from tandem.edge.server import create_edge

    engines = VllmEngines(cfg)
    engines.start()
    cloud = await create_cloud(cfg, engines)
    edge = await create_edge(EdgeConfig(split_dir=split_dir, cloud_target=f"127.0.0.1:{cloud.port}", port=0))
    client = AsyncClient(f"127.0.0.1:{edge.port}")
    try:
        yield {"engines": engines, "client": client}
    finally:
        await client.close()
        await edge.stop(1)
        await cloud.stop(1)
        engines.shutdown()
