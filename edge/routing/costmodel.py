"""The edge's TTFT cost model: predict each serving mode's time to first token, pick the lowest.

Modes (``Route``): ``local`` (the whole model in ONNX Runtime here), ``split`` at a split
layer ``k`` (head here, tail and decode in the cloud), ``direct`` (token ids up, the cloud
runs every layer). For a prompt of ``T`` tokens, the formula per mode (all times in ms):

    local(T)    = q_local + p + min(p, W_heads),  p = P_local(n_local)               + r_local
    direct(T)   = RTT + T * b_ids / G + q_cloud + c + s_dec(c),  c = P_cloud(T)      + r_direct
    split(T, k) = W_head[k] + h + min(h, W_local + W_heads - W_head[k]) + n_up * b_split[k] / G
                  + RTT + q_cloud + t + s_dec(t),  t = P_tail[k](n_tail)            + r_split[k],
                  h = P_head[k](n_head),   s_dec(p) = alpha_dec * min(p, W_dec)

* ``P_*(n) = a + b * n + c * n^2``: the time of each compute stage for ``n`` tokens (a fixed
  part, projections and MLP linear in ``n``, attention over the prompt quadratic), fitted online
  by exponentially weighted least squares of the *relative* error (each sample weighted by
  ``1 / ms^2``: the choice compares ratios; ``Line``, forgetting factor ``LINE_DECAY``) on the
  stage timings every request reports: ``local_prefill_ms`` (local), ``edge_head_ms`` (head at
  ``k``), ``cloud_tail_prefill_ms`` (tail at ``k``, from the cloud's ``Final``),
  ``cloud_decode_first_token_ms`` (the cloud's whole-model prefill, direct mode). Until a stage
  has requests of different lengths, its slope is the measured rate: the edge's own (local
  engine, head warm-up) or the cloud's (``ServerLoad``, polled and in every ``Final``; before the
  cloud measured one, the edge's whole-model rate scaled to the layers run).
* ``n_local`` / ``n_head``: prompt tokens the session's edge state does not cover (the longest
  common prefix with the state of the previous turn is reused); ``n_up``: tokens whose
  activations the cloud lacks; ``n_tail = T - B * floor(n_cloud / B)`` (tail KV of full blocks
  the cloud computed in earlier turns is loaded, not recomputed; ``B`` the KV block size).
* ``q_local``: the local engine's queue this prefill joins (its runs are FIFO, one at a time): the
  prompt tokens of the prefills waiting or running x the local prefill rate (``W_local``), plus the
  other requests decoding x the local decode step (each runs one step before it). ``W_head[k]``:
  the head batcher's queue at ``k`` (FIFO), the new tokens of its rows waiting or running x the
  head's rate; ``W_heads`` the sum over every ``k`` (these queues come with each prediction, an
  ``EdgeLoad`` the router reads when it decides; the model keeps no load of its own). The heads
  and the local engine run on the same processor, beside each other rather than behind: shared
  with one other stream of ``W`` ms of
  work, a run of ``p`` ms alone finishes after ``p + min(p, W)`` (processor sharing: both run at
  half speed until the shorter is done). ``q_cloud``: the
  cloud's mean admission wait when its queue is not empty or this edge already uses its share
  (its own requests in the cloud count from when it sends them), else 0, and at least the predicted
  cloud compute of this edge's turns in the cloud that have not had their first token (``W_cloud``:
  their prefills run before or beside this one, as the local queue's do). ``W_dec``: how long this
  edge's turns in the cloud keep its decode engine busy decoding (``InFlight.cloud_decode_ms``; a
  turn still in prefill with all of its output to come, since it decodes next); a
  cloud prefill beside them shares the engines' processor with that stream, by a fraction
  ``alpha_dec`` of the processor-sharing bound: 1 where the engines share CPU cores one step at a
  time, near 0 on a GPU whose decode steps batch beside a prefill almost for free. ``alpha_dec`` is
  learnt from the cloud stages measured beside decodes (``DECODE_OVERLAP_ALPHA``; before any,
  ``DECODE_OVERLAP_PRIOR``).
* What a stage's measured time holds beyond the stage's own compute (``Prediction.within``): the
  sharing terms above, and the part of ``q_cloud`` beyond the admission wait (``W_cloud``, spent
  inside the engine beside the other prefills). The stage timings are the runs alone
  (``local_queue_ms`` and ``edge_head_queue_ms`` are the waits before them, timed apart), so a line
  is fitted on the measured time less that predicted contention, and the residual sees the measured
  stage as a whole: counting a queue both in its term and inside a stage time would make the
  residual cancel the queue term.
* ``b_split[k]``: bytes per prompt token on the wire (activations in the link's wire dtype and
  head KV of layers ``[0, k)``, times the codec's measured ratio); ``b_ids`` = 5 bytes (a varint);
  ``G`` goodput, ``RTT`` round trip, both measured (``edge.link.connection``).
* ``r_*``: per-route residual, an exponentially weighted mean (alpha ``RESIDUAL_ALPHA``) of
  measured TTFT minus the formula: what the stages leave out (tokenization, framing, the
  transport's own overhead), kept per prompt-length octave (``length_bucket``: 64 and 100
  tokens share one, 256 another) and read from the nearest octave that has one, so that the
  noise of long prompts (tens of ms) does not land on short ones. The prediction stays above
  ``MIN_PREDICTION_FRACTION`` of the formula.

Why each of these terms, and the calibrations they replaced, measured: docs/design-decisions.md,
"Cost model and choice".

``choose`` takes the route with the lowest prediction, with hysteresis: the route chosen last
stays unless another is predicted ``hysteresis`` (5%) faster, so near-ties do not flap. To
keep the fits fresh, a route predicted within ``explore_within`` of the best that has not
served any request (of any mode: requested ones count) in the last ``explore_every`` choices runs
once (the cost is bounded by ``explore_within``, at most once per route per ``explore_every``
choices; with mixed traffic the other modes' requests keep every route fresh and auto never explores).
Pure domain code: no grpc, no ONNX.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from tandem.common.protocol.modes import Mode
from tandem.common.runtime.ewma import Ewma
from tandem.stages import Stage

ID_BYTES = 5  # a token id as a protobuf varint, at most
LINE_DECAY = 0.95  # weight of a stage's older samples per new one (about the last 20-40 count)
RESIDUAL_ALPHA = 0.3
MIN_WEIGHT_MS = 1.0  # a stage sample below this weighs as if it took this long (no infinite weights)
MIN_PREDICTION_FRACTION = 0.5
# Most pieces a pipelined head runs in: the overlap keeps 1 - 1/8 of its ideal, and the head KV
# the pieces re-read stays within 4x one pass (on the H200, 32 pieces of a 4096-token prompt at
# the 1B shape's 16 KB of head KV per token spent 1.5 s moving it; docs/benchmarks.md).
MAX_PIPELINE_PIECES = 8
DECODE_OVERLAP_PRIOR = 0.5  # alpha_dec before a cloud stage was measured beside decodes: between GPU and CPU
DECODE_OVERLAP_ALPHA = 0.2  # the weight of each new alpha_dec sample


@dataclass
class Line:
    """``time_ms = a + b * n + c * n**2`` for one compute stage: prefill costs a fixed part, a part
    linear in the tokens (projections, MLP) and a part quadratic in them (attention over the
    prompt). Fitted by exponentially weighted least squares of the measured stage time on the
    stage's token count (all coefficients >= 0). With samples of one length only (spread below
    20% of their mean) the slope is the given prior rate and only ``a`` is fitted, unless that
    slope alone already overshoots the samples (a rate measured on short requests, whose fixed
    part it counts per token): then the line runs through the origin and the samples' mean.
    With two lengths, a line; with three samples or more, ``c = 0`` unless the three-term fit is
    possible and non-negative. Whatever the branch, the line passes through the samples' mean
    where its coefficients allow."""

    decay: float = LINE_DECAY
    s: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)))  # weighted sums of x x^T, x = [1, n, n^2]
    t: np.ndarray = field(default_factory=lambda: np.zeros(3))  # weighted sums of x * ms
    samples: int = 0

    def add(self, n: float, ms: float) -> None:
        """One sample: ``n`` tokens took ``ms``; weighted ``1 / ms^2`` (least squares of the relative error)."""
        if not (n > 0 and ms >= 0):
            return
        x = np.array([1.0, n / SCALE, (n / SCALE) ** 2])
        w = 1.0 / max(ms, MIN_WEIGHT_MS) ** 2
        self.s = self.decay * self.s + w * np.outer(x, x)
        self.t = self.decay * self.t + w * x * ms
        self.samples += 1

    def coefficients(self, prior_rate: float) -> tuple[float, float, float]:
        """(a, b, c) in ms, ms per token, ms per token squared; ``(0, prior_rate, 0)`` before any sample."""
        w = self.s[0, 0]
        if w == 0:
            return 0.0, max(0.0, prior_rate), 0.0
        mx, my = self.s[0, 1] / w, self.t[0] / w
        var = self.s[1, 1] / w - mx * mx

        def one_length() -> tuple[float, float, float]:  # the prior slope, a fitted offset
            b = max(0.0, prior_rate) * SCALE
            if my - b * mx < 0 and mx > 0:  # the prior overshoots what was measured: through the origin
                return 0.0, my / mx / SCALE, 0.0
            return my - b * mx, b / SCALE, 0.0

        # lengths too close to tell a slope from noise (30 and 50 tokens: a noisy pair would give a
        # flat line that predicts 150 ms for 4000 tokens); two lengths at least 2x apart are a line
        if var <= (0.3 * mx) ** 2:
            return one_length()
        a = b = c = -1.0
        if self.samples >= 3:
            try:
                a, b, c = np.linalg.solve(self.s + 1e-12 * np.trace(self.s) * np.eye(3), self.t)
            except np.linalg.LinAlgError:
                pass
        if min(a, b, c) < 0:  # a line instead (two lengths, or a fit that bends the wrong way)
            b = (self.s[0, 1] * self.t[0] / w - self.t[1]) / (mx * self.s[0, 1] - self.s[1, 1]) if var > 0 else 0.0
            a = my - b * mx
            c = 0.0
            if b < 0:  # longer prompts measured faster: noise; as if of one length
                return one_length()
            if a < 0:
                a, b = 0.0, max(0.0, self.t[1] / self.s[1, 1])
        return float(a), float(b) / SCALE, float(c) / SCALE**2

    def predict(self, n: float, prior_rate: float) -> float:
        a, b, c = self.coefficients(prior_rate)
        return a + b * n + c * n * n if n > 0 else 0.0


SCALE = 1000.0  # token counts enter the fit in thousands (a well-conditioned system)


@dataclass(frozen=True, order=True)
class Route:
    """A serving mode and its split layer (``k = 0`` for local and direct)."""

    mode: Mode
    k: int = 0


class LineKind(enum.Enum):
    """The compute stage a ``Line`` times, and the stage timing it is fitted on."""

    LOCAL = Stage.LOCAL_PREFILL  # the whole model on the edge
    DIRECT = Stage.CLOUD_DECODE_FIRST_TOKEN  # the cloud's whole-model prefill
    HEAD = Stage.EDGE_HEAD  # the edge head at split layer k
    TAIL = Stage.CLOUD_TAIL_PREFILL  # the cloud's tail prefill at split layer k

    @property
    def stage(self) -> Stage:
        return self.value


@dataclass(frozen=True)
class LineKey:
    """Which ``Line`` of the cost model: a stage kind and its split layer (0 for local and direct)."""

    kind: LineKind
    k: int = 0


CLOUD_KINDS = frozenset({LineKind.DIRECT, LineKind.TAIL})  # the stages the cloud's engines run


def length_bucket(prompt_tokens: int) -> int:
    """The prompt-length octave a residual is kept for: ``floor(log2(tokens))`` (64..127 -> 6)."""
    return max(0, int(prompt_tokens).bit_length() - 1)


@dataclass(frozen=True)
class RequestShape:
    """What a request asks of each route: its prompt length and what each side already holds."""

    prompt_tokens: int
    local_cached_tokens: int = 0  # prompt tokens the local session's KV covers
    head_cached_tokens: dict[int, int] = field(default_factory=dict)  # k -> tokens the split session's head covers
    cloud_cached_tokens: dict[int, int] = field(default_factory=dict)  # k -> tokens whose activations the cloud holds


@dataclass
class EdgeRates:
    """The edge's own measured rates (ms per token)."""

    local_prefill_ms_per_token: Ewma = field(default_factory=Ewma)
    local_decode_ms_per_token: Ewma = field(default_factory=Ewma)
    head_ms_per_token: dict[int, Ewma] = field(default_factory=dict)

    def head(self, k: int) -> Ewma:
        return self.head_ms_per_token.setdefault(k, Ewma())


@dataclass(frozen=True)
class EdgeLoad:
    """The edge's own queues at one moment (``Router.load``), an input of each prediction."""

    local_active: int = 0  # local turns in flight (prefilling or decoding)
    local_pending_prefill_tokens: int = 0  # prompt tokens of the local prefills waiting or running
    local_pending_prefills: int = 0  # those prefills
    head_pending_tokens: Mapping[int, int] = field(default_factory=dict)  # k -> new tokens in that head's batcher


IDLE = EdgeLoad()  # no queue on the edge


@dataclass
class LinkState:
    """What the edge knows of its link and the cloud right now."""

    rtt_ms: float = 0.0
    goodput_mbps: float = 0.0
    cloud_prefill_ms_per_token: float = 0.0
    cloud_tail_prefill_ms_per_token: dict[int, float] = field(default_factory=dict)
    queue_wait_ms: float = 0.0  # the cloud's recent mean admission wait
    cloud_busy: bool = False  # the cloud's queue is not empty, or this edge uses its whole share
    own_cloud_prefill_ms: float = 0.0  # predicted cloud compute of this edge's turns before their first token
    own_cloud_decode_ms: float = 0.0  # W_dec: how long this edge's turns in the cloud keep it busy decoding
    bytes_per_token: dict[int, float] = field(default_factory=dict)  # k -> wire bytes per prompt token
    block_size_tokens: int = 32
    num_layers: int = 30
    cloud_decode_ms_per_token: float = 0.0  # the decode engine's time per output token
    kv_cache_usage: float = 0.0  # the cloud engines' KV cache use, 0..1
    cloud_waiting: int = 0  # requests waiting for admission at the cloud, all links
    full_kv_block_bytes: float = 0.0  # one whole-model KV block in the link's KV format (remote prefill)
    ttft_slo_ms: float = 0.0  # this edge's objectives (0 = none declared)
    itl_slo_ms: float = 0.0


@dataclass(frozen=True)
class Prediction:
    route: Route
    ttft_ms: float
    formula_ms: float  # without the residual
    stages: Mapping[LineKey, tuple[int, float]] = field(default_factory=dict)  # line -> (n, prior rate)
    rest_ms: float = 0.0  # the formula's terms other than the compute stages and ``within`` (RTT, wire, queues)
    prompt_tokens: int = 0
    within: Mapping[LineKey, float] = field(default_factory=dict)  # line -> contention its measured time holds (ms)
    decode_overlap_ms: float = 0.0  # min(p, W_dec) of its cloud stage, before alpha_dec (ms)
    alpha_dec: float = DECODE_OVERLAP_PRIOR  # the alpha_dec its ``within`` was predicted with


class CostModel:
    """Predictions per route, online calibration, and the choice (see the module doc)."""

    def __init__(
        self,
        hysteresis: float = 0.05,
        explore_every: int = 50,
        explore_within: float = 1.5,
        pipeline_tokens: int = 0,
    ) -> None:
        """``pipeline_tokens``: the edge's head piece size (``EdgeNode.pipeline_tokens``; 0 = no
        pipelining), so split predictions count the head's overlap with the upload."""
        self.hysteresis, self.explore_every, self.explore_within = hysteresis, explore_every, explore_within
        self.pipeline_tokens = pipeline_tokens
        self.edge = EdgeRates()
        self.lines: dict[LineKey, Line] = {}
        self.residual: dict[Route, dict[int, Ewma]] = {}  # route -> length octave -> residual (ms)
        self.last: Route | None = None
        self.choices = 0
        self.last_run: dict[Route, int] = {}  # route -> choice count when it last ran
        self.decode_overlap = Ewma(DECODE_OVERLAP_ALPHA)  # alpha_dec's samples

    @property
    def alpha_dec(self) -> float:
        """The fraction of ``min(p, W_dec)`` a cloud prefill beside decodes is slowed by (module doc)."""
        return self.decode_overlap.value if self.decode_overlap.samples else DECODE_OVERLAP_PRIOR

    # ------------------------------------------------------------------ prediction

    def _goodput_bytes_per_ms(self, link: LinkState) -> float:
        return link.goodput_mbps * 1e6 / 8 / 1e3 if link.goodput_mbps > 0 else float("inf")

    def _cloud_rate(self, measured: float, layers: int, link: LinkState) -> float:
        """The cloud's measured rate, or (prior) the edge's whole-model rate scaled to ``layers``."""
        if measured > 0:
            return measured
        return self.edge.local_prefill_ms_per_token.value * layers / max(1, link.num_layers)

    def local_run_ms(self, tokens: float) -> float:
        """One run of ``tokens`` new tokens through the edge's whole model, as the fitted local line
        predicts it (the engine's prefill rate per token before the line has samples); 0 for none
        (ms). The handover model and the remote-prefill turn's takeover order both read it."""
        rate = self.edge.local_prefill_ms_per_token.value
        return self.lines.get(LineKey(LineKind.LOCAL), Line()).predict(tokens, rate)

    def local_runs_ms(self, tokens: np.ndarray) -> np.ndarray:
        """``local_run_ms`` of each element of ``tokens`` (any shape), from one fit of the line: the
        remote-prefill plan weighs every split of a long prompt at once (ms, float64; 0 where <= 0)."""
        a, b, c = self.lines.get(LineKey(LineKind.LOCAL), Line()).coefficients(
            self.edge.local_prefill_ms_per_token.value
        )
        n = np.asarray(tokens, np.float64)
        return np.where(n > 0, a + b * n + c * n * n, 0.0)

    def local_queue_ms(self, load: EdgeLoad) -> float:
        """``q_local``: what a new run on the local engine waits for, its prefills waiting or running
        and one decode step of each turn decoding (ms); remote prefill's plan starts the edge's own
        run after it too."""
        decoding = max(0, load.local_active - load.local_pending_prefills)
        return self._local_prefill_queue_ms(load) + decoding * self.edge.local_decode_ms_per_token.value

    def _local_prefill_queue_ms(self, load: EdgeLoad) -> float:
        """``W_local``: the local engine's prefills waiting or running, at the local prefill rate (ms)."""
        return load.local_pending_prefill_tokens * self.edge.local_prefill_ms_per_token.value

    def _head_queue_ms(self, load: EdgeLoad, k: int) -> float:
        """``W_head[k]``: the new tokens in the head batcher at ``k``, at the head's rate (ms)."""
        return load.head_pending_tokens.get(k, 0) * self.edge.head(k).value

    def _heads_ms(self, load: EdgeLoad) -> float:
        """``W_heads``: every head batcher's queue (ms)."""
        return sum(self._head_queue_ms(load, k) for k in load.head_pending_tokens)

    def _stage(self, key: LineKey, n: int, prior_rate: float, stages: dict[LineKey, tuple[int, float]]) -> float:
        stages[key] = (n, prior_rate)
        return self.lines.get(key, Line()).predict(n, prior_rate)

    def formula(
        self,
        route: Route,
        shape: RequestShape,
        link: LinkState,
        stages: dict[LineKey, tuple[int, float]] | None = None,
        within: dict[LineKey, float] | None = None,
        load: EdgeLoad = IDLE,
    ) -> float:
        """The formula part of the prediction (ms), without the residual, with the edge's queues as
        ``load`` holds them; ``stages`` receives each compute stage's token count and prior rate (for
        calibration), ``within`` the contention each stage's measured time holds (ms)."""
        tokens = {} if stages is None else stages
        inside = {} if within is None else within
        T = shape.prompt_tokens
        if route.mode is Mode.LOCAL:
            n = T - min(shape.local_cached_tokens, T - 1)
            q = self.local_queue_ms(load)
            key = LineKey(LineKind.LOCAL)
            p = self._stage(key, n, self.edge.local_prefill_ms_per_token.value, tokens)
            inside[key] = min(p, self._heads_ms(load))  # the heads running beside it
            return q + p + inside[key]
        g = self._goodput_bytes_per_ms(link)
        admission = link.queue_wait_ms if link.cloud_busy else 0.0
        q_cloud = max(admission, link.own_cloud_prefill_ms)
        if route.mode in (Mode.DIRECT, Mode.REMOTE_PREFILL):  # the same prefill, from token ids
            p = self._cloud_rate(link.cloud_prefill_ms_per_token, link.num_layers, link)
            key = LineKey(LineKind.DIRECT)
            c = self._stage(key, T, p, tokens)
            dec = self.alpha_dec * min(c, link.own_cloud_decode_ms)
            inside[key] = q_cloud - admission + dec  # beside this edge's other prefills and decodes, in the engine
            return link.rtt_ms + T * ID_BYTES / g + q_cloud + c + dec
        k = route.k
        n_head = T - min(shape.head_cached_tokens.get(k, 0), T - 1)
        n_cloud = min(shape.cloud_cached_tokens.get(k, 0), T)
        n_up = T - n_cloud
        B = max(1, link.block_size_tokens)
        n_tail = T - B * (n_cloud // B)
        p_tail = self._cloud_rate(link.cloud_tail_prefill_ms_per_token.get(k, 0.0), link.num_layers - k, link)
        head_key, tail_key = LineKey(LineKind.HEAD, k), LineKey(LineKind.TAIL, k)
        head = self._stage(head_key, n_head, self.edge.head(k).value, tokens)
        w_head = self._head_queue_ms(load, k)
        # sharing the edge's processor with the local prefills and the other split layers' heads
        inside[head_key] = min(head, self._local_prefill_queue_ms(load) + self._heads_ms(load) - w_head)
        head += inside[head_key]
        wire = n_up * link.bytes_per_token.get(k, 0.0) / g
        overlap = min(head, wire) * (1 - 1 / pieces) if (pieces := self.pipeline_pieces(n_head, head, wire)) else 0.0
        tail = self._stage(tail_key, n_tail, p_tail, tokens)
        dec = self.alpha_dec * min(tail, link.own_cloud_decode_ms)
        inside[tail_key] = q_cloud - admission + dec
        return w_head + head + wire - overlap + link.rtt_ms + q_cloud + tail + dec

    def split_pipeline_pieces(self, k: int, n_head: int, link: LinkState) -> int:
        """``pipeline_pieces`` for a split turn at ``k`` whose head runs ``n_head`` new tokens (and
        uploads them), with this model's head line and ``link``'s goodput and bytes per token."""
        head = self.lines.get(LineKey(LineKind.HEAD, k), Line()).predict(n_head, self.edge.head(k).value)
        wire = n_head * link.bytes_per_token.get(k, 0.0) / self._goodput_bytes_per_ms(link)
        return self.pipeline_pieces(n_head, head, wire)

    def pipeline_pieces(self, n_head: int, head_ms: float, wire_ms: float) -> int:
        """Pieces the edge runs a split turn's head in (0: it runs whole first). Pipelined when the
        head has at least two pieces of new tokens and the upload is predicted to take at least as
        long as the head: then the head hides under the upload, and the cloud, which holds the
        turn's admission slot from its header on, waits no longer than for the upload alone (an
        upload predicted to take no time, on a link not measured, runs the head whole). With
        ``P`` pieces the two overlap except for one piece: ``head + wire - min(head, wire) (1 - 1/P)``.

        ``P`` is at most ``MAX_PIPELINE_PIECES``: each piece reads the KV of every token before it
        (host to device and back on a GPU), so ``P`` pieces move about ``P/2`` times the turn's head
        KV; past that many pieces longer prompts get longer pieces (``pipeline_piece_tokens``)."""
        seg = self.pipeline_tokens
        if not seg or n_head < 2 * seg or wire_ms <= 0 or wire_ms < head_ms:  # 0: not measured
            return 0
        return min(MAX_PIPELINE_PIECES, -(-n_head // seg))

    def pipeline_piece_tokens(self, n_head: int, pieces: int) -> int:
        """Head tokens per piece when ``n_head`` new tokens run in ``pieces`` pieces: at least the
        configured ``pipeline_tokens``."""
        return max(self.pipeline_tokens, -(-n_head // max(1, pieces)))

    def residual_ms(self, route: Route, prompt_tokens: int) -> float:
        """The route's residual (ms) at this prompt length: its octave's, else the nearest octave's
        (the shorter one on a tie), 0 before any."""
        octaves = self.residual.get(route)
        if not octaves:
            return 0.0
        b = length_bucket(prompt_tokens)
        return octaves[min(octaves, key=lambda o: (abs(o - b), o))].value

    def predict(self, route: Route, shape: RequestShape, link: LinkState, load: EdgeLoad = IDLE) -> Prediction:
        """``route``'s TTFT for a request of ``shape`` over ``link`` with the edge's queues ``load``."""
        stages: dict[LineKey, tuple[int, float]] = {}
        within: dict[LineKey, float] = {}
        f = self.formula(route, shape, link, stages, within, load)
        r = self.residual_ms(route, shape.prompt_tokens)
        ttft = max(MIN_PREDICTION_FRACTION * f, f + r)
        rest = f - sum(self.lines.get(k, Line()).predict(n, rate) for k, (n, rate) in stages.items())
        rest -= sum(within.values())
        overlap = min(self.cloud_stages_ms(stages), link.own_cloud_decode_ms)
        return Prediction(route, ttft, f, stages, rest, shape.prompt_tokens, within, overlap, self.alpha_dec)

    def cloud_stages_ms(self, stages: Mapping[LineKey, tuple[int, float]]) -> float:
        """The cloud's compute stages among ``stages`` (``Prediction.stages``) as their lines predict
        them now (ms)."""
        return sum(
            self.lines.get(k, Line()).predict(n, rate) for k, (n, rate) in stages.items() if k.kind in CLOUD_KINDS
        )

    # ------------------------------------------------------------------ choice and calibration

    def choose(self, predictions: list[Prediction]) -> tuple[Prediction, str]:
        """The prediction to run and why. Raises ValueError when ``predictions`` is empty."""
        if not predictions:
            raise ValueError("no route to choose from")
        self.choices += 1
        best = min(predictions, key=lambda p: p.ttft_ms)
        pick, why = best, "lowest predicted TTFT"
        last = next((p for p in predictions if p.route == self.last), None)
        if last is not None and last is not best and last.ttft_ms <= best.ttft_ms * (1 + self.hysteresis):
            pick, why = last, f"hysteresis: within {self.hysteresis:.0%} of the best"
        if self.explore_every:
            stale = [
                p
                for p in predictions
                if p is not pick
                and p.ttft_ms <= best.ttft_ms * self.explore_within
                and self.choices - self.last_run.get(p.route, -self.explore_every) >= self.explore_every
            ]
            if stale:
                pick = min(stale, key=lambda p: self.last_run.get(p.route, -self.explore_every))
                why = "exploration: refresh the calibration of a near route"
        self.last = pick.route if not why.startswith("exploration") else self.last
        return pick, why

    def ran(self, route: Route) -> None:
        """Note that ``route`` served a request (for exploration)."""
        self.last_run[route] = self.choices

    def _observe_decode_overlap(self, prediction: Prediction, timings: Mapping[Stage, float]) -> None:
        """An ``alpha_dec`` sample from a cloud stage measured beside this edge's decodes: what it took
        beyond its line and the other contention predicted inside it, over ``min(p, W_dec)``, in [0, 1]."""
        s = prediction.decode_overlap_ms
        if s <= 0:
            return
        for key, (n, rate) in prediction.stages.items():
            if key.kind in CLOUD_KINDS and key.kind.stage in timings:
                other = prediction.within.get(key, 0.0) - prediction.alpha_dec * s
                extra = timings[key.kind.stage] - self.lines.get(key, Line()).predict(n, rate) - other
                self.decode_overlap.add(min(1.0, max(0.0, extra / s)))
                return

    def observe(self, prediction: Prediction, measured_ttft_ms: float, timings: Mapping[Stage, float]) -> None:
        """Calibrate with a served request: each compute stage's line from its measured time
        (``timings``, ms) less the contention predicted inside it (``Prediction.within``; at least
        ``MIN_PREDICTION_FRACTION`` of what the line predicted, so that an overstated contention does
        not drag the line towards zero, where a sample's weight ``1 / ms^2`` would dominate), then the
        route's residual from the measured TTFT (ms): what the compute stages, as measured, do not
        explain (the formula's other terms' error, and what it leaves out). A stage that reported no
        time counts with its line's prediction and its predicted contention. Taking the measured
        stage times, not the lines, keeps a line's error out of the residual: a line fitted badly at
        one moment (two samples, a noisy one) would otherwise leave a residual that outlives the
        line's own correction. A cloud stage measured beside this edge's decodes teaches
        ``alpha_dec`` instead of its line: the line and that fraction cannot both be fitted from one
        sample."""
        self._observe_decode_overlap(prediction, timings)  # against the lines before this sample
        stages, rest = prediction.stages, prediction.rest_ms
        explained = rest
        for key, (n, rate) in stages.items():
            stage, inside = key.kind.stage, prediction.within.get(key, 0.0)
            if stage in timings:
                ms, line = timings[stage], self.lines.setdefault(key, Line())
                floor = min(ms, MIN_PREDICTION_FRACTION * line.predict(n, rate))  # an overstated contention
                if not (key.kind in CLOUD_KINDS and prediction.decode_overlap_ms > 0):  # that one teaches alpha_dec
                    line.add(n, max(ms - inside, floor))
                explained += ms
            else:
                explained += self.lines.get(key, Line()).predict(n, rate) + inside
        octaves = self.residual.setdefault(prediction.route, {})
        octave = length_bucket(prediction.prompt_tokens)
        octaves.setdefault(octave, Ewma(RESIDUAL_ALPHA)).add(measured_ttft_ms - explained)


def zstd_pays(ratio: float, compress_mb_per_s: float, decompress_mb_per_s: float, goodput_mbps: float) -> bool:
    """Whether zstd shortens a transfer: the wire time it saves per byte, ``(1 - ratio) / G``,
    exceeds what it costs, ``1 / compress + ratio / decompress`` (all per byte; ``ratio`` =
    compressed / raw size measured on this model's activations and KV). Unknown goodput: no."""
    if goodput_mbps <= 0 or compress_mb_per_s <= 0 or decompress_mb_per_s <= 0:
        return False
    g = goodput_mbps / 8  # MB/s
    return (1 - ratio) / g > 1 / compress_mb_per_s + ratio / decompress_mb_per_s
