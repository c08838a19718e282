"""Every setting is bounded by what its consumer accepts: a value that cannot work is refused when
the settings are built, not when the first request (or the engine's start) trips on it.

A table of bad values, one or more per numeric setting of ``CloudConfig``, ``EngineConfig`` and
``EdgeConfig`` (a test fails when a numeric setting has none), good values at the edges of each
bound, and every string setting refused when it is not text."""

from __future__ import annotations

import math
import os
import typing

import pytest
from pydantic import BaseModel, ByteSize, ValidationError

from tandem.cloud import config as cloud_config
from tandem.cloud.config import CloudConfig, EngineConfig
from tandem.edge.config import EdgeConfig

INF, NAN = math.inf, math.nan
OVER_INT32 = 2**31  # a count the wire's int32 / uint32 fields and gRPC's int arguments cannot carry


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("TANDEM_CLOUD_", "TANDEM_EDGE_")):
            monkeypatch.delenv(k)


# (model, field, bad value, words of the error)
BAD: list[tuple[type[BaseModel], str, typing.Any, str]] = [
    # found by an attack run: these four passed validation
    (CloudConfig, "codec_level", 99, "less than or equal to 22"),
    (CloudConfig, "upload_timeout_s", INF, "finite"),
    (CloudConfig, "edge_rate_limit", "0/second", "rate of 0"),
    (EngineConfig, "block_size_tokens", 7, "multiple of"),
    # the engines (vLLM)
    (EngineConfig, "block_size_tokens", 24, "multiple of"),
    (EngineConfig, "block_size_tokens", 0, "greater than or equal to 1"),
    (EngineConfig, "max_model_len_tokens", 1, "greater than or equal to 2"),
    (EngineConfig, "max_model_len_tokens", OVER_INT32, "less than or equal"),
    (EngineConfig, "max_num_seqs", 0, "greater than or equal to 1"),
    (EngineConfig, "max_num_batched_tokens", 4, "below max_num_seqs"),  # max_num_seqs is 8
    (EngineConfig, "kv_cache_bytes", 0, "greater than 0"),
    (EngineConfig, "kv_cache_bytes", 2**63, "less than or equal"),
    (EngineConfig, "worker_busy_poll_s", -1, "greater than or equal to 0"),
    (EngineConfig, "worker_busy_poll_s", NAN, "finite"),
    (EngineConfig, "kv_save_queue_bytes", 2**63, "less than or equal"),
    (EngineConfig, "tail_gpu_memory_utilization", 0, "greater than 0"),
    (EngineConfig, "tail_gpu_memory_utilization", 1.5, "less than or equal to 1"),
    (EngineConfig, "decode_gpu_memory_utilization", NAN, "finite"),
    (EngineConfig, "tail_gpu", -1, "greater than or equal to 0"),
    (EngineConfig, "decode_gpu", 1024, "less than or equal to 1023"),
    (EngineConfig, "tensor_parallel_size", 0, "greater than or equal to 1"),
    # the cloud
    (CloudConfig, "drain_grace_s", INF, "finite"),
    (CloudConfig, "drain_grace_s", -1, "greater than or equal to 0"),
    (CloudConfig, "metrics_port", 65536, "less than or equal to 65535"),
    (CloudConfig, "port", -1, "greater than or equal to 0"),
    (CloudConfig, "health_port", 65536, "less than or equal to 65535"),
    (CloudConfig, "edge_max_links", 0, "greater than or equal to 1"),
    (CloudConfig, "edge_max_sessions", 0, "greater than or equal to 1"),
    (CloudConfig, "edge_max_stored_bytes", 0, "greater than 0"),
    (CloudConfig, "edge_rate_limit", "50/second;0/minute", "rate of 0"),
    (CloudConfig, "edge_rate_limit", "5/fortnight", "notation"),
    (CloudConfig, "store_bytes", 0, "greater than 0"),
    (CloudConfig, "chunk_tokens", 0, "greater than or equal to 1"),
    (CloudConfig, "chunk_tokens", 2**32, "less than or equal"),
    (CloudConfig, "max_chunk_tokens", 0, "greater than or equal to 1"),
    (CloudConfig, "codec_level", 23, "less than or equal to 22"),
    (CloudConfig, "codec_level", -(1 << 17) - 1, "greater than or equal"),
    (CloudConfig, "max_prompt_tokens", 0, "greater than or equal to 1"),
    (CloudConfig, "max_prompt_tokens", 2**32, "less than or equal"),
    (CloudConfig, "max_new_tokens", 0, "greater than or equal to 1"),
    (CloudConfig, "max_new_tokens", OVER_INT32, "less than or equal"),
    (CloudConfig, "max_chunk_resends", -1, "greater than or equal to 0"),
    (CloudConfig, "max_repair_rounds", -1, "greater than or equal to 0"),
    (CloudConfig, "upload_timeout_s", 0, "greater than 0"),
    (CloudConfig, "upload_timeout_s", NAN, "finite"),
    (CloudConfig, "max_uploads", 0, "greater than or equal to 1"),
    (CloudConfig, "max_upload_bytes", 0, "greater than 0"),
    (CloudConfig, "max_uploads_per_peer", 0, "greater than or equal to 1"),
    (CloudConfig, "max_upload_bytes_per_peer", 0, "greater than 0"),
    (CloudConfig, "tail_save_wait_s", 0, "greater than 0"),
    (CloudConfig, "tail_save_wait_s", INF, "finite"),
    (CloudConfig, "drain_timeout_s", INF, "finite"),
    (CloudConfig, "max_abs_activation", INF, "finite"),
    (CloudConfig, "max_abs_activation", 0, "greater than 0"),
    (CloudConfig, "max_links", 0, "greater than or equal to 1"),
    (CloudConfig, "link_idle_s", 0, "greater than 0"),
    (CloudConfig, "link_idle_s", INF, "finite"),
    (CloudConfig, "max_queue_per_link", -1, "greater than or equal to 0"),
    (CloudConfig, "max_queue_wait_s", INF, "finite"),
    (CloudConfig, "max_queue_wait_s", -1, "greater than or equal to 0"),
    (CloudConfig, "slo_interval_s", 0, "greater than 0"),
    (CloudConfig, "slo_window_s", INF, "finite"),
    (CloudConfig, "max_sessions", 0, "greater than or equal to 1"),
    (CloudConfig, "session_bytes", 0, "greater than 0"),
    (CloudConfig, "session_idle_s", 0, "greater than 0"),
    (CloudConfig, "session_idle_s", INF, "finite"),
    # the edge
    (EdgeConfig, "drain_grace_s", NAN, "finite"),
    (EdgeConfig, "metrics_port", 70000, "less than or equal to 65535"),
    (EdgeConfig, "max_prompt_tokens", 0, "greater than or equal to 1"),
    (EdgeConfig, "connect_timeout_s", INF, "finite"),
    (EdgeConfig, "cloud_resolve_s", 0, "greater than 0"),
    (EdgeConfig, "poll_s", 0, "greater than 0"),
    (EdgeConfig, "probe_bytes", 2 << 20, "less than or equal to 1048576"),
    (EdgeConfig, "probe_bytes", -1, "byte"),
    (EdgeConfig, "hysteresis", 1, "less than 1"),
    (EdgeConfig, "hysteresis", -0.1, "greater than or equal to 0"),
    (EdgeConfig, "hysteresis", NAN, "finite"),
    (EdgeConfig, "explore_every", -1, "greater than or equal to 0"),
    (EdgeConfig, "port", 65536, "less than or equal to 65535"),
    (EdgeConfig, "edge_id", "", "at least 1 character"),
    (EdgeConfig, "edge_id", "é" * 65, "at most 128 bytes"),
    (EdgeConfig, "max_batch", 0, "greater than or equal to 1"),
    (EdgeConfig, "max_batch", 2**32, "less than or equal"),
    (EdgeConfig, "intra_op_threads", -1, "greater than or equal to 0"),
    (EdgeConfig, "pipeline_tokens", -1, "greater than or equal to 0"),
    (EdgeConfig, "max_sessions", 0, "greater than or equal to 1"),
    (EdgeConfig, "session_bytes", 0, "greater than 0"),
    (EdgeConfig, "local_kv_bytes", 0, "greater than 0"),
    (EdgeConfig, "session_idle_s", -1, "greater than 0"),
    (EdgeConfig, "session_idle_s", NAN, "finite"),
    (EdgeConfig, "max_new_tokens", 0, "greater than or equal to 1"),
    (EdgeConfig, "max_new_tokens", OVER_INT32, "less than or equal"),
    (EdgeConfig, "keepalive_time_s", 0, "greater than 0"),
    (EdgeConfig, "keepalive_time_s", 3e6, "less than or equal"),  # beyond gRPC's int32 milliseconds
    (EdgeConfig, "keepalive_timeout_s", INF, "finite"),
    (EdgeConfig, "turn_timeout_s", INF, "finite"),
    (EdgeConfig, "turn_timeout_s", -5, "greater than 0"),
    (EdgeConfig, "resume_wait_s", INF, "finite"),
    (EdgeConfig, "resume_wait_s", 0, "greater than 0"),
    (EdgeConfig, "ttft_slo_ms", 0, "greater than 0"),
    (EdgeConfig, "ttft_slo_ms", INF, "finite"),
    (EdgeConfig, "itl_p99_slo_ms", NAN, "finite"),
    (EdgeConfig, "http_port", 65536, "less than or equal to 65535"),
    (EdgeConfig, "cloud_budget_s", -1, "greater than or equal to 0"),
    (EdgeConfig, "cloud_budget_s", INF, "finite"),
]


def build(model: type[BaseModel], **kw: typing.Any) -> BaseModel:
    return CloudConfig(engine=EngineConfig(**kw)) if model is EngineConfig else model(**kw)


@pytest.mark.parametrize(
    ("model", "field", "value", "words"), BAD, ids=[f"{m.__name__}.{f}={v!r}" for m, f, v, _ in BAD]
)
def test_a_value_its_consumer_cannot_take_is_refused(model, field, value, words):
    with pytest.raises(ValidationError) as e:
        build(model, **{field: value})
    assert field in str(e.value) and words in str(e.value), str(e.value)


def _numeric(model: type[BaseModel]) -> list[str]:
    out = []
    for name, info in model.model_fields.items():
        tp = info.annotation
        if typing.get_origin(tp) in (list, dict):
            continue  # lists of names (formats, codecs) are checked as their items' enums
        args = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) is not None else [tp]
        base = [typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a for a in args]
        if any(isinstance(b, type) and issubclass(b, int | float | ByteSize) and b is not bool for b in base):
            out.append(name)
    return out


@pytest.mark.parametrize("model", [CloudConfig, EngineConfig, EdgeConfig])
def test_every_numeric_setting_has_a_bad_value_in_the_table(model):
    covered = {f for m, f, _, _ in BAD if m is model}
    assert set(_numeric(model)) - covered == set()


GOOD = [
    (CloudConfig, "codec_level", 22),
    (CloudConfig, "codec_level", -5),  # zstd's fast levels
    (CloudConfig, "edge_rate_limit", "1/second"),
    (CloudConfig, "edge_rate_limit", None),
    (CloudConfig, "max_queue_per_link", 0),
    (CloudConfig, "drain_timeout_s", 0),
    (EngineConfig, "block_size_tokens", 32),
    (EngineConfig, "block_size_tokens", 128),
    (EngineConfig, "kv_save_queue_bytes", 0),
    (EdgeConfig, "probe_bytes", 1 << 20),
    (EdgeConfig, "probe_bytes", 0),
    (EdgeConfig, "hysteresis", 0.0),
    (EdgeConfig, "keepalive_time_s", 2_000_000),
    (EdgeConfig, "edge_id", "e" * 128),
    (EdgeConfig, "explore_every", 0),
]


@pytest.mark.parametrize(("model", "field", "value"), GOOD, ids=[f"{m.__name__}.{f}={v!r}" for m, f, v in GOOD])
def test_values_at_the_bounds_are_taken(model, field, value):
    cfg = build(model, **{field: value})
    got = getattr(cfg.engine if model is EngineConfig else cfg, field)  # type: ignore[attr-defined]
    assert got == value


def test_block_sizes_follow_the_installed_vllm(monkeypatch):
    """Multiples of 32 with vLLM's CPU build (its attention's kernel blocks), of 16 with a GPU build."""
    monkeypatch.setattr(cloud_config, "vllm_block_multiple", lambda: 16)
    assert EngineConfig(block_size_tokens=16).block_size_tokens == 16
    assert EngineConfig(block_size_tokens=48).block_size_tokens == 48
    with pytest.raises(ValidationError, match="multiple of 16"):
        EngineConfig(block_size_tokens=8)
    monkeypatch.setattr(cloud_config, "vllm_block_multiple", lambda: 32)
    with pytest.raises(ValidationError, match="multiple of 32"):
        EngineConfig(block_size_tokens=48)


def _strings(model: type[BaseModel]) -> list[str]:
    return [
        name
        for name, info in model.model_fields.items()
        if info.annotation is str
        or (typing.get_origin(info.annotation) is not None and str in typing.get_args(info.annotation))
    ]


@pytest.mark.parametrize(
    ("model", "field"),
    [(m, f) for m in (CloudConfig, EdgeConfig) for f in _strings(m)],
    ids=lambda x: getattr(x, "__name__", x),
)
def test_every_string_setting_must_be_text(model, field):
    """A NUL, or a lone surrogate (what an environment variable's undecodable byte becomes), fails
    where the string is sent (protobuf) or logged: refused at once."""
    for bad in ("host\x00:1", "host\udcff:1"):
        with pytest.raises(ValidationError) as e:
            model(**{field: bad})
        assert field in str(e.value), str(e.value)
