"""One chat turn as the edge runs it: ``Turn`` (the request, its token ids, its deadline, its
route, its cloud connection and session) and ``TurnClock`` (its id, stage timings and what
happened to it). Every step of a turn (``edge.node``, ``edge.modes.cloud``, ``edge.modes.split_head``,
``edge.modes.local``, ``edge.modes.sync``) takes the ``Turn`` rather than its parts. State only: no
decision and no I/O here.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import LinkParams, Sampling
from tandem.common.runtime.logs import new_request_id
from tandem.common.wire.messages import TurnHeader
from tandem.edge.detok import TextStream
from tandem.edge.events import ChatTurn, SentBytes, TurnDone
from tandem.edge.link.connection import CloudConnection
from tandem.edge.routing.accounting import RoutedTurn
from tandem.edge.routing.router import Decision
from tandem.edge.session import EdgeSession
from tandem.stages import Stage, Timings


@dataclass
class TurnClock:
    """One turn's request id (sent to the cloud, on every log line), stage timings from its
    start, when tokens arrived, and the mode that served it; shared by the turn's legs."""

    t_start: float = field(default_factory=time.perf_counter)
    timings: Timings = field(default_factory=dict)
    acked: bool = False  # the cloud verified this turn's upload (its session moved on)
    request_id: str = field(default_factory=new_request_id)
    token_times: list[float] = field(default_factory=list)  # perf_counter at each arrival of tokens
    mode: Mode = Mode.AUTO  # the mode that served the turn (the requested one until a mode runs)
    resumes: int = 0  # times the turn continued after its cloud failed mid-stream
    cloud_called: bool = False  # a Generate call of this turn reached the cloud
    session_expired: bool = False  # the edge had evicted this turn's session (bounded state)

    def since(self, stage: Stage, t0: float | None = None) -> None:
        self.timings[stage] = (time.perf_counter() - (self.t_start if t0 is None else t0)) * 1e3

    def tokens_arrived(self) -> None:
        """New output tokens arrived (the first ones set the time to first token)."""
        self.token_times.append(time.perf_counter())
        if len(self.token_times) == 1:
            self.since(Stage.TTFT)


@dataclass
class Turn:
    """One leg of a chat turn. A turn is one leg unless its cloud fails after tokens reached the
    client: it then goes on as another leg (``continued``) from the prompt plus the tokens already
    emitted, with the same clock and text stream, so the client sees one stream. ``timeout_s`` is
    the leg's budget, fixed when the leg is made; ``decision``, ``account`` (the router's
    accounting of the leg on that route, ``Router.track``), ``conn`` (the cloud connection the leg
    is pinned to), ``session`` (its edge session, split and direct) and ``head_tokens`` are set as
    the leg runs."""

    request: ChatTurn  # this leg's request (a continued leg asks only for the tokens left)
    ids: list[int]  # this leg's prompt token ids
    clock: TurnClock
    text: TextStream  # the turn's output so far
    deadline: float  # event-loop time by which the whole turn ends
    timeout_s: float = field(init=False)
    decision: Decision | None = None
    account: RoutedTurn | None = None
    conn: CloudConnection | None = None
    session: EdgeSession | None = None
    head_tokens: int = 0  # prompt tokens the edge head computed in this leg

    def __post_init__(self) -> None:
        self.timeout_s = max(0.001, self.deadline - asyncio.get_running_loop().time())

    @property
    def session_id(self) -> str:
        return self.request.session_id

    @property
    def prompt_param(self) -> str:
        """The prompt's field as the client named it: ``messages`` for a chat, else ``prompt``."""
        return "messages" if self.request.messages else "prompt"

    @property
    def sampling(self) -> Sampling:
        return self.request.sampling

    @property
    def request_id(self) -> str:
        return self.clock.request_id

    @property
    def requested(self) -> Mode:
        """The mode the client asked for (``AUTO``: the edge picks)."""
        return self.request.mode

    @property
    def route_decision(self) -> Decision:
        """The leg's decision; raises RuntimeError before the leg was routed."""
        if self.decision is None:
            raise RuntimeError("the turn has not been routed yet")
        return self.decision

    @property
    def edge_session(self) -> EdgeSession:
        """The leg's edge session; raises RuntimeError before a cloud leg took one."""
        if self.session is None:
            raise RuntimeError("the turn holds no edge session")
        return self.session

    @property
    def cloud(self) -> CloudConnection:
        """The leg's cloud connection; raises RuntimeError before the leg was pinned to one."""
        if self.conn is None:
            raise RuntimeError("the turn is pinned to no cloud connection")
        return self.conn

    def left_cloud(self) -> None:
        """Tell the router the leg's part in the cloud ended (``RoutedTurn.left_cloud``)."""
        if self.account is not None:
            self.account.left_cloud()

    def continued(self) -> Turn:
        """The leg that continues this turn (called on its first leg): its prompt plus the tokens
        the turn emitted, asking for the tokens left; same clock, text and deadline."""
        out = self.text.token_ids
        left = self.sampling.max_new_tokens - len(out)
        request = replace(self.request, sampling=replace(self.sampling, max_new_tokens=left))
        return Turn(request, self.ids + out, self.clock, self.text, self.deadline)

    def header(self, p: LinkParams, link_id: str) -> TurnHeader:
        """The leg's request header under params ``p``, with no cached tokens, chunks or blocks
        (``edge.link.framing`` fills those in)."""
        return TurnHeader(
            request_id=self.request_id,
            session_id=self.session_id,
            params_version=p.params_version,
            split_layer=p.split_layer,
            prompt_token_ids=tuple(self.ids),
            cached_tokens=0,
            num_chunks=0,
            num_kv_blocks=0,
            sampling=self.sampling,
            link_id=link_id,
        )

    def done(
        self,
        finish_reason: str,
        prompt_tokens: int,
        *,
        output_tokens: int | None = None,
        external_tokens: int = 0,
        split_layer: int = 0,
        sent_bytes: SentBytes | None = None,
        resent_chunks: int = 0,
        repaired_blocks: int = 0,
        params_version: int = 0,
        received_kv_bytes: int = 0,
        edge_decoded_tokens: int = 0,
    ) -> TurnDone:
        """The leg's ``TurnDone``: its decision, the clock's timings and the turn's output so far
        (``output_tokens`` defaults to its length); what it sent, for a leg through the cloud, and what
        came down and what the edge decoded itself, for a remote-prefill leg."""
        d, out = self.route_decision, self.text.token_ids
        return TurnDone(
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            output_tokens=len(out) if output_tokens is None else output_tokens,
            head_tokens=self.head_tokens,
            external_tokens=external_tokens,
            split_layer=split_layer,
            timings=dict(self.clock.timings),
            sent_bytes=sent_bytes,
            output_token_ids=tuple(out),
            mode=d.route.mode,
            predicted_ttft_ms=d.prediction.ttft_ms if d.prediction is not None else 0.0,
            ttft_ms=self.clock.timings.get(Stage.TTFT, 0.0),
            params_version=params_version,
            mode_reason=d.reason,
            session_expired=self.clock.session_expired,
            resumes=self.clock.resumes,
            resent_chunks=resent_chunks,
            repaired_blocks=repaired_blocks,
            received_kv_bytes=received_kv_bytes,
            edge_decoded_tokens=edge_decoded_tokens,
        )
