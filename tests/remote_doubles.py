"""In-memory doubles of remote prefill's whole model: ``ToyLocal``, the edge's ``LocalEngine`` with
``edge-full.onnx`` replaced by the toy whole model (``cloud.engines.memory.ToyLM``) that the cloud's
``MemoryEngines`` runs too, and ``rp_stack``, the in-memory stack (``tests.doubles.toy_stack``)
with both, so that direct, local and remote prefill can be compared token for token."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import numpy as np

from tandem.cloud.engines.memory import ToyLM
from tandem.common.protocol.manifest import ModelShape
from tandem.common.wire.kvdown import full_model_key
from tandem.edge.compute.local import LocalEngine, LocalSessions, blocks_from_past, past_from_blocks
from tandem.edge.compute.localmodel import ForwardModel
from tests.doubles import MANIFEST, Toy, toy_stack


def toy_lm(shape: ModelShape = MANIFEST.shape) -> ToyLM:
    return ToyLM(shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.vocab_size)


class ToyForward(ForwardModel):
    """``ToyLM`` as the whole model: its forward pass over growing KV (``edge.compute.localmodel``).
    ``runs`` lists the new tokens of every forward pass."""

    def __init__(self, toy: ToyLM, shape: ModelShape, step_delay_s: float = 0.0) -> None:
        self.toy, self.shape, self.step_delay_s = toy, shape, step_delay_s
        self.providers = ["CPUExecutionProvider"]
        self.runs: list[int] = []

    def forward(self, new_ids: Sequence[int], past: list) -> tuple[np.ndarray, list, float]:
        t0 = time.perf_counter()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self.runs.append(len(new_ids))
        kv = blocks_from_past(past) if past[0].shape[2] else None
        full = self.toy.prompt_kv([int(t) for t in new_ids], kv)
        logits = np.zeros(self.shape.vocab_size, np.float32)
        logits[self.toy.next_token(full)] = 1.0
        return logits, past_from_blocks(full), (time.perf_counter() - t0) * 1e3


class ToyLocal(LocalEngine):
    """``LocalEngine`` whose model is ``ToyForward`` (everything else is the real engine's: sessions,
    prefix reuse, adopt, extend, sampling, stops). ``runs`` lists the new tokens of every forward pass."""

    def __init__(
        self,
        toy: ToyLM,
        shape: ModelShape = MANIFEST.shape,
        eos_token_ids: Sequence[int] = (),
        session_bytes: int = 1 << 30,
        step_delay_s: float = 0.0,
    ) -> None:
        self.toy = toy
        self.model = ToyForward(toy, shape, step_delay_s)
        self._init_state(shape, eos_token_ids, LocalSessions(64, session_bytes))
        self.prefill_rate.add(0.01)
        self.decode_rate.add(max(0.1, step_delay_s * 1e3))

    @property
    def runs(self) -> list[int]:
        return self.model.runs


async def rp_stack(step_delay_s: float = 0.005, local_step_s: float = 0.0, prompt_kv: str = "download", **kw) -> Toy:
    """``toy_stack(**kw)`` whose cloud decodes with ``ToyLM`` (``step_delay_s`` per token) and whose
    edge holds ``ToyLocal`` (``local_step_s`` per forward pass), names whole-model KV blocks and gets a
    remote prefill's prompt KV as ``prompt_kv`` says (``EdgeConfig.remote_prefill_prompt_kv``)."""
    lm = toy_lm()
    local = ToyLocal(lm, step_delay_s=local_step_s)
    node_kw = {"local": local, "model_key": full_model_key(MANIFEST), "prompt_kv": prompt_kv}
    toy = await toy_stack(node_kw=node_kw, **kw)
    toy.engines.toy, toy.engines.step_delay_s = lm, step_delay_s
    return toy


class DownTamperLink:
    """Wraps a ``CloudLink``: every downlink event passes through ``down(event, n)`` (``n`` counts
    the events of its type from 1 in this call; None drops it), every uplink item through
    ``up(item)`` (which may raise ``LinkLost``: the item is not sent and the call breaks with it at
    its next event, as a dropped connection; or return the item); ``sent`` records the uplink
    items of every call."""

    def __init__(self, inner, down=None, up=None) -> None:
        self.inner = inner
        self.down = down or (lambda ev, n: ev)
        self.up = up or (lambda item: item)
        self.sent: list = []

    async def negotiate(self, offer):
        return await self.inner.negotiate(offer)

    async def server_info(self, link_id, padding_bytes=0, timeout_s=5.0):
        return await self.inner.server_info(link_id, padding_bytes, timeout_s)

    async def sync_session(self, req, timeout_s=5.0):
        return await self.inner.sync_session(req, timeout_s)

    def open(self, timeout_s):
        return _DownTamperCall(self.inner.open(timeout_s), self)

    async def close(self) -> None:
        await self.inner.close()


class _DownTamperCall:
    def __init__(self, inner, link: DownTamperLink) -> None:
        self.inner, self.link = inner, link
        self.cut: Exception | None = None

    def send(self, item) -> int:
        self.link.sent.append(item)
        try:
            item = self.link.up(item)
        except Exception as e:  # the call breaks on its next event, as a connection that dropped
            self.cut = e
            return 0
        return 0 if self.cut is not None else self.inner.send(item)

    def close_send(self) -> None:
        self.inner.close_send()

    async def events(self):
        counts: dict[type, int] = {}
        async with contextlib.aclosing(self.inner.events()) as events:
            async for ev in events:
                if self.cut is not None:
                    raise self.cut
                n = counts[type(ev)] = counts.get(type(ev), 0) + 1
                out = self.link.down(ev, n)
                if out is not None:
                    yield out
        if self.cut is not None:
            raise self.cut

    def cancel(self) -> None:
        self.inner.cancel()
