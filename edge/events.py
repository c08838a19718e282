"""Domain forms of the ``Edge.Chat`` RPC and their protobuf conversion, in one place.

``ChatTurn`` comes in from the SDK; ``TextOut`` and ``TurnDone`` go back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.common.errors import InvalidRequest
from tandem.common.params import MAX_STOP_TOKENS, MAX_TEMPERATURE, Sampling
from tandem.common.text import check_text
from tandem.edge.detok import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tandem.pbconv import to_pb
from tandem.stages import Timings, timings_to_wire
from tandem.v1 import tandem_pb2 as pb

ROLES = ("system", "user", "assistant")
MODE_NAMES = {
    pb.MODE_UNSPECIFIED: "auto",
    pb.MODE_AUTO: "auto",
    pb.MODE_SPLIT: "split",
    pb.MODE_DIRECT: "direct",
    pb.MODE_LOCAL: "local",
}


@dataclass(frozen=True)
class ChatTurn:
    """One request from the SDK: ``messages`` (chat template applied) or a raw ``prompt``.

    Every string is text (``common.text``), whichever API built the turn.

    Raises:
        InvalidRequest: a role, content, prompt, session id or stop string that is not text.
    """

    messages: tuple[tuple[str, str], ...] = ()
    prompt: str = ""
    session_id: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    mode: str = "auto"  # "auto" | "local" | "split" | "direct"
    stop: tuple[str, ...] = ()  # stop strings (the output ends before the first; not included)
    split_layer: int = 0  # with mode "split": the k to use (0 = the edge's choice)

    def __post_init__(self) -> None:
        for i, (role, content) in enumerate(self.messages):
            check_text(role, f"messages[{i}].role")
            check_text(content, f"messages[{i}].content")
        check_text(self.prompt, "prompt")
        check_text(self.session_id, "session_id")
        for i, s in enumerate(self.stop):
            check_text(s, f"stop[{i}]")

    @property
    def direct(self) -> bool:
        return self.mode == "direct"

    @classmethod
    def from_pb(cls, r: pb.ChatRequest) -> ChatTurn:
        """Raises InvalidRequest for unknown roles or mode, bad sampling values, or strings that are not text."""
        for i, m in enumerate(r.messages):
            if check_text(m.role, f"messages[{i}].role") not in ROLES:
                raise InvalidRequest(f"messages[{i}].role: {m.role!r} is not one of {ROLES}")
        if r.mode not in MODE_NAMES:
            raise InvalidRequest(f"unknown mode {r.mode}")
        if r.split_layer and r.mode != pb.MODE_SPLIT:
            raise InvalidRequest("split_layer is for mode split only")
        s = Sampling.from_pb(r.sampling) if r.HasField("sampling") else Sampling()
        if not 0 <= s.temperature <= MAX_TEMPERATURE or not 0 < s.top_p <= 1 or s.top_k < 0:
            raise InvalidRequest(f"bad sampling: temperature={s.temperature} top_p={s.top_p}")
        if len(r.stop) > MAX_STOP_STRINGS or any(not 0 < len(x) <= MAX_STOP_CHARS for x in r.stop):
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings of 1 to {MAX_STOP_CHARS} characters")
        if len(s.stop_token_ids) > MAX_STOP_TOKENS:
            raise InvalidRequest(f"at most {MAX_STOP_TOKENS} stop token ids")
        messages = tuple((m.role, m.content) for m in r.messages)
        return cls(
            messages, r.prompt, r.session_id, s, MODE_NAMES[r.mode], tuple(x for x in r.stop if x), r.split_layer
        )


@dataclass(frozen=True)
class TextOut:
    text: str
    token_ids: tuple[int, ...]

    def to_pb(self) -> pb.ChatEvent:
        return pb.ChatEvent(delta=pb.TextDelta(text=self.text, token_ids=list(self.token_ids)))


@dataclass(frozen=True)
class TurnDone:
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    head_tokens: int
    external_tokens: int
    split_layer: int
    timings: Timings
    sent_bytes: dict[str, int]
    output_token_ids: tuple[int, ...]
    mode: str = ""  # "local" | "split" | "direct"
    predicted_ttft_ms: float = 0.0
    ttft_ms: float = 0.0
    params_version: int = 0
    mode_reason: str = ""
    resumes: int = 0  # times the turn continued after its cloud failed mid-stream
    session_expired: bool = False  # the edge had evicted the session (its bound): it started again

    def to_pb(self) -> pb.ChatEvent:
        done = to_pb(pb.ChatDone, self, exclude=("timings",), timings_ms=timings_to_wire(self.timings))
        return pb.ChatEvent(done=done)
