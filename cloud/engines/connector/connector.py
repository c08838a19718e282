"""``TandemConnector``: vLLM's KV-connector API (``KVConnectorBase_V1``) over tandem's block store, a
thin class that builds one side and delegates every call of the API to it.

vLLM instantiates the connector once in each engine process with its role: the EngineCore's
scheduler gets a ``KVConnectorRole.SCHEDULER`` instance, each model-runner worker a
``KVConnectorRole.WORKER`` one. The scheduler-side instance holds only a
``TandemConnectorScheduler`` (per-request plans, store presence lookups); the worker-side one only
a ``TandemConnectorWorker`` (the paged layout, the step's copies, the writer thread and its
queue). Both open the block store and start the process's ``lifeline``. A call of the other
side's API raises ``RuntimeError`` naming the role (vLLM never makes one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from tandem.cloud.engines import lifeline
from tandem.cloud.engines.connector.metadata import ConnectorSettings, TandemMetadata
from tandem.cloud.engines.connector.scheduler import TandemConnectorScheduler
from tandem.cloud.engines.connector.worker import TandemConnectorWorker
from tandem.cloud.store.blocks import open_store

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class TandemConnector(KVConnectorBase_V1):
    """KV connector between vLLM's paged cache and tandem's block store (see the package doc)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        """Raises:
        ValueError: tandem's entries of ``kv_connector_extra_config`` are missing or malformed.
        InvalidRequest, EngineError: the block store cannot be opened (``open_store``)."""
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.from_vllm(vllm_config)
        store = open_store(settings.store_url, settings.store_dir, settings.store_bytes)
        self.connector_scheduler: TandemConnectorScheduler | None = None
        self.connector_worker: TandemConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = TandemConnectorScheduler(settings, store)
        else:
            self.connector_worker = TandemConnectorWorker(settings, store, vllm_config)
        lifeline.watch_parent(settings.gateway_pid)

    @property
    def scheduler(self) -> TandemConnectorScheduler:
        """The scheduler side.

        Raises:
            RuntimeError: this is the worker-side instance."""
        if self.connector_scheduler is None:
            raise RuntimeError(f"a scheduler-side call on tandem's {self.role.name} connector")
        return self.connector_scheduler

    @property
    def worker(self) -> TandemConnectorWorker:
        """The worker side.

        Raises:
            RuntimeError: this is the scheduler-side instance."""
        if self.connector_worker is None:
            raise RuntimeError(f"a worker-side call on tandem's {self.role.name} connector")
        return self.connector_worker

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, TandemMetadata):
            self.worker.start_load_kv(meta, forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, TandemMetadata):
            self.worker.save_kv_layer(meta, layer_name, kv_layer)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        """vLLM's engine shutdown: a worker side writes its queued saves, then its writer ends."""
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        super().shutdown()
