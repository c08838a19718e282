"""A turn's calls into the engines, shared by every mode's path: the tail prefill (split), the
decode's token stream (every cloud mode) and the turn's final message, each timing its stage into
the turn and updating the node's measured rates (``cloud.links.rates``).

``Gateway`` (split and direct) and ``RemotePrefills`` (remote prefill) hold one ``EngineCalls``,
built once at the entry point (``cloud.server.build_gateway``). Admission, uploads, pins and the
downlink are theirs, not this module's. No grpc here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import numpy as np

from tandem.cloud.engines.kvparams import KVTransferSpec, PartSpec
from tandem.cloud.engines.vllm_engines import EngineBackend, TailResult
from tandem.cloud.links.rates import CloudRates
from tandem.cloud.links.table import Ticket
from tandem.cloud.turn import Turn, bounded
from tandem.common.protocol.errors import DeadlineExceeded
from tandem.common.protocol.params import Sampling, ServerLoad
from tandem.common.runtime.ewma import Ewma
from tandem.common.runtime.tracing import traced
from tandem.common.wire.messages import DownEvent, TokensOut, TurnFinal
from tandem.stages import Stage

# a turn's time per output token counts as (its token gaps / this) samples of the decode rate: vLLM
# streams tokens in bursts (on an H100 with CUDA graphs 14-27% of a direct turn's gaps were under
# 0.3 ms, benchmarks/results/gpu/h100-matrix-smollm2), so a turn of a few tokens measures the
# stream's grouping more than the engine's step
DECODE_SAMPLE_TOKENS = 16


class EngineCalls:
    """The engine calls of a turn on ``engines``, recording into ``rates``; ``load`` gives a link's
    view of the node's load (``LinkRegistry.load``) for each final message."""

    def __init__(self, engines: EngineBackend, rates: CloudRates, load: Callable[[str], ServerLoad]) -> None:
        self.engines, self.rates, self.load = engines, rates, load

    @traced("cloud_tail_prefill")
    async def tail_prefill(self, turn: Turn, hidden: np.ndarray, part: PartSpec) -> TailResult:
        """Tail engine over ``prompt_embeds = hidden`` (float32 ``[T, H]``) at the turn's split
        layer: loads the tail KV of ``part``'s blocks computed from the same activations before,
        saves the rest, samples the first output token. Records ``cloud_tail_prefill_ms`` and the
        tail's rate per computed token.

        Raises:
            DeadlineExceeded: the deadline passed. EngineError: the engine failed.
        """
        turn.engine_start()
        k = turn.header.split_layer
        try:
            async with asyncio.timeout_at(turn.deadline):
                tail = await self.engines.tail_prefill(
                    turn.engine_id, k, hidden, KVTransferSpec(loads=(part,), save=part), turn.header.sampling
                )
        except TimeoutError:
            raise DeadlineExceeded("deadline passed during the tail prefill") from None
        turn.timings[Stage.CLOUD_TAIL_PREFILL] = tail.elapsed_ms
        computed = hidden.shape[0] - tail.external_tokens
        if computed > 0:
            self.rates.tail_prefill_ms_per_token.setdefault(k, Ewma()).add(tail.elapsed_ms / computed)
        return tail

    @traced("cloud_decode")
    async def decode(
        self,
        turn: Turn,
        ids: list[int],
        kv: KVTransferSpec | None,
        sampling: Sampling,
        first_index: int,
        ticket: Ticket,
    ) -> AsyncIterator[DownEvent]:
        """Stream the decode engine's tokens over prompt ``ids`` (loading and saving ``kv``; None:
        the whole prompt is prefilled here), output indices from ``first_index``, then the turn's
        ``final``. The first token frees the ticket's prefill share. Updates the node's rates:
        prefill per prompt token (a whole prompt's first token) and time per output token (weighted
        by the turn's token gaps, ``DECODE_SAMPLE_TOKENS``).

        Raises:
            DeadlineExceeded: the deadline passed while decoding. EngineError: the engine failed.
        """
        t0 = time.perf_counter()
        turn.engine_start()
        n = first_index
        t_first: float | None = None
        steps = self.engines.decode(turn.engine_id, ids, kv, sampling)
        async for step in bounded(steps, turn.deadline, lambda: DeadlineExceeded("deadline passed while decoding")):
            if step.token_ids:
                if n == first_index:
                    turn.external_tokens = step.external_tokens
                    turn.time(Stage.CLOUD_DECODE_FIRST_TOKEN, t0)
                    t_first = time.perf_counter()
                    ticket.prefill_done()
                    if kv is None:  # direct mode: the whole prompt was prefilled here
                        self.rates.prefill_ms_per_token.add(turn.timings[Stage.CLOUD_DECODE_FIRST_TOKEN] / len(ids))
                yield TokensOut(token_ids=tuple(step.token_ids), index=n)
                n += len(step.token_ids)
            if step.finish_reason is not None:
                turn.time(Stage.CLOUD_DECODE, t0)
                if t_first is not None and n - first_index > 1:
                    per_token = (time.perf_counter() - t_first) * 1e3 / (n - first_index - 1)
                    self.rates.decode_ms_per_token.add(per_token, (n - first_index - 1) / DECODE_SAMPLE_TOKENS)
                yield self.final(turn, step.finish_reason, n, step.external_tokens)

    def final(self, turn: Turn, finish_reason: str, output_tokens: int, external_tokens: int) -> TurnFinal:
        """The turn's final message, with the node's load as it ends."""
        return TurnFinal(
            finish_reason=finish_reason,
            prompt_tokens=len(turn.header.prompt_token_ids),
            output_tokens=output_tokens,
            external_tokens=external_tokens,
            timings=turn.timings,
            received_bytes=turn.received_bytes,
            load=self.load(turn.header.link_id),
            queue_wait_ms=turn.timings.get(Stage.CLOUD_QUEUE, 0.0),
        )
