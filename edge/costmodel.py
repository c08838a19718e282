"""The edge's TTFT cost model: predict each serving mode's time to first token, pick the lowest.

Modes (``Route``): ``local`` (the whole model in ONNX Runtime here), ``split`` at a split
layer ``k`` (head here, tail and decode in the cloud), ``direct`` (token ids up, the cloud
runs every layer). For a prompt of ``T`` tokens, the formula per mode (all times in ms):

    local(T)    = q_local + n_local * p_local
    direct(T)   = RTT + T * b_ids / G + q_cloud + T * p_cloud
    split(T, k) = n_head * p_head[k] + n_up * b_split[k] / G + RTT + q_cloud
                  + n_tail * p_tail[k]

each then calibrated per route (``a * formula + b``, below).

* ``n_local`` / ``n_head``: prompt tokens the session's edge state does not cover (the longest
  common prefix with the state of the previous turn is reused); ``n_up``: tokens whose
  activations the cloud lacks; ``n_tail = T - B * floor(n_cloud / B)`` (tail KV of full blocks
  the cloud computed in earlier turns is loaded, not recomputed; ``B`` the KV block size).
* ``p_local``, ``p_head[k]``: the edge's measured prefill time per token (whole model, head);
  ``q_local``: other local requests in flight x the local decode step (they interleave per step).
* ``p_cloud``, ``p_tail[k]``: the cloud's measured prefill time per token of the full model and of
  the tail (``ServerLoad``, polled and in every ``Final``); before the cloud measured one, the
  edge's own rate scaled by the layers run is the prior. ``q_cloud``: the cloud's mean admission
  wait when its queue is not empty or this edge already uses its share, else 0.
* ``b_split[k]``: bytes per prompt token on the wire (activations in the link's wire dtype and
  head KV of layers ``[0, k)``, times the codec's measured ratio); ``b_ids`` = 5 bytes (a varint);
  ``G`` goodput, ``RTT`` round trip, both measured (``edge.cloudconn``).
* calibration per route: the prediction is ``a * formula + b``, fitted online by exponentially
  weighted least squares (``Calibration``, forgetting factor ``CALIBRATION_DECAY`` per request) of
  the measured TTFT on the formula over the route's recent requests. ``b`` absorbs fixed costs
  the formula leaves out (tokenization, framing, scheduling), ``a`` a rate that is off (a CPU
  busier than when it was measured, prefill that scales better than linearly). Until the route's
  requests span a range of formula values it is a plain offset (``a = 1``); ``a`` stays within
  ``[1/4, 4]`` and the prediction above ``MIN_PREDICTION_FRACTION`` of the formula.

``choose`` takes the route with the lowest prediction, with hysteresis: the route chosen last
stays unless another is predicted ``hysteresis`` (10%) faster, so near-ties do not flap. To
keep calibrations fresh, a route predicted within ``explore_within`` of the best that has not
served any request (of any mode: requested ones count) in the last ``explore_every`` choices runs
once (the cost is bounded by ``explore_within``, at most once per route per ``explore_every``
choices; with mixed traffic the other modes' requests keep every route fresh and auto never explores).
Pure domain code: no grpc, no ONNX.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.common.ewma import Ewma

LOCAL, SPLIT, DIRECT = "local", "split", "direct"
ID_BYTES = 5  # a token id as a protobuf varint, at most
CALIBRATION_DECAY = 0.8  # weight of a route's older requests per new one (about the last 5-10 count)
MIN_PREDICTION_FRACTION = 0.1


@dataclass
class Calibration:
    """Exponentially weighted least squares of measured TTFT ``y`` on the formula ``x`` (both ms)."""

    decay: float = CALIBRATION_DECAY
    n: float = 0.0  # weighted count
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    samples: int = 0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.n, self.sx, self.sy = d * self.n + 1, d * self.sx + x, d * self.sy + y
        self.sxx, self.sxy = d * self.sxx + x * x, d * self.sxy + x * y
        self.samples += 1

    def coefficients(self) -> tuple[float, float]:
        """(a, b) of ``y = a * x + b``; (1, 0) before any sample."""
        if self.n == 0:
            return 1.0, 0.0
        mx, my = self.sx / self.n, self.sy / self.n
        var = self.sxx / self.n - mx * mx
        a = 1.0
        if self.samples >= 3 and var > (0.1 * mx) ** 2:  # formula values spread by more than ~10%
            a = min(4.0, max(0.25, (self.sxy / self.n - mx * my) / var))
        return a, my - a * mx

    def apply(self, x: float) -> float:
        a, b = self.coefficients()
        return max(MIN_PREDICTION_FRACTION * x, a * x + b)


@dataclass(frozen=True, order=True)
class Route:
    """A serving mode and its split layer (``k = 0`` for local and direct)."""

    mode: str
    k: int = 0

    @property
    def key(self) -> str:
        return f"{self.mode}-k{self.k}" if self.mode == SPLIT else self.mode


@dataclass(frozen=True)
class RequestShape:
    """What a request asks of each route: its prompt length and what each side already holds."""

    prompt_tokens: int
    local_cached_tokens: int = 0  # prompt tokens the local session's KV covers
    head_cached_tokens: dict[int, int] = field(default_factory=dict)  # k -> tokens the split session's head covers
    cloud_cached_tokens: dict[int, int] = field(default_factory=dict)  # k -> tokens whose activations the cloud holds


@dataclass
class EdgeRates:
    """The edge's own measured rates (ms per token) and its local load."""

    local_prefill_ms_per_token: Ewma = field(default_factory=Ewma)
    local_decode_ms_per_token: Ewma = field(default_factory=Ewma)
    head_ms_per_token: dict[int, Ewma] = field(default_factory=dict)
    local_active: int = 0

    def head(self, k: int) -> Ewma:
        return self.head_ms_per_token.setdefault(k, Ewma())


@dataclass
class LinkState:
    """What the edge knows of its link and the cloud right now."""

    rtt_ms: float = 0.0
    goodput_mbps: float = 0.0
    cloud_prefill_ms_per_token: float = 0.0
    cloud_tail_prefill_ms_per_token: dict[int, float] = field(default_factory=dict)
    queue_wait_ms: float = 0.0  # the cloud's recent mean admission wait
    cloud_busy: bool = False  # the cloud's queue is not empty, or this edge uses its whole share
    bytes_per_token: dict[int, float] = field(default_factory=dict)  # k -> wire bytes per prompt token
    block_size_tokens: int = 32
    num_layers: int = 30


@dataclass(frozen=True)
class Prediction:
    route: Route
    ttft_ms: float
    formula_ms: float  # before calibration


class CostModel:
    """Predictions per route, online calibration, and the choice (see the module doc)."""

    def __init__(self, hysteresis: float = 0.10, explore_every: int = 50, explore_within: float = 1.5) -> None:
        self.hysteresis, self.explore_every, self.explore_within = hysteresis, explore_every, explore_within
        self.edge = EdgeRates()
        self.calibration: dict[str, Calibration] = {}
        self.last: Route | None = None
        self.choices = 0
        self.last_run: dict[str, int] = {}  # route key -> choice count when it last ran

    # ------------------------------------------------------------------ prediction

    def _goodput_bytes_per_ms(self, link: LinkState) -> float:
        return link.goodput_mbps * 1e6 / 8 / 1e3 if link.goodput_mbps > 0 else float("inf")

    def _cloud_rate(self, measured: float, layers: int, link: LinkState) -> float:
        """The cloud's measured rate, or (prior) the edge's whole-model rate scaled to ``layers``."""
        if measured > 0:
            return measured
        return self.edge.local_prefill_ms_per_token.value * layers / max(1, link.num_layers)

    def formula(self, route: Route, shape: RequestShape, link: LinkState) -> float:
        """The formula part of the prediction (ms), before calibration."""
        T = shape.prompt_tokens
        if route.mode == LOCAL:
            n = T - min(shape.local_cached_tokens, T - 1)
            q = self.edge.local_active * self.edge.local_decode_ms_per_token.value
            return q + n * self.edge.local_prefill_ms_per_token.value
        g = self._goodput_bytes_per_ms(link)
        q_cloud = link.queue_wait_ms if link.cloud_busy else 0.0
        if route.mode == DIRECT:
            p = self._cloud_rate(link.cloud_prefill_ms_per_token, link.num_layers, link)
            return link.rtt_ms + T * ID_BYTES / g + q_cloud + T * p
        k = route.k
        n_head = T - min(shape.head_cached_tokens.get(k, 0), T - 1)
        n_cloud = min(shape.cloud_cached_tokens.get(k, 0), T)
        n_up = T - n_cloud
        B = max(1, link.block_size_tokens)
        n_tail = T - B * (n_cloud // B)
        p_tail = self._cloud_rate(link.cloud_tail_prefill_ms_per_token.get(k, 0.0), link.num_layers - k, link)
        head = n_head * self.edge.head(k).value
        wire = n_up * link.bytes_per_token.get(k, 0.0) / g
        return head + wire + link.rtt_ms + q_cloud + n_tail * p_tail

    def predict(self, route: Route, shape: RequestShape, link: LinkState) -> Prediction:
        f = self.formula(route, shape, link)
        c = self.calibration.get(route.key)
        return Prediction(route, c.apply(f) if c is not None else f, f)

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
                and self.choices - self.last_run.get(p.route.key, -self.explore_every) >= self.explore_every
            ]
            if stale:
                pick = min(stale, key=lambda p: self.last_run.get(p.route.key, -self.explore_every))
                why = "exploration: refresh the calibration of a near route"
        self.last = pick.route if not why.startswith("exploration") else self.last
        return pick, why

    def ran(self, route: Route) -> None:
        """Note that ``route`` served a request (for exploration)."""
        self.last_run[route.key] = self.choices

    def observe(self, prediction: Prediction, measured_ttft_ms: float) -> None:
        """Calibrate the route with a measured TTFT (ms) against its formula."""
        self.calibration.setdefault(prediction.route.key, Calibration()).add(prediction.formula_ms, measured_ttft_ms)


def zstd_pays(ratio: float, compress_mb_per_s: float, decompress_mb_per_s: float, goodput_mbps: float) -> bool:
    """Whether zstd shortens a transfer: the wire time it saves per byte, ``(1 - ratio) / G``,
    exceeds what it costs, ``1 / compress + ratio / decompress`` (all per byte; ``ratio`` =
    compressed / raw size measured on this model's activations and KV). Unknown goodput: no."""
    if goodput_mbps <= 0 or compress_mb_per_s <= 0 or decompress_mb_per_s <= 0:
        return False
    g = goodput_mbps / 8  # MB/s
    return (1 - ratio) / g > 1 / compress_mb_per_s + ratio / decompress_mb_per_s
