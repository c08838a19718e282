"""The scheduler side of tandem's KV connector (vLLM's EngineCore process): per request, how many
prompt tokens the block store can supply, and per step, which vLLM blocks the worker side loads
from the store and which it saves to it (``TandemMetadata``). It reads the store only to ask
which keys are present (``BlockStore.contains``); it never touches KV tensors.

Who calls what (vLLM v1 scheduler): ``get_num_new_matched_tokens`` when a request is scheduled
(again after a preemption), ``update_state_after_alloc`` once its blocks are allocated,
``build_connector_meta`` once per step, ``request_finished`` once per request. A request whose
plan fails (a store out of reach, a spec that does not fit its blocks) saves nothing more and has
this step's loads reported failed, so vLLM recomputes them; no call raises.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from tandem.cloud.engines.connector.metadata import ConnectorSettings, PartOp, TandemMetadata
from tandem.cloud.engines.kvparams import ConnectorReport, KVTransferSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from tandem.cloud.store.blocks import BlockStore

log = logging.getLogger("tandem.connector")


@dataclass
class _ReqState:
    """Scheduler-side state of one request with tandem params."""

    spec: KVTransferSpec
    num_prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    external_tokens: int = 0
    local_hit_tokens: int = 0
    load_pending: bool = False
    saved_blocks: int = 0  # blocks [0, saved_blocks) are saved or known present


class TandemConnectorScheduler:
    """Plans each step's loads and saves of the requests carrying a ``KVTransferSpec``."""

    def __init__(self, settings: ConnectorSettings, store: BlockStore) -> None:
        self.block_size = settings.block_size
        self.store = store
        self._reqs: dict[str, _ReqState] = {}

    def _state(self, request: Request) -> _ReqState | None:
        st = self._reqs.get(request.request_id)
        if st is None:
            try:
                spec = KVTransferSpec.from_vllm(request.kv_transfer_params)
            except ValueError as e:  # the request runs without the store: vLLM computes all of it
                log.error("tandem connector: malformed KV params of %s (%s); computing it", request.request_id, e)
                request.kv_transfer_params = None
                return None
            if spec is None:
                return None
            st = _ReqState(spec, request.num_prompt_tokens)
            self._reqs[request.request_id] = st
        return st

    def _present_blocks(self, st: _ReqState, start: int) -> int:
        """Number of consecutive blocks from ``start`` whose entries for all load parts are stored."""
        n, parts = start, st.spec.loads
        while n < st.spec.num_blocks and all(self.store.contains(p.store_key(n)) for p in parts):
            n += 1
        return n - start

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens loadable from the store past ``num_computed_tokens``: whole blocks, and never
        the last prompt token (vLLM must compute at least one token to sample)."""
        st = self._state(request)
        if st is None or not st.spec.loads or num_computed_tokens % self.block_size:
            return 0, False
        first = num_computed_tokens // self.block_size
        cap_blocks = (st.num_prompt_tokens - 1) // self.block_size
        try:
            present = self._present_blocks(st, first)
        except Exception:  # a store out of reach: nothing is loadable, vLLM computes the prompt
            log.exception("tandem connector: cannot look up blocks of request %s; computing them", request.request_id)
            return 0, False
        n = min(present, max(0, cap_blocks - first))
        return n * self.block_size, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._state(request)
        if st is None:
            return
        if num_external_tokens > 0:
            st.external_tokens = num_external_tokens
            st.local_hit_tokens = request.num_computed_tokens
            st.load_pending = True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TandemMetadata:
        meta = TandemMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0])
                self._plan_guarded(new.req_id, st, new.num_computed_tokens, scheduler_output, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    st.block_ids = list(new_ids[0])
                else:
                    st.block_ids.extend(new_ids[0])
            self._plan_guarded(req_id, st, cached.num_computed_tokens[i], scheduler_output, meta)
        return meta

    def _plan_guarded(self, req_id: str, st: _ReqState, num_computed: int, so: SchedulerOutput, meta: TandemMetadata):
        """``_plan``, never raising: a request whose plan fails saves nothing more, and if it had
        blocks to load this step, every block of it is reported failed so vLLM recomputes them."""
        n_loads, n_saves = len(meta.loads), len(meta.saves)
        try:
            self._plan(req_id, st, num_computed, so, meta)
        except Exception:
            log.exception("tandem connector: planning request %s failed; vLLM computes its blocks", req_id)
            del meta.saves[n_saves:]
            if st.load_pending or len(meta.loads) > n_loads:
                del meta.loads[n_loads:]
                meta.failed_loads.extend(st.block_ids)
            st.load_pending = False
            st.spec = replace(st.spec, save=None)

    def _plan(self, req_id: str, st: _ReqState, num_computed: int, so: SchedulerOutput, meta: TandemMetadata) -> None:
        """Add this step's loads (once, at first schedule) and saves (blocks completed by this step)."""
        bs = self.block_size
        if st.load_pending:
            first = st.local_hit_tokens // bs
            for j in range(first, first + st.external_tokens // bs):
                meta.loads.append((st.block_ids[j], tuple(PartOp(p.layers, p.store_key(j)) for p in st.spec.loads)))
            st.load_pending = False
            st.saved_blocks = max(st.saved_blocks, first + st.external_tokens // bs)  # loaded: already stored
        save = st.spec.save
        if save is None:
            return
        done = min(num_computed + so.num_scheduled_tokens.get(req_id, 0), st.num_prompt_tokens)
        full = min(done // bs, len(save.keys), len(st.block_ids))
        for j in range(st.saved_blocks, full):
            key = save.store_key(j)
            if not self.store.contains(key):  # keys commit to the inputs: a present entry is this KV
                meta.saves.append((st.block_ids[j], PartOp(save.layers, key)))
        st.saved_blocks = max(st.saved_blocks, full)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Report what the connector did for the request in ``RequestOutput.kv_transfer_params``;
        blocks are never held past the request (``False``: vLLM frees them at once)."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        return False, ConnectorReport(st.external_tokens, st.saved_blocks).to_vllm()
