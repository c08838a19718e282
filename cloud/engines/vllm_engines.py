"""The two vLLM engines of a cloud node, as ``AsyncLLM`` instances so concurrent
requests batch (continuous batching inside each engine):

* tail-prefill engine: the *tail checkpoint* (layers ``[k, L)`` renumbered), fed
  ``prompt_embeds = h_k``; its ``TandemConnector`` (``kv_both``) loads tail KV of
  earlier turns and saves the tail KV of every full prompt block;
* decode engine: the *full checkpoint*, fed prompt token ids; its connector
  (``kv_both``) loads all layers of the block-aligned prefix (split mode: head KV from the
  edge, tail KV from the tail engine; remote prefill: the session's earlier blocks) and, in
  remote prefill, saves every layer of the prompt's other full blocks, which go down to the edge.

Both run with prefix caching off: the block store is the one source of reused
KV, so a plain request (no tandem params) on the decode engine is plain vLLM.
Who calls: the gateway, once per request per engine. Engines must be started
inside a ``if __name__ == "__main__"`` program (vLLM spawns processes).

Engine death (``kill -9`` of an EngineCore, an OOM kill, a crash): vLLM's client notices
the process exit (a sentinel monitor thread) and marks the ``AsyncLLM`` ``errored``; its
requests then raise ``EngineDeadError``. Here every failure of an errored engine becomes
``EngineError`` (gRPC UNAVAILABLE: retry elsewhere or later), never INTERNAL, and
``cloud.engines.supervisor`` restarts the dead engine through :meth:`VllmEngines.restart`.

Starting one engine (its vLLM arguments, KV connector configuration and GPU placement) is
``cloud.engines.start``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from tandem.cloud.config import CloudConfig
from tandem.cloud.engines import vllm_metrics
from tandem.cloud.engines.kvparams import ConnectorReport, KVTransferSpec
from tandem.cloud.engines.resources import EngineResources, capture, engine_pids
from tandem.cloud.engines.start import start_engine
from tandem.common.protocol.errors import EngineError
from tandem.common.protocol.manifest import SplitManifest
from tandem.common.protocol.params import Sampling

log = logging.getLogger("tandem.engines")


@dataclass(frozen=True)
class EngineRole:
    """One engine of a node: the tail-prefill engine of split layer ``split_layer`` (``kind``
    "tail") or the decode engine (``kind`` "decode", ``split_layer`` 0). ``name`` labels it in
    logs, thread names and errors ("tail-k4", "decode"); ``str(role)`` is its name.

    Raises:
        ValueError: a tail role without a split layer, or a decode role with one.
    """

    kind: Literal["tail", "decode"]
    split_layer: int = 0

    def __post_init__(self) -> None:
        if (self.kind == "tail") != (self.split_layer > 0):
            raise ValueError(f"a tail engine has a split layer > 0 and the decode engine none, not {self!r}")

    @classmethod
    def tail(cls, split_layer: int) -> EngineRole:
        return cls("tail", split_layer)

    @property
    def name(self) -> str:
        return f"tail-k{self.split_layer}" if self.kind == "tail" else "decode"

    def __str__(self) -> str:
        return self.name


DECODE = EngineRole("decode")


@dataclass(frozen=True)
class TailResult:
    """What the tail prefill did: the first output token (sampled by the tail engine from the
    last prompt position's logits, which are the full model's), ``finish_reason`` "stop" when
    that token ends the output, ``saved_blocks`` tail blocks written or already present,
    ``external_tokens`` tail KV tokens loaded from earlier turns, ``elapsed_ms``."""

    first_token: int
    finish_reason: str | None
    saved_blocks: int
    external_tokens: int
    elapsed_ms: float


@dataclass(frozen=True)
class DecodeStep:
    """New output tokens; ``finish_reason`` set on the last step. ``external_tokens``: the prompt
    tokens the engine loaded through the connector instead of computing them, on the first step
    (vLLM's ``num_cached_tokens``: the engines run without prefix caching) and on the last (the
    connector's own report), 0 on the steps between."""

    token_ids: list[int]
    finish_reason: str | None = None
    external_tokens: int = 0
    prompt_tokens: int = 0


class EngineBackend(Protocol):
    """Seam between the gateway and the engines.

    ``tail_prefill`` returns the first output token as soon as it is sampled; the tail KV of
    the prompt's full blocks reaches the block store after it (the connector's writer thread),
    so a reader waits for its keys (``Pins.await_tail_saves``). ``decode`` yields output
    tokens as they are sampled; the caller owns nothing the engine holds.
    """

    async def tail_prefill(
        self, request_id: str, split_layer: int, hidden: np.ndarray, kv: KVTransferSpec, sampling: Sampling
    ) -> TailResult: ...

    def decode(
        self, request_id: str, token_ids: list[int], kv: KVTransferSpec | None, sampling: Sampling
    ) -> AsyncIterator[DecodeStep]: ...


def to_vllm_sampling(s: Sampling, max_tokens: int | None = None, kv: KVTransferSpec | None = None):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": kv.to_vllm()} if kv is not None else None,
    )


def _is_engine_death(err: BaseException, engine: Any) -> bool:
    """Whether ``err`` (raised by ``engine.generate``) means the engine is dead rather than one
    request failing: vLLM's ``EngineDeadError``, or any error while the engine is ``errored``."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(err, EngineDeadError) or bool(getattr(engine, "errored", False))


def _stop_output_handler(engine: Any, wait_s: float = 2.0) -> None:
    """Cancel ``engine``'s output-handler task (``AsyncLLM.output_handler``) before its shutdown.
    vLLM 0.26 shuts the EngineCore down first and cancels the handler after, so the handler saw the
    core go and logged ``EngineDeadError`` with a traceback at ERROR on every normal stop. From a
    thread other than the handler's event loop this waits (up to ``wait_s``) until the handler has
    ended; on the loop's own thread the cancellation is queued ahead of anything the shutdown causes."""
    task = getattr(engine, "output_handler", None)
    if task is None or task.done():
        return
    loop = task.get_loop()
    try:
        on_loop = asyncio.get_running_loop() is loop
    except RuntimeError:
        on_loop = False
    if on_loop:
        task.cancel()
        return
    ended = threading.Event()
    try:
        loop.call_soon_threadsafe(lambda: (task.cancel(), task.add_done_callback(lambda _: ended.set())))
    except RuntimeError:  # the loop is closed: nothing can run the handler any more
        return
    ended.wait(wait_s)


def _shutdown_all(engines: list[Any], timeout_s: float) -> None:
    """``shutdown(timeout_s)`` every engine, in parallel; one that raises is logged and the others
    still stop."""

    def stop(e: Any) -> None:
        try:
            _stop_output_handler(e)
            e.shutdown(timeout_s)
        except Exception:  # noqa: BLE001 - one engine's failure must not leave the others running
            log.exception("an engine failed to shut down")

    threads = [threading.Thread(target=stop, args=(e,), name="engine-shutdown") for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class VllmEngines:
    """Real engines (``EngineBackend``) on the manifest's tail and full checkpoints.

    Liveness for ``cloud.engines.supervisor``: :meth:`is_alive`, :meth:`restart` and :attr:`closed`.
    """

    def __init__(self, cfg: CloudConfig) -> None:
        self.cfg = cfg
        self.manifest = SplitManifest.load(cfg.split_dir)
        # one tail engine per split layer served: the primary split and the extra ones (none for a
        # direct manifest, split layer 0: the decode engine alone serves direct mode)
        self.splits = {
            m.split_layer: (m, d)
            for d in (cfg.split_dir, *cfg.extra_split_dirs)
            if (m := SplitManifest.load(d)).split_layer
        }
        self.ROLES = (*(EngineRole.tail(k) for k in sorted(self.splits)), DECODE)
        self._engines: dict[EngineRole, Any] = dict.fromkeys(self.ROLES)
        self._resources: dict[EngineRole, EngineResources] = {}  # what each engine would leave if it died
        self._restarting = False
        self._closed = False
        self._lock = threading.Lock()  # _closed and the engine slots, against a restart thread

    @property
    def tail_engine(self) -> Any:
        """The primary split's tail engine."""
        return self._engines[EngineRole.tail(self.manifest.split_layer)]

    @property
    def decode_engine(self) -> Any:
        return self._engines[DECODE]

    def _checkpoint(self, role: EngineRole) -> Path:
        """The checkpoint ``role``'s engine serves (its ``model_name`` in the ``vllm:`` metrics)."""
        if role.kind == "tail":
            m, d = self.splits[role.split_layer]
            return m.resolve(d, m.tail_checkpoint)
        return self.manifest.resolve(self.cfg.split_dir, self.manifest.full_checkpoint)

    def _new_engine(self, role: EngineRole) -> Any:
        """Start one engine (blocking, about 20-60 s on CPU)."""
        if role.kind == "tail":
            m, _ = self.splits[role.split_layer]
            overrides = m.agreement.hf_overrides
            return start_engine(self._checkpoint(role), self.cfg, role, "kv_both", role.split_layer, overrides)
        # a direct-only checkpoint (split layer 0: no head, no tail) needs no KV moved: plain vLLM
        kv_role = "kv_both" if self.manifest.split_layer > 0 else None
        return start_engine(self._checkpoint(role), self.cfg, role, kv_role, 0, self.manifest.agreement.hf_overrides)

    def _get(self, role: EngineRole) -> Any:
        return self._engines[role]

    def _set(self, role: EngineRole, engine: Any) -> None:
        self._engines[role] = engine
        if engine is not None:
            self._resources[role] = capture(engine)

    def _live_pids(self) -> list[int]:
        """EngineCore pids of the engines in their slots now."""
        return [pid for r in self.ROLES if (e := self._get(r)) is not None for pid in engine_pids(e)]

    def start(self) -> None:
        """Start every engine, all at once (blocking). Most of an engine's 20-30 s start on CPU is
        its EngineCore and worker processes importing torch and vLLM, one core each, so the starts
        overlap: on 2 cores the 3-engine test cloud is up in 78 s (91 s one after another). If any start
        fails, every start error is logged, the engines that did start are shut down (together),
        and the first error is raised."""
        self._closed = False
        started: dict[EngineRole, Any] = {}
        errors: list[tuple[EngineRole, BaseException]] = []

        def one(role: EngineRole) -> None:
            try:
                started[role] = self._new_engine(role)
            except BaseException as e:  # noqa: BLE001 - re-raised below, in the caller's thread
                errors.append((role, e))

        threads = [threading.Thread(target=one, args=(r,), name=f"engine-start-{r.name}") for r in self.ROLES]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        finally:
            if errors or any(t.is_alive() for t in threads):  # a failed start, or interrupted here
                for role, e in errors:
                    log.error("the %s engine did not start: %s", role.name, e)
                for t in threads:  # an interrupt: let the starts finish, then stop what they started
                    t.join()
                _shutdown_all(list(started.values()), 10.0)
                started.clear()
        if errors:
            raise errors[0][1]
        for role in self.ROLES:
            self._set(role, started[role])
        # something in vLLM's start keeps a frame of ``one`` (and with it this dict) alive; only the
        # slots may hold the engines, or VllmEngines.shutdown cannot let them go
        started.clear()

    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` was called: the engines are down on purpose."""
        return self._closed

    def is_alive(self) -> bool:
        """Both engines started, not restarting, and not ``errored`` (vLLM's ``AsyncLLM.errored``:
        its EngineCore process died or its output handler failed)."""
        return not self._restarting and all((e := self._get(r)) is not None and not e.errored for r in self.ROLES)

    async def restart(self) -> None:
        """Shut down the dead engine(s) and start fresh ones; a live engine keeps running.

        Engine start blocks for tens of seconds, so it runs in a worker thread and the event
        loop keeps serving (health checks, refusals). ``AsyncLLM`` built off the loop starts
        its output handler lazily on the first request, on the loop. Requests meanwhile fail
        at once with ``EngineError("engines restarting")``.

        Raises:
            EngineError: :meth:`shutdown` was called meanwhile.
            Exception: an engine failed to start (the caller may retry).
        """
        self._restarting = True
        try:
            for role in self.ROLES:
                old = self._get(role)
                if old is not None and not old.errored:
                    continue
                self._set(role, None)
                if old is not None:
                    log.warning("shutting down the dead %s engine", role.name)
                    _stop_output_handler(old)
                    await asyncio.to_thread(old.shutdown, 10.0)
                    if (left := self._resources.pop(role, None)) is not None:
                        await asyncio.to_thread(left.release, self._live_pids())
                log.warning("starting a new %s engine", role.name)
                await asyncio.to_thread(self._replace, role)
                log.warning("the %s engine is running again", role.name)
        finally:
            self._restarting = False

    def _replace(self, role: EngineRole) -> None:
        """Start an engine for ``role`` and install it (worker thread). The thread, not the
        awaiting coroutine, installs it or shuts it down, so a cancelled restart leaks nothing."""
        if self._closed:
            raise EngineError("engines were shut down during a restart")
        new = self._new_engine(role)
        with self._lock:
            if not self._closed:
                self._set(role, new)
                return
        new.shutdown(10.0)
        raise EngineError("engines were shut down during a restart")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop both engines, in parallel: SIGTERM to each EngineCore (it stops its worker), SIGKILL
        only if one is still running after ``timeout_s``. Blocking."""
        with self._lock:
            self._closed = True
            engines = [e for r in self.ROLES if (e := self._get(r)) is not None]
            for role in self.ROLES:
                self._set(role, None)
        _shutdown_all(engines, timeout_s)
        # their last gauge values would still be exported (and count as this node's KV use)
        vllm_metrics.forget_vllm_engines({str(self._checkpoint(r)) for r in self.ROLES})
        # vLLM's AsyncLLM sits in reference cycles, so without a collection here its __del__ (which
        # shuts down again) would run at interpreter teardown, when the module globals it calls are
        # already None: a "TypeError: 'NoneType' object is not callable" traceback per engine at
        # every stop of tandem-cloud
        del engines
        gc.collect()

    def _engine_for(self, role: EngineRole) -> Any:
        """The engine of ``role``, or EngineError at once when it cannot take requests."""
        if self._restarting:
            raise EngineError("engines restarting")
        e = self._get(role)
        if e is None:
            raise EngineError(f"{role.name} engine is not running")
        if e.errored:
            raise EngineError(f"{role.name} engine is dead; the cloud is restarting it")
        return e

    async def tail_prefill(
        self, request_id: str, split_layer: int, hidden: np.ndarray, kv: KVTransferSpec, sampling: Sampling
    ) -> TailResult:
        import torch

        if split_layer not in self.splits:
            raise EngineError(f"no tail engine for split layer {split_layer}")
        engine = self._engine_for(EngineRole.tail(split_layer))
        t0 = time.perf_counter()
        sp = to_vllm_sampling(sampling, 1, kv)
        final = None
        try:
            async for out in engine.generate({"prompt_embeds": torch.from_numpy(hidden)}, sp, f"tail-{request_id}"):
                final = out
        except Exception as e:
            if _is_engine_death(e, engine):
                raise EngineError(f"tail engine died during request {request_id}") from e
            raise
        if final is None or not final.outputs[0].token_ids:
            raise EngineError(f"tail engine returned no token for request {request_id}")
        c = final.outputs[0]
        report = ConnectorReport.from_vllm(final.kv_transfer_params)
        return TailResult(
            c.token_ids[0],
            "stop" if c.finish_reason == "stop" else None,
            report.saved_blocks,
            report.external_tokens,
            (time.perf_counter() - t0) * 1e3,
        )

    async def decode(
        self, request_id: str, token_ids: list[int], kv: KVTransferSpec | None, sampling: Sampling
    ) -> AsyncIterator[DecodeStep]:
        engine = self._engine_for(DECODE)
        sp = to_vllm_sampling(sampling, kv=kv)
        try:
            first = True
            async for out in engine.generate({"prompt_token_ids": token_ids}, sp, f"dec-{request_id}"):
                c = out.outputs[0]
                if out.finished:
                    report = ConnectorReport.from_vllm(out.kv_transfer_params)
                    yield DecodeStep(
                        list(c.token_ids),
                        c.finish_reason or "stop",
                        report.external_tokens,
                        len(out.prompt_token_ids or []),
                    )
                else:  # the engines run without prefix caching: every cached token came through the connector
                    cached = (getattr(out, "num_cached_tokens", None) or 0) if first else 0  # absent: not reported
                    yield DecodeStep(list(c.token_ids), None, cached)
                first = False
        except Exception as e:
            if _is_engine_death(e, engine):
                raise EngineError(f"decode engine died during request {request_id}") from e
            raise
