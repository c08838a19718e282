"""The edge daemon's one typed config, built by the entry point and passed down."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict


class EdgeConfig(BaseModel):
    model_config = ConfigDict(frozen=True)

    split_dir: Path  # models/<model>/split-k{k}: head.onnx + manifest.json; tokenizer from the full checkpoint
    cloud_target: str = "localhost:50051"  # host:port of tandem-cloud
    host: str = "0.0.0.0"
    port: int = 50061  # 0 = any free port
    edge_id: str = "tandem-edge"
    max_batch: int = 8  # rows per ONNX head call
    intra_op_threads: int = 0  # ONNX Runtime threads; 0 = its default
    max_sessions: int = 256
    session_bytes: int = 512 << 20  # head KV + activations kept for sessions, all together; LRU beyond
    keepalive_time_s: float = 5.0  # HTTP/2 PING to the cloud after this long without one (gRPC keepalive)
    keepalive_timeout_s: float = 5.0  # no PING ack within this: the link is dead, calls fail UNAVAILABLE
    turn_timeout_s: float = 300.0  # deadline of one call to the cloud when the client set none
    rtt_ms: float = 0.0  # measured link, reported in Negotiate
    goodput_mbps: float = 0.0
    ttft_slo_ms: float = 1000.0
    itl_p99_slo_ms: float = 200.0
