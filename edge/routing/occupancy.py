"""Beyond the time to first token: each route's predicted end-to-end time and cloud occupancy
(engine milliseconds per request), from the same measurements as the TTFT model
(``edge.routing.costmodel``), and the auto choice that holds the cloud least within the objectives.

For a prompt of ``T`` tokens and ``N`` expected output tokens (the recent outputs' mean, at most
the request's ``max_new_tokens``), with the TTFT prediction ``F`` of the route, the cloud's time
per output token ``d_c`` and the edge's ``d_e``, all in ms:

    local           e2e = F + (N - 1) d_e                    cloud = 0
    direct          e2e = F + (N - 1) d_c                    cloud = P_c + (N - 1) d_c
    split           e2e = F + (N - 1) d_c                    cloud = P_c + T x_c + (N - 1) d_c
    remote prefill  handover h = max(P_local(n_edge) - F, w + n_down * b / G_down)
                                 + P_local(r + m) + RTT
                    (no P_local(r + m) where it fits in the RTT: ``takeover_first``;
                    h = max(0, P_local(n_edge) + RTT - F) where no block comes down and the
                    edge's run ends first: its takeover goes up before the first token)
                    m = min(N, 1 + h / d_c) tokens come from the cloud
                    e2e = F + h + (N - m) d_e                cloud = P_c + h
                    (m = N: the cloud decodes all, as direct)

``P_c`` is the route's cloud compute stage as the TTFT model predicts it (the whole-model prefill,
or the tail prefill at ``k``), the engine time until the first token. A split then hands the prompt
over to the decode engine, which loads the KV of every layer before its first step: ``x_c`` is that
hand-off's measured time per prompt token (``cloud_decode_first_token_ms`` of split turns), so that
a split does not look lighter on the cloud than it is.

A remote-prefill turn's edge gets the prompt's KV two ways at once (``PromptKVPlan``): from the
turn's start it computes the tokens ``n_edge`` past what its session holds, from the front, while
the cloud's ``n_down`` blocks after them come down once the first token is out (the terms without
``w + n_down * b / G_down`` where none come down); ``r`` is what neither covers, the partial last
block where blocks come down. ``prompt_kv_plan`` puts the boundary where the handover is predicted
earliest (the split of Cake, "Compute Or Load KV Cache? Why Not Both?", Jin et al. 2024, between
computing a cached prefix and loading it): a GPU edge that prefills the prompt before the cloud's
first token is back needs no block, an edge that prefills slower than the link carries KV takes
most of them, and a policy (``PromptKV``, ``EdgeConfig.remote_prefill_prompt_kv``) may force either.

``d_e`` and ``d_c`` are what the clients of served turns saw between their first and last
tokens, per token (local turns for the edge; direct and split turns for the cloud): the quantity
the end-to-end time is made of. The local engine's own decode-step rate stood at 4.4 ms a token
on an H200 while its local turns' clients saw 1.4-1.6 (the SmolLM2 matrix; the gap's cause not
traced), and put whole replies on the cloud that the edge finished 1.7-1.8x sooner. Before a turn
of the kind was served: the local engine's decode-step rate, and the cloud's reported decode time
per token (until the cloud has measured one, ``d_e``: the same model's, as the TTFT model takes
the edge's prefill rate for the cloud's before it is measured).

``b`` is a whole-model block's bytes in the link's KV format, ``G_down`` the downlink goodput
measured on earlier downloads (before one: the uplink's), ``w`` the measured wait for the engine's
KV writes after the first token. Every served turn
calibrates ``N``, ``G_down`` and ``w``, and its predicted end-to-end time and cloud time are
compared with the measured ones (``tandem:prediction_error_ratio{mode,quantity}``).

``lightest`` is the choice under cloud pressure (the cloud reports a queue or a nearly full KV
cache, ``ServerLoad``) or under a cloud budget the edge declares: among
the routes whose TTFT is within the objective (else within ``LIGHT_TTFT_SLACK`` of the best) and
whose decoding side keeps the inter-token objective, the one with the least cloud time (within
the budget, the fastest of them). Pure domain code: no grpc, no ONNX.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from tandem.common.protocol.modes import Mode
from tandem.common.runtime.ewma import Ewma
from tandem.edge import metrics
from tandem.edge.routing.costmodel import (
    CostModel,
    LinkState,
    Prediction,
    RequestShape,
    Route,
)
from tandem.stages import Stage, Timings

LIGHT_TTFT_SLACK = 1.5  # without a TTFT objective: within this factor of the best TTFT
KV_PRESSURE = 0.9  # the cloud's KV cache use from which it is under pressure
CLOUD_MODES = (Mode.DIRECT, Mode.SPLIT, Mode.REMOTE_PREFILL)


class PromptKV(enum.StrEnum):
    """Where a remote-prefill turn's edge gets the prompt's KV (``EdgeConfig.remote_prefill_prompt_kv``)."""

    AUTO = "auto"  # computed here up to the boundary of the earliest predicted handover, the rest down
    DOWNLOAD = "download"  # every full block the session lacks comes down (the partial last one is computed here)
    COMPUTE = "compute"  # all computed here, beside the cloud's prefill: no block comes down


@dataclass(frozen=True)
class PromptKVPlan:
    """How a remote-prefill turn's edge comes to hold the prompt's ``T`` tokens of KV: from the
    turn's start it computes ``ids[held_tokens:compute_to_tokens]`` itself (one run, beside the
    cloud's prefill), while the blocks ``[first_down_block, T // B)`` come down. ``compute_to_tokens``
    is ``first_down_block * B``, or ``T`` where no block comes down (the partial last block then
    computed up front too)."""

    held_tokens: int  # the prompt's tokens the session's KV covers as the turn starts
    compute_to_tokens: int
    first_down_block: int
    down_blocks: int
    ready_ms: float = 0.0  # predicted: from the first token to the edge holding the planned KV
    edge_run_ms: float = 0.0  # predicted: from the turn's start to the end of the edge's own run (its queue in)

    @property
    def edge_tokens(self) -> int:
        """The prompt tokens the edge computes up front."""
        return max(0, self.compute_to_tokens - self.held_tokens)


def prompt_kv_plan(
    prompt_tokens: int,
    held_tokens: int,
    block_tokens: int,
    first_token_ms: float,
    local_runs_ms: Callable[[np.ndarray], np.ndarray],
    save_wait_ms: float,
    block_down_ms: float,
    policy: PromptKV = PromptKV.AUTO,
    queue_ms: float = 0.0,
) -> PromptKVPlan:
    """The plan of a remote-prefill turn's prompt KV (see the module doc): for each boundary block
    ``c`` from the session's held blocks to the prompt's full blocks, the edge's run of the tokens
    before it finishes at ``P_local(n_edge)`` after the turn's start, the blocks from ``c`` on are
    down ``w + n_down * b / G_down`` after the first token (at ``first_token_ms``; no wait where
    none come down), and the partial block left over takes one more run; ``AUTO`` takes the ``c``
    with the earliest end of both, preferring fewer edge tokens on a tie (the edge stays free for
    other turns). ``local_runs_ms``: the edge's whole-model run time of each of an array of token
    counts (``CostModel.local_runs_ms``); ``block_down_ms``: one block's time on the downlink;
    ``queue_ms``: what the edge's run waits for on the local engine first (``CostModel.local_queue_ms``)."""
    policy = PromptKV(policy)
    T, B = max(0, prompt_tokens), max(1, block_tokens)
    held = min(max(0, held_tokens), T)
    n_full = T // B
    if policy is PromptKV.DOWNLOAD:
        c = np.array([held // B], np.int64)
    elif policy is PromptKV.COMPUTE:
        c = np.array([n_full], np.int64)
    else:
        c = np.arange(held // B, n_full + 1, dtype=np.int64)
    down = n_full - c
    compute_to = np.where(down > 0, c * B, T)
    edge = np.maximum(0, compute_to - held)
    fetched = np.where(down > 0, save_wait_ms + down * block_down_ms, 0.0)
    ran = np.where(edge > 0, max(0.0, queue_ms) + local_runs_ms(edge), 0.0)
    ready = np.maximum(ran - first_token_ms, fetched)
    left = np.where(down > 0, T - n_full * B, 0)  # the partial last block, where blocks come down
    total = ready + local_runs_ms(left)
    i = int(np.lexsort((edge, total))[0])
    ready_i = float(max(0.0, ready[i]))
    return PromptKVPlan(held, int(compute_to[i]), int(c[i]), int(down[i]), ready_i, float(ran[i]))


@dataclass(frozen=True)
class Occupancy:
    """One route's predicted end-to-end time and cloud engine time (ms), and the output tokens
    the cloud decodes (remote prefill: before the handover)."""

    e2e_ms: float
    cloud_ms: float
    cloud_tokens: float
    decode_ms_per_token: float  # the decoding side's time per token after the handover (or throughout)


@dataclass
class OccupancyModel:
    """The measurements beyond the TTFT model's: output lengths, the downlink's goodput and the
    wait for the cloud's KV writes, each an exponentially weighted mean; and the policy of remote
    prefill's prompt KV (``prompt_kv``)."""

    output_tokens: Ewma = field(default_factory=Ewma)
    down_goodput_mbps: Ewma = field(default_factory=Ewma)
    kv_save_wait_ms: Ewma = field(default_factory=Ewma)
    split_handoff_ms_per_token: Ewma = field(default_factory=Ewma)  # ``x_c``
    prompt_kv: PromptKV = PromptKV.AUTO  # where remote prefill's prompt KV comes from (``kv_plan``)
    local_itl_ms: Ewma = field(default_factory=Ewma)  # ``d_e`` as local turns' clients saw it
    cloud_itl_ms: Ewma = field(default_factory=Ewma)  # ``d_c`` as direct and split turns' clients saw it

    def expected_output(self, max_new_tokens: int) -> float:
        n = self.output_tokens.value
        return float(max_new_tokens) if n <= 0 else min(float(max_new_tokens), n)

    def predict(
        self,
        p: Prediction,
        shape: RequestShape,
        link: LinkState,
        cost: CostModel,
        max_new_tokens: int,
        queue_ms: float = 0.0,
    ) -> Occupancy:
        """``p``'s route's end-to-end time and cloud time (see the module doc); ``queue_ms``: the
        local engine's queue, which remote prefill's own run on the edge waits for first."""
        N = self.expected_output(max_new_tokens)
        d_e, d_c = self.edge_ms_per_token(cost), self.cloud_ms_per_token(link, cost)
        mode = p.route.mode
        if mode is Mode.LOCAL:
            return Occupancy(p.ttft_ms + (N - 1) * d_e, 0.0, 0.0, d_e)
        cloud_first = cloud_stage_ms(p, cost)
        if mode is Mode.SPLIT:
            cloud_first += shape.prompt_tokens * self.split_handoff_ms_per_token.value
        cloud_all = Occupancy(p.ttft_ms + (N - 1) * d_c, cloud_first + (N - 1) * d_c, N, d_c)
        if mode is not Mode.REMOTE_PREFILL or d_c <= 0:
            return cloud_all
        h = self.handover_ms(shape, link, cost, d_c, p.ttft_ms, queue_ms)
        m = min(N, 1 + h / d_c)
        if m >= N:
            return cloud_all
        return Occupancy(p.ttft_ms + h + (N - m) * d_e, cloud_first + h, m, d_e)

    def edge_ms_per_token(self, cost: CostModel) -> float:
        """``d_e``: the time per output token local turns' clients measured (``local_itl_ms``), or
        before one did, the local engine's decode step (ms)."""
        if self.local_itl_ms.samples:
            return self.local_itl_ms.value
        return cost.edge.local_decode_ms_per_token.value

    def cloud_ms_per_token(self, link: LinkState, cost: CostModel) -> float:
        """``d_c``: the time per output token direct and split turns' clients measured
        (``cloud_itl_ms``), or before one did, the cloud's reported decode time per token
        (``cloud_decode_ms_per_token``) (ms)."""
        if self.cloud_itl_ms.samples:
            return self.cloud_itl_ms.value
        return cloud_decode_ms_per_token(link, cost)

    def kv_plan(
        self, shape: RequestShape, link: LinkState, cost: CostModel, first_token_ms: float, queue_ms: float = 0.0
    ) -> PromptKVPlan:
        """The remote-prefill plan of a turn whose first token is predicted at ``first_token_ms``
        (``prompt_kv_plan`` under ``prompt_kv``, with this model's downlink goodput and KV-write wait;
        ``queue_ms``: the local engine's queue, ``CostModel.local_queue_ms``)."""
        g = self.down_goodput_mbps.value or link.goodput_mbps
        block_ms = link.full_kv_block_bytes * 8 / (g * 1e3) if g > 0 else 0.0
        return prompt_kv_plan(
            shape.prompt_tokens,
            shape.local_cached_tokens,
            link.block_size_tokens,
            first_token_ms,
            cost.local_runs_ms,
            self.kv_save_wait_ms.value,
            block_ms,
            self.prompt_kv,
            queue_ms,
        )

    def handover_ms(
        self,
        shape: RequestShape,
        link: LinkState,
        cost: CostModel,
        d_c: float,
        first_token_ms: float,
        queue_ms: float = 0.0,
    ) -> float:
        """From the first token to the cloud's handover: the edge holding the prompt's KV as planned
        (``kv_plan``: its own run, the blocks on the downlink after the KV writes), the edge's run
        over what neither covers and the tokens meanwhile (unless it fits in the takeover's round
        trip: ``takeover_first``), a round trip. Where no block comes down and the edge's own run
        ends before the first token, the takeover goes up then, for that token: the cloud stops at
        the later of its first token and the takeover's arrival, ``max(0, P_local + RTT - F)``."""
        plan = self.kv_plan(shape, link, cost, first_token_ms, queue_ms)
        if not plan.down_blocks and plan.edge_run_ms < first_token_ms:  # the takeover goes up before it
            return max(0.0, plan.edge_run_ms + link.rtt_ms - first_token_ms)
        B, T = max(1, link.block_size_tokens), shape.prompt_tokens
        left = T - (plan.first_down_block + plan.down_blocks) * B if plan.down_blocks else 0
        m0 = plan.ready_ms / d_c if d_c > 0 else 0.0
        local = cost.local_run_ms(left + m0 + 1)
        return plan.ready_ms + link.rtt_ms + (0.0 if takeover_first(local, link.rtt_ms) else local)

    def observe(
        self,
        mode: Mode,
        predicted: Occupancy,
        timings: Timings,
        output_tokens: int,
        kv_bytes: int,
        prompt_tokens: int = 0,
    ) -> None:
        """Calibrate with a served turn and record the prediction errors of its end-to-end time and
        cloud time (``timings``: its stages, ms)."""
        if output_tokens > 0:
            self.output_tokens.add(output_tokens)
        decoding_ms = timings.get(Stage.TOTAL, 0.0) - timings.get(Stage.TTFT, 0.0)
        if output_tokens >= 2 and Stage.TTFT in timings and decoding_ms > 0:
            itl = {Mode.LOCAL: self.local_itl_ms, Mode.DIRECT: self.cloud_itl_ms, Mode.SPLIT: self.cloud_itl_ms}
            if mode in itl:
                itl[mode].add(decoding_ms / (output_tokens - 1))
        if mode is Mode.SPLIT and prompt_tokens > 0 and Stage.CLOUD_DECODE_FIRST_TOKEN in timings:
            self.split_handoff_ms_per_token.add(timings[Stage.CLOUD_DECODE_FIRST_TOKEN] / prompt_tokens)
        wait = timings.get(Stage.CLOUD_KV_SAVE_WAIT)
        if wait is not None and (wait > 0 or kv_bytes > 0):  # a turn that asked for no block waited for none
            self.kv_save_wait_ms.add(wait)
        down_ms = timings.get(Stage.KV_DOWNLINK, 0.0) - timings.get(Stage.TTFT, 0.0)
        down_ms -= timings.get(Stage.CLOUD_KV_SAVE_WAIT, 0.0)
        if kv_bytes >= 32 << 10 and down_ms > 0:
            self.down_goodput_mbps.add(kv_bytes * 8 / (down_ms * 1e3))
        metrics.record_prediction_of(mode, "e2e", predicted.e2e_ms, timings.get(Stage.TOTAL, 0.0))
        if mode in CLOUD_MODES:
            cloud = timings.get(Stage.CLOUD_DECODE, 0.0) + timings.get(Stage.CLOUD_TAIL_PREFILL, 0.0)
            metrics.record_prediction_of(mode, "cloud_engine", predicted.cloud_ms, cloud)


def cloud_decode_ms_per_token(link: LinkState, cost: CostModel) -> float:
    """``d_c``: the cloud's measured decode time per output token, or before it measured one (a
    cloud that has decoded nothing yet reports 0) the edge's, the same model's, so that an
    unmeasured cloud does not look as if it decoded for free (ms; 0 while neither is measured)."""
    measured = link.cloud_decode_ms_per_token
    return measured if measured > 0 else cost.edge.local_decode_ms_per_token.value


def cloud_stage_ms(p: Prediction, cost: CostModel) -> float:
    """The cloud compute stages of ``p`` as its lines predict them (ms)."""
    return cost.cloud_stages_ms(p.stages)


def under_pressure(link: LinkState) -> bool:
    """The cloud reports pressure (``ServerLoad``): requests waiting for admission, or a nearly full KV cache."""
    return link.cloud_waiting > 0 or link.kv_cache_usage >= KV_PRESSURE


def lightest(
    preds: list[Prediction], occ: Mapping[Route, Occupancy], link: LinkState, budget_ms: float
) -> tuple[Prediction, str] | None:
    """The route that holds the cloud least within the objectives (see the module doc), with why;
    None when no route keeps them."""
    if not preds:
        return None
    best = min(p.ttft_ms for p in preds)
    bound = link.ttft_slo_ms if link.ttft_slo_ms > 0 else best * LIGHT_TTFT_SLACK
    ok = [p for p in preds if p.ttft_ms <= max(bound, best) and _keeps_itl(occ[p.route], link)]
    if not ok:
        return None
    if budget_ms > 0:
        within = [p for p in ok if occ[p.route].cloud_ms <= budget_ms]
        if within:
            return min(within, key=lambda p: p.ttft_ms), f"cloud budget {budget_ms:.0f} ms: fastest within it"
    pick = min(ok, key=lambda p: (occ[p.route].cloud_ms, p.ttft_ms))
    return pick, "cloud under pressure: least cloud time within the objectives"


def quickest(
    preds: list[Prediction], occ: Mapping[Route, Occupancy], output_tokens: float = 0.0
) -> tuple[Prediction, str]:
    """The route with the lowest predicted end-to-end time (``Occupancy.e2e_ms``), with why: the
    four quickest routes' predictions and what they assume, ``output_tokens`` (the expected reply,
    ``OccupancyModel.expected_output``; left out where 0) at the edge's and the cloud's time per
    token, e.g. ``... (local 172 ms, direct 217 ms; 128 tokens at local 1.30, cloud 1.50
    ms/token)``. The choice for a client that uses the reply only whole, to which the time to the
    first token is the time to the last. Raises ValueError when ``preds`` is empty."""
    if not preds:
        raise ValueError("no route to choose from")
    ranked = sorted(preds, key=lambda p: (occ[p.route].e2e_ms, occ[p.route].cloud_ms))
    seen = ", ".join(f"{_route_name(p.route)} {occ[p.route].e2e_ms:.0f} ms" for p in ranked[:4])
    rates = []
    for side, mode in (("local", Mode.LOCAL), ("cloud", Mode.DIRECT)):
        route = next((p.route for p in preds if p.route.mode is mode), None)
        if route is not None:
            rates.append(f"{side} {occ[route].decode_ms_per_token:.2f}")
    if rates:
        tokens = f"{output_tokens:.0f} tokens at " if output_tokens > 0 else ""
        seen += f"; {tokens}{', '.join(rates)} ms/token"
    return ranked[0], f"whole reply: lowest predicted end-to-end time ({seen})"


def _route_name(r: Route) -> str:
    return f"{r.mode.value} k={r.k}" if r.k else r.mode.value


def _keeps_itl(o: Occupancy, link: LinkState) -> bool:
    return link.itl_slo_ms <= 0 or o.decode_ms_per_token <= link.itl_slo_ms


def takeover_first(catch_up_ms: float, rtt_ms: float) -> bool:
    """Whether remote prefill's takeover goes up before the edge's catch-up run (over the partial
    last block and the cloud's tokens so far), predicted at ``catch_up_ms``: where that run takes
    no longer than ``rtt_ms``, the time the takeover takes to reach the cloud and its final to come
    back, the cloud stops one run sooner and the client's stream does not wait for the run;
    otherwise the edge takes over once the run is done (a slow edge would stall the stream for the
    run, the cloud still able to finish the reply). An unknown prediction or RTT (0) says no."""
    return 0.0 < catch_up_ms <= rtt_ms
