"""In-memory doubles of remote prefill's whole model: ``ToyLocal``, the edge's ``LocalEngine`` with
``edge-full.onnx`` replaced by the toy whole model (``cloud.memory_engines.ToyLM``) that the cloud's
``MemoryEngines`` runs too, and ``rp_stack``, the in-memory stack (``tests.doubles.toy_stack``)
with both, so that direct, local and remote prefill can be compared token for token."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np

from tandem.cloud.memory_engines import ToyLM
from tandem.common.ewma import Ewma
from tandem.common.kvdown import full_model_key
from tandem.common.manifest import ModelShape
from tandem.edge.local import LocalEngine, LocalSessions, blocks_from_past, past_from_blocks
from tests.doubles import MANIFEST, Toy, toy_stack


def toy_lm(shape: ModelShape = MANIFEST.shape) -> ToyLM:
    return ToyLM(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.vocab_size)


class ToyLocal(LocalEngine):
    """``LocalEngine`` whose forward pass is ``ToyLM``'s (everything else is the real engine's:
    sessions, prefix reuse, adopt, extend, sampling, stops). ``runs`` lists the new tokens of every
    forward pass."""

    def __init__(
        self,
        toy: ToyLM,
        shape: ModelShape = MANIFEST.shape,
        eos_token_ids: Sequence[int] = (),
        session_bytes: int = 1 << 30,
        step_delay_s: float = 0.0,
    ) -> None:
        self.toy, self.shape, self.step_delay_s = toy, shape, step_delay_s
        self.eos_token_ids = frozenset(eos_token_ids)
        self._past_names = [f"past_{i}" for i in range(2 * shape.num_layers)]
        self.sessions = LocalSessions(64, session_bytes)
        self._model_lock = asyncio.Lock()
        self.prefill_rate, self.decode_rate = Ewma(), Ewma()
        self.prefill_rate.add(0.01)
        self.decode_rate.add(max(0.1, step_delay_s * 1e3))
        self.active = self.last_computed_tokens = self.last_reused_tokens = 0
        self.runs: list[int] = []

    def forward(self, new_ids: Sequence[int], past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray], float]:
        t0 = time.perf_counter()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.runs.append(len(new_ids))
        kv = blocks_from_past(past) if past[0].shape[2] else None
        full = self.toy.prompt_kv([int(t) for t in new_ids], kv)
        logits = np.zeros(self.shape.vocab_size, np.float32)
        logits[self.toy.next_token(full)] = 1.0
        return logits, past_from_blocks(full), (time.perf_counter() - t0) * 1e3


async def rp_stack(step_delay_s: float = 0.005, local_step_s: float = 0.0, **kw) -> Toy:
    """``toy_stack(**kw)`` whose cloud decodes with ``ToyLM`` (``step_delay_s`` per token) and whose
    edge holds ``ToyLocal`` (``local_step_s`` per forward pass) and names whole-model KV blocks."""
    toy = await toy_stack(**kw)
    lm = toy_lm()
    toy.engines.toy, toy.engines.step_delay_s = lm, step_delay_s
    toy.edge.local = ToyLocal(lm, step_delay_s=local_step_s)
    toy.edge.model_key = full_model_key(MANIFEST)
    toy.edge.router.remote_prefill = True
    return toy
