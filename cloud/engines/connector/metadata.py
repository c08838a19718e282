"""What both sides of tandem's KV connector agree on: the connector's settings (read once from
vLLM's config in each process) and the per-step metadata the scheduler side builds and the worker
side executes (vLLM carries it from the EngineCore to the workers inside ``SchedulerOutput``, so it
is plain picklable data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from tandem.common.wire.kvblocks import LayerRange

if TYPE_CHECKING:
    from vllm.config import VllmConfig

DEFAULT_SAVE_QUEUE_BYTES = 256 << 20


@dataclass(frozen=True)
class PartOp:
    """One block's entry of one layer range: ``key`` in the store."""

    part: LayerRange
    key: str


@dataclass
class TandemMetadata(KVConnectorMetadata):
    """One step's work for the worker side; built by the scheduler side.
    ``loads``: (vLLM block id, every part of it to write into the paged cache);
    ``saves``: (vLLM block id, the part to read out and store);
    ``failed_loads``: vLLM block ids to report as load errors (their plan failed)."""

    loads: list[tuple[int, tuple[PartOp, ...]]] = field(default_factory=list)
    saves: list[tuple[int, PartOp]] = field(default_factory=list)
    failed_loads: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's configuration in one engine process: the model's KV geometry from vLLM's
    config and tandem's entries of ``kv_connector_extra_config`` (written by
    ``cloud.engines.start``).

    ``block_size``: tokens per paged KV block (``B``); ``layer_offset``: the global index of the
    engine's layer 0 (``k`` on the tail engine, 0 on the decode engine); ``num_kv_heads``
    (``Hkv``) and ``head_dim`` (``D``) of the whole model; the store (``store_url`` for Redis,
    else the disk store in ``store_dir``, bounded by ``store_bytes``); ``save_queue_bytes``: the
    copies a worker's writer may hold before a step waits; ``gateway_pid``: the process whose
    death ends this one (``lifeline``)."""

    block_size: int
    layer_offset: int
    num_kv_heads: int
    head_dim: int
    store_url: str
    store_dir: str
    store_bytes: int
    save_queue_bytes: int = DEFAULT_SAVE_QUEUE_BYTES
    gateway_pid: int | None = None

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> ConnectorSettings:
        """The settings of the engine ``vllm_config`` describes.

        Raises:
            ValueError: ``kv_connector_extra_config`` lacks ``store_dir`` or ``store_bytes``, or
                holds a value of the wrong type; the engine does not start.
        """
        transfer = vllm_config.kv_transfer_config
        extra: dict[str, Any] = (transfer.kv_connector_extra_config if transfer is not None else None) or {}
        model = vllm_config.model_config
        try:
            pid = extra.get("gateway_pid")
            return cls(
                block_size=int(vllm_config.cache_config.block_size),
                layer_offset=int(extra.get("layer_offset", 0)),
                num_kv_heads=int(model.get_total_num_kv_heads()),
                head_dim=int(model.get_head_size()),
                store_url=str(extra.get("store_url") or ""),
                store_dir=str(extra["store_dir"]),
                store_bytes=int(extra["store_bytes"]),
                save_queue_bytes=int(extra.get("save_queue_bytes", DEFAULT_SAVE_QUEUE_BYTES)),
                gateway_pid=int(pid) if pid else None,
            )
        except KeyError as e:
            raise ValueError(f"tandem's KV connector needs {e.args[0]!r} in kv_connector_extra_config") from e
        except (TypeError, ValueError) as e:
            raise ValueError(f"tandem's KV connector: bad kv_connector_extra_config ({e})") from e
