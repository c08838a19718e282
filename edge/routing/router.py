"""Which route a turn takes: the routes this edge can serve now, and the cost model's choice.

``Router.decide`` takes the requested mode (refused with a clear error when it cannot run) or,
in auto mode, the route with the lowest predicted TTFT (``edge.routing.costmodel``) among those servable
now; for a turn whose client uses the reply only whole, the lowest predicted end-to-end time
(``edge.routing.occupancy``); under cloud pressure or a cloud budget, the lightest on the cloud.
``link_state``, ``request_shape`` and ``load`` are what the cost model sees of the link, the cloud,
the session and the edge's own queues, each passed to its predictions; the cloud's state is read
from ``CloudTarget.current()`` (inside a turn, the connection the turn is pinned to). ``track``
accounts for each routed turn from the choice to its end (``edge.routing.accounting``: in-flight
counts, this edge's own work in the cloud, the outcome that calibrates the models). Reads state
only: no I/O, no grpc.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from tandem.common.protocol.errors import EngineError, ModeUnavailable
from tandem.common.protocol.manifest import ModelShape
from tandem.common.protocol.modes import Mode
from tandem.common.wire import chunks as wire
from tandem.common.wire.kvwire import kv_raw_nbytes
from tandem.edge import metrics
from tandem.edge.compute.local import LocalEngine
from tandem.edge.events import ChatTurn, TurnDone
from tandem.edge.link.connection import CloudTarget
from tandem.edge.routing.accounting import InFlight, RoutedTurn
from tandem.edge.routing.costmodel import CostModel, EdgeLoad, LinkState, Prediction, RequestShape, Route
from tandem.edge.routing.occupancy import (
    Occupancy,
    OccupancyModel,
    PromptKV,
    PromptKVPlan,
    cloud_stage_ms,
    lightest,
    quickest,
    under_pressure,
)
from tandem.edge.session import EdgeSessions


@dataclass(frozen=True)
class Decision:
    """The route a turn runs on, the cost model's predictions for it (TTFT; end-to-end and cloud
    time), and why it was chosen."""

    route: Route
    prediction: Prediction | None
    reason: str
    occupancy: Occupancy | None = None
    kv_plan: PromptKVPlan | None = None  # remote prefill: how the edge comes to hold the prompt's KV


class Router:
    """The routes servable now, the choice among them, and the accounting of the turns it routed
    (``track``: the one place that hears how they run and end). Holds the cost model (``cost``,
    which the edge's turns calibrate) and the local model (``local``); both may be replaced while
    the edge runs, and the cost model then reads the local model's measured rates."""

    def __init__(
        self,
        head_layers: Collection[int],
        cloud: CloudTarget | None,
        sessions: EdgeSessions,
        cost: CostModel,
        *,
        local: LocalEngine | None = None,
        shape: ModelShape | None = None,
        remote_prefill: bool = False,
        head_pending_tokens: Callable[[], Mapping[int, int]] | None = None,
        codec_ratio: float = 1.0,
        cloud_budget_ms: float = 0.0,
        prompt_kv: PromptKV = PromptKV.AUTO,
    ) -> None:
        """``head_layers``: the split layers this edge holds heads for; ``shape``: the model's, for
        wire bytes per token in the cost model (None: wire time not modelled); ``remote_prefill``:
        this edge names whole-model KV blocks (it can take a remote prefill over, given its local model);
        ``head_pending_tokens``: the new tokens waiting or running in each head's batcher now (k ->
        tokens; ``HeadBatcher.pending_tokens``), the head queues the cost model counts;
        ``codec_ratio``: compressed / raw size of this model's wire bytes under zstd (measured at
        start-up); ``cloud_budget_ms``: cloud engine time per request this edge declares (0 = none);
        ``prompt_kv``: where remote prefill's prompt KV comes from (``OccupancyModel.kv_plan``)."""
        self.head_layers = frozenset(head_layers)
        self.head_pending_tokens = head_pending_tokens
        self.remote_prefill = remote_prefill
        self.codec_ratio, self.cloud_budget_ms = codec_ratio, cloud_budget_ms
        self.occupancy = OccupancyModel(
            prompt_kv=prompt_kv
        )  # end-to-end and cloud-time predictions, calibrated by the turns
        self.cloud, self.sessions, self.shape = cloud, sessions, shape
        self._cost = cost
        self._local: LocalEngine | None = None
        self.local = local
        self.inflight = InFlight()  # the turns this router routed, from ``track`` to their end

    # ------------------------------------------------------------------ the turns it routed

    def track(self, decision: Decision) -> RoutedTurn:
        """The accounting of ``decision``'s turn, to run the turn inside (``with``): it counts from
        the block's start to its end, however the block ends; a cloud route's predicted prefill (or
        tail prefill at ``k``) counts in ``cloud_prefill_ms`` until its first token, and its decode
        in ``cloud_decode_ms`` until it leaves the cloud. Notes the route as run (the cost model's
        exploration)."""
        ms = cloud_stage_ms(decision.prediction, self.cost) if decision.prediction is not None else 0.0
        tokens = max(0.0, decision.occupancy.cloud_tokens - 1) if decision.occupancy is not None else 0.0
        self.cost.ran(decision.route)
        return RoutedTurn(decision, self.inflight, ms, tokens, self._heard)

    def _heard(self, d: Decision, done: TurnDone) -> None:
        """A routed turn's outcome: calibrate the cost model and the occupancy model with what it
        measured, and record the prediction errors."""
        assert d.prediction is not None  # ``RoutedTurn.finished`` reports only predicted turns
        self.cost.observe(d.prediction, done.ttft_ms, done.timings)
        metrics.record_prediction(d.route.mode, d.prediction.ttft_ms, done.ttft_ms)
        if d.occupancy is not None:
            self.occupancy.observe(
                d.route.mode, d.occupancy, done.timings, done.output_tokens, done.received_kv_bytes, done.prompt_tokens
            )

    @property
    def cloud_inflight(self) -> int:
        """This edge's turns in the cloud now."""
        return self.inflight.in_cloud

    @property
    def cloud_prefill_ms(self) -> float:
        """The predicted cloud compute (ms) of this edge's cloud turns not yet at their first token:
        what a turn sent now queues behind there (``InFlight.cloud_prefill_ms``)."""
        return self.inflight.cloud_prefill_ms

    def cloud_decode_ms(self) -> float:
        """``W_dec`` at the cloud's measured decode time per token (``InFlight.cloud_decode_ms``);
        0 before the cloud measured that time."""
        d_c = self.cloud.current().load.decode_ms_per_token if self.cloud is not None else 0.0
        return self.inflight.cloud_decode_ms(d_c)

    def load(self) -> EdgeLoad:
        """The edge's own queues now, as the cost model takes them: the local engine's and the heads'."""
        local, heads = self.local, self.head_pending_tokens
        return EdgeLoad(
            local.active if local is not None else 0,
            local.pending_prefill_tokens if local is not None else 0,
            local.pending_prefills if local is not None else 0,
            dict(heads()) if heads is not None else {},
        )

    @property
    def local(self) -> LocalEngine | None:
        """The whole model on this edge (local mode), or None."""
        return self._local

    @local.setter
    def local(self, engine: LocalEngine | None) -> None:
        self._local = engine
        self._share_local_rates()

    @property
    def cost(self) -> CostModel:
        """The cost model that predicts each mode's TTFT."""
        return self._cost

    @cost.setter
    def cost(self, model: CostModel) -> None:
        model.pipeline_tokens = self._cost.pipeline_tokens
        self._cost = model
        self._share_local_rates()

    def _share_local_rates(self) -> None:
        """One measurement of the local model's rates: the cost model reads the engine's own EWMAs."""
        if self._local is not None:
            self._cost.edge.local_prefill_ms_per_token = self._local.prefill_rate
            self._cost.edge.local_decode_ms_per_token = self._local.decode_rate

    # ------------------------------------------------------------------ what this edge can do now

    @property
    def split_layers(self) -> tuple[int, ...]:
        """Split layers usable now: the edge holds the head and the connected cloud the tail."""
        if self.cloud is None:
            return ()
        return tuple(k for k in self.cloud.current().split_layers if k in self.head_layers)

    def routes(self) -> list[Route]:
        """Routes servable now."""
        out = [Route(Mode.LOCAL)] if self.local is not None else []
        if self.cloud is not None and self.cloud.current().params(0) is not None:
            out += [Route(Mode.SPLIT, k) for k in self.split_layers] + [Route(Mode.DIRECT)]
            if self.local is not None and self.remote_prefill:
                out.append(Route(Mode.REMOTE_PREFILL))
        return out

    def degraded(self) -> str:
        """Why not every mode this edge was built for is available ("" when all are)."""
        if self.cloud is None:
            return ""
        c = self.cloud.current()
        if c.params(0) is None:
            return f"cloud not connected ({c.last_error or 'connecting'}): local mode only"
        missing = sorted(self.head_layers - set(self.split_layers))
        return f"the cloud serves no tail for k in {missing}" if missing else ""

    # ------------------------------------------------------------------ what the cost model sees

    def link_state(self) -> LinkState:
        """The cost model's view of the link and the cloud right now."""
        st = LinkState(num_layers=self.shape.num_layers if self.shape else 30)
        if self.cloud is None:
            return st
        c = self.cloud.current()
        load = c.load
        st.rtt_ms, st.goodput_mbps = c.rtt_ms.value, c.goodput_mbps.value
        st.cloud_prefill_ms_per_token = load.prefill_ms_per_token
        st.cloud_tail_prefill_ms_per_token = dict(load.tail_prefill_ms_per_token)
        st.queue_wait_ms = load.queue_wait_ms
        st.cloud_decode_ms_per_token, st.kv_cache_usage = load.decode_ms_per_token, load.kv_cache_usage
        st.cloud_waiting = load.waiting_requests
        st.ttft_slo_ms, st.itl_slo_ms = c.base_offer.ttft_slo_ms, c.base_offer.itl_p99_slo_ms
        p = c.params(0)
        share = p.max_concurrent_requests if p is not None else 1
        st.cloud_busy = load.waiting_requests > 0 or self.cloud_inflight >= share
        st.own_cloud_prefill_ms = self.cloud_prefill_ms
        st.own_cloud_decode_ms = self.cloud_decode_ms()
        if p is not None:  # the blocks remote prefill moves, on an edge without split heads too
            st.block_size_tokens = p.kv_block_size_tokens
        if p is not None and self.shape is not None:
            sh = self.shape
            full = (sh.num_layers, 2, sh.num_kv_heads, p.kv_block_size_tokens, sh.head_dim)
            st.full_kv_block_bytes = kv_raw_nbytes(full, p.kv_wire_dtype) * (
                self.codec_ratio if p.codec != wire.Codec.NONE else 1.0
            )
        for k in self.head_layers:
            pk = c.params(k)
            if pk is not None:
                st.block_size_tokens = pk.kv_block_size_tokens
                ratio = self.codec_ratio if pk.codec != wire.Codec.NONE else 1.0
                per_token = self.wire_bytes_per_token(k, pk.wire_dtype, pk.kv_wire_dtype, pk.kv_block_size_tokens)
                st.bytes_per_token[k] = per_token * ratio
        return st

    def wire_bytes_per_token(
        self, k: int, dtype: wire.WireDtype, kv_dtype: wire.WireDtype = wire.WireDtype.FP32, block_tokens: int = 32
    ) -> float:
        """Uncompressed uplink bytes per prompt token at split layer ``k``: activations in ``dtype``
        and head KV of layers ``[0, k)`` in ``kv_dtype`` (its scales spread over a block of
        ``block_tokens``); 0 without a model shape."""
        if self.shape is None:
            return 0.0
        sh = self.shape
        block = kv_raw_nbytes((k, 2, sh.num_kv_heads, block_tokens, sh.head_dim), kv_dtype) if k else 0
        return wire.raw_nbytes_of(1, dtype, sh.hidden_size) + block / block_tokens

    def request_shape(self, request: ChatTurn, ids: list[int]) -> RequestShape:
        """What the session already holds, per route (for the cost model)."""
        local_cached = self.local.cached_tokens(request.session_id, ids) if self.local is not None else 0
        s = self.sessions.peek(request.session_id) if request.session_id else None
        head, cloud = {}, {}
        if s is not None and s.k in self.head_layers:
            head[s.k] = s.common_prefix(ids)
            cloud[s.k] = min(s.cloud_tokens, s.common_prefix(ids))
        return RequestShape(len(ids), local_cached, head, cloud)

    # ------------------------------------------------------------------ the choice

    def decide(self, request: ChatTurn, ids: list[int]) -> Decision:
        """The route for this turn: the requested one (refused with a clear error when it cannot
        run), or in auto mode the cost model's choice among the routes servable now.

        Raises:
            ModeUnavailable: the requested mode (or split layer) is not available on this edge now.
            EngineError: the requested mode needs the cloud, which cannot serve it now.
        """
        candidates = self._candidates(request)
        # every turn gets a prediction, so that every turn calibrates the cost model (and reports its error)
        shape, link, load = self.request_shape(request, ids), self.link_state(), self.load()
        preds = [self.cost.predict(r, shape, link, load) for r in candidates]
        queue_ms = self.cost.local_queue_ms(load)  # what remote prefill's own run on the edge waits for
        want = request.mode
        if len(preds) == 1 and want is not Mode.AUTO:
            pick, why = preds[0], "requested"
        elif want is not Mode.AUTO:
            pick = min(preds, key=lambda p: p.ttft_ms)
            why = f"requested {want}; lowest predicted TTFT of its split layers"
        else:
            pick, why = self._auto(preds, shape, link, request, queue_ms)
        occupancy = self.occupancy.predict(pick, shape, link, self.cost, request.sampling.max_new_tokens, queue_ms)
        plan = None
        if pick.route.mode is Mode.REMOTE_PREFILL:
            plan = self.occupancy.kv_plan(shape, link, self.cost, pick.ttft_ms, queue_ms)
        return Decision(pick.route, pick, why, occupancy, plan)

    def _auto(
        self, preds: list[Prediction], shape: RequestShape, link: LinkState, request: ChatTurn, queue_ms: float = 0.0
    ) -> tuple[Prediction, str]:
        """The lowest predicted TTFT (remote prefill's is direct's: it is chosen for the cloud time it
        saves, not for its TTFT), or for a turn whose client uses the reply only whole
        (``ChatTurn.whole_reply``) the lowest predicted end-to-end time (``edge.routing.occupancy.quickest``);
        under cloud pressure or a declared cloud budget, the route that holds the cloud least within
        the objectives (``edge.routing.occupancy.lightest``)."""
        hold_cloud_least = self.cloud_budget_ms > 0 or under_pressure(link)
        occ: dict[Route, Occupancy] = {}
        if request.whole_reply or hold_cloud_least:
            n = request.sampling.max_new_tokens
            occ = {p.route: self.occupancy.predict(p, shape, link, self.cost, n, queue_ms) for p in preds}
        if request.whole_reply:
            pick, why = quickest(preds, occ, self.occupancy.expected_output(request.sampling.max_new_tokens))
        else:
            fast = [p for p in preds if p.route.mode is not Mode.REMOTE_PREFILL]
            pick, why = self.cost.choose(fast or preds)
        if hold_cloud_least:
            light = lightest(preds, occ, link, self.cloud_budget_ms)
            if light is not None:
                pick, why = light
        return pick, f"auto: {why}"

    def fallback(self, request: ChatTurn, ids: list[int], reason: str) -> Decision:
        """Local mode for a turn the cloud refused before its first token (auto mode only)."""
        local = Route(Mode.LOCAL)
        p = self.cost.predict(local, self.request_shape(request, ids), self.link_state(), self.load())
        return Decision(local, p, reason)

    def fallback_to_cloud(self, request: ChatTurn, ids: list[int], reason: str) -> Decision | None:
        """Direct mode for a turn local mode refused before its first token (auto mode only), or
        None while the cloud cannot take it."""
        direct = Route(Mode.DIRECT)
        if direct not in self.routes():
            return None
        p = self.cost.predict(direct, self.request_shape(request, ids), self.link_state(), self.load())
        return Decision(direct, p, reason)

    def _candidates(self, request: ChatTurn) -> list[Route]:
        """The routes the request may take (raises as ``decide``)."""
        candidates = _CANDIDATES[request.mode](self, request)
        if not candidates:
            raise EngineError(f"no mode can serve now: {self.degraded()}")
        return candidates

    def _local_only(self, request: ChatTurn) -> list[Route]:
        if self.local is None:
            raise ModeUnavailable("local mode needs the whole model on the edge (edge-full.onnx); none loaded")
        return [Route(Mode.LOCAL)]

    def _direct_only(self, request: ChatTurn) -> list[Route]:
        if Route(Mode.DIRECT) not in self.routes():
            raise EngineError(f"direct mode needs the cloud; {self.degraded() or 'not connected'}")
        return [Route(Mode.DIRECT)]

    def _split_only(self, request: ChatTurn) -> list[Route]:
        routes, k = self.routes(), request.split_layer
        ks = [k] if k else sorted(self.head_layers)
        candidates = [Route(Mode.SPLIT, j) for j in ks if Route(Mode.SPLIT, j) in routes]
        if not candidates:
            if k and k not in self.head_layers:
                raise ModeUnavailable(
                    f"this edge holds heads for k in {sorted(self.head_layers)}, not k={k}", param="split_layer"
                )
            raise EngineError(f"split mode needs the cloud and a common split layer; {self.degraded()}")
        return candidates

    def _remote_prefill_only(self, request: ChatTurn) -> list[Route]:
        if self.local is None or not self.remote_prefill:
            raise ModeUnavailable("remote prefill needs the whole model on the edge (edge-full.onnx); none loaded")
        if Route(Mode.REMOTE_PREFILL) not in self.routes():
            raise EngineError(f"remote prefill needs the cloud; {self.degraded() or 'not connected'}")
        return [Route(Mode.REMOTE_PREFILL)]

    def _any(self, request: ChatTurn) -> list[Route]:
        return self.routes()


_CANDIDATES = {
    Mode.LOCAL: Router._local_only,
    Mode.DIRECT: Router._direct_only,
    Mode.SPLIT: Router._split_only,
    Mode.REMOTE_PREFILL: Router._remote_prefill_only,
    Mode.AUTO: Router._any,
}
