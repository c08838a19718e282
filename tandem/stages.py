"""Named stages of a request's latency, the one vocabulary shared by the edge, the cloud,
the SDK, ``make run`` and the benchmarks.

Each member's value is the key it travels under in ``Final.timings_ms`` /
``ChatDone.timings_ms`` (milliseconds). Cloud stages carry the ``cloud_`` prefix on
the wire already, so no side renames another's keys. Pure Python: the SDK imports it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class Stage(enum.StrEnum):
    """One timed stage; ``label`` is how tables print it."""

    TOKENIZE = "tokenize_ms"
    EDGE_HEAD_QUEUE = "edge_head_queue_ms"
    EDGE_HEAD = "edge_head_ms"
    ENCODE = "encode_ms"
    UPLINK = "uplink_ms"
    CLOUD_QUEUE = "cloud_queue_ms"
    CLOUD_UPLOAD_WAIT = "cloud_upload_wait_ms"
    CLOUD_STORE_PUT = "cloud_store_put_ms"
    CLOUD_TAIL_PREFILL = "cloud_tail_prefill_ms"
    CLOUD_TAIL_SAVE_WAIT = "cloud_tail_save_wait_ms"
    CLOUD_DECODE_FIRST_TOKEN = "cloud_decode_first_token_ms"
    CLOUD_DECODE = "cloud_decode_ms"
    CLOUD_KV_SAVE_WAIT = "cloud_kv_save_wait_ms"
    CLOUD_KV_DOWNLINK = "cloud_kv_downlink_ms"
    LOCAL_QUEUE = "local_queue_ms"
    LOCAL_PREFILL = "local_prefill_ms"
    EDGE_PREFILL = "edge_prefill_ms"
    KV_DOWNLINK = "kv_downlink_ms"
    KV_ADOPT = "kv_adopt_ms"
    CATCH_UP = "catch_up_ms"
    TAKEOVER = "takeover_ms"
    HANDOVER = "handover_ms"
    TTFT = "ttft_ms"
    TOTAL = "total_ms"

    @property
    def label(self) -> str:
        return _LABELS[self]

    @property
    def short_label(self) -> str:
        """``label`` in at most ``SHORT_LABEL_CHARS`` characters, for tables that must fit a
        terminal (``make run``'s)."""
        return _SHORT_LABELS.get(self, _LABELS[self])

    @property
    def is_cloud(self) -> bool:
        return self.value.startswith("cloud_")


_LABELS = {
    Stage.TOKENIZE: "tokenize (edge)",
    Stage.EDGE_HEAD_QUEUE: "edge head: wait for the head batcher (batches ahead)",
    Stage.EDGE_HEAD: "edge head: ONNX layers [0,k)",
    Stage.ENCODE: "encode: chunks+CRC32C, KV blocks+BLAKE3",
    Stage.UPLINK: "uplink: send until cloud verified",
    Stage.CLOUD_QUEUE: "cloud: wait for the link's share (admission)",
    Stage.CLOUD_UPLOAD_WAIT: "cloud: header to verified upload",
    Stage.CLOUD_STORE_PUT: "cloud: store put of head KV",
    Stage.CLOUD_TAIL_PREFILL: "cloud: tail prefill + 1st token (vLLM)",
    Stage.CLOUD_TAIL_SAVE_WAIT: "cloud: tail KV writes after the 1st token",
    Stage.CLOUD_DECODE_FIRST_TOKEN: "cloud: KV handoff + decode engine's 1st step",
    Stage.CLOUD_DECODE: "cloud: decode engine, whole stream (remote prefill: until the handover)",
    Stage.CLOUD_KV_SAVE_WAIT: "cloud: the downlink's waits for the whole-model KV writes (remote prefill)",
    Stage.CLOUD_KV_DOWNLINK: "cloud: KV blocks down, from the 1st token to the commit (remote prefill)",
    Stage.LOCAL_QUEUE: "edge: wait for the local engine (runs ahead of the prefill)",
    Stage.LOCAL_PREFILL: "edge: whole model prefill + 1st token (local mode)",
    Stage.EDGE_PREFILL: "edge: its own run over the prompt's first tokens, beside the cloud's prefill (remote prefill)",
    Stage.KV_DOWNLINK: "edge: turn start to the blocks that came down verified + the commit (remote prefill)",
    Stage.KV_ADOPT: "edge: the verified KV written into the local session (remote prefill)",
    Stage.CATCH_UP: "edge: the catch-up run over the partial block and the tokens so far (remote prefill)",
    Stage.TAKEOVER: "edge: turn start to the takeover sent (remote prefill)",
    Stage.HANDOVER: "edge: turn start to the cloud's handover (remote prefill)",
    Stage.TTFT: "time to first token (client)",
    Stage.TOTAL: "end to end",
}

SHORT_LABEL_CHARS = 32
_SHORT_LABELS = {  # the labels longer than SHORT_LABEL_CHARS
    Stage.EDGE_HEAD_QUEUE: "edge head: wait for the batcher",
    Stage.ENCODE: "encode: chunks, KV blocks",
    Stage.UPLINK: "uplink: until cloud verified",
    Stage.CLOUD_QUEUE: "cloud: wait for the link's share",
    Stage.CLOUD_TAIL_PREFILL: "cloud: tail prefill + 1st token",
    Stage.CLOUD_TAIL_SAVE_WAIT: "cloud: tail KV writes after 1st",
    Stage.CLOUD_DECODE_FIRST_TOKEN: "cloud: KV handoff + decode 1st",
    Stage.CLOUD_DECODE: "cloud: decode engine, stream",
    Stage.CLOUD_KV_SAVE_WAIT: "cloud: waits for KV writes",
    Stage.CLOUD_KV_DOWNLINK: "cloud: KV blocks down to commit",
    Stage.LOCAL_QUEUE: "edge: wait for the local engine",
    Stage.LOCAL_PREFILL: "edge: local prefill + 1st token",
    Stage.EDGE_PREFILL: "edge: own prompt run",
    Stage.KV_DOWNLINK: "edge: start to blocks + commit",
    Stage.KV_ADOPT: "edge: KV into the session",
    Stage.CATCH_UP: "edge: catch-up run",
    Stage.TAKEOVER: "edge: start to the takeover",
    Stage.HANDOVER: "edge: start to the handover",
}

# The stages that add up to a split request's time to first token, in order.
TTFT_STAGES: tuple[Stage, ...] = (
    Stage.TOKENIZE,
    Stage.EDGE_HEAD,
    Stage.ENCODE,
    Stage.UPLINK,
    Stage.CLOUD_STORE_PUT,
    Stage.CLOUD_TAIL_PREFILL,
    Stage.CLOUD_DECODE_FIRST_TOKEN,
)

Timings = dict[Stage, float]


def timings_to_wire(t: Mapping[Stage, float]) -> dict[str, float]:
    """Stage -> ms, as the string-keyed map the protobuf messages carry."""
    return {s.value: float(v) for s, v in t.items()}


def timings_from_wire(m: Mapping[str, float]) -> Timings:
    """The inverse of ``timings_to_wire``; keys this version does not know are dropped
    (a newer peer may time more stages)."""
    known = {s.value: s for s in Stage}
    return {known[k]: float(v) for k, v in m.items() if k in known}
