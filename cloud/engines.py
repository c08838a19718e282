"""The two vLLM engines of a cloud node, as ``AsyncLLM`` instances so concurrent
requests batch (continuous batching inside each engine):

* tail-prefill engine: the *tail checkpoint* (layers ``[k, L)`` renumbered), fed
  ``prompt_embeds = h_k``; its ``TandemConnector`` (``kv_both``) loads tail KV of
  earlier turns and saves the tail KV of every full prompt block;
* decode engine: the *full checkpoint*, fed prompt token ids; its connector
  (``kv_consumer``) loads all layers of the block-aligned prefix.

Both run with prefix caching off: the block store is the one source of reused
KV, so a plain request (no tandem params) on the decode engine is plain vLLM.
Who calls: the gateway, once per request per engine. Engines must be started
inside a ``if __name__ == "__main__"`` program (vLLM spawns processes).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from cloud.config import CloudConfig
from common.errors import EngineError
from common.manifest import SplitManifest
from common.params import Sampling


@dataclass(frozen=True)
class TailResult:
    """What the tail prefill did: the first output token (sampled by the tail engine from the
    last prompt position's logits, which are the full model's), ``finish_reason`` "stop" when
    that token ends the output, ``saved_blocks`` tail blocks written or already present,
    ``external_tokens`` tail KV tokens loaded from earlier turns, ``elapsed_ms``."""

    first_token: int
    finish_reason: str | None
    saved_blocks: int
    external_tokens: int
    elapsed_ms: float


@dataclass(frozen=True)
class DecodeStep:
    """New output tokens; ``finish_reason`` and ``external_tokens`` set on the last step."""

    token_ids: list[int]
    finish_reason: str | None = None
    external_tokens: int = 0
    prompt_tokens: int = 0


class EngineBackend(Protocol):
    """Seam between the gateway and the engines.

    ``tail_prefill`` returns the first output token once the tail KV of the prompt's full
    blocks is in the block store. ``decode`` yields output tokens as they are sampled; the
    caller owns nothing the engine holds.
    """

    async def tail_prefill(
        self, request_id: str, hidden: np.ndarray, kv_params: dict[str, Any], sampling: Sampling
    ) -> TailResult: ...

    def decode(
        self, request_id: str, token_ids: list[int], kv_params: dict[str, Any] | None, sampling: Sampling
    ) -> AsyncIterator[DecodeStep]: ...


def _kv_transfer(cfg: CloudConfig, role: str, layer_offset: int) -> dict[str, Any]:
    return {
        "kv_connector": "TandemConnector",
        "kv_connector_module_path": "cloud.connector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "store_dir": str(cfg.store_dir),
            "store_bytes": cfg.store_bytes,
            "layer_offset": layer_offset,
        },
    }


def _engine(model: Path, cfg: CloudConfig, role: str, layer_offset: int, prompt_embeds: bool):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    e = cfg.engine
    args = AsyncEngineArgs(
        model=str(model),
        dtype=e.dtype,
        max_model_len=e.max_model_len_tokens,
        block_size=e.block_size_tokens,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        kv_cache_memory_bytes=e.kv_cache_bytes,
        enforce_eager=e.enforce_eager,
        enable_prefix_caching=False,
        enable_prompt_embeds=prompt_embeds,
        disable_log_stats=True,
        kv_transfer_config=KVTransferConfig(**_kv_transfer(cfg, role, layer_offset)),
    )
    return AsyncLLM.from_engine_args(args)


def to_vllm_sampling(s: Sampling, max_tokens: int | None = None, kv_params: dict | None = None):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": kv_params} if kv_params else None,
    )


class VllmEngines:
    """Real engines (``EngineBackend``) on the manifest's tail and full checkpoints."""

    def __init__(self, cfg: CloudConfig) -> None:
        self.cfg = cfg
        self.manifest = SplitManifest.load(cfg.split_dir)
        self.tail_engine: Any = None
        self.decode_engine: Any = None

    def start(self) -> None:
        """Start both engines (about 20-30 s each on CPU)."""
        m, d = self.manifest, self.cfg.split_dir
        self.tail_engine = _engine(m.resolve(d, m.tail_checkpoint), self.cfg, "kv_both", m.split_layer, True)
        self.decode_engine = _engine(m.resolve(d, m.full_checkpoint), self.cfg, "kv_consumer", 0, False)

    def shutdown(self) -> None:
        for e in (self.tail_engine, self.decode_engine):
            if e is not None:
                e.shutdown()
        self.tail_engine = self.decode_engine = None

    async def tail_prefill(
        self, request_id: str, hidden: np.ndarray, kv_params: dict[str, Any], sampling: Sampling
    ) -> TailResult:
        import torch

        if self.tail_engine is None:
            raise EngineError("tail engine is not running")
        t0 = time.perf_counter()
        sp = to_vllm_sampling(sampling, 1, kv_params)
        final = None
        async for out in self.tail_engine.generate(
            {"prompt_embeds": torch.from_numpy(hidden)}, sp, f"tail-{request_id}"
        ):
            final = out
        if final is None or not final.outputs[0].token_ids:
            raise EngineError(f"tail engine returned no token for request {request_id}")
        c = final.outputs[0]
        params = (final.kv_transfer_params or {}).get("tandem", {})
        return TailResult(
            c.token_ids[0],
            "stop" if c.finish_reason == "stop" else None,
            int(params.get("saved_blocks", 0)),
            int(params.get("external_tokens", 0)),
            (time.perf_counter() - t0) * 1e3,
        )

    async def decode(
        self, request_id: str, token_ids: list[int], kv_params: dict[str, Any] | None, sampling: Sampling
    ) -> AsyncIterator[DecodeStep]:
        if self.decode_engine is None:
            raise EngineError("decode engine is not running")
        sp = to_vllm_sampling(sampling, kv_params=kv_params)
        async for out in self.decode_engine.generate({"prompt_token_ids": token_ids}, sp, f"dec-{request_id}"):
            c = out.outputs[0]
            if out.finished:
                params = (out.kv_transfer_params or {}).get("tandem", {})
                yield DecodeStep(
                    list(c.token_ids),
                    c.finish_reason or "stop",
                    int(params.get("external_tokens", 0)),
                    len(out.prompt_token_ids or []),
                )
            else:
                yield DecodeStep(list(c.token_ids))
