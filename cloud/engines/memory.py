"""``MemoryEngines``: the in-memory double of ``cloud.engines.vllm_engines.EngineBackend`` for unit tests
of the gateway (and of the edge through ``edge.link.base.InProcessLink``) without vLLM.

It honours the connector contract against a real ``BlockStore``: a request loads the
longest run of consecutive blocks present for every load part (never the block holding
the last prompt token, as vLLM's connector API requires), saves the save part's missing
blocks, and reports ``external_tokens`` in a ``ConnectorReport``, through the same
``to_vllm`` / ``from_vllm`` round trip as the connector and ``VllmEngines``. Like the real
connector, it can write its saves after it returns the first token (``save_delay_s``;
``None``: never, a store refusing them), one block at a time (``save_block_interval_s``).
Its tokens are a deterministic function of the prompt *and of the bytes it loaded*, so a
test sees when loaded KV differs from KV computed from the inputs. Saved tail blocks are a
digest of the activations they stand for.

With a ``ToyLM`` (``toy``), direct and remote-prefill decodes (no KV spec, or one whole-model
part, layers ``[0, L)``) run that toy whole model instead: the KV of every layer of every token is
a function of the token prefix, the next token a function of the context's KV, loaded blocks are
used as stored, and the save part's missing blocks are written as canonical float32 blocks (after
``save_delay_s``, like the tail saves). The edge's double of the whole model runs the same
``ToyLM`` (``tests.doubles.ToyLocal``), so direct, local and remote prefill give equal tokens
exactly when the KV that came down is the KV the cloud computed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import blake3
import numpy as np

from tandem.cloud.engines.kvparams import ConnectorReport, KVTransferSpec
from tandem.cloud.engines.vllm_engines import DECODE, DecodeStep, EngineRole, TailResult
from tandem.cloud.store.blocks import BlockStore
from tandem.common.protocol.errors import EngineError
from tandem.common.protocol.params import Sampling

KV_STEP = 1.0 / 1024  # the toy's K and V are multiples of this in [-1, 1): exact in fp16 too


@dataclass(frozen=True)
class ToyLM:
    """A deterministic whole model without weights, of ``L`` layers, ``Hkv`` KV heads of dim ``D``.

    The KV of token ``i`` (float32 ``[L, 2, Hkv, D]``) is drawn from BLAKE3 of the KV of token
    ``i - 1`` and the id of token ``i``, so it depends on the whole prefix, as a transformer's does;
    the next token is BLAKE3 of the context's KV (canonical ``[L, 2, Hkv, T, D]`` bytes) modulo the
    vocabulary, so any change to any stored K or V changes what follows."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    def token_kv(self, prev: np.ndarray | None, token: int) -> np.ndarray:
        """float32 ``[L, 2, Hkv, D]`` of ``token`` after a token whose KV is ``prev`` (None: first)."""
        n = self.num_layers * 2 * self.num_kv_heads * self.head_dim
        seed = (b"" if prev is None else np.ascontiguousarray(prev, np.float32).tobytes()) + int(token).to_bytes(
            4, "little"
        )
        u = np.frombuffer(blake3.blake3(seed).digest(length=2 * n), "<u2")
        v = (u.astype(np.float32) % 2048 - 1024) * KV_STEP
        return v.reshape(self.num_layers, 2, self.num_kv_heads, self.head_dim)

    def prompt_kv(self, ids: list[int], past: np.ndarray | None = None) -> np.ndarray:
        """float32 ``[L, 2, Hkv, P + T, D]``: ``past`` (``[L, 2, Hkv, P, D]``, None = empty) then the
        KV of ``ids``."""
        shape = (self.num_layers, 2, self.num_kv_heads, 0, self.head_dim)
        kv = np.zeros(shape, np.float32) if past is None else np.asarray(past, np.float32)
        rows = [kv]
        prev = kv[:, :, :, -1] if kv.shape[3] else None
        for t in ids:
            prev = self.token_kv(prev, t)
            rows.append(prev[:, :, :, None])
        return np.ascontiguousarray(np.concatenate(rows, axis=3))

    def next_token(self, kv: np.ndarray) -> int:
        """The token after a context whose KV is ``kv`` (float32 ``[L, 2, Hkv, T, D]``)."""
        digest = blake3.blake3(np.ascontiguousarray(kv, np.float32).tobytes()).digest()
        return int.from_bytes(digest[:4], "little") % self.vocab_size


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
    save_block_interval_s: float = 0.0  # then one block per interval, in order, as the connector's writer puts them
    toy: ToyLM | None = None  # the whole model of direct and remote-prefill decodes (None: a digest of what loaded)
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
        """Put ``items`` in order: all at once, or the first now and each next one
        ``save_block_interval_s`` later."""
        if self.save_block_interval_s <= 0.0 or len(items) <= 1:
            for key, value in items:
                self.store.put(key, value)
            return
        self.store.put(*items[0])
        asyncio.get_running_loop().call_later(self.save_block_interval_s, self._put_all, items[1:])

    def _whole_model(self, kv: KVTransferSpec | None) -> bool:
        """Whether a decode runs the toy whole model: no spec, or one part of every layer."""
        if self.toy is None:
            return False
        return kv is None or all(p.layers.lo == 0 and p.layers.hi == self.toy.num_layers for p in kv.loads)

    async def decode(
        self, request_id: str, token_ids: list[int], kv: KVTransferSpec | None, sampling: Sampling
    ) -> AsyncIterator[DecodeStep]:
        if not self.alive:
            raise EngineError("decode engine is not running")
        self.calls.append((DECODE, request_id, kv))
        if self._whole_model(kv):
            async for step in self._toy_decode(token_ids, kv, sampling):
                yield step
            return
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
            yield DecodeStep([tok], None, loaded * self.block_size if i == 0 else 0)

    async def _toy_decode(
        self, token_ids: list[int], kv: KVTransferSpec | None, sampling: Sampling
    ) -> AsyncIterator[DecodeStep]:
        """The toy whole model over ``token_ids``: loaded blocks as stored, the rest computed; the save
        part's missing full prompt blocks written (canonical float32 ``[L, 2, Hkv, B, D]``)."""
        toy, B = self.toy, self.block_size
        assert toy is not None  # _whole_model
        loaded, values = self._load(kv, len(token_ids))
        shape = (toy.num_layers, 2, toy.num_kv_heads, B, toy.head_dim)
        past = np.concatenate([np.frombuffer(v, np.float32).reshape(shape) for v in values], axis=3) if values else None
        ctx = toy.prompt_kv(token_ids[loaded * B :], past)
        if kv is not None and kv.save is not None:
            saves = [
                (kv.save.store_key(j), ctx[:, :, :, j * B : (j + 1) * B].tobytes())
                for j in range(min(len(kv.save.keys), len(token_ids) // B))
                if not self.store.contains(kv.save.store_key(j))
            ]
            if self.save_delay_s == 0.0:
                self._put_all(saves)
            elif self.save_delay_s is not None and saves:
                asyncio.get_running_loop().call_later(self.save_delay_s, self._put_all, saves)
        for i in range(sampling.max_new_tokens):
            await asyncio.sleep(self.step_delay_s)
            tok = toy.next_token(ctx)
            ctx = toy.prompt_kv([tok], ctx)
            if i == sampling.max_new_tokens - 1 or (tok == self.eos_token_id and not sampling.ignore_eos):
                reason = "stop" if tok == self.eos_token_id else "length"
                report = _reported(ConnectorReport(external_tokens=loaded * B))
                yield DecodeStep([tok], reason, report.external_tokens, len(token_ids))
                return
            yield DecodeStep([tok], None, loaded * B if i == 0 else 0)
