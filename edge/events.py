"""Domain forms of the ``Edge.Chat`` RPC and their protobuf conversion, in one place.

``ChatTurn`` comes in from the SDK; ``TextOut`` and ``TurnDone`` go back. ``SentBytes`` is what
a turn's upload cost on the wire, per stream kind. ``chat_role`` and ``check_stops`` are the one
check of a message's role and of stop strings, for the gRPC API and the HTTP API alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.limits import check_session_id
from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import Sampling
from tandem.common.protocol.text import check_text
from tandem.edge.detok import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tandem.pbconv import to_pb
from tandem.ranges import carried_top_k
from tandem.stages import Timings, timings_to_wire
from tandem.v1 import tandem_pb2 as pb

# a message's role -> the role the chat template gets (OpenAI's developer messages are system messages)
ROLE_OF = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def chat_role(role: str, i: int) -> str:
    """The chat template's role for message ``i``'s ``role``.

    Raises:
        InvalidRequest: a role not in ``ROLE_OF``, or none (``param`` ``messages.[i].role``).
    """
    where = f"messages.[{i}].role"
    if not role:  # protobuf's unset string: a message without its role
        raise InvalidRequest(f"{where}: a message needs its role", param=where, code="missing_required_parameter")
    if check_text(role, where) not in ROLE_OF:
        raise InvalidRequest(f"{where}: {role!r} is not one of {list(ROLE_OF)}", param=where)
    return ROLE_OF[role]


def check_stops(stop: Sequence[str], one: bool = False) -> tuple[str, ...]:
    """Stop strings as a tuple: at most ``MAX_STOP_STRINGS``, each text of 1 to ``MAX_STOP_CHARS``
    characters. ``one``: the request gave one string (its field is ``stop``, not ``stop.[0]``).

    Raises:
        InvalidRequest: ``param`` ``stop`` (too many) or the string's ``stop.[i]``.
    """
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop", code="array_above_max_length"
        )
    for i, x in enumerate(stop):
        where = "stop" if one else f"stop.[{i}]"
        check_text(x, where)
        if not x:
            raise InvalidRequest(f"{where}: a stop string is not empty", param=where)
        if len(x) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"{where}: at most {MAX_STOP_CHARS} characters", param=where, code="string_above_max_length"
            )
    return tuple(stop)


@dataclass(frozen=True, kw_only=True)
class ChatTurn:
    """One request from the SDK: ``messages`` (chat template applied) or a raw ``prompt``.

    Every string is text (``common.protocol.text``), whichever API built the turn.

    Raises:
        InvalidRequest: a role, content, prompt, session id or stop string that is not text.
    """

    messages: tuple[tuple[str, str], ...] = ()
    prompt: str = ""
    session_id: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    mode: Mode = Mode.AUTO
    stop: tuple[str, ...] = ()  # stop strings (the output ends before the first; not included)
    split_layer: int = 0  # with mode split: the k to use (0 = the edge's choice)
    whole_reply: bool = False  # the client uses the reply only whole: auto minimises end-to-end time, not TTFT

    def __post_init__(self) -> None:
        for i, (role, content) in enumerate(self.messages):
            check_text(role, f"messages.[{i}].role")
            check_text(content, f"messages.[{i}].content")
        check_text(self.prompt, "prompt")
        check_text(self.session_id, "session_id")
        for i, s in enumerate(self.stop):
            check_text(s, f"stop.[{i}]")

    @classmethod
    def from_pb(cls, r: pb.ChatRequest) -> ChatTurn:
        """Raises InvalidRequest (``param`` the field) for unknown roles (``developer`` is ``system``)
        or mode, ``split_layer`` with a mode other than split, too many or empty stop strings, a
        session id too long, or strings that are not text. A top_k of -1 is off, as 0 (vLLM's).
        Sampling values and stop token ids are the node's to check, as in every mode
        (``edge.validation.check_turn``)."""
        messages = tuple((chat_role(m.role, i), m.content) for i, m in enumerate(r.messages))
        mode = Mode.from_pb(r.mode)
        check_split_layer(r.split_layer, mode)
        s = Sampling.from_pb(r.sampling) if r.HasField("sampling") else Sampling()
        s = replace(s, top_k=carried_top_k(s.top_k))
        stop = check_stops(r.stop)
        check_session_id(r.session_id)
        return cls(
            messages=messages,
            prompt=r.prompt,
            session_id=r.session_id,
            sampling=s,
            mode=mode,
            stop=stop,
            split_layer=r.split_layer,
            whole_reply=r.whole_reply,
        )


def check_split_layer(split_layer: int, mode: Mode) -> None:
    """Raises InvalidRequest (``param`` ``split_layer``) for a split layer with a mode other than split."""
    if split_layer and mode is not Mode.SPLIT:
        raise InvalidRequest("split_layer is for mode split only", param="split_layer")


@dataclass(frozen=True, kw_only=True)
class TextOut:
    text: str
    token_ids: tuple[int, ...]

    def to_pb(self) -> pb.ChatEvent:
        return pb.ChatEvent(delta=pb.TextDelta(text=self.text, token_ids=list(self.token_ids)))


@dataclass(frozen=True, kw_only=True)
class SentBytes:
    """Bytes one turn sent to the cloud, per stream kind, as sent (after the codec; resends and
    repairs included): the header and commits, the activation chunks, the head-KV blocks."""

    header_bytes: int = 0
    activations_bytes: int = 0
    kv_bytes: int = 0

    def __add__(self, other: SentBytes) -> SentBytes:
        return SentBytes(
            header_bytes=self.header_bytes + other.header_bytes,
            activations_bytes=self.activations_bytes + other.activations_bytes,
            kv_bytes=self.kv_bytes + other.kv_bytes,
        )

    @property
    def payload_bytes(self) -> int:
        """Activation and KV bytes (what a goodput sample counts)."""
        return self.activations_bytes + self.kv_bytes

    def by_kind(self) -> dict[str, int]:
        """Bytes keyed by the stream kinds the APIs and metrics name: ``header``, ``activations``, ``kv``."""
        return {"header": self.header_bytes, "activations": self.activations_bytes, "kv": self.kv_bytes}


@dataclass(frozen=True, kw_only=True)
class TurnDone:
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    head_tokens: int
    external_tokens: int
    split_layer: int
    timings: Timings
    sent_bytes: SentBytes | None  # None: the turn sent nothing to the cloud (local mode)
    output_token_ids: tuple[int, ...]
    mode: Mode  # the mode that served the turn (local, split or direct)
    predicted_ttft_ms: float = 0.0
    ttft_ms: float = 0.0
    params_version: int = 0
    mode_reason: str = ""
    resumes: int = 0  # times the turn continued after its cloud failed mid-stream
    session_expired: bool = False  # the edge had evicted the session (its bound): it started again
    resent_chunks: int = 0  # activation chunks sent again after the cloud NACKed them
    repaired_blocks: int = 0  # KV blocks sent again after the cloud asked for their repair
    received_kv_bytes: int = 0  # remote prefill: KV block bytes received from the cloud (each block once)
    edge_decoded_tokens: int = 0  # remote prefill: output tokens the edge decoded after it took over

    def wire_sent_bytes(self) -> dict[str, int]:
        """``ChatDone.sent_bytes``: bytes per stream kind and the resend and repair counts; empty
        for a turn that sent nothing."""
        if self.sent_bytes is None:
            return {}
        return {
            **self.sent_bytes.by_kind(),
            "resent_chunks": self.resent_chunks,
            "repaired_blocks": self.repaired_blocks,
        }

    def wire_received_bytes(self) -> dict[str, int]:
        """``ChatDone.received_bytes``: bytes per stream kind received from the cloud (remote
        prefill's KV blocks, each once); empty when none came."""
        return {"kv": self.received_kv_bytes} if self.received_kv_bytes else {}

    def to_pb(self) -> pb.ChatEvent:
        done = to_pb(
            pb.ChatDone,
            self,
            exclude=("timings", "resent_chunks", "repaired_blocks", "received_kv_bytes"),
            timings_ms=timings_to_wire(self.timings),
            sent_bytes=self.wire_sent_bytes(),
            mode=self.mode.value,
            received_bytes=self.wire_received_bytes(),
        )
        return pb.ChatEvent(done=done)
