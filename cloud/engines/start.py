"""Starting one vLLM ``AsyncLLM`` of a cloud node (``start_engine``): its engine arguments resolved for
the installed vLLM build (``EngineConfig.for_engine``), tandem's KV connector configuration, and its
placement on GPUs (``CUDA_VISIBLE_DEVICES`` around the start, GPU starts one at a time)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.cloud.config import CloudConfig
from tandem.cloud.engines import vllm_metrics, vllm_plugin
from tandem.common.protocol.errors import EngineError

if TYPE_CHECKING:
    from tandem.cloud.engines.vllm_engines import EngineRole


def _kv_transfer(cfg: CloudConfig, kv_role: str, layer_offset: int) -> dict[str, Any]:
    return {
        "kv_connector": "TandemConnector",
        "kv_connector_module_path": "tandem.cloud.engines.connector",
        "kv_role": kv_role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "store_url": cfg.store_url,  # its password reaches the workers in their environment only
            "store_dir": str(cfg.store_dir),
            "store_bytes": cfg.store_bytes,
            "layer_offset": layer_offset,
            "save_queue_bytes": cfg.engine.kv_save_queue_bytes,
            # the connector's lifeline exits the engine processes when this process dies
            "gateway_pid": os.getpid(),
        },
    }


_PLACEMENT_LOCK = threading.Lock()  # one GPU engine start at a time (``placed_on``)


def visible_devices(first: int, count: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for an engine on devices ``first .. first + count - 1`` of those this
    process sees (indices into its own ``CUDA_VISIBLE_DEVICES`` when that is set).

    Raises:
        EngineError: the devices are not among those visible.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")] if visible else None
    want = range(first, first + count)
    if ids is not None and want.stop > len(ids):
        raise EngineError(f"GPUs {first}..{want.stop - 1} asked for, but CUDA_VISIBLE_DEVICES={visible}")
    return ",".join(ids[i] if ids is not None else str(i) for i in want)


@contextlib.contextmanager
def placed_on(gpu: int | None, tensor_parallel_size: int) -> Iterator[None]:
    """Start an engine on GPU ``gpu`` (and the ``tensor_parallel_size - 1`` after it): its processes
    inherit ``CUDA_VISIBLE_DEVICES`` when vLLM spawns them, so the variable is set around the start.
    GPU starts run one at a time (a lock): the variable is process-wide, and vLLM sizes an engine's
    KV cache from the free memory it profiles at start, which another engine starting on the same
    device would change under it. The CPU build (``gpu`` None) starts its engines together."""
    if gpu is None:
        yield
        return
    with _PLACEMENT_LOCK:
        before = os.environ.get("CUDA_VISIBLE_DEVICES")
        if gpu != 0 or tensor_parallel_size != 1 or before is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(gpu, tensor_parallel_size)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = before


def start_engine(
    model: Path,
    cfg: CloudConfig,
    role: EngineRole,
    kv_role: str | None,
    layer_offset: int,
    hf_overrides: dict[str, Any] | None = None,
):
    """Start one ``AsyncLLM`` for ``role`` (blocking) with the engine settings resolved for the
    installed vLLM build (``EngineConfig.for_engine``: fp32 and eager on the CPU build, the
    checkpoint's dtype with CUDA graphs and its memory share on a GPU). ``kv_role`` None starts it
    without tandem's KV connector (plain vLLM: a direct-only checkpoint, whose layers tandem does not
    name and whose KV never moves). ``hf_overrides``: config values vLLM reads in place of the
    checkpoint's (the manifest's ``EngineAgreement.hf_overrides``: e.g. a Llama's ``sliding_window``,
    which HF ignores, set to None)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    e = cfg.engine
    placed = e.for_engine(role.kind)
    # read by tandem's vLLM plugin in the engine processes this start spawns (cloud/engines/vllm_plugin.py)
    os.environ[vllm_plugin.ENV] = repr(e.worker_busy_poll_s)
    os.environ[vllm_plugin.FAST_EXIT_ENV] = "1"  # each engine stops in about 2 s, not 9 (install_fast_exit)
    if placed.gpu is not None:
        # vLLM forks its EngineCore unless torch reports CUDA initialized, but torch.cuda.is_available()
        # or device_count() in this process already leaves a forked child unable to use CUDA ("Cannot
        # re-initialize CUDA in forked subprocess") while not counting as initialized: spawn always
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    args = AsyncEngineArgs(
        model=str(model),
        dtype=placed.dtype,
        max_model_len=e.max_model_len_tokens,
        block_size=e.block_size_tokens,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        kv_cache_memory_bytes=placed.kv_cache_bytes,
        gpu_memory_utilization=placed.gpu_memory_utilization,
        tensor_parallel_size=placed.tensor_parallel_size,
        enforce_eager=placed.enforce_eager,
        enable_prefix_caching=False,
        enable_prompt_embeds=role.kind == "tail",
        # stats on: vLLM's Prometheus metrics (vllm:*) in this process's registry, served by the
        # cloud's metrics endpoint; its logging stat logger logs only when do_log_stats() is called
        # (never here), so no periodic log lines
        disable_log_stats=False,
        kv_transfer_config=KVTransferConfig(**_kv_transfer(cfg, kv_role, layer_offset)) if kv_role else None,
        hf_overrides=dict(hf_overrides or {}),
    )
    # vLLM's Prometheus logger unregisters the vllm: metrics at every engine start; this one keeps
    # one shared family per name, so both engines are exported (told apart by model_name)
    with placed_on(placed.gpu, placed.tensor_parallel_size):
        return AsyncLLM.from_engine_args(args, stat_loggers=vllm_metrics.vllm_stat_loggers())
