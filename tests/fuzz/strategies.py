"""Hypothesis strategies of the fuzzing's targets (``strategy_of``): mutated upload plans, well-typed
adversarial messages into the ``Cloud`` and ``Edge`` services, and raw or damaged serialized requests to
known and unknown methods."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hypothesis import strategies as st

from tandem.common.protocol.params import LinkParams, NegotiateOffer
from tandem.common.wire import chunks as wire
from tandem.common.wire.messages import (
    uplink_to_pb,
)
from tandem.v1 import tandem_pb2 as pb
from tests.fuzz.uploads import (
    FLAVORS,
    GOOD_SESSION,
    OTHER_LINK,
    POLICIES,
    BlockEdit,
    BlockPayload,
    BlockValues,
    ChunkEdit,
    ChunkPayload,
    ChunkValues,
    CommitEdit,
    HeaderEdit,
    Mutation,
    PayloadOp,
    PromptTokenEdit,
    Reorder,
    UplinkPlan,
    make_upload,
    token_ids,
)
from tests.toy import MANIFEST, VOCAB, B, H, K

T = TypeVar("T")

# ------------------------------------------------------------------ strategies


def weighted(*choices: tuple[int, st.SearchStrategy[T]]) -> st.SearchStrategy[T]:
    """``st.one_of`` with integer weights (``one_of`` drops repeated alternatives, so repeating one does not
    weigh it)."""
    table = [s for w, s in choices for _ in range(w)]
    return st.sampled_from(range(len(table))).flatmap(lambda i: table[i])


U32, U64 = 2**32 - 1, 2**64 - 1
u32 = st.one_of(
    st.integers(0, 80),
    st.sampled_from([127, 128, 511, 512, 513, 1535, 1536, 1537, 2**31 - 1, 2**31, U32]),
    st.integers(0, U32),
)
u64 = st.one_of(st.integers(0, 4), st.sampled_from([2**32, 2**63 - 1, 2**63, U64]), st.integers(0, U64))
i32 = st.one_of(st.integers(-3, 3), st.sampled_from([-(2**31), 2**31 - 1]), st.integers(-(2**31), 2**31 - 1))
i64 = st.one_of(st.integers(-3, 3), st.integers(-(2**63), 2**63 - 1))
enum_ints = st.one_of(st.integers(0, 6), i32)  # open proto3 enums carry any int32
ids_text = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["", "x" * 128, "x" * 129, "é" * 64, "é" * 65, "\x00", "\u202e\n"]),
    st.text(min_size=100, max_size=300),
)
hashes = st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=40), st.just(b""))
special_floats = st.sampled_from([math.nan, math.inf, -math.inf, 1e6, -3.0e38, 1e5 * 1.0001])
any_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), special_floats, st.floats(-3, 3))


def sampling_fields() -> st.SearchStrategy[dict[str, Any]]:
    """Fields of a ``SamplingParams`` message, absurd values included."""
    return st.fixed_dictionaries(
        {},
        optional={
            "temperature": any_floats,
            "top_p": any_floats,
            "top_k": i32,
            "max_new_tokens": u32,
            "seed": i64,
            "stop_token_ids": st.lists(u32, max_size=80),
            "ignore_eos": st.booleans(),
        },
    )


payload_ops = st.one_of(
    st.builds(PayloadOp, st.just("flip"), st.integers(0, 10_000), st.integers(1, 255)),
    st.builds(PayloadOp, st.just("truncate"), st.integers(0, 10_000)),
    st.builds(PayloadOp, st.just("extend"), data=st.binary(min_size=1, max_size=64)),
    st.builds(PayloadOp, st.just("replace"), data=st.binary(max_size=600)),
)
HEADER_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "request_id": ids_text,
    "session_id": weighted((6, ids_text), (1, st.just(GOOD_SESSION))),
    "link_id": weighted((6, ids_text), (1, st.just(OTHER_LINK))),
    "params_version": u64,
    "split_layer": u32,
    "cached_tokens": u32,
    "num_chunks": u32,
    "num_kv_blocks": u32,
    "prompt_token_ids": st.one_of(
        st.just(()),
        st.lists(u32, max_size=40).map(tuple),
        st.builds(lambda t, n: (t,) * n, st.integers(0, VOCAB - 1), st.sampled_from([1536, 1537, 3000])),
    ),
    "sampling": sampling_fields(),
}
CHUNK_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "seq": u32,
    "token_offset": u32,
    "num_tokens": u32,
    "wire_dtype": enum_ints,
    "codec": enum_ints,
    "raw_nbytes": u32,
    "crc32c": u32,
    "params_version": u64,
}
BLOCK_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "leaf_index": u32,
    "block_hash": hashes,
    "layer_lo": u32,
    "layer_hi": u32,
    "codec": enum_ints,
    "raw_nbytes": u32,
    "leaf_hash": hashes,
    "params_version": u64,
    "crc32c": u32,
}


def _field_edit(
    cls: Callable[..., T], fields: dict[str, st.SearchStrategy[Any]], indexed: bool
) -> st.SearchStrategy[T]:
    def one(name: str) -> st.SearchStrategy[T]:
        if indexed:
            return st.builds(cls, st.integers(0, 20), st.just(name), fields[name])
        return st.builds(cls, st.just(name), fields[name])

    return st.sampled_from(sorted(fields)).flatmap(one)


def mutations() -> st.SearchStrategy[Mutation]:
    """Any one mutation of an upload."""
    idx = st.integers(0, 40)
    return st.one_of(
        _field_edit(HeaderEdit, HEADER_FIELDS, False),
        st.builds(PromptTokenEdit, idx, st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([VOCAB, U32]))),
        _field_edit(ChunkEdit, CHUNK_FIELDS, True),
        st.builds(ChunkPayload, idx, payload_ops, st.booleans()),
        st.builds(ChunkValues, idx, st.integers(0, 15), st.integers(0, H - 1), special_floats),
        _field_edit(BlockEdit, BLOCK_FIELDS, True),
        st.builds(BlockPayload, idx, payload_ops, st.booleans(), st.booleans()),
        st.builds(BlockValues, idx, st.integers(0, 10_000), special_floats),
        st.builds(CommitEdit, st.just("leaf_count"), u32) | st.builds(CommitEdit, st.just("merkle_root"), hashes),
        st.builds(
            Reorder,
            st.sampled_from(["drop", "duplicate", "swap", "truncate", "header", "empty", "stall"]),
            idx,
            idx,
        ),
    )


def uplink_plans(
    policies: Sequence[str] = POLICIES, max_mutations: int = 3, deadlines: Sequence[str] = ("none",) * 4 + ("past",)
) -> st.SearchStrategy[UplinkPlan]:
    """Uplink cases: zero to ``max_mutations`` mutations of a valid upload."""
    return st.builds(
        UplinkPlan,
        flavor=st.sampled_from(sorted(FLAVORS)),
        scenario=st.sampled_from(["stateless", "new", "next"]),
        base_tokens=st.integers(1, 100),
        new_tokens=st.integers(1, 140),
        values_seed=st.integers(0, 2**16),
        mutations=st.lists(mutations(), max_size=max_mutations).map(tuple),
        policy=st.sampled_from(tuple(policies)),
        deadline=st.sampled_from(tuple(deadlines)),
    )


# ------------------------------------------------------------------ gRPC cases

CLOUD_METHODS = {  # path -> arity ("uu" unary, "us" server streaming, "ss" bidirectional)
    "/tandem.v1.Cloud/Negotiate": "uu",
    "/tandem.v1.Cloud/GetServerInfo": "uu",
    "/tandem.v1.Cloud/Generate": "ss",
}
EDGE_METHODS = {"/tandem.v1.Edge/Chat": "us", "/tandem.v1.Edge/GetInfo": "uu"}
UNKNOWN_METHODS = {
    "/tandem.v1.Cloud/Chat": "us",
    "/tandem.v1.Edge/Generate": "ss",
    "/tandem.v1.Cloud/Nope": "uu",
    "/tandem.v2.Cloud/Negotiate": "uu",
    "/": "uu",
}


@dataclass(frozen=True)
class RawCall:
    """Raw request bytes into ``method`` (``messages``: one for unary requests, any number for ``Generate``)."""

    method: str
    messages: tuple[bytes, ...]


@dataclass(frozen=True)
class TypedCall:
    """A well-typed request: ``message`` (the request message, or for ``Generate`` an ``UplinkPlan`` or a
    sequence of ``Uplink`` messages) into ``method``."""

    method: str
    message: Any


def _valid_samples() -> dict[str, list[bytes]]:
    """Serialized valid requests of every method, to damage (most random bytes do not even parse)."""
    params = LinkParams(
        params_version=1,
        split_layer=K,
        chunk_tokens=16,
        wire_dtype=wire.WireDtype.FP32,
        codec=wire.Codec.NONE,
        codec_level=3,
        kv_block_size_tokens=B,
        inflight_window_bytes=1 << 26,
        max_concurrent_requests=8,
        max_batched_tokens=4096,
        max_prompt_tokens=1536,
        max_new_tokens=512,
        hidden_size=H,
        max_chunk_resends=3,
    )
    u = make_upload(params, token_ids(1, 40), "", "raw", values_seed=1)
    offer = NegotiateOffer(edge_id="e", model_id="toy", head_keys={K: MANIFEST.compatibility_key()}, edge_max_batch=4)
    chat = pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content="hi")], sampling=pb.SamplingParams(max_new_tokens=3)
    )
    return {
        "/tandem.v1.Cloud/Negotiate": [offer.to_pb().SerializeToString()],
        "/tandem.v1.Cloud/GetServerInfo": [pb.ServerInfoRequest(link_id="x", padding=b"\0" * 8).SerializeToString()],
        "/tandem.v1.Cloud/Generate": [uplink_to_pb(x).SerializeToString() for x in (u.header, *u.items)],
        "/tandem.v1.Edge/Chat": [chat.SerializeToString()],
        "/tandem.v1.Edge/GetInfo": [b""],
    }


VALID_SAMPLES = _valid_samples()


def _damaged(method: str) -> st.SearchStrategy[bytes]:
    samples = VALID_SAMPLES.get(method, [b"\x08\x01"])
    sample = st.sampled_from(samples)
    return st.one_of(
        st.binary(max_size=64),
        sample,
        st.builds(lambda s, op: op.apply(s), sample, payload_ops),
        st.builds(lambda a, b: a + b, sample, st.binary(max_size=16)),
        st.builds(lambda a, b: a + b, st.binary(max_size=8), sample),
    )


def raw_calls(methods: dict[str, str]) -> st.SearchStrategy[RawCall]:
    """Arbitrary and damaged serialized requests into ``methods`` and into unknown methods."""

    def one(method: str) -> st.SearchStrategy[RawCall]:
        arity = {**methods, **UNKNOWN_METHODS}[method]
        # one message into an unknown method: grpc core answers a client still writing to one INTERNAL
        n = st.integers(0, 6) if arity == "ss" and method in methods else st.just(1)
        messages = n.flatmap(lambda k: st.lists(_damaged(method), min_size=k, max_size=k)).map(tuple)
        return st.builds(RawCall, st.just(method), messages)

    known = st.sampled_from(sorted(methods))
    return weighted((7, known), (1, st.sampled_from(sorted(UNKNOWN_METHODS)))).flatmap(one)


def overridden(base: Any, overrides: dict[str, Any]) -> Any:
    """A copy of protobuf message ``base`` with ``overrides`` (field name -> value; messages, maps and repeated
    fields replaced whole)."""
    m = type(base)()
    m.CopyFrom(base)
    for name, value in overrides.items():
        f = getattr(m, name)
        if isinstance(value, dict):
            f.clear()
            f.update(value)
        elif hasattr(value, "ListFields"):
            f.CopyFrom(value)
        elif isinstance(value, list | tuple):
            del f[:]
            f.extend(value)
        else:
            setattr(m, name, value)
    return m


def negotiate_requests() -> st.SearchStrategy[pb.NegotiateRequest]:
    """A good ``NegotiateRequest`` with any of its fields replaced by adversarial values (NaN, infinite and huge
    measurements, unknown enums, many or wrong heads, long ids)."""
    key = MANIFEST.compatibility_key()
    base = NegotiateOffer(edge_id="e", model_id="toy", head_keys={K: key}, edge_max_batch=4).to_pb()
    head_keys = st.dictionaries(
        st.one_of(st.sampled_from([0, 1, K, K + 1]), u32),
        st.one_of(st.just(key), st.text(max_size=20), st.just("k" * 1025)),
        max_size=4,
    ) | st.builds(lambda n: {i: key for i in range(n)}, st.sampled_from([64, 65]))
    floats = st.one_of(any_floats, st.floats(0, 1e4), st.sampled_from([1e300, 1e308]))
    return st.fixed_dictionaries(
        {},
        optional={
            "edge_id": ids_text,
            "model_id": st.sampled_from(["", "other"]) | st.text(max_size=10),
            "split_layers": st.lists(u32, max_size=5),
            "wire_dtypes": st.lists(enum_ints, max_size=5),
            "codecs": st.lists(enum_ints, max_size=5),
            "edge_max_batch": u32,
            "link": st.builds(pb.LinkMeasurement, rtt_ms=floats, goodput_mbps=floats),
            "slo": st.builds(pb.LatencySlo, ttft_ms=floats, itl_p99_ms=floats),
            "head_keys": head_keys,
            "link_id": weighted((6, ids_text), (1, st.just(OTHER_LINK))),
        },
    ).map(lambda o: overridden(base, o))


def server_info_requests() -> st.SearchStrategy[pb.ServerInfoRequest]:
    """``ServerInfoRequest`` with long link ids and paddings around the message size bound."""
    big = st.sampled_from([(1 << 20) - 64, (1 << 20) + 4000, (1 << 20) + 8192])
    sizes = weighted((5, st.integers(0, 64)), (1, big))
    return st.builds(
        pb.ServerInfoRequest,
        link_id=st.one_of(ids_text, st.sampled_from(["x" * 256, "x" * 257, OTHER_LINK])),
        padding=sizes.map(bytes),
    )


def uplink_streams() -> st.SearchStrategy[tuple[pb.Uplink, ...]]:
    """Uplink sequences that do not start with a good header (none, empty oneofs, a body item first)."""
    one = st.one_of(
        st.just(pb.Uplink()),
        st.builds(pb.Uplink, commit=st.builds(pb.Commit, leaf_count=u32, merkle_root=hashes)),
        st.builds(pb.Uplink, chunk=st.builds(pb.ActivationChunk, seq=u32, payload=st.binary(max_size=32))),
        st.builds(pb.Uplink, header=st.builds(pb.RequestHeader, prompt_token_ids=st.lists(u32, max_size=5))),
    )
    return st.lists(one, max_size=4).map(tuple)


def chat_requests() -> st.SearchStrategy[pb.ChatRequest]:
    """A good ``ChatRequest`` with any of its fields (and of its sampling) replaced by adversarial values: roles,
    modes, split layers, stop strings, sizes."""
    base = pb.ChatRequest(
        messages=[pb.ChatMessage(role="user", content="hello, tell me something")],
        sampling=pb.SamplingParams(max_new_tokens=4),
        mode=pb.MODE_SPLIT,
    )
    text = weighted((2, st.text(max_size=40)), (1, st.integers(0, 110_000).map(lambda n: "x" * n)))
    roles = st.sampled_from(["system", "user", "assistant"])
    role = weighted((3, roles), (1, st.text(max_size=8)))
    messages = st.lists(st.builds(pb.ChatMessage, role=role, content=text), max_size=4)
    modes = st.sampled_from(sorted(pb.Mode.values()))
    return st.fixed_dictionaries(
        {},
        optional={
            "session_id": ids_text,
            "messages": messages,
            "prompt": st.one_of(st.just(""), text),
            "sampling": st.builds(lambda f: overridden(base.sampling, f), sampling_fields()),
            "mode": weighted((2, modes), (1, enum_ints)),
            "stop": st.lists(st.one_of(st.text(max_size=5), st.just("s" * 257)), max_size=18),
            "split_layer": st.one_of(st.sampled_from([0, K]), u32),
        },
    ).map(lambda o: overridden(base, o))


def typed_cloud_calls() -> st.SearchStrategy[TypedCall]:
    """Well-typed adversarial requests into the three ``Cloud`` methods."""
    return st.one_of(
        st.builds(TypedCall, st.just("/tandem.v1.Cloud/Negotiate"), negotiate_requests()),
        st.builds(TypedCall, st.just("/tandem.v1.Cloud/GetServerInfo"), server_info_requests()),
        st.builds(TypedCall, st.just("/tandem.v1.Cloud/Generate"), uplink_plans(("mute",), deadlines=("none",))),
        st.builds(TypedCall, st.just("/tandem.v1.Cloud/Generate"), uplink_plans(("mute",), deadlines=("none",))),
        st.builds(TypedCall, st.just("/tandem.v1.Cloud/Generate"), uplink_streams()),
    )


def typed_edge_calls() -> st.SearchStrategy[TypedCall]:
    """Well-typed adversarial requests into the ``Edge`` methods."""
    return st.one_of(
        st.builds(TypedCall, st.just("/tandem.v1.Edge/Chat"), chat_requests()),
        st.builds(TypedCall, st.just("/tandem.v1.Edge/GetInfo"), st.just(pb.GetInfoRequest())),
    )


def strategy_of(target: str) -> st.SearchStrategy[Any]:
    """The cases of ``target`` (one of ``TARGETS``)."""
    return {
        "uplink": lambda: uplink_plans(),
        "cloud-typed": typed_cloud_calls,
        "cloud-raw": lambda: raw_calls(CLOUD_METHODS),
        "edge-typed": typed_edge_calls,
        "edge-raw": lambda: raw_calls(EDGE_METHODS),
    }[target]()
