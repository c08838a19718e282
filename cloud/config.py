"""The cloud process's one typed config, built by the entry point and passed down."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from tandem.common.wire import Codec, WireDtype


class EngineConfig(BaseModel):
    """Settings shared by the tail-prefill and decode vLLM engines."""

    model_config = ConfigDict(frozen=True)

    block_size_tokens: int = 32  # vLLM's CPU backend wants multiples of 32
    max_model_len_tokens: int = 2048
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 4096
    kv_cache_bytes: int = 1 << 30  # per engine
    enforce_eager: bool = True
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "float32"


class CloudConfig(BaseModel):
    """``tandem-cloud`` configuration."""

    model_config = ConfigDict(frozen=True)

    split_dir: Path  # models/<model>/split-k{k}, holding manifest.json
    host: str = "0.0.0.0"
    port: int = 50051  # 0 = any free port
    cloud_id: str = "tandem-cloud"
    store_dir: Path = Path("/tmp/tandem-kv")
    store_bytes: int = 4 << 30
    engine: EngineConfig = Field(default_factory=EngineConfig)
    chunk_tokens: int = 64
    wire_dtype: WireDtype = WireDtype.FP32  # fp32 keeps greedy output equal to the unsplit model
    codec: Codec = Codec.NONE
    codec_level: int = 3
    max_prompt_tokens: int = 1536
    max_new_tokens: int = 512
    max_chunk_resends: int = 3
    max_repair_rounds: int = 3  # commits answered with a repair request before DATA_LOSS
    upload_timeout_s: float = 30.0  # header to verified upload (the session is not locked meanwhile)
    max_uploads: int = 64  # split uploads in flight, all edges
    max_upload_bytes: int = 1 << 30  # bytes those uploads may buffer (reserved at the header), all edges
    max_uploads_per_peer: int = 16  # the same, per edge
    max_upload_bytes_per_peer: int = 256 << 20
    drain_timeout_s: float = 2.0  # after refusing a turn, wait this long for the edge to stop sending
    max_abs_activation: float = 1e5  # |h_k| and |KV| bound; real SmolLM2 values stay under 1e3
    max_sessions: int = 256
    session_bytes: int = 1 << 30  # activations kept for multi-turn sessions, all sessions together
