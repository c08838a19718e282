"""The edge daemon's one typed config, built by the entry point and passed down.

``EdgeConfig`` is a pydantic-settings model: every field is also a ``tandem-edge`` flag
(``--session-bytes``), an environment variable (``TANDEM_EDGE_SESSION_BYTES``) and a key of the TOML
config file (``--config FILE`` or ``TANDEM_EDGE_CONFIG``). Precedence: flags > environment > config
file > defaults (in code: keyword arguments > environment > config file > defaults). See
``tandem.common.runtime.settings`` and docs/configuration.md, generated from these fields by docs/gen_configuration.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from tandem.common.runtime.security import (
    MAX_SCOPED_BYTES,
    ApiKeys,
    check_key,
    check_target,
    check_tls_files,
    is_loopback,
)
from tandem.common.runtime.settings import (
    Bytes,
    Count,
    Count0,
    DaemonSettings,
    ListSetting,
    Millis,
    OptionalInputFile,
    OptionalPort,
    OptionalStr,
    Port,
    PositiveBytes,
    Seconds,
    Seconds0,
    SplitDir,
    WireDtypeSetting,
    checked,
    gib,
    kib,
    mib,
)
from tandem.common.runtime.startup import FileRole, check_model
from tandem.edge.link.discovery import parse_dns_target

DEFAULT_SPLIT_DIR = Path("models/smollm2-135m/split-k4")
MAX_PROBE_BYTES = 1 << 20  # the padding a cloud accepts in a goodput probe (cloud.gateway.MAX_PROBE_BYTES)
MAX_ID_BYTES = MAX_SCOPED_BYTES  # the ids a cloud accepts (an edge id longer is refused in Negotiate)


class EdgeConfig(DaemonSettings):
    """``tandem-edge`` configuration."""

    model_config = SettingsConfigDict(
        env_prefix="TANDEM_EDGE_",
        cli_shortcuts={"cloud-target": "cloud"},  # `--cloud HOST:PORT`, a short alias
    )

    split_dir: SplitDir = Field(
        default=DEFAULT_SPLIT_DIR,
        description="Split directory (`models/<model>/split-k<k>`): head.onnx + manifest.json; tokenizer from the "
        "full checkpoint.",
    )
    extra_split_dirs: Annotated[ListSetting[Path], FileRole.SPLIT_DIR] = Field(
        default_factory=list,
        description="More split directories of the same model (heads at other split layers k); the edge may "
        "split at any k the cloud also serves.",
    )
    builder_head: bool = Field(
        default=True,
        description="Run each split's head as ONNX Runtime GenAI's model builder wrote it (`split-k<k>/head-builder/`, "
        "checked against HF by `tandem-model`) where its manifest names one; else, or when false, tandem's torch.onnx "
        "export `head.onnx`. The log says which head each split runs and why.",
    )
    prefill_shapes: Literal["auto", "exact", "bucketed"] = Field(
        default="auto",
        description="How the model builder's graphs (the whole model and the builder heads) shape runs of several "
        "new tokens: `bucketed` cuts them into runs of at most 512 tokens, pads each to 4, 8, ..., 512 tokens and "
        "binds the attention mask over the KV slot, and the warm-up runs each of those shapes once, so that a prompt "
        "or remote prefill's catch-up never pays ONNX Runtime's first run of a new shape (tens of ms on the CUDA "
        "provider); `exact` runs each at its own length; `auto`: `bucketed` on the CUDA provider, `exact` on the CPU "
        "(which has no such cost, and where the padding would cost compute).",
    )
    local: bool = Field(
        default=True,
        description="Serve local mode (the whole model here) when the local model file exists; also the fallback "
        "while the cloud is down or busy.",
    )
    local_model: Annotated[Path | None, FileRole.MODEL] = Field(
        default=None,
        description="The whole model for local mode: a folder built by ONNX Runtime GenAI's model builder "
        "(`tandem-model` writes `edge-decoder/`) or an ONNX file (`edge-full.onnx`); default `edge-decoder/` "
        "beside the split directory where it passed its check, else `edge-full.onnx` there.",
    )
    local_kv_bytes: PositiveBytes = Field(
        default=gib(1),
        description="Memory for the whole model's KV in local mode and remote prefill (the builder graph, "
        "`edge-decoder/`), in bytes: sessions' own buffers, batch pools and spare buffers together (device memory "
        "on a GPU). Idle buffers are freed to make room; a turn that needs more beside the turns in flight is refused "
        "RESOURCE_EXHAUSTED (HTTP 429, worth retrying), one whose own KV slot is larger than this whole bound "
        "FAILED_PRECONDITION (HTTP 400, not worth retrying; auto mode serves it in the cloud). A turn's "
        "slot holds its prompt + max_new_tokens rounded up to a slot size (powers of two from 256 tokens): what it "
        "holds, and what both refusals count. Keep `session_bytes` below it, so the session table drops idle "
        "sessions first.",
    )
    max_prompt_tokens: Count = Field(default=1536, description="Longest prompt accepted, in tokens.")
    max_new_tokens: Count = Field(
        default=4096,
        description="Most output tokens of one turn, in every mode (the cloud's bound narrows it while known).",
    )
    cloud_target: str = Field(
        default="localhost:50051",
        description="Address of tandem-cloud, `host:port`; or a DNS name of all its replicas, "
        "`dns:///NAME:PORT` (a Kubernetes headless Service; `dns://DNS-SERVER/NAME:PORT` asks that server): "
        "the edge resolves it every `cloud_resolve_s` and holds one link per address, as with `cloud_replicas`.",
    )
    cloud_replicas: ListSetting[str] = Field(
        default_factory=list,
        description="More `host:port` targets of the same cloud deployment (replicas sharing one block store, "
        "`tandem-cloud --store-url`): each session stays on one replica (rendezvous hashing over those that "
        "answer) and moves, syncing from the shared store, when its replica fails. `dns:` names as in "
        "`cloud_target`.",
    )
    cloud_resolve_s: Seconds = Field(
        default=30.0,
        description="Seconds between resolutions of a `dns:` cloud target (also resolved, at most once a second, "
        "when a turn fails on a replica); replicas that join get their share of sessions, those that leave move "
        "only their own.",
    )
    cloud_tls: bool = Field(
        default=False,
        description="Speak TLS to the cloud (on by itself when `cloud_ca_file` or `cloud_cert_file` is set); the "
        "cloud's certificate must match `cloud_ca_file` (else the system's roots) and the target's host name.",
    )
    cloud_ca_file: OptionalInputFile = Field(
        default=None, description="CA (PEM) the cloud's certificate must chain to."
    )
    cloud_cert_file: OptionalInputFile = Field(
        default=None, description="This edge's client certificate (PEM) for mutual TLS with the cloud."
    )
    cloud_key_file: OptionalInputFile = Field(default=None, description="Private key (PEM) of `cloud_cert_file`.")
    cloud_server_name: OptionalStr = Field(
        default=None,
        description="Name the cloud's certificate must carry when it differs from the target's host (e.g. an IP "
        "target); `none` = the target's host.",
    )
    cloud_api_key: OptionalStr = Field(
        default=None,
        description="Bearer token sent to the cloud (its `edge_keys`); prefer `TANDEM_EDGE_CLOUD_API_KEY` or the "
        "config file over a flag.",
    )
    cloud_insecure: bool = Field(
        default=False, description="Allow plaintext to a cloud target that is not a loopback address."
    )
    connect_timeout_s: Seconds0 = Field(
        default=10.0,
        description="Seconds to wait at start-up for the first negotiation; the edge starts anyway (local mode, "
        "degraded) and keeps reconnecting in the background.",
    )
    poll_s: Seconds = Field(
        default=2.0, description="Seconds between GetServerInfo polls (cloud load, link params, RTT)."
    )
    probe_bytes: Bytes = Field(
        default=kib(256),
        le=MAX_PROBE_BYTES,
        description="Padding of the goodput probe at connect, in bytes; 0 = no probe.",
    )
    wire_dtypes: ListSetting[WireDtypeSetting] = Field(
        default=["fp16", "fp32", "int8_hadamard"],
        validate_default=True,
        min_length=1,
        description="Activation formats this edge accepts, preferred first: the cloud picks the smallest pair "
        "its fidelity table qualifies among them, else the first it allows. The default offers fp16, fp32 and the "
        "formats the packaged fidelity tables qualify.",
    )
    kv_wire_dtypes: ListSetting[WireDtypeSetting] = Field(
        default=["fp16", "bf16", "fp32", "int4", "int8_hadamard"],
        validate_default=True,
        min_length=1,
        description="KV block formats this edge accepts, preferred first, chosen for head-KV blocks as "
        "`wire_dtypes`; remote prefill's downlink takes a format the fidelity table qualifies for every layer's "
        "KV, else the cloud engines' own KV dtype where it is listed, else the most faithful one listed.",
    )
    hysteresis: float = Field(
        default=0.05,
        ge=0,
        lt=1,
        allow_inf_nan=False,  # a mode predicted 100% faster would still not be taken
        description="Auto mode keeps its last mode unless another is predicted this much faster.",
    )
    explore_every: Count0 = Field(
        default=50,
        description="A mode predicted within 1.5x of the best that served nothing in this many auto choices runs "
        "once (keeps the cost model calibrated); 0 = never.",
    )
    host: str = Field(default="127.0.0.1", description="gRPC bind address; `0.0.0.0` listens on all interfaces.")
    port: Port = Field(default=50061, description="gRPC port; 0 = any free port (see `--ready-file`).")
    edge_id: str = Field(default="tandem-edge", min_length=1, description="Name this edge reports in Negotiate.")
    max_batch: Count = Field(default=8, description="Rows per ONNX head call.")
    intra_op_threads: Count0 = Field(default=0, description="ONNX Runtime intra-op threads; 0 = its default.")
    pipeline_tokens: Count0 = Field(
        default=128,
        description="Head tokens per piece of a pipelined split turn: a turn with at least twice this many new "
        "tokens, whose upload the cost model predicts to outlast its head, runs the head piece by piece, each "
        "piece's chunks and KV blocks on the wire while the next is computed (at most 8 pieces: longer prompts "
        "get longer pieces); 0 = the head always runs whole first.",
    )
    max_sessions: Count = Field(default=256, description="Multi-turn sessions kept (LRU beyond).")
    session_bytes: PositiveBytes = Field(
        default=mib(512), description="Head KV + activations kept for sessions, all together, in bytes (LRU beyond)."
    )
    session_idle_s: Seconds = Field(
        default=1800.0,
        description="Seconds without a turn after which a session ends (the edge drops its state and tells the "
        "cloud); its next turn starts over.",
    )
    keepalive_time_s: Seconds = Field(
        default=5.0, description="Seconds without a ping before the edge pings the cloud (HTTP/2 keepalive)."
    )
    keepalive_timeout_s: Seconds = Field(
        default=5.0,
        description="Seconds to wait for a ping's ack; then the link is dead and calls fail UNAVAILABLE.",
    )
    turn_timeout_s: Seconds = Field(
        default=300.0, description="Deadline in seconds of one call to the cloud when the client set none."
    )
    resume_wait_s: Seconds = Field(
        default=120.0,
        description="Seconds a turn whose cloud failed mid-stream waits for it (or a restarted instance) to answer "
        "again before it fails UNAVAILABLE, within the turn's deadline (auto mode goes on locally at once).",
    )
    ttft_slo_ms: Millis = Field(
        default=1000.0, description="Time-to-first-token objective reported in Negotiate, in ms."
    )
    itl_p99_slo_ms: Millis = Field(
        default=200.0, description="p99 inter-token latency objective reported in Negotiate, in ms."
    )
    cloud_budget_s: Seconds0 = Field(
        default=0.0,
        description="Cloud engine time per request this edge aims to stay within, in seconds; > 0: auto mode takes "
        "the fastest route predicted within it and the objectives (local, remote prefill, ...). 0 = none: auto "
        "minimises TTFT (end-to-end time for a whole-reply turn) unless the cloud reports pressure.",
    )
    remote_prefill_prompt_kv: Literal["auto", "download", "compute"] = Field(
        default="auto",
        description="Where a remote-prefill turn's edge gets the prompt's KV before it takes the decode over: "
        "`download`: every full block its session lacks comes down from the cloud; `compute`: the edge runs the "
        "prompt itself beside the cloud's prefill and no block comes down (the cloud still serves the first "
        "tokens); `auto`: the edge computes the prompt's first blocks and downloads the rest, with the boundary "
        "where the cost model predicts the earliest handover (its prefill rate against the cloud's first token, "
        "the downlink's goodput and the block size; a GPU edge that prefills before the first token is back "
        "downloads nothing, a slow edge on a fast link downloads almost all). A seeded sampled turn asks for no "
        "block under every setting: the edge computes what its session lacks of the prompt itself, so that the "
        "reply never depends on the link.",
    )
    http_host: str = Field(default="127.0.0.1", description="Bind address of the OpenAI-compatible HTTP API.")
    http_port: OptionalPort = Field(default=None, description="Port of the OpenAI-compatible HTTP API; `none` = off.")
    api_keys: ListSetting[str] = Field(
        default_factory=list,
        description="Bearer tokens (at least 16 characters) clients must send, on gRPC (`authorization: Bearer "
        "...`) and on the HTTP API; each key's sessions are its own. Empty = no authentication. Prefer "
        "`TANDEM_EDGE_API_KEYS='[\"k1\"]'` or the config file over a flag.",
    )
    http_api_keys: ListSetting[str] = Field(
        default_factory=list,
        description="More bearer tokens the HTTP API accepts, besides `api_keys` (any of them); with both empty, "
        "no authentication. Prefer the "
        'environment (`TANDEM_EDGE_HTTP_API_KEYS=\'["k1","k2"]\'`) or the config file over a flag.',
    )

    @property
    def cloud_targets(self) -> list[str]:
        """``cloud_target`` and its replicas."""
        return [self.cloud_target, *self.cloud_replicas]

    @property
    def cloud_uses_tls(self) -> bool:
        return self.cloud_tls or self.cloud_ca_file is not None or self.cloud_cert_file is not None

    @field_validator("api_keys", "http_api_keys")
    @classmethod
    def _keys(cls, v: list[str]) -> list[str]:
        checked(ApiKeys, v)
        return v

    @field_validator("cloud_api_key")
    @classmethod
    def _cloud_key(cls, v: str | None) -> str | None:
        return v if v is None else checked(check_key, v, "cloud_api_key")

    @field_validator("edge_id")
    @classmethod
    def _edge_id(cls, v: str) -> str:
        if len(v.encode(errors="surrogatepass")) > MAX_ID_BYTES:
            raise ValueError(f"at most {MAX_ID_BYTES} bytes (UTF-8): a cloud refuses longer ids")
        return v

    @field_validator("cloud_target")
    @classmethod
    def _target(cls, v: str) -> str:
        checked(parse_dns_target, v)
        return checked(check_target, v, "cloud_target")

    @field_validator("cloud_replicas")
    @classmethod
    def _replicas(cls, v: list[str]) -> list[str]:
        for t in v:
            checked(parse_dns_target, t)
            checked(check_target, t, "cloud_replicas entry")
        return v

    @field_validator("local_model")
    @classmethod
    def _local_model(cls, v: Path | None) -> Path | None:
        if v is not None:
            checked(check_model, v, "the whole model (a builder folder or an ONNX file)")
        return v

    @model_validator(mode="after")
    def _cloud_channel_consistent(self) -> Self:
        if (self.cloud_cert_file is None) != (self.cloud_key_file is None):
            raise ValueError("cloud_cert_file and cloud_key_file go together: set both or neither")
        if self.api_keys and self.tls_client_ca_file is not None:
            raise ValueError(
                "api_keys with tls_client_ca_file: keys given as a list name no identity to bind to a client "
                "certificate (common.runtime.security); use one of them"
            )
        names = "cloud_cert_file/cloud_key_file/cloud_ca_file"
        checked(check_tls_files, self.cloud_cert_file, self.cloud_key_file, self.cloud_ca_file, names)
        if len(set(self.cloud_targets)) != len(self.cloud_targets):
            raise ValueError(f"cloud targets must differ: {self.cloud_targets}")
        remote = [t for t in self.cloud_targets if not is_loopback(t)]
        if not self.cloud_uses_tls and not self.cloud_insecure and remote:
            which = "cloud_target" if remote[0] == self.cloud_target else "cloud_replicas entry"
            raise ValueError(
                f"{which} {remote[0]!r} is not a loopback address: set cloud_tls (and cloud_ca_file), "
                "or cloud_insecure = true to send activations and KV in plaintext explicitly"
            )
        if self.http_port is not None and self.tls_cert_file is None and not self.insecure:
            if not is_loopback(self.http_host):
                raise ValueError(
                    f"http_host {self.http_host!r} is not a loopback address: set tls_cert_file/tls_key_file (HTTPS), "
                    "or insecure = true to serve plaintext explicitly"
                )
        return self
