from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WireDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WIRE_DTYPE_UNSPECIFIED: _ClassVar[WireDtype]
    WIRE_DTYPE_FP32: _ClassVar[WireDtype]
    WIRE_DTYPE_FP16: _ClassVar[WireDtype]
    WIRE_DTYPE_BF16: _ClassVar[WireDtype]
    WIRE_DTYPE_INT8: _ClassVar[WireDtype]
    WIRE_DTYPE_INT4: _ClassVar[WireDtype]
    WIRE_DTYPE_INT8_HADAMARD: _ClassVar[WireDtype]
    WIRE_DTYPE_INT4_HADAMARD: _ClassVar[WireDtype]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_NONE: _ClassVar[Codec]
    CODEC_ZSTD: _ClassVar[Codec]

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_SPLIT: _ClassVar[Mode]
    MODE_DIRECT: _ClassVar[Mode]
    MODE_LOCAL: _ClassVar[Mode]
    MODE_AUTO: _ClassVar[Mode]
    MODE_REMOTE_PREFILL: _ClassVar[Mode]
WIRE_DTYPE_UNSPECIFIED: WireDtype
WIRE_DTYPE_FP32: WireDtype
WIRE_DTYPE_FP16: WireDtype
WIRE_DTYPE_BF16: WireDtype
WIRE_DTYPE_INT8: WireDtype
WIRE_DTYPE_INT4: WireDtype
WIRE_DTYPE_INT8_HADAMARD: WireDtype
WIRE_DTYPE_INT4_HADAMARD: WireDtype
CODEC_UNSPECIFIED: Codec
CODEC_NONE: Codec
CODEC_ZSTD: Codec
MODE_UNSPECIFIED: Mode
MODE_SPLIT: Mode
MODE_DIRECT: Mode
MODE_LOCAL: Mode
MODE_AUTO: Mode
MODE_REMOTE_PREFILL: Mode

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EndSessionReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: bool = ...) -> None: ...

class SyncSessionRequest(_message.Message):
    __slots__ = ("link_id", "session_id", "split_layer", "token_ids", "leaf_count", "merkle_root", "proof_from", "consistency_proof", "block_size_tokens")
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPLIT_LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LEAF_COUNT_FIELD_NUMBER: _ClassVar[int]
    MERKLE_ROOT_FIELD_NUMBER: _ClassVar[int]
    PROOF_FROM_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_PROOF_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    link_id: str
    session_id: str
    split_layer: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    leaf_count: int
    merkle_root: bytes
    proof_from: int
    consistency_proof: _containers.RepeatedScalarFieldContainer[bytes]
    block_size_tokens: int
    def __init__(self, link_id: _Optional[str] = ..., session_id: _Optional[str] = ..., split_layer: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., leaf_count: _Optional[int] = ..., merkle_root: _Optional[bytes] = ..., proof_from: _Optional[int] = ..., consistency_proof: _Optional[_Iterable[bytes]] = ..., block_size_tokens: _Optional[int] = ...) -> None: ...

class SyncSessionReply(_message.Message):
    __slots__ = ("found", "held_tokens", "held_leaves", "held_root", "proven", "leaf_hashes")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    HELD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HELD_LEAVES_FIELD_NUMBER: _ClassVar[int]
    HELD_ROOT_FIELD_NUMBER: _ClassVar[int]
    PROVEN_FIELD_NUMBER: _ClassVar[int]
    LEAF_HASHES_FIELD_NUMBER: _ClassVar[int]
    found: bool
    held_tokens: int
    held_leaves: int
    held_root: bytes
    proven: bool
    leaf_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, found: bool = ..., held_tokens: _Optional[int] = ..., held_leaves: _Optional[int] = ..., held_root: _Optional[bytes] = ..., proven: bool = ..., leaf_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LinkMeasurement(_message.Message):
    __slots__ = ("rtt_ms", "goodput_mbps")
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_MBPS_FIELD_NUMBER: _ClassVar[int]
    rtt_ms: float
    goodput_mbps: float
    def __init__(self, rtt_ms: _Optional[float] = ..., goodput_mbps: _Optional[float] = ...) -> None: ...

class LatencySlo(_message.Message):
    __slots__ = ("ttft_ms", "itl_p99_ms")
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_P99_MS_FIELD_NUMBER: _ClassVar[int]
    ttft_ms: float
    itl_p99_ms: float
    def __init__(self, ttft_ms: _Optional[float] = ..., itl_p99_ms: _Optional[float] = ...) -> None: ...

class NegotiateRequest(_message.Message):
    __slots__ = ("edge_id", "model_id", "split_layers", "wire_dtypes", "codecs", "edge_max_batch", "link", "slo", "head_keys", "link_id", "kv_wire_dtypes")
    class HeadKeysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    EDGE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SPLIT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPES_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    EDGE_MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    SLO_FIELD_NUMBER: _ClassVar[int]
    HEAD_KEYS_FIELD_NUMBER: _ClassVar[int]
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    KV_WIRE_DTYPES_FIELD_NUMBER: _ClassVar[int]
    edge_id: str
    model_id: str
    split_layers: _containers.RepeatedScalarFieldContainer[int]
    wire_dtypes: _containers.RepeatedScalarFieldContainer[WireDtype]
    codecs: _containers.RepeatedScalarFieldContainer[Codec]
    edge_max_batch: int
    link: LinkMeasurement
    slo: LatencySlo
    head_keys: _containers.ScalarMap[int, str]
    link_id: str
    kv_wire_dtypes: _containers.RepeatedScalarFieldContainer[WireDtype]
    def __init__(self, edge_id: _Optional[str] = ..., model_id: _Optional[str] = ..., split_layers: _Optional[_Iterable[int]] = ..., wire_dtypes: _Optional[_Iterable[_Union[WireDtype, str]]] = ..., codecs: _Optional[_Iterable[_Union[Codec, str]]] = ..., edge_max_batch: _Optional[int] = ..., link: _Optional[_Union[LinkMeasurement, _Mapping]] = ..., slo: _Optional[_Union[LatencySlo, _Mapping]] = ..., head_keys: _Optional[_Mapping[int, str]] = ..., link_id: _Optional[str] = ..., kv_wire_dtypes: _Optional[_Iterable[_Union[WireDtype, str]]] = ...) -> None: ...

class LinkParams(_message.Message):
    __slots__ = ("params_version", "split_layer", "chunk_tokens", "wire_dtype", "codec", "codec_level", "kv_block_size_tokens", "inflight_window_bytes", "max_concurrent_requests", "max_batched_tokens", "max_prompt_tokens", "max_new_tokens", "hidden_size", "max_chunk_resends", "kv_wire_dtype", "max_model_len_tokens", "vocab_size")
    PARAMS_VERSION_FIELD_NUMBER: _ClassVar[int]
    SPLIT_LAYER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CODEC_LEVEL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_WINDOW_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_RESENDS_FIELD_NUMBER: _ClassVar[int]
    KV_WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    params_version: int
    split_layer: int
    chunk_tokens: int
    wire_dtype: WireDtype
    codec: Codec
    codec_level: int
    kv_block_size_tokens: int
    inflight_window_bytes: int
    max_concurrent_requests: int
    max_batched_tokens: int
    max_prompt_tokens: int
    max_new_tokens: int
    hidden_size: int
    max_chunk_resends: int
    kv_wire_dtype: WireDtype
    max_model_len_tokens: int
    vocab_size: int
    def __init__(self, params_version: _Optional[int] = ..., split_layer: _Optional[int] = ..., chunk_tokens: _Optional[int] = ..., wire_dtype: _Optional[_Union[WireDtype, str]] = ..., codec: _Optional[_Union[Codec, str]] = ..., codec_level: _Optional[int] = ..., kv_block_size_tokens: _Optional[int] = ..., inflight_window_bytes: _Optional[int] = ..., max_concurrent_requests: _Optional[int] = ..., max_batched_tokens: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., hidden_size: _Optional[int] = ..., max_chunk_resends: _Optional[int] = ..., kv_wire_dtype: _Optional[_Union[WireDtype, str]] = ..., max_model_len_tokens: _Optional[int] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class NegotiateResponse(_message.Message):
    __slots__ = ("params", "cloud_id", "model_id", "link_id", "split_layers", "note", "instance_id", "params_by_split")
    class ParamsBySplitEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: LinkParams
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[LinkParams, _Mapping]] = ...) -> None: ...
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CLOUD_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    SPLIT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_BY_SPLIT_FIELD_NUMBER: _ClassVar[int]
    params: LinkParams
    cloud_id: str
    model_id: str
    link_id: str
    split_layers: _containers.RepeatedScalarFieldContainer[int]
    note: str
    instance_id: str
    params_by_split: _containers.MessageMap[int, LinkParams]
    def __init__(self, params: _Optional[_Union[LinkParams, _Mapping]] = ..., cloud_id: _Optional[str] = ..., model_id: _Optional[str] = ..., link_id: _Optional[str] = ..., split_layers: _Optional[_Iterable[int]] = ..., note: _Optional[str] = ..., instance_id: _Optional[str] = ..., params_by_split: _Optional[_Mapping[int, LinkParams]] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ("link_id", "padding")
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    link_id: str
    padding: bytes
    def __init__(self, link_id: _Optional[str] = ..., padding: _Optional[bytes] = ...) -> None: ...

class ServerLoad(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "kv_cache_usage", "tail_prefill_ms_per_token", "prefill_ms_per_token", "decode_ms_per_token", "queue_wait_ms", "link_running", "link_waiting")
    class TailPrefillMsPerTokenEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    TAIL_PREFILL_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    LINK_RUNNING_FIELD_NUMBER: _ClassVar[int]
    LINK_WAITING_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    kv_cache_usage: float
    tail_prefill_ms_per_token: _containers.ScalarMap[int, float]
    prefill_ms_per_token: float
    decode_ms_per_token: float
    queue_wait_ms: float
    link_running: int
    link_waiting: int
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., tail_prefill_ms_per_token: _Optional[_Mapping[int, float]] = ..., prefill_ms_per_token: _Optional[float] = ..., decode_ms_per_token: _Optional[float] = ..., queue_wait_ms: _Optional[float] = ..., link_running: _Optional[int] = ..., link_waiting: _Optional[int] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("cloud_id", "instance_id", "load", "link_known", "params_by_split", "split_layers", "serving")
    class ParamsBySplitEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: LinkParams
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[LinkParams, _Mapping]] = ...) -> None: ...
    CLOUD_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LINK_KNOWN_FIELD_NUMBER: _ClassVar[int]
    PARAMS_BY_SPLIT_FIELD_NUMBER: _ClassVar[int]
    SPLIT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    cloud_id: str
    instance_id: str
    load: ServerLoad
    link_known: bool
    params_by_split: _containers.MessageMap[int, LinkParams]
    split_layers: _containers.RepeatedScalarFieldContainer[int]
    serving: bool
    def __init__(self, cloud_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., load: _Optional[_Union[ServerLoad, _Mapping]] = ..., link_known: bool = ..., params_by_split: _Optional[_Mapping[int, LinkParams]] = ..., split_layers: _Optional[_Iterable[int]] = ..., serving: bool = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "seed", "stop_token_ids", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: bool = ...) -> None: ...

class RequestHeader(_message.Message):
    __slots__ = ("request_id", "session_id", "params_version", "split_layer", "prompt_token_ids", "cached_tokens", "num_chunks", "num_kv_blocks", "sampling", "link_id", "remote_prefill")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_VERSION_FIELD_NUMBER: _ClassVar[int]
    SPLIT_LAYER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LINK_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    params_version: int
    split_layer: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cached_tokens: int
    num_chunks: int
    num_kv_blocks: int
    sampling: SamplingParams
    link_id: str
    remote_prefill: RemotePrefill
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., params_version: _Optional[int] = ..., split_layer: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cached_tokens: _Optional[int] = ..., num_chunks: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., link_id: _Optional[str] = ..., remote_prefill: _Optional[_Union[RemotePrefill, _Mapping]] = ...) -> None: ...

class RemotePrefill(_message.Message):
    __slots__ = ("held_tokens",)
    HELD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    held_tokens: int
    def __init__(self, held_tokens: _Optional[int] = ...) -> None: ...

class ActivationChunk(_message.Message):
    __slots__ = ("seq", "token_offset", "num_tokens", "wire_dtype", "codec", "raw_nbytes", "payload", "crc32c", "params_version")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TOKEN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RAW_NBYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    PARAMS_VERSION_FIELD_NUMBER: _ClassVar[int]
    seq: int
    token_offset: int
    num_tokens: int
    wire_dtype: WireDtype
    codec: Codec
    raw_nbytes: int
    payload: bytes
    crc32c: int
    params_version: int
    def __init__(self, seq: _Optional[int] = ..., token_offset: _Optional[int] = ..., num_tokens: _Optional[int] = ..., wire_dtype: _Optional[_Union[WireDtype, str]] = ..., codec: _Optional[_Union[Codec, str]] = ..., raw_nbytes: _Optional[int] = ..., payload: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., params_version: _Optional[int] = ...) -> None: ...

class KVBlockDelta(_message.Message):
    __slots__ = ("leaf_index", "block_hash", "layer_lo", "layer_hi", "codec", "raw_nbytes", "payload", "leaf_hash", "params_version", "wire_dtype", "crc32c")
    LEAF_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYER_LO_FIELD_NUMBER: _ClassVar[int]
    LAYER_HI_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RAW_NBYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    LEAF_HASH_FIELD_NUMBER: _ClassVar[int]
    PARAMS_VERSION_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    leaf_index: int
    block_hash: bytes
    layer_lo: int
    layer_hi: int
    codec: Codec
    raw_nbytes: int
    payload: bytes
    leaf_hash: bytes
    params_version: int
    wire_dtype: WireDtype
    crc32c: int
    def __init__(self, leaf_index: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., layer_lo: _Optional[int] = ..., layer_hi: _Optional[int] = ..., codec: _Optional[_Union[Codec, str]] = ..., raw_nbytes: _Optional[int] = ..., payload: _Optional[bytes] = ..., leaf_hash: _Optional[bytes] = ..., params_version: _Optional[int] = ..., wire_dtype: _Optional[_Union[WireDtype, str]] = ..., crc32c: _Optional[int] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("leaf_count", "merkle_root")
    LEAF_COUNT_FIELD_NUMBER: _ClassVar[int]
    MERKLE_ROOT_FIELD_NUMBER: _ClassVar[int]
    leaf_count: int
    merkle_root: bytes
    def __init__(self, leaf_count: _Optional[int] = ..., merkle_root: _Optional[bytes] = ...) -> None: ...

class KVDownAck(_message.Message):
    __slots__ = ("received_bytes", "verified_blocks", "resend_blocks")
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESEND_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    verified_blocks: int
    resend_blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, received_bytes: _Optional[int] = ..., verified_blocks: _Optional[int] = ..., resend_blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class Takeover(_message.Message):
    __slots__ = ("output_tokens",)
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    output_tokens: int
    def __init__(self, output_tokens: _Optional[int] = ...) -> None: ...

class Uplink(_message.Message):
    __slots__ = ("header", "chunk", "kv_block", "commit", "kv_ack", "takeover")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    KV_ACK_FIELD_NUMBER: _ClassVar[int]
    TAKEOVER_FIELD_NUMBER: _ClassVar[int]
    header: RequestHeader
    chunk: ActivationChunk
    kv_block: KVBlockDelta
    commit: Commit
    kv_ack: KVDownAck
    takeover: Takeover
    def __init__(self, header: _Optional[_Union[RequestHeader, _Mapping]] = ..., chunk: _Optional[_Union[ActivationChunk, _Mapping]] = ..., kv_block: _Optional[_Union[KVBlockDelta, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., kv_ack: _Optional[_Union[KVDownAck, _Mapping]] = ..., takeover: _Optional[_Union[Takeover, _Mapping]] = ...) -> None: ...

class Nack(_message.Message):
    __slots__ = ("seq", "reason")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    reason: str
    def __init__(self, seq: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class RepairRequest(_message.Message):
    __slots__ = ("leaf_indices", "reason")
    LEAF_INDICES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    leaf_indices: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    def __init__(self, leaf_indices: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ...) -> None: ...

class WindowAck(_message.Message):
    __slots__ = ("received_bytes", "held_tokens")
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    held_tokens: int
    def __init__(self, received_bytes: _Optional[int] = ..., held_tokens: _Optional[int] = ...) -> None: ...

class UploadAck(_message.Message):
    __slots__ = ("verified_tokens", "leaf_count", "merkle_root")
    VERIFIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEAF_COUNT_FIELD_NUMBER: _ClassVar[int]
    MERKLE_ROOT_FIELD_NUMBER: _ClassVar[int]
    verified_tokens: int
    leaf_count: int
    merkle_root: bytes
    def __init__(self, verified_tokens: _Optional[int] = ..., leaf_count: _Optional[int] = ..., merkle_root: _Optional[bytes] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("token_ids", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., index: _Optional[int] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("finish_reason", "prompt_tokens", "output_tokens", "external_tokens", "timings_ms", "received_bytes", "load", "queue_wait_ms")
    class TimingsMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ReceivedBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_MS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    external_tokens: int
    timings_ms: _containers.ScalarMap[str, float]
    received_bytes: _containers.ScalarMap[str, int]
    load: ServerLoad
    queue_wait_ms: float
    def __init__(self, finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., external_tokens: _Optional[int] = ..., timings_ms: _Optional[_Mapping[str, float]] = ..., received_bytes: _Optional[_Mapping[str, int]] = ..., load: _Optional[_Union[ServerLoad, _Mapping]] = ..., queue_wait_ms: _Optional[float] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("kind", "message", "retry_after_ms", "base_kinds")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    BASE_KINDS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    message: str
    retry_after_ms: int
    base_kinds: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kind: _Optional[str] = ..., message: _Optional[str] = ..., retry_after_ms: _Optional[int] = ..., base_kinds: _Optional[_Iterable[str]] = ...) -> None: ...

class KVBlockDown(_message.Message):
    __slots__ = ("block_index", "block_hash", "layer_lo", "layer_hi", "wire_dtype", "codec", "raw_nbytes", "payload", "crc32c", "leaf_hash", "params_version")
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYER_LO_FIELD_NUMBER: _ClassVar[int]
    LAYER_HI_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RAW_NBYTES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    LEAF_HASH_FIELD_NUMBER: _ClassVar[int]
    PARAMS_VERSION_FIELD_NUMBER: _ClassVar[int]
    block_index: int
    block_hash: bytes
    layer_lo: int
    layer_hi: int
    wire_dtype: WireDtype
    codec: Codec
    raw_nbytes: int
    payload: bytes
    crc32c: int
    leaf_hash: bytes
    params_version: int
    def __init__(self, block_index: _Optional[int] = ..., block_hash: _Optional[bytes] = ..., layer_lo: _Optional[int] = ..., layer_hi: _Optional[int] = ..., wire_dtype: _Optional[_Union[WireDtype, str]] = ..., codec: _Optional[_Union[Codec, str]] = ..., raw_nbytes: _Optional[int] = ..., payload: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., leaf_hash: _Optional[bytes] = ..., params_version: _Optional[int] = ...) -> None: ...

class KVCommitDown(_message.Message):
    __slots__ = ("first_block", "leaf_count", "merkle_root")
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    LEAF_COUNT_FIELD_NUMBER: _ClassVar[int]
    MERKLE_ROOT_FIELD_NUMBER: _ClassVar[int]
    first_block: int
    leaf_count: int
    merkle_root: bytes
    def __init__(self, first_block: _Optional[int] = ..., leaf_count: _Optional[int] = ..., merkle_root: _Optional[bytes] = ...) -> None: ...

class Downlink(_message.Message):
    __slots__ = ("nack", "repair", "upload_ack", "tokens", "final", "error", "window_ack", "kv_block", "kv_commit")
    NACK_FIELD_NUMBER: _ClassVar[int]
    REPAIR_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ACK_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WINDOW_ACK_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_FIELD_NUMBER: _ClassVar[int]
    KV_COMMIT_FIELD_NUMBER: _ClassVar[int]
    nack: Nack
    repair: RepairRequest
    upload_ack: UploadAck
    tokens: Tokens
    final: Final
    error: Error
    window_ack: WindowAck
    kv_block: KVBlockDown
    kv_commit: KVCommitDown
    def __init__(self, nack: _Optional[_Union[Nack, _Mapping]] = ..., repair: _Optional[_Union[RepairRequest, _Mapping]] = ..., upload_ack: _Optional[_Union[UploadAck, _Mapping]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., window_ack: _Optional[_Union[WindowAck, _Mapping]] = ..., kv_block: _Optional[_Union[KVBlockDown, _Mapping]] = ..., kv_commit: _Optional[_Union[KVCommitDown, _Mapping]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EdgeInfo(_message.Message):
    __slots__ = ("model_id", "split_layer", "max_prompt_tokens", "max_new_tokens", "max_stop_strings", "max_stop_token_ids", "default_timeout_s", "version", "modes", "split_layers", "cloud_connected", "degraded")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SPLIT_LAYER_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODES_FIELD_NUMBER: _ClassVar[int]
    SPLIT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CLOUD_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    split_layer: int
    max_prompt_tokens: int
    max_new_tokens: int
    max_stop_strings: int
    max_stop_token_ids: int
    default_timeout_s: float
    version: str
    modes: _containers.RepeatedScalarFieldContainer[str]
    split_layers: _containers.RepeatedScalarFieldContainer[int]
    cloud_connected: bool
    degraded: str
    def __init__(self, model_id: _Optional[str] = ..., split_layer: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., max_stop_strings: _Optional[int] = ..., max_stop_token_ids: _Optional[int] = ..., default_timeout_s: _Optional[float] = ..., version: _Optional[str] = ..., modes: _Optional[_Iterable[str]] = ..., split_layers: _Optional[_Iterable[int]] = ..., cloud_connected: bool = ..., degraded: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("session_id", "messages", "prompt", "sampling", "mode", "stop", "split_layer", "whole_reply")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SPLIT_LAYER_FIELD_NUMBER: _ClassVar[int]
    WHOLE_REPLY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    prompt: str
    sampling: SamplingParams
    mode: Mode
    stop: _containers.RepeatedScalarFieldContainer[str]
    split_layer: int
    whole_reply: bool
    def __init__(self, session_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., prompt: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., mode: _Optional[_Union[Mode, str]] = ..., stop: _Optional[_Iterable[str]] = ..., split_layer: _Optional[int] = ..., whole_reply: bool = ...) -> None: ...

class TextDelta(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatDone(_message.Message):
    __slots__ = ("finish_reason", "prompt_tokens", "output_tokens", "head_tokens", "external_tokens", "split_layer", "timings_ms", "sent_bytes", "output_token_ids", "mode", "predicted_ttft_ms", "ttft_ms", "params_version", "mode_reason", "resumes", "session_expired", "received_bytes", "edge_decoded_tokens")
    class TimingsMsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class SentBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ReceivedBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPLIT_LAYER_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_MS_FIELD_NUMBER: _ClassVar[int]
    SENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_REASON_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    SESSION_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EDGE_DECODED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    head_tokens: int
    external_tokens: int
    split_layer: int
    timings_ms: _containers.ScalarMap[str, float]
    sent_bytes: _containers.ScalarMap[str, int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    mode: str
    predicted_ttft_ms: float
    ttft_ms: float
    params_version: int
    mode_reason: str
    resumes: int
    session_expired: bool
    received_bytes: _containers.ScalarMap[str, int]
    edge_decoded_tokens: int
    def __init__(self, finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., head_tokens: _Optional[int] = ..., external_tokens: _Optional[int] = ..., split_layer: _Optional[int] = ..., timings_ms: _Optional[_Mapping[str, float]] = ..., sent_bytes: _Optional[_Mapping[str, int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., mode: _Optional[str] = ..., predicted_ttft_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., params_version: _Optional[int] = ..., mode_reason: _Optional[str] = ..., resumes: _Optional[int] = ..., session_expired: bool = ..., received_bytes: _Optional[_Mapping[str, int]] = ..., edge_decoded_tokens: _Optional[int] = ...) -> None: ...

class ChatEvent(_message.Message):
    __slots__ = ("delta", "done")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    delta: TextDelta
    done: ChatDone
    def __init__(self, delta: _Optional[_Union[TextDelta, _Mapping]] = ..., done: _Optional[_Union[ChatDone, _Mapping]] = ...) -> None: ...
