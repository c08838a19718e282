"""Local mode: a turn on the whole model on this edge (``edge.compute.local.LocalEngine``), its tokens
detokenized and streamed as they come, its prefill's wait for the engine and its run measured for
the cost model. No cloud."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from tandem.edge.compute.local import LocalEngine
from tandem.edge.events import TextOut, TurnDone
from tandem.edge.turn import Turn
from tandem.stages import Stage

log = logging.getLogger("tandem.edge")


async def run_local(turn: Turn, engine: LocalEngine) -> AsyncIterator[TextOut | TurnDone]:
    """Yields the turn's text deltas, then its ``TurnDone`` (finish ``stop`` at a stop string, else
    the engine's reason).

    Raises:
        TurnTooLarge: the turn's own KV is larger than the engine's whole bound (before it runs).
        QuotaExceeded: no room beside the turns in flight (``LocalEngine.generate``)."""
    text, finish, first = turn.text, "length", True
    if engine.session_expired(turn.session_id):
        turn.clock.session_expired = True
        log.info("local session %s had expired (dropped by a bound or idle): starting it again", turn.session_id)
    async for step in engine.generate(turn.ids, turn.sampling, turn.session_id, prompt_param=turn.prompt_param):
        if first:  # the prefill's run apart from its wait for the runs ahead (the cost model's queue term)
            turn.clock.timings[Stage.LOCAL_QUEUE] = step.wait_ms
            turn.clock.timings[Stage.LOCAL_PREFILL] = step.run_ms
            first = False
        turn.clock.tokens_arrived()
        delta = text.feed([step.token_id])
        if delta:
            yield TextOut(text=delta, token_ids=text.take_ids())
        if text.stopped:
            finish = "stop"
            break
        if step.finish_reason is not None:
            finish = step.finish_reason
    rest, ids = text.flush(), text.take_ids()
    if rest or ids:
        yield TextOut(text=rest, token_ids=ids)
    turn.clock.since(Stage.TOTAL)
    yield turn.done(finish, len(turn.ids))
