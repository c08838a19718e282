"""``MemoryEngines``: the in-memory double of ``cloud.engines.EngineBackend`` for unit tests
of the gateway (and of the edge through ``edge.link.InProcessLink``) without vLLM.

It honours the connector contract against a real ``BlockStore``: a request loads the
longest run of consecutive blocks present for every load part (never the block holding
the last prompt token, as vLLM's connector API requires), saves the save part's missing
blocks, and reports ``external_tokens`` in a ``ConnectorReport``, through the same
``to_vllm`` / ``from_vllm`` round trip as the connector and ``VllmEngines``. Like the real
connector, it can write its saves after it returns the first token (``save_delay_s``;
``None``: never, a store refusing them).
Its tokens are a deterministic function of the prompt *and of the bytes it loaded*, so a
test sees when loaded KV differs from KV computed from the inputs. Saved tail blocks are a
digest of the activations they stand for.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import blake3
import numpy as np

from tandem.cloud.engines import DECODE, DecodeStep, EngineRole, TailResult
from tandem.common.errors import EngineError
from tandem.common.kvparams import ConnectorReport, KVTransferSpec
from tandem.common.kvstore import BlockStore
from tandem.common.params import Sampling


def _reported(report: ConnectorReport) -> ConnectorReport:
    """``report`` as the engines read it back: the real connector returns it from
    ``request_finished`` (``to_vllm``) and ``VllmEngines`` reads vLLM's ``kv_transfer_params``
    (``from_vllm``); the double takes the same round trip."""
    return ConnectorReport.from_vllm(report.to_vllm())


@dataclass
class MemoryEngines:
    store: BlockStore
    block_size: int
    vocab_size: int = 1000
    eos_token_id: int | None = None
    alive: bool = True
    step_delay_s: float = 0.0  # per decode step, to emulate a slow engine
    save_delay_s: float | None = 0.0  # tail saves land this long after the first token (None: never)
    calls: list[tuple[EngineRole, str, KVTransferSpec | None]] = field(
        default_factory=list
    )  # (engine, request id, spec)

    def _load(self, kv: KVTransferSpec | None, num_prompt_tokens: int) -> tuple[int, list[bytes]]:
        """(blocks loaded, per loaded block the concatenation of its parts' stored values)."""
        if kv is None or not kv.loads:
            return 0, []
        cap = min(kv.num_blocks, (num_prompt_tokens - 1) // self.block_size)
        loaded: list[bytes] = []
        while len(loaded) < cap:
            values = [self.store.get(p.store_key(len(loaded))) for p in kv.loads]
            if any(v is None for v in values):
                break
            loaded.append(b"".join(v or b"" for v in values))
        return len(loaded), loaded

    @staticmethod
    def _tail_block(hidden: np.ndarray) -> bytes:
        """What the double 'computes' and stores as a tail block: a digest of its activations."""
        return blake3.blake3(np.ascontiguousarray(hidden, np.float32).tobytes()).digest()

    def _token(self, *parts: bytes) -> int:
        return int.from_bytes(blake3.blake3(b"|".join(parts)).digest()[:4], "little") % self.vocab_size

    async def tail_prefill(
        self, request_id: str, split_layer: int, hidden: np.ndarray, kv: KVTransferSpec, sampling: Sampling
    ) -> TailResult:
        if not self.alive:
            raise EngineError("tail engine is not running")
        self.calls.append((EngineRole.tail(split_layer), request_id, kv))
        await asyncio.sleep(0)
        loaded, values = self._load(kv, hidden.shape[0])
        B = self.block_size
        # the KV the tail "attends to": loaded blocks as stored, the rest computed from the activations,
        # so loading correct KV gives the same token as computing it and loading wrong KV does not
        n_full = hidden.shape[0] // B
        effective = values + [self._tail_block(hidden[j * B : (j + 1) * B]) for j in range(loaded, n_full)]
        saves: list[tuple[str, bytes]] = []
        if kv.save is not None:
            for j in range(min(len(kv.save.keys), n_full)):
                key = kv.save.store_key(j)
                if not self.store.contains(key):
                    saves.append((key, effective[j]))
        saved = len(saves)
        if self.save_delay_s == 0.0:
            self._put_all(saves)
        elif self.save_delay_s is not None and saves:
            asyncio.get_running_loop().call_later(self.save_delay_s, self._put_all, saves)
        tok = self._token(*effective, np.ascontiguousarray(hidden[n_full * B :], np.float32).tobytes())
        report = _reported(ConnectorReport(external_tokens=loaded * B, saved_blocks=saved))
        return TailResult(
            tok, "stop" if tok == self.eos_token_id else None, report.saved_blocks, report.external_tokens, 0.1
        )

    def _put_all(self, items: list[tuple[str, bytes]]) -> None:
        for key, value in items:
            self.store.put(key, value)

    async def decode(
        self, request_id: str, token_ids: list[int], kv: KVTransferSpec | None, sampling: Sampling
    ) -> AsyncIterator[DecodeStep]:
        if not self.alive:
            raise EngineError("decode engine is not running")
        self.calls.append((DECODE, request_id, kv))
        loaded, values = self._load(kv, len(token_ids))
        digest = blake3.blake3(b"".join(values)).digest()
        ctx = np.asarray(token_ids, "<i8").tobytes()
        out: list[int] = []
        for i in range(sampling.max_new_tokens):
            await asyncio.sleep(self.step_delay_s)
            tok = self._token(digest, ctx, np.asarray(out, "<i8").tobytes())
            out.append(tok)
            last = i == sampling.max_new_tokens - 1 or (tok == self.eos_token_id and not sampling.ignore_eos)
            if last:
                reason = "stop" if tok == self.eos_token_id else "length"
                report = _reported(ConnectorReport(external_tokens=loaded * self.block_size))
                yield DecodeStep([tok], reason, report.external_tokens, len(token_ids))
                return
            yield DecodeStep([tok])
