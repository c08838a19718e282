"""The whole model as ONNX Runtime GenAI's model builder writes it, driven by tandem with ONNX Runtime:
a session's KV in preallocated buffers, bound as past and present at once.

The graph (``onnxruntime_genai.models.builder``; see ``common.model.builder_export``) takes
``input_ids`` int64 ``[1, S]``, ``attention_mask`` int64 ``[1, M]`` and, per layer ``i``,
``past_key_values.i.key`` / ``.value`` ``[1, Hkv, C, D]``; it returns ``logits`` ``[1, S, V]``,
``present.i.key`` / ``.value`` and (added by tandem's preparation) ``next_token_ids`` int64 ``[1,
S]``, the argmax of each row of the logits. A CUDA build has the sampler beside it
(``sampler.onnx``, ``common.model.builder_export.write_sampler``): ``DeviceSampler`` runs it on a
step's logits where they lie on the device, with ``temperature``, ``top_k``, ``top_p`` and
``uniform`` per row (the float32 ``sampling`` input ``[B, 4]``), and reads back only
``sampled_ids`` int64 ``[B, 1]``, each row's last token sampled at its ``uniform``; on a decode
step's fixed buffers its run is a CUDA graph too; a greedy step never runs it. Its attention is ``GroupQueryAttention``
with rotary fused: the positions of the new tokens come from the mask (``sum(mask) - S`` tokens are
already held), and with past and present bound to one buffer of ``C`` tokens ("past-present share
buffer") it writes the new tokens' keys and values in place after the held ones. Nothing grows per
token, so a decode step's inputs and outputs keep their addresses and ONNX Runtime's CUDA provider
can replay it as a CUDA graph (``enable_cuda_graph``; prefills run uncaptured, ``gpu_graph_id =
-1``).

``KVSlot``: one session's KV, in its own buffers (``2L`` KV tensors, the mask, the step's input
and outputs, and the CUDA graph captured on them: one graph id per set of buffers) or in a batch
pool row, never in both. ``DecoderGraph.run`` computes new tokens into a slot; greedy turns read
back only the token id, sampled turns too where the build has the sampler, others the logits of the
last token.

Batched decode (``DecoderGraph.run_batch``): several sessions' one-token steps in one run, with
``input_ids`` ``[B, 1]``, ``attention_mask`` ``[B, C]`` right-padded (per row ones over its held
tokens and the new one; GroupQueryAttention takes each row's length from it) and KV ``[B, Hkv, C,
D]``. The sessions of one capacity decode in a ``BatchPool``: per layer one buffer ``[R, Hkv, C,
D]`` whose first rows the sessions occupy (``edge.compute.decoder_batch.RowTable``); a step binds the first
``b`` rows by address (``b`` = the power of two that covers them, the rows past the sessions
padding that write only their position 0), so each pool captures one CUDA graph per ``b``. A
session's KV moves into a row when it first steps in a batch, and its own buffers become a spare
(kept for the next session of that capacity, their graph with them, up to
``FREE_SLOTS_PER_CAPACITY``; freed beyond). A run of the session alone (its next turn's prefill)
runs in its row, uncaptured, its row bound by address as ``[1, Hkv, C, D]``; the KV moves back into
own buffers (a spare's, else new) only when ``read_kv`` or ``write_kv`` needs it, when it sat out
``IDLE_STEPS`` steps or when it must grow. The moves are device copies
(``edge.compute.decoder_batch.KVCopier``) of the held tokens only.

Memory: ``KVSlot.nbytes`` is what a session holds (its own buffers or its pool row), which the
engine's session table bounds; ``memory`` counts every buffer held (sessions', spares, pools with
their free rows) against ``max_kv_bytes``. Without CUDA graphs, a pool whose rows no step needed
all of for ``IDLE_S`` seconds shrinks to the rows its sessions need (freed when it has none), and
spare buffers unused that long are freed (checked at each run call). An allocation beyond the
bound first frees spares, empty pools and unneeded pool rows, then raises ``QuotaExceeded`` (a
batched step that cannot join or grow a pool steps the session alone instead). Freed buffers' CUDA
graphs are never replayed again, and ONNX Runtime keeps every captured graph until its session ends
(it has no call to drop one) while its arena keeps the freed memory: so with CUDA graphs buffers
are not given back by idleness (only the bound frees them), and at most ``MAX_GRAPHS`` graphs are
captured, steps on buffers without one running uncaptured past that.

Shapes: ``L`` layers, ``Hkv`` KV heads, ``D`` head dim, ``C`` a slot's capacity in tokens, ``T``
tokens held, ``V`` vocabulary; the KV dtype is the graph's (float32 on the CPU build, float16 or
bfloat16 on a GPU). Not here: sampling, sessions, locks (``edge.compute.local``).

A split head built by the same builder (``common.model.builder_head``: layers ``[0, k)``, output
``hidden`` ``[1, S, H]`` in place of the logits) loads here too: ``run_rows(slot, ids, "hidden")``
runs it into a slot (``edge.compute.builder_head.BuilderHead``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tandem.common.model.builder_export import (
    GENAI_CONFIG,
    NEXT_TOKEN,
    ONNX_ELEMENT,
    SAMPLED,
    SAMPLER_FILE,
    SAMPLING,
    TOP_CAP,
    TOP_SAMPLER_FILE,
    load_build,
    neutral_sampling,
    sampling_row,
)
from tandem.common.protocol.errors import InvalidRequest, QuotaExceeded
from tandem.edge.compute.decoder_batch import (
    IDLE_S,
    MIN_POOL_ROWS,
    KVCopier,
    KVMemory,
    RowTable,
    bucket_rows,
    shrink_rows,
)
from tandem.edge.compute.localmodel import Draw
from tandem.edge.compute.prefill import PrefillPlan

log = logging.getLogger(__name__)

MIN_SLOT_TOKENS = 256  # a session's first slot holds at least this many tokens; slots grow by doubling
FREE_SLOTS_PER_CAPACITY = 4  # spare slot buffers (released, or given up for a pool row) kept per capacity
# CUDA graphs one decoder captures at most: ONNX Runtime keeps each captured graph (and what it holds on
# the device) until the session ends and offers no way to drop one, so buffers freed and made anew
# would otherwise add graphs without end; past the cap, steps on buffers without a graph run uncaptured
MAX_GRAPHS = 256
# KV capacities a warm-up sets decode graphs up for, at most this many tokens (where ``max_kv_bytes``
# does not bound them lower): a served turn's first decode step on a capacity without a graph paid
# its setup, 10-340 ms on an H100 (benchmarks/results/gpu/README.md, "The edge's runtimes")
WARM_MAX_TOKENS = 8192
# KV and logits types (ONNX Runtime's name -> ONNX element type); bfloat16 has no numpy dtype, so its
# tensors are held as uint16 bit patterns and bound by address with their ONNX type
ONNX_TYPES = ONNX_ELEMENT
ITEM_BYTES = {"tensor(float)": 4, "tensor(float16)": 2, "tensor(uint16)": 2, "tensor(int64)": 8}  # as held
# a slot's device buffers: what it gives up while its KV lives in a pool row, and what a spare keeps
BUFFER_FIELDS = (
    "kv",
    "mask",
    "step_ids",
    "step_logits",
    "step_next",
    "graph_id",
    "binding",
)


class GraphThread:
    """The thread that replays a session's CUDA graphs. ONNX Runtime's CUDA provider keeps captured
    graphs in a context per thread, and with CUDA graphs on it never hands a thread's context to
    another (``CUDAExecutionProvider::OnRunEnd`` releases it only when graphs are off): a graph id
    run on a second thread is captured again there, into a new context with new cuBLAS handles,
    and the first thread's context and graphs stay held until the session ends. So every captured
    run of a ``DecoderGraph`` and its sampler must come from one thread
    (``edge.compute.stepper.Stepper`` keeps its thread for the engine's life for such a model).

    ``threads``: the native ids of the threads captured runs came from (1 when driven right); the
    second one is logged as a warning.

    ``setup_runs``: runs that set a CUDA graph up, its first two (``note``); one decoder's graphs
    are few (``MAX_GRAPHS``, the sampler's ``DeviceSampler.MAX_GRAPHS``), so the count per graph
    id is kept for the session's life."""

    def __init__(self) -> None:
        self.threads: set[int] = set()
        self.setup_runs = 0  # runs that set a graph up (see ``note``)
        self._runs: dict[tuple[int, int], int] = {}  # (session, graph id) -> its runs, up to 2

    def note(self, session: object, graph_id: int) -> None:
        """Called before each run of ``session`` with ``gpu_graph_id`` >= 1. A new graph id's first
        run is ONNX Runtime's uncaptured one (its allocations) and its second the capture, each
        tens of ms once: both count in ``setup_runs``."""
        key = (id(session), graph_id)
        runs = self._runs.get(key, 0)
        if runs < 2:
            self._runs[key] = runs + 1
            self.setup_runs += 1
        t = threading.get_native_id()  # the kernel's id: a new thread seldom gets an ended one's
        if t in self.threads:
            return
        self.threads.add(t)
        if len(self.threads) == 2:
            log.warning(
                "CUDA graphs replayed from a second thread: ONNX Runtime captures them again there and keeps "
                "the first thread's until the session ends; drive the decoder from one thread"
            )

    def replay(self, session: object, graph_id: int) -> Any:
        """The run options of a run of ``session`` through graph ``graph_id`` (>= 1), ``note``d."""
        self.note(session, graph_id)
        return _run_options(graph_id)


def _run_options(graph_id: int | None) -> Any:
    """ONNX Runtime's run options naming the CUDA graph a run replays (``graph_id`` >= 1; captured at
    its second run), -1 for an uncaptured run of a session with CUDA graphs on (a run that names none
    there is captured as graph 0), or None for a session without them."""
    import onnxruntime as ort

    opts = ort.RunOptions()
    if graph_id is not None:
        opts.add_run_config_entry("gpu_graph_id", str(graph_id))
    return opts


@dataclass(frozen=True)
class DecoderSpec:
    """What ``genai_config.json`` and the graph say about the decoder."""

    path: Path  # the ONNX file
    num_layers: int  # L
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    vocab_size: int  # V
    context_tokens: int  # the model's positions (the builder's ``context_length``)
    past_key: str  # e.g. "past_key_values.%d.key"
    past_value: str
    present_key: str
    present_value: str
    hidden_size: int = 0  # H (0 where the config does not say)

    @classmethod
    def load(cls, model_dir: Path) -> DecoderSpec:
        """Raises:
        FileNotFoundError: no ``genai_config.json`` in ``model_dir``.
        KeyError: the config lacks a field the decoder needs."""
        cfg = json.loads((Path(model_dir) / GENAI_CONFIG).read_text())["model"]
        dec = cfg["decoder"]
        return cls(
            path=Path(model_dir) / dec["filename"],
            num_layers=int(dec["num_hidden_layers"]),
            num_kv_heads=int(dec["num_key_value_heads"]),
            head_dim=int(dec["head_size"]),
            vocab_size=int(cfg["vocab_size"]),
            context_tokens=int(cfg["context_length"]),
            past_key=dec["inputs"]["past_key_names"],
            past_value=dec["inputs"]["past_value_names"],
            present_key=dec["outputs"]["present_key_names"],
            present_value=dec["outputs"]["present_value_names"],
            hidden_size=int(dec.get("hidden_size", 0)),
        )

    def past_names(self) -> list[str]:
        """``2L`` input names, key then value per layer."""
        return [n % i for i in range(self.num_layers) for n in (self.past_key, self.past_value)]

    def present_names(self) -> list[str]:
        return [n % i for i in range(self.num_layers) for n in (self.present_key, self.present_value)]


@dataclass
class KVSlot:
    """One session's KV on ``device``, owned by its ``DecoderGraph``: in the slot's own buffers, or
    (``pool`` set) in a row of a ``BatchPool``, never in both once a call returns.

    kv: ``2L`` tensors ``[1, Hkv, C, D]`` (KV dtype), key then value per layer, each bound as past
        and present; ``tokens`` of them are valid, the rest is scratch. Empty while the KV lives in
        a pool row (the buffers went to the graph's spares or were freed).
    mask_host: int64 ``[1, C]`` on the host, ``1`` for the held tokens and the ones being computed,
        ``0`` after (wherever the KV lives); mask: its device copy (own buffers).
    step_ids / step_logits / step_next: a decode step's input ``[1, 1]`` int64 and outputs
        ``[1, 1, V]`` and ``[1, 1]`` int64, at fixed addresses (what a CUDA graph replays).
    graph_id: the CUDA graph id of a decode step on these buffers (``>= 1``; 0 without buffers).
    pool: the ``BatchPool`` whose row holds the KV, else None.
    capacity_tokens: ``C``; 0 once released.
    """

    capacity_tokens: int
    kv: list[Any]
    mask: Any
    mask_host: np.ndarray
    step_ids: Any
    step_logits: Any
    step_next: Any
    graph_id: int
    tokens: int = 0
    binding: Any = field(default=None, repr=False)
    pool: Any = field(default=None, repr=False)

    @property
    def live(self) -> bool:
        """Not released."""
        return self.capacity_tokens > 0

    def own_nbytes(self) -> int:
        """Bytes of the slot's own buffers (0 while its KV lives in a pool row)."""
        return _values_nbytes([*self.kv, self.mask, self.step_ids, self.step_logits, self.step_next])

    def nbytes(self) -> int:
        """Bytes the session holds (device memory on a GPU): its own buffers, or its row of each of
        its pool's buffers (KV, mask, ids, outputs)."""
        return self.own_nbytes() + (self.pool.row_nbytes if self.pool is not None else 0)


@dataclass
class BatchPool:
    """The decode rows of the sessions of one capacity ``C``, ``R`` rows, owned by its ``DecoderGraph``.

    kv: ``2L`` tensors ``[R, Hkv, C, D]`` (KV dtype), key then value per layer; row ``r`` of each is
        the KV of ``table``'s member in row ``r`` (its only copy).
    ids / ids_host: int64 ``[R, 1]``, a step's input ids (device buffer and its host copy).
    mask / mask_host: int64 ``[R, C]``, a step's attention mask.
    next_ids: int64 ``[R, 1]``, the argmax output; logits: ``[R, 1, V]``.
    graph_ids / bindings: per bucket ``b`` (rows run), the CUDA graph id and the IO binding it was
        captured with (the buffers' first ``b`` rows bound by address).
    nbytes: bytes of all its device buffers; busy_at: the graph's clock (s) when a step last needed
        all ``R`` rows (or the pool was made).
    """

    capacity_tokens: int
    rows: int
    kv: list[Any]
    ids: Any
    ids_host: np.ndarray
    mask: Any
    mask_host: np.ndarray
    next_ids: Any
    logits: Any
    table: RowTable[KVSlot] = field(default_factory=RowTable)
    graph_ids: dict[int, int] = field(default_factory=dict)
    bindings: dict[int, Any] = field(default_factory=dict)
    nbytes: int = 0
    busy_at: float = 0.0

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row of every buffer: what one session in the pool holds."""
        return self.nbytes // self.rows


class DeviceSampler:
    """The build's sampler graphs (``sampler.onnx`` and, where written, the top-k sampler
    ``sampler-top64.onnx``; ``common.model.builder_export.sampling_nodes``), each in an ONNX Runtime
    session of its own on the decoder's device, run on logits where they lie.

    Who calls: its ``DecoderGraph``, after a run whose rows sample (never on a greedy step: ONNX
    Runtime runs every node of a session's graph, and the sampler sorts logits per row).

    A step whose read rows all have ``1 <= top_k <= top_cap`` runs the top-k sampler (it sorts only
    the ``top_cap`` largest logits); where it answers ``-1`` for a read row (ties past the cap) the
    step runs the whole sort, as do the other steps. Logits at a fixed address (a slot's or a pool's
    decode-step output, ``fixed=True``) are sampled through a binding kept per graph and ``(address,
    shape)``, with the ``sampling`` input and the ``sampled_ids`` output in device buffers of their
    own; on the CUDA provider with ``capture`` that run is a CUDA graph (captured at its first use,
    replayed after: a sampled step costs the sampler's kernels, not ONNX Runtime's per-node
    launches). At most ``MAX_GRAPHS`` such bindings are kept per graph (each captured graph stays in
    ONNX Runtime until the session ends); beyond, and for logits that will not be seen again (a
    prefill's), a run binds afresh, uncaptured.
    """

    MAX_GRAPHS = 256

    def __init__(
        self,
        path: Path,
        providers: list[Any],
        device: str,
        capture: bool = False,
        top_path: Path | None = None,
        graph_thread: GraphThread | None = None,
    ) -> None:
        """``providers``: the decoder's; ``capture``: replay fixed-address runs as CUDA graphs (the
        CUDA provider only); ``top_path``: the top-k sampler's graph (``TOP_CAP`` largest logits), or
        None; ``graph_thread``: the decoder's (its captured runs come from that thread too). Where
        ONNX Runtime refuses to capture a graph it runs uncaptured and ``capture_note``
        says why.

        Raises:
            ValueError: a graph's inputs are not ``logits`` and ``sampling`` (a build older than
                this runtime: run ``tandem-model`` again).
            What ``onnxruntime.InferenceSession`` raises for a bad file.
        """
        self.device = device
        self.path = path
        self.capture_note = ""
        self.graph_thread = graph_thread or GraphThread()
        self.whole = _SamplerGraph(self, path, providers, capture and device == "cuda")
        self.top = _SamplerGraph(self, top_path, providers, self.whole.captured) if top_path is not None else None
        self.top_cap = TOP_CAP if self.top is not None else 0
        self.runs = 0  # sampled steps so far (and of them, those the top-k sampler answered whole)
        self.top_runs = 0
        self.last_ms = 0.0  # the last step's sampling time (ms, host clock, copies included)
        self._next_graph_id = 1

    @property
    def captured(self) -> bool:
        """Whether fixed-address runs replay as CUDA graphs."""
        return self.whole.captured

    def sample(
        self,
        logits: Any,
        rows: int,
        logits_type: str,
        sampling: np.ndarray,
        fixed: bool = False,
        read: Sequence[int] | None = None,
    ) -> np.ndarray:
        """The tokens sampled from the last position of each of the first ``rows`` rows of
        ``logits`` (an ``OrtValue`` ``[R, S, V]`` of ``logits_type`` on the device, bound by
        address), at the per-row ``sampling`` (float32 ``[>= rows, 4]``, ``SAMPLING_COLUMNS``):
        int64 ``[rows]`` on the host, exact for the rows in ``read`` (default: all; the others'
        tokens are not read). ``fixed``: the logits buffer is one the caller will sample from
        again (through a kept binding, a CUDA graph where captured)."""
        t0 = time.perf_counter()
        params = np.ascontiguousarray(sampling[:rows], np.float32)
        read = range(rows) if read is None else read
        tokens = None
        if self.top is not None and all(1 <= params[r, 1] <= self.top_cap for r in read):
            tokens = self.top.run(logits, rows, logits_type, params, fixed)
            if any(tokens[r] < 0 for r in read):
                tokens = None
            else:
                self.top_runs += 1
        if tokens is None:
            tokens = self.whole.run(logits, rows, logits_type, params, fixed)
        self.runs += 1
        self.last_ms = (time.perf_counter() - t0) * 1e3
        return tokens

    def graph_id(self) -> int:
        """A CUDA graph id no other kept binding of this sampler uses (``>= 1``)."""
        self._next_graph_id += 1
        return self._next_graph_id - 1


class _SamplerGraph:
    """One sampler graph in its own ONNX Runtime session, with its kept bindings (``DeviceSampler``)."""

    def __init__(self, owner: DeviceSampler, path: Path, providers: list[Any], capture: bool) -> None:
        import onnxruntime as ort

        from tandem.edge.compute.head import session_options, with_cuda_options

        def provider_list(graph: bool) -> list[Any]:
            return with_cuda_options(providers, {"enable_cuda_graph": "1" if graph else "0"})

        self.owner, self.captured = owner, capture
        try:
            self.session = ort.InferenceSession(str(path), session_options(), providers=provider_list(capture))
        except Exception as e:  # noqa: BLE001 - ONNX Runtime refuses CUDA graphs for some graphs at load
            if not capture:
                raise
            self.captured = False
            owner.capture_note += f"{path.name}: CUDA graph refused at load: {e}. "
            self.session = ort.InferenceSession(str(path), session_options(), providers=provider_list(False))
        names = {i.name for i in self.session.get_inputs()}
        if names != {"logits", SAMPLING}:
            raise ValueError(
                f"{path}: the sampler's inputs are {sorted(names)}, not logits and {SAMPLING}: "
                "built by an older tandem-model; prepare the model again"
            )
        self._bound: dict[tuple[int, int, int, int], _SamplerBinding] = {}

    def run(self, logits: Any, rows: int, logits_type: str, params: np.ndarray, fixed: bool) -> np.ndarray:
        """This graph's tokens ``[rows]`` (``DeviceSampler.sample``), through a kept binding where
        ``fixed`` and there is room for one, else a fresh one."""
        _, steps, vocab = logits.shape()
        key = (logits.data_ptr(), rows, steps, vocab)
        kept = self._bound.get(key) if fixed else None
        if kept is None and fixed and len(self._bound) < DeviceSampler.MAX_GRAPHS:
            kept = self._bound[key] = self._keep(logits, rows, logits_type)
        if kept is None:
            return self._run_fresh(logits, rows, logits_type, params)
        kept.params.update_inplace(params)
        opts = self.owner.graph_thread.replay(self.session, kept.graph_id) if self.captured else _run_options(None)
        self.session.run_with_iobinding(kept.binding, opts)
        return kept.tokens.numpy()[:, 0]

    def _keep(self, logits: Any, rows: int, logits_type: str) -> _SamplerBinding:
        """A binding of the first ``rows`` rows of ``logits`` to device buffers of the sampler's own."""
        import onnxruntime as ort

        device = self.owner.device
        params = ort.OrtValue.ortvalue_from_numpy(neutral_sampling(rows), device, 0)
        tokens = ort.OrtValue.ortvalue_from_shape_and_type([rows, 1], np.int64, device, 0)
        b = self._bind_logits(logits, rows, logits_type)
        b.bind_ortvalue_input(SAMPLING, params)
        b.bind_ortvalue_output(SAMPLED, tokens)
        return _SamplerBinding(b, params, tokens, self.owner.graph_id())

    def _bind_logits(self, logits: Any, rows: int, logits_type: str) -> Any:
        """A new IO binding with the first ``rows`` rows of ``logits`` (on the device) as input."""
        _, steps, vocab = logits.shape()
        b = self.session.io_binding()
        b.bind_input("logits", self.owner.device, 0, ONNX_TYPES[logits_type], [rows, steps, vocab], logits.data_ptr())
        return b

    def _run_fresh(self, logits: Any, rows: int, logits_type: str, params: np.ndarray) -> np.ndarray:
        """One uncaptured run with a binding of its own: the parameters from the host, the tokens back."""

        b = self._bind_logits(logits, rows, logits_type)
        b.bind_cpu_input(SAMPLING, params)
        b.bind_output(SAMPLED, "cpu")
        self.session.run_with_iobinding(b, _run_options(-1 if self.captured else None))
        return b.get_outputs()[0].numpy()[:, 0]


@dataclass(frozen=True)
class DeviceRows:
    """The first rows of a device tensor, as the sampler binds them (its ``data_ptr`` and
    ``shape``, as an ``OrtValue`` answers them): a padded prefill's logits ``[1, W, V]`` seen as
    ``[1, S, V]``, so that the row sampled is the last real one."""

    address: int
    dims: list[int]

    def data_ptr(self) -> int:
        return self.address

    def shape(self) -> list[int]:
        return list(self.dims)


@dataclass
class _SamplerBinding:
    """A kept sampler binding: the IO binding, its ``sampling`` input ``[rows, 4]`` and ``sampled_ids``
    output ``[rows, 1]`` on the device, and its CUDA graph id (``>= 1``)."""

    binding: Any
    params: Any
    tokens: Any
    graph_id: int


class DecoderGraph:
    """A builder-format decoder in one ONNX Runtime session, run into ``KVSlot`` buffers.

    Who calls: ``edge.compute.local.LocalEngine`` (one run at a time, from a worker thread) and the
    benchmarks. Thread-safety: no two calls may overlap, on any slots (``run_batch`` moves other
    sessions' rows; the engine serialises every call under its model lock).

    Memory: ``memory.held_bytes`` counts every buffer the graph allocated and still holds
    (sessions' own slots, spare slots, pools); with ``max_kv_bytes`` it never exceeds that bound:
    an allocation that would frees spares, empty pools and pools' unneeded rows first, then raises
    ``QuotaExceeded``.
    """

    batched_decode = True  # ``run_batch`` runs several sessions' decode steps in one run

    def __init__(
        self,
        model_dir: Path,
        providers: list[Any] | None = None,
        intra_op_threads: int = 0,
        cuda_graph: bool = True,
        max_kv_bytes: int | None = None,
        idle_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        prefill: PrefillPlan | None = None,
    ) -> None:
        """``providers``: ONNX Runtime's (default: CUDA where onnxruntime-gpu has a GPU, then CPU);
        ``cuda_graph``: capture each slot's decode step as a CUDA graph on the CUDA provider (fp32
        MatMuls there run without TF32, as vLLM's fp32 engines do); ``max_kv_bytes``: bound on
        ``memory.held_bytes`` (None: none); ``idle_s``: how long a pool or a spare waits idle
        before it is given back (``_tick``), by ``clock`` (seconds); None: ``IDLE_S`` where no CUDA
        graph is captured, never where one is (ONNX Runtime keeps a freed buffer set's graph and
        its arena keeps the memory, so giving buffers back by idleness would only make the next
        session capture another graph; the ``max_kv_bytes`` bound still frees them when it needs
        room); ``prefill``: how runs of more than one new token are cut and padded
        (``edge.compute.prefill``; default: ``PrefillPlan.bucketed()`` on the CUDA provider,
        ``PrefillPlan.EXACT`` elsewhere).

        Raises:
            ValueError: ``max_kv_bytes`` < 1.
            FileNotFoundError / KeyError: see ``DecoderSpec.load``.
            What ``onnxruntime.InferenceSession`` raises for a bad file.
        """
        import onnxruntime as ort

        from tandem.edge.compute.head import default_providers, session_options, with_cuda_options

        self.memory = KVMemory(max_kv_bytes)
        self.spec = DecoderSpec.load(model_dir)
        names = list(providers or default_providers())
        names = with_cuda_options(names, {"use_tf32": "0", "enable_cuda_graph": "1" if cuda_graph else "0"})
        self.session = ort.InferenceSession(str(self.spec.path), session_options(intra_op_threads), providers=names)
        self.on_cuda = "CUDAExecutionProvider" in self.session.get_providers()
        self.cuda_graph = self.on_cuda and cuda_graph
        self.device = "cuda" if self.on_cuda else "cpu"
        self.prefill = prefill if prefill is not None else PrefillPlan.bucketed() if self.on_cuda else PrefillPlan.EXACT
        types = {i.name: i.type for i in self.session.get_inputs()}
        self.kv_type = types[self.spec.past_names()[0]]
        # a head (``common.model.builder_head``) has no logits: its rows output is ``hidden``
        self.output_types = {o.name: o.type for o in self.session.get_outputs()}
        self.logits_type = self.output_types.get("logits", "")
        # the output with a row per new token: ``logits``, or a head's ``hidden``
        kv_out = {*self.spec.present_names(), NEXT_TOKEN}
        self.rows_output = "logits" if self.logits_type else next(o for o in self.output_types if o not in kv_out)
        for t in (self.kv_type, self.logits_type or self.kv_type):
            if t not in ONNX_TYPES:
                raise ValueError(f"{self.spec.path}: KV and logits must be float32, float16 or bfloat16, got {t}")
        self.has_next_token = NEXT_TOKEN in {o.name for o in self.session.get_outputs()}
        self.graph_thread = GraphThread()
        sampler = self.spec.path.parent / SAMPLER_FILE
        top = self.spec.path.parent / TOP_SAMPLER_FILE
        self.sampler = (
            DeviceSampler(
                sampler, names, self.device, self.cuda_graph, top if top.is_file() else None, self.graph_thread
            )
            if sampler.is_file()
            else None
        )
        self.has_sampling = self.sampler is not None
        self._graphs = 0  # graph ids bound for decode steps (slots' and pools' buckets)
        self.providers: list[str] = self.session.get_providers()
        # a slot holds more than the graph's sliding window (ONNX Runtime refuses a smaller KV buffer)
        self.min_slot_tokens = max(MIN_SLOT_TOKENS, _window_tokens(model_dir) + 1)
        self._next_graph_id = 1
        self._free: dict[int, list[KVSlot]] = {}  # spare buffers per capacity, the longest kept first
        self._kept_at: dict[int, float] = {}  # id(spare) -> the clock (s) when it was kept
        self._pools: dict[int, BatchPool] = {}
        self._copier = KVCopier(names, self.device)
        self._item_bytes = int(np.dtype(_storage(self.kv_type)).itemsize)
        self.clock = clock
        self.idle_s = idle_s if idle_s is not None else math.inf if self.cuda_graph else IDLE_S
        self.max_graphs = MAX_GRAPHS
        self._graphs_capped = False  # the cap's warning logged
        self._now = clock()  # at the latest run call

    # ---- slots ------------------------------------------------------------------------------

    def new_slot(self, capacity_tokens: int, keep: BatchPool | None = None) -> KVSlot:
        """Allocate a slot of ``capacity_tokens`` (zeroed KV, an all-zero mask), within
        ``max_kv_bytes`` (``_reserve``; ``keep``: a pool not to shrink for room).

        Raises:
            ValueError: ``capacity_tokens`` < 1 or beyond the model's positions.
            QuotaExceeded: no room for it within ``max_kv_bytes``.
        """
        import onnxruntime as ort

        s = self.spec
        if not 1 <= capacity_tokens <= s.context_tokens:
            raise ValueError(f"capacity_tokens {capacity_tokens}: 1 to the model's {s.context_tokens}")
        self._reserve(self._session_nbytes(capacity_tokens), keep)
        shape = [1, s.num_kv_heads, capacity_tokens, s.head_dim]
        kv = [self._zeros(shape) for _ in range(2 * s.num_layers)]
        mask_host = np.zeros((1, capacity_tokens), np.int64)
        dev = self.device
        slot = KVSlot(
            capacity_tokens=capacity_tokens,
            kv=kv,
            mask=ort.OrtValue.ortvalue_from_numpy(mask_host.copy(), dev, 0),
            mask_host=mask_host,
            step_ids=ort.OrtValue.ortvalue_from_shape_and_type([1, 1], np.int64, dev, 0),
            step_logits=self._empty_logits(1) if self.logits_type else None,
            step_next=ort.OrtValue.ortvalue_from_shape_and_type([1, 1], np.int64, dev, 0),
            graph_id=self._next_graph_id,
        )
        self._next_graph_id += 1
        self.memory.took(slot.own_nbytes())
        return slot

    def _zeros(self, shape: list[int]) -> Any:
        """A zeroed KV tensor ``shape`` on the device, in the KV dtype's storage type."""
        import onnxruntime as ort

        return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, _storage(self.kv_type)), self.device, 0)

    def _sampling_rows(self, draws: Sequence[Draw | None], rows: int, at: Sequence[int]) -> np.ndarray:
        """The sampler's ``sampling`` input, float32 ``[rows, 4]``: ``draws[i]`` in row ``at[i]``,
        neutral values elsewhere (a greedy row's sample is not read)."""
        host = neutral_sampling(rows)
        for d, r in zip(draws, at, strict=True):
            if d is not None:
                host[r] = sampling_row(d.temperature, d.top_k, d.top_p, d.uniform)
        return host

    def _samples(self, greedy: bool, draw: Draw | None) -> bool:
        """Whether a row's token is the sampler's (not greedy, a draw, the build has the sampler)."""
        return not greedy and draw is not None and self.has_sampling

    def _empty_logits(self, rows: int, output: str = "logits") -> Any:
        """An output buffer ``[1, rows, X]`` for the graph's rows output ``output`` (``logits``:
        ``X = V``; a head's ``hidden``: ``X = H``) in its storage type, on the device."""
        import onnxruntime as ort

        width = self.spec.vocab_size if output == "logits" else self.spec.hidden_size
        onnx_type = self.output_types[output]
        return ort.OrtValue.ortvalue_from_shape_and_type([1, rows, width], _storage(onnx_type), self.device, 0)

    # ---- runs -------------------------------------------------------------------------------

    def run(
        self, slot: KVSlot, new_ids: list[int], greedy: bool, draw: Draw | None = None
    ) -> tuple[int | None, np.ndarray | None, float]:
        """Compute ``new_ids`` (``S >= 1`` tokens) after the ``slot.tokens`` the slot holds, in
        place: afterwards the slot holds ``tokens + S`` (grown first where it must).

        Returns ``(token, logits, ms)``: with ``greedy`` and the graph's argmax output the argmax
        token of the last new row and no logits; not greedy, with a ``draw`` and the build's
        sampler, the last row's token sampled at ``draw`` on the device and no logits; otherwise ``None`` and the
        last row's logits, float32 ``[V]`` on the host; and the run time in ms.

        A slot whose KV is in a pool row runs there (uncaptured) when the new tokens fit its
        capacity; otherwise (or to grow) it first takes own buffers back.

        Raises:
            InvalidRequest: no new token, or ``tokens + S`` exceeds the model's positions.
            QuotaExceeded: growing (or leaving a pool row to grow) needs memory beyond ``max_kv_bytes``.
        """
        self._tick()
        return self._run(slot, new_ids, greedy, draw)

    def _run(
        self, slot: KVSlot, new_ids: list[int], greedy: bool, draw: Draw | None = None
    ) -> tuple[int | None, np.ndarray | None, float]:
        """``run`` without a tick of the idleness clock (inside ``run_batch`` too)."""
        n = len(new_ids)
        t = self._begin(slot, n)
        t0 = time.perf_counter()
        if n == 1 and slot.pool is None and self._may_capture(slot.binding is not None):
            token, logits = self._decode_step(slot, new_ids[0], greedy, draw)
        else:
            token, logits = self._run_unbound(slot, t, new_ids, greedy, draw)
        slot.tokens = t + n
        return token, logits, (time.perf_counter() - t0) * 1e3

    def _run_unbound(
        self, slot: KVSlot, held: int, new_ids: list[int], greedy: bool, draw: Draw | None = None
    ) -> tuple[int | None, np.ndarray | None]:
        """Runs with a fresh binding of ``new_ids`` after ``held`` tokens: a prefill (cut and padded
        by ``prefill``), or every run where no CUDA graph is captured. Only the last piece's output
        is read."""
        want_token = greedy and self.has_next_token
        *first, last = self._pieces(held, new_ids)
        for at, piece in first:
            self._run_bound(slot, at, piece, NEXT_TOKEN if self.has_next_token else None)
        at, piece = last
        b, logits, rows = self._run_bound(slot, at, piece, NEXT_TOKEN if want_token else None)
        if logits is None:
            # outputs come back in the order they were bound
            return int(b.get_outputs()[-1].numpy()[0, rows - 1]), None
        if self._samples(greedy, draw):
            first_rows = DeviceRows(logits.data_ptr(), [1, rows, self.spec.vocab_size])
            return int(self._sample(first_rows, 1, self._sampling_rows([draw], 1, [0]))[0]), None
        return None, np.asarray(_as_float32(logits)[0, rows - 1], np.float32)

    def _pieces(self, held: int, new_ids: list[int]) -> list[tuple[int, list[int]]]:
        """``new_ids`` cut into ``prefill``'s runs: ``(held tokens before it, its ids)`` each."""
        out, at = [], held
        for n in self.prefill.pieces(len(new_ids)):
            out.append((at, new_ids[at - held : at - held + n]))
            at += n
        return out

    def _run_bound(
        self, slot: KVSlot, held: int, new_ids: list[int], token_output: str | None, rows_output: str = "logits"
    ) -> tuple[Any, Any, int]:
        """One uncaptured run of ``new_ids`` (``S`` tokens) after ``held`` tokens, padded on the right
        to ``prefill.width`` (``W >= S``; the padding repeats the last id and is computed as if held,
        unseen by the real tokens: causal attention): the ids and the mask (ones over ``held + W``,
        bound ``[1, held + W]``, or ``[1, C]`` with ``prefill.capacity_mask``) from the host, the KV
        bound as past and present, and as output either the argmax token of each row
        (``token_output``) or the ``rows_output`` (the logits, or a head's hidden state) of every
        row, on the device. Returns the binding, that tensor (``None`` with a token output) and
        ``S``: the real rows are the first ``S``."""
        n = len(new_ids)
        width = self.prefill.width(n, slot.capacity_tokens - held)
        ids = [*new_ids, *[new_ids[-1]] * (width - n)]
        mask = np.zeros((1, slot.capacity_tokens if self.prefill.capacity_mask else held + width), np.int64)
        mask[0, : held + width] = 1
        b = self.session.io_binding()
        b.bind_cpu_input("input_ids", np.asarray([ids], np.int64))
        b.bind_cpu_input("attention_mask", mask)
        self._bind_kv(b, slot)
        logits = None
        if token_output is not None:
            b.bind_output(token_output, "cpu")
        else:
            logits = self._empty_logits(width, rows_output)
            self._bind(b, rows_output, logits, self.output_types[rows_output], output=True)
        self.session.run_with_iobinding(b, _run_options(-1 if self.cuda_graph else None))
        return b, logits, n

    def run_rows(self, slot: KVSlot, new_ids: list[int], output: str = "logits") -> np.ndarray:
        """``run`` that returns the graph's ``output`` of every new token, float32 on the host,
        uncaptured: the logits ``[S, V]`` (the preparation's check against HF), or a builder head's
        ``hidden`` ``[S, H]`` (``edge.compute.builder_head``).

        Raises:
            InvalidRequest: as ``run``."""
        self._tick()
        t = self._begin(slot, len(new_ids))
        rows = []
        for at, piece in self._pieces(t, new_ids):
            _, out, n = self._run_bound(slot, at, piece, None, rows_output=output)
            rows.append(_as_float32(out)[0, :n])
        slot.tokens = t + len(new_ids)
        return rows[0] if len(rows) == 1 else np.concatenate(rows)

    def warm_prefills(self, max_tokens: int | None = None) -> list[int]:
        """Run each of ``prefill``'s padded lengths once on a slot of each capacity a served turn
        is likely to hold (the first slot capacity and ``plan_warm_capacities``'s, up to
        ``WARM_MAX_TOKENS`` and to the capacity of ``max_tokens``, the most a served turn holds;
        None: the model's positions: the KV inputs ``[1, Hkv, C, D]`` are part of every run's shapes), so
        that ONNX Runtime has run every shape a served prefill runs where the mask is bound over
        the capacity (without it the mask's width ``T + S`` varies with the held tokens too, which
        no warm-up covers). A head runs through ``run_rows``, as ``BuilderHead`` runs it. Returns
        the capacities warmed (none with ``PrefillPlan.EXACT``); one the memory bound refuses
        (``QuotaExceeded``) ends the warm-up there. Nothing is held afterwards (the slots become
        spares)."""
        top = self._capacity_for(min(max_tokens or self.spec.context_tokens, self.spec.context_tokens))
        caps = [c for c in (next(self._capacities()), *self._planned_capacities()) if c <= top]
        warmed: list[int] = []
        for cap in caps:
            shapes = self.prefill.shapes(cap)
            if not shapes:
                continue
            try:
                slot = self.new_kv(cap)
            except QuotaExceeded as e:
                log.info("prefill shapes not run past KV capacity %s: %s", warmed[-1] if warmed else "-", e)
                break
            try:
                for width in shapes:
                    self.truncate(slot, 0)
                    ids = [(1 + 7919 * i) % self.spec.vocab_size for i in range(width)]
                    if self.logits_type:  # a served prefill's run: the argmax token read back
                        self.run(slot, ids, greedy=True)
                    else:  # a head's: its rows (``hidden``) read back, as ``BuilderHead`` runs it
                        self.run_rows(slot, ids, self.rows_output)
            finally:
                self.release(slot)
            warmed.append(cap)
        return warmed

    def _begin(self, slot: KVSlot, n: int) -> int:
        """Ready ``slot`` for ``n`` new tokens: where its pool row (or own buffers) cannot hold them,
        grown into own buffers that can; their mask set. Returns the tokens held before them.

        Raises:
            InvalidRequest: ``n`` < 1, or the held and new tokens exceed the model's positions.
            QuotaExceeded: growing needs memory beyond ``max_kv_bytes``.
        """
        if n < 1:
            raise InvalidRequest("a run needs at least one new token")
        t = slot.tokens
        if slot.pool is None or t + n > slot.capacity_tokens:
            self._own(slot, t + n)
        slot.mask_host[0, t : t + n] = 1
        return t

    def _may_capture(self, captured: bool) -> bool:
        """Whether a decode step runs through a CUDA graph: one its buffers have (``captured``), or
        a new one while fewer than ``max_graphs`` were captured. Past the cap the step runs
        uncaptured (its first refusal is logged as a warning)."""
        if not self.cuda_graph:
            return False
        if captured or self._graphs < self.max_graphs:
            return True
        if not self._graphs_capped:
            self._graphs_capped = True
            log.warning(
                "%d CUDA graphs captured, the most one decoder keeps: decode steps on new buffers run uncaptured",
                self.max_graphs,
            )
        return False

    def _decode_step(
        self, slot: KVSlot, token_id: int, greedy: bool, draw: Draw | None = None
    ) -> tuple[int | None, np.ndarray | None]:
        """One token through the slot's captured CUDA graph: the input id and the whole mask ``[1, C]``
        are copied into their fixed buffers, the graph replays (captured on the first step), and
        only the token id (greedy, or sampled on the device from the step's logits) or the logits
        row comes back."""

        slot.step_ids.update_inplace(np.asarray([[token_id]], np.int64))
        slot.mask.update_inplace(slot.mask_host)
        if slot.binding is None:
            b = self.session.io_binding()
            b.bind_ortvalue_input("input_ids", slot.step_ids)
            b.bind_ortvalue_input("attention_mask", slot.mask)
            self._bind_kv(b, slot)
            self._bind(b, "logits", slot.step_logits, self.logits_type, output=True)
            if self.has_next_token:
                b.bind_ortvalue_output(NEXT_TOKEN, slot.step_next)
            slot.binding = b
            self._graphs += 1
        self.session.run_with_iobinding(slot.binding, self.graph_thread.replay(self.session, slot.graph_id))
        if greedy and self.has_next_token:
            return int(slot.step_next.numpy()[0, -1]), None
        if self._samples(greedy, draw):
            picks = self._sample(slot.step_logits, 1, self._sampling_rows([draw], 1, [0]), fixed=True)
            return int(picks[0]), None
        return None, _last_row(_as_float32(slot.step_logits))

    def _sample(
        self, logits: Any, rows: int, sampling: np.ndarray, fixed: bool = False, read: Sequence[int] = (0,)
    ) -> np.ndarray:
        """The sampler's tokens of the first ``rows`` rows of ``logits`` (``[R, S, V]`` on the
        device), exact for the rows in ``read``; ``fixed``: a decode step's output buffer (sampled
        again at the same address)."""
        assert self.sampler is not None
        return self.sampler.sample(logits, rows, self.logits_type, sampling, fixed=fixed, read=read)

    def _bind_kv(self, b: Any, slot: KVSlot) -> None:
        """Bind the slot's KV as past and present: its own buffers, or its pool row by address (a row
        of ``[R, Hkv, C, D]`` is a contiguous ``[1, Hkv, C, D]``)."""
        names = zip(self.spec.past_names(), self.spec.present_names(), strict=True)
        pool = slot.pool
        if pool is None:
            for (past, present), v in zip(names, slot.kv, strict=True):
                self._bind(b, past, v, self.kv_type, output=False)
                self._bind(b, present, v, self.kv_type, output=True)
            return
        shape = [1, self.spec.num_kv_heads, pool.capacity_tokens, self.spec.head_dim]
        for (past, present), ptr in zip(names, self._row_ptrs(pool, pool.table.row(slot)), strict=True):
            self._bind_at(b, past, ptr, shape, self.kv_type, output=False)
            self._bind_at(b, present, ptr, shape, self.kv_type, output=True)

    def _bind(self, b: Any, name: str, v: Any, onnx_type: str, output: bool) -> None:
        """Bind ``v`` as ``name``; a bfloat16 tensor (held as uint16) by its address and ONNX type."""
        if onnx_type != "tensor(bfloat16)":
            (b.bind_ortvalue_output if output else b.bind_ortvalue_input)(name, v)
            return
        bind = b.bind_output if output else b.bind_input
        bind(name, self.device, 0, ONNX_TYPES[onnx_type], v.shape(), v.data_ptr())

    # ---- batched decode steps ---------------------------------------------------------------

    def run_batch(
        self,
        slots: Sequence[KVSlot],
        token_ids: Sequence[int],
        greedy: Sequence[bool],
        draws: Sequence[Draw | None] | None = None,
    ) -> tuple[list[int | None], list[np.ndarray | None], float]:
        """One decode step of each slot, ``token_ids[i]`` after ``slots[i].tokens``, in one run per
        capacity among the slots (one run where they share one): afterwards each slot holds one
        token more (grown first where it must, which moves it to the pool of its new capacity).

        Returns, per slot in order, the argmax token (``greedy[i]`` and the graph's argmax output),
        the token sampled at ``draws[i]`` on the device (not greedy, a draw, and the build's sampler) or None, the
        new token's logits float32 ``[V]`` on the host where no token is returned, else None; and
        the run time in ms (all runs, moves included).

        A slot the pool of its capacity has no room for (``max_kv_bytes``) steps alone.

        Raises:
            InvalidRequest: lengths that differ (``draws``: None or one per slot), no slot, a slot
                twice or released, or a slot whose ``tokens + 1`` exceeds the model's positions;
                nothing changes then.
            QuotaExceeded: a slot must grow and there is no room for it within ``max_kv_bytes``
                (the slots grown before it keep their new capacity; none has stepped).
        """
        n = len(slots)
        draws = [None] * n if draws is None else list(draws)
        if n < 1 or len(token_ids) != n or len(greedy) != n or len(draws) != n:
            raise InvalidRequest(f"a batched step takes one token per slot: {n} slots, {len(token_ids)} tokens")
        if len({id(s) for s in slots}) != n or any(not s.live for s in slots):
            raise InvalidRequest("a batched step takes each live slot once")
        for s in slots:
            self._capacity_for(s.tokens + 1)
        self._tick()
        t0 = time.perf_counter()
        for s in slots:
            if s.tokens + 1 > s.capacity_tokens:
                self._own(s, s.tokens + 1)
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(slots):
            groups.setdefault(s.capacity_tokens, []).append(i)
        tokens: list[int | None] = [None] * n
        logits: list[np.ndarray | None] = [None] * n
        for cap, idx in groups.items():
            toks, rows = self._step_pool(
                cap,
                [slots[i] for i in idx],
                [int(token_ids[i]) for i in idx],
                [greedy[i] for i in idx],
                [draws[i] for i in idx],
            )
            for j, i in enumerate(idx):
                tokens[i], logits[i] = toks[j], rows[j]
        return tokens, logits, (time.perf_counter() - t0) * 1e3

    def _step_pool(
        self, cap: int, slots: list[KVSlot], token_ids: list[int], greedy: list[bool], draws: list[Draw | None]
    ) -> tuple[list[int | None], list[np.ndarray | None]]:
        """One step of ``slots`` (all of capacity ``cap``): those not in the pool of ``cap`` join it
        (giving up their own buffers), then one run over its first ``bucket_rows(n)`` rows; a slot
        the pool has no room for, or every slot where the pool cannot run (``_ready``), steps alone."""
        if cap not in self._pools:
            with contextlib.suppress(QuotaExceeded):
                self._pools[cap] = self._new_pool(cap, max(MIN_POOL_ROWS, bucket_rows(len(slots))))
        for s in slots:
            if s.pool is None:
                with contextlib.suppress(QuotaExceeded):
                    self._join(s)
        pool = self._pools.get(cap)
        batched = [i for i, s in enumerate(slots) if s.pool is not None]
        if pool is None or not self._ready(pool, [slots[i] for i in batched]):
            batched = []
        tokens: list[int | None] = [None] * len(slots)
        logits: list[np.ndarray | None] = [None] * len(slots)
        if batched and pool is not None:
            pick = [slots[i] for i in batched]
            toks, rows = self._step_rows(
                pool, pick, [token_ids[i] for i in batched], [greedy[i] for i in batched], [draws[i] for i in batched]
            )
            for j, i in enumerate(batched):
                tokens[i], logits[i] = toks[j], rows[j]
        for i in sorted(set(range(len(slots))) - set(batched)):
            tokens[i], logits[i], _ = self._run(slots[i], [token_ids[i]], greedy[i], draws[i])
        return tokens, logits

    def _ready(self, pool: BatchPool, stepping: list[KVSlot]) -> bool:
        """Ready ``pool`` for a step of ``stepping`` (members all): the members that sat out
        ``IDLE_STEPS`` steps go back to own buffers where there is room, and so must every member
        that does not step and whose row has no scratch position left (``tokens == C``). False when
        one of those cannot (no room): the pool cannot run this step."""
        for m in pool.table.step(stepping):
            with contextlib.suppress(QuotaExceeded):
                self._settle(m)
        ids = {id(s) for s in stepping}
        for m in pool.table.members():
            if id(m) not in ids and m.tokens >= pool.capacity_tokens:
                try:
                    self._settle(m)
                except QuotaExceeded:
                    return False
        return True

    def _step_rows(
        self, pool: BatchPool, slots: list[KVSlot], token_ids: list[int], greedy: list[bool], draws: list[Draw | None]
    ) -> tuple[list[int | None], list[np.ndarray | None]]:
        """One run over the first ``bucket_rows(n)`` rows of ``pool`` for ``slots`` (members all): a
        member that does not step computes one scratch token at its position ``tokens`` (past what
        it holds), a padding row one at position 0 of a free row."""
        b = bucket_rows(len(pool.table))
        if b >= pool.rows:
            pool.busy_at = self._now
        lengths = np.ones(b, np.int64)  # per row: held tokens + the one computed now
        pool.ids_host[:] = 0
        for m in pool.table.members():
            r = pool.table.row(m)
            lengths[r] = m.tokens + 1
        for s, tok in zip(slots, token_ids, strict=True):
            pool.ids_host[pool.table.row(s), 0] = tok
        pool.mask_host[:b] = np.arange(pool.capacity_tokens)[None, :] < lengths[:, None]
        if self._may_capture(b in pool.bindings):
            self._replay_bucket(pool, b)
        else:
            self._run_bucket(pool, b, int(lengths.max()))
        for s in slots:
            s.mask_host[0, s.tokens] = 1
            s.tokens += 1
        return self._step_outputs(pool, b, [pool.table.row(s) for s in slots], greedy, draws)

    def _step_outputs(
        self, pool: BatchPool, bucket: int, rows: list[int], greedy: list[bool], draws: list[Draw | None]
    ) -> tuple[list[int | None], list[np.ndarray | None]]:
        """Per row, its argmax token (greedy, where the graph computes it), its sampled token (a
        draw, where the build has the sampler: one sampler run over the step's first ``bucket`` rows
        of logits, on the device) or its logits row; only what some row needs is read back."""
        argmax = [g and self.has_next_token for g in greedy]
        sampled = [self._samples(g, d) for g, d in zip(greedy, draws, strict=True)]
        ids = pool.next_ids.numpy()[:, 0] if any(argmax) else None
        picks = None
        if any(sampled):
            on = [d if s else None for d, s in zip(draws, sampled, strict=True)]
            read = [r for r, s in zip(rows, sampled, strict=True) if s]
            picks = self._sample(pool.logits, bucket, self._sampling_rows(on, bucket, rows), self.cuda_graph, read)
        logits = _as_float32(pool.logits) if not all(a or s for a, s in zip(argmax, sampled, strict=True)) else None
        tokens: list[int | None] = []
        rows_out: list[np.ndarray | None] = []
        for r, a, s in zip(rows, argmax, sampled, strict=True):
            tok = int(ids[r]) if a and ids is not None else int(picks[r]) if s and picks is not None else None
            tokens.append(tok)
            rows_out.append(np.asarray(logits[r, -1], np.float32) if tok is None and logits is not None else None)
        return tokens, rows_out

    def _bind_rows(self, b: Any, pool: BatchPool, rows: int) -> None:
        """Bind the pool's first ``rows`` rows of KV (past and present) and outputs by address."""
        s = self.spec
        shape = [rows, s.num_kv_heads, pool.capacity_tokens, s.head_dim]
        for past, present, v in zip(s.past_names(), s.present_names(), pool.kv, strict=True):
            self._bind_at(b, past, v.data_ptr(), shape, self.kv_type, output=False)
            self._bind_at(b, present, v.data_ptr(), shape, self.kv_type, output=True)
        self._bind_at(b, "logits", pool.logits.data_ptr(), [rows, 1, s.vocab_size], self.logits_type, output=True)
        if self.has_next_token:
            self._bind_at(b, NEXT_TOKEN, pool.next_ids.data_ptr(), [rows, 1], "tensor(int64)", output=True)

    def _run_bucket(self, pool: BatchPool, rows: int, mask_tokens: int) -> None:
        """A step over the first ``rows`` rows without a CUDA graph (none on this provider, or past
        ``max_graphs``), the mask bound over its first ``mask_tokens`` positions (every row's length
        fits)."""
        b = self.session.io_binding()
        b.bind_cpu_input("input_ids", np.ascontiguousarray(pool.ids_host[:rows]))
        b.bind_cpu_input("attention_mask", np.ascontiguousarray(pool.mask_host[:rows, :mask_tokens]))
        self._bind_rows(b, pool, rows)
        self.session.run_with_iobinding(b, _run_options(-1 if self.cuda_graph else None))

    def _replay_bucket(self, pool: BatchPool, rows: int) -> None:
        """A step over the first ``rows`` rows through the pool's CUDA graph of that bucket (captured
        on its first use): the ids and the whole mask ``[R, C]`` copied into their fixed buffers, the
        first ``rows`` rows of each bound by address."""

        pool.ids.update_inplace(pool.ids_host)
        pool.mask.update_inplace(pool.mask_host)
        if rows not in pool.bindings:
            b = self.session.io_binding()
            self._bind_at(b, "input_ids", pool.ids.data_ptr(), [rows, 1], "tensor(int64)", output=False)
            self._bind_at(
                b, "attention_mask", pool.mask.data_ptr(), [rows, pool.capacity_tokens], "tensor(int64)", output=False
            )
            self._bind_rows(b, pool, rows)
            pool.bindings[rows] = b
            pool.graph_ids[rows] = self._next_graph_id
            self._next_graph_id += 1
            self._graphs += 1
        opts = self.graph_thread.replay(self.session, pool.graph_ids[rows])
        self.session.run_with_iobinding(pool.bindings[rows], opts)

    def _bind_at(self, b: Any, name: str, address: int, shape: list[int], onnx_type: str, output: bool) -> None:
        """Bind the tensor ``shape`` of ``onnx_type`` at ``address`` on the device as ``name``."""
        element = np.int64 if onnx_type == "tensor(int64)" else ONNX_TYPES[onnx_type]
        (b.bind_output if output else b.bind_input)(name, self.device, 0, element, shape, address)

    # ---- pools: rows, joins, leaves ---------------------------------------------------------

    def _new_pool(self, capacity_tokens: int, rows: int, keep: BatchPool | None = None) -> BatchPool:
        """A pool of ``rows`` rows of ``capacity_tokens``, within ``max_kv_bytes`` (``_reserve``;
        ``keep``: a pool not to shrink for room).

        Raises:
            QuotaExceeded: no room for it."""
        import onnxruntime as ort

        self._reserve(rows * self._session_nbytes(capacity_tokens), keep)
        s, dev = self.spec, self.device
        ids_host = np.zeros((rows, 1), np.int64)
        mask_host = np.zeros((rows, capacity_tokens), np.int64)
        pool = BatchPool(
            capacity_tokens=capacity_tokens,
            rows=rows,
            kv=[self._zeros([rows, s.num_kv_heads, capacity_tokens, s.head_dim]) for _ in range(2 * s.num_layers)],
            ids=ort.OrtValue.ortvalue_from_numpy(ids_host.copy(), dev, 0),
            ids_host=ids_host,
            mask=ort.OrtValue.ortvalue_from_numpy(mask_host.copy(), dev, 0),
            mask_host=mask_host,
            next_ids=ort.OrtValue.ortvalue_from_shape_and_type([rows, 1], np.int64, dev, 0),
            logits=ort.OrtValue.ortvalue_from_shape_and_type(
                [rows, 1, s.vocab_size], _storage(self.logits_type), dev, 0
            ),
            busy_at=self.clock(),
        )
        pool.nbytes = _values_nbytes([*pool.kv, pool.ids, pool.mask, pool.next_ids, pool.logits])
        self.memory.took(pool.nbytes)
        return pool

    def _free_pool(self, pool: BatchPool) -> None:
        """Free the buffers of ``pool`` (no members left) and forget its CUDA graphs."""
        if self._pools.get(pool.capacity_tokens) is pool:
            del self._pools[pool.capacity_tokens]
        self.memory.freed(pool.nbytes)
        pool.nbytes = 0
        pool.kv, pool.ids, pool.mask, pool.next_ids, pool.logits = [], None, None, None, None
        pool.bindings, pool.graph_ids = {}, {}

    def _kv_row_bytes(self, capacity_tokens: int) -> int:
        """Bytes of one row ``[1, Hkv, C, D]`` of one KV tensor."""
        return self.spec.num_kv_heads * capacity_tokens * self.spec.head_dim * self._item_bytes

    def _session_nbytes(self, capacity_tokens: int) -> int:
        """Bytes of one session's buffers of ``capacity_tokens``: a slot's own (``KVSlot.own_nbytes``),
        or one row of each buffer of a pool (``BatchPool.row_nbytes``)."""
        s = self.spec
        logits = s.vocab_size * np.dtype(_storage(self.logits_type)).itemsize if self.logits_type else 0  # a head: none
        mask_ids_next = 8 * capacity_tokens + 8 + 8
        return 2 * s.num_layers * self._kv_row_bytes(capacity_tokens) + logits + mask_ids_next

    def _row_ptrs(self, pool: BatchPool, row: int) -> list[int]:
        return [v.data_ptr() + row * self._kv_row_bytes(pool.capacity_tokens) for v in pool.kv]

    def _head_ranges(
        self, src: list[int], src_tokens: int, dst: list[int], dst_tokens: int, tokens: int
    ) -> list[tuple[int, int, int]]:
        """The copies of the first ``tokens`` of each KV head between tensors ``[1, Hkv, *, D]`` at
        ``src`` (``src_tokens`` positions) and ``dst`` (``dst_tokens``): ``2L * Hkv`` ranges."""
        d = self.spec.head_dim * self._item_bytes
        return [
            (a + h * src_tokens * d, z + h * dst_tokens * d, tokens * d)
            for a, z in zip(src, dst, strict=True)
            for h in range(self.spec.num_kv_heads)
        ]

    def _join(self, slot: KVSlot) -> None:
        """Move ``slot``'s held KV from its own buffers into a free row of the pool of its capacity
        (made, or doubled when full) and give its own buffers up: its KV lives in the row alone.

        Raises:
            QuotaExceeded: no room for the pool or its doubling; nothing changes then."""
        cap = slot.capacity_tokens
        pool = self._pools.get(cap)
        if pool is None:
            pool = self._pools[cap] = self._new_pool(cap, MIN_POOL_ROWS)
        elif len(pool.table) == pool.rows:
            pool = self._resize_pool(pool, 2 * pool.rows)
        row = pool.table.add(slot)
        self._copier.copy(self._head_ranges(_ptrs(slot.kv), cap, self._row_ptrs(pool, row), cap, slot.tokens))
        slot.pool = pool
        self._give_up(slot)

    def _leave(self, pool: BatchPool, slot: KVSlot) -> None:
        """Free ``slot``'s row; the last row's session moves into it (its held KV copied)."""
        moved = pool.table.remove(slot)
        slot.pool = None
        if moved is not None:
            src, dst = moved
            m = pool.table.members()[dst]
            cap = pool.capacity_tokens
            self._copier.copy(
                self._head_ranges(self._row_ptrs(pool, src), cap, self._row_ptrs(pool, dst), cap, m.tokens)
            )

    def _settle(self, slot: KVSlot, tokens: int = 0) -> None:
        """Bring ``slot``'s KV from its pool row into own buffers (a spare, else new) and free its
        row; the buffers hold ``max(tokens, slot.tokens)`` (the row's capacity, else the one that
        fits). Nothing if in no pool.

        Raises:
            InvalidRequest: ``tokens`` exceeds the model's positions.
            QuotaExceeded: no room for own buffers; nothing changes then."""
        pool = slot.pool
        if pool is None:
            return
        need = max(tokens, slot.tokens)
        cap = pool.capacity_tokens if need <= pool.capacity_tokens else self._capacity_for(need)
        own = self._spare(cap, keep=pool)
        src = self._row_ptrs(pool, pool.table.row(slot))
        self._copier.copy(self._head_ranges(src, pool.capacity_tokens, _ptrs(own.kv), cap, slot.tokens))
        self._leave(pool, slot)
        for f in BUFFER_FIELDS:
            setattr(slot, f, getattr(own, f))
        slot.capacity_tokens, slot.mask_host = cap, own.mask_host
        slot.mask_host[0, : slot.tokens] = 1

    def _own(self, slot: KVSlot, tokens: int) -> None:
        """Make ``slot`` hold its KV in own buffers of at least ``tokens`` positions (from its pool
        row, or grown).

        Raises:
            InvalidRequest: ``tokens`` exceeds the model's positions.
            QuotaExceeded: no room for the buffers."""
        if slot.pool is not None:
            self._settle(slot, tokens)
        else:
            self._fit(slot, tokens)

    def _give_up(self, slot: KVSlot) -> None:
        """Hand ``slot``'s own buffers (its KV is in a pool row now) to the spares."""
        spare = KVSlot(
            capacity_tokens=slot.capacity_tokens,
            mask_host=np.zeros_like(slot.mask_host),
            **{f: getattr(slot, f) for f in BUFFER_FIELDS},
        )
        _clear_buffers(slot)
        self._keep_spare(spare)

    def _resize_pool(self, pool: BatchPool, rows: int) -> BatchPool:
        """A pool of ``rows`` rows (at least its members) in place of ``pool``, its occupied rows
        copied over; the old buffers are freed and their CUDA graphs forgotten (the new buffers get
        their own when first stepped).

        Raises:
            QuotaExceeded: no room for the new buffers beside the old; nothing changes then."""
        new = self._new_pool(pool.capacity_tokens, rows, keep=pool)
        used = len(pool.table) * self._kv_row_bytes(pool.capacity_tokens)
        self._copier.copy([(a.data_ptr(), z.data_ptr(), used) for a, z in zip(pool.kv, new.kv, strict=True)])
        new.table, pool.table = pool.table, RowTable()
        for m in new.table.members():
            m.pool = new
        self._pools[pool.capacity_tokens] = new
        self._free_pool(pool)
        return new

    # ---- memory: the bound, spares, idle pools ------------------------------------------------

    def _spare(self, capacity_tokens: int, keep: BatchPool | None = None) -> KVSlot:
        """Buffers of ``capacity_tokens`` for a session: a spare's (its CUDA graph reused), else new.

        Raises:
            QuotaExceeded: none spare and no room for new ones."""
        kept = self._free.get(capacity_tokens)
        if not kept:
            return self.new_slot(capacity_tokens, keep)
        spare = kept.pop()
        self._kept_at.pop(id(spare), None)
        return spare

    def _keep_spare(self, spare: KVSlot) -> None:
        """Keep ``spare``'s buffers (no session's) for the next session of their capacity, up to
        ``FREE_SLOTS_PER_CAPACITY`` per capacity; free them beyond."""
        spare.tokens, spare.pool = 0, None
        spare.mask_host[:] = 0
        kept = self._free.setdefault(spare.capacity_tokens, [])
        if len(kept) < FREE_SLOTS_PER_CAPACITY:
            kept.append(spare)
            self._kept_at[id(spare)] = self.clock()
        else:
            self._free_slot(spare)

    def _free_slot(self, spare: KVSlot) -> None:
        """Free ``spare``'s buffers (its CUDA graph is never replayed again)."""
        self._kept_at.pop(id(spare), None)
        self.memory.freed(spare.own_nbytes())
        _clear_buffers(spare)

    def _reserve(self, nbytes: int, keep: BatchPool | None = None) -> None:
        """Make room for ``nbytes`` more within ``max_kv_bytes``: free spare buffers, then empty
        pools, then shrink the pools with rows no session needs (all but ``keep``), until they fit.

        Raises:
            QuotaExceeded: they do not fit even so."""
        fits = self.memory.fits
        for kept in self._free.values():
            while kept and not fits(nbytes):
                self._free_slot(kept.pop(0))
        for pool in sorted(self._pools.values(), key=lambda p: len(p.table)):  # empty pools first
            if fits(nbytes):
                return
            if pool is not keep:
                self._shrink(pool)
        if not fits(nbytes):
            raise self.memory.refusal(nbytes)

    def _shrink(self, pool: BatchPool) -> None:
        """Free ``pool`` if it has no member, else move its members into a pool of the rows they
        need (``bucket_rows``) where that is fewer and fits beside it within ``max_kv_bytes``."""
        rows = shrink_rows(len(pool.table), pool.rows)
        if rows == 0:
            self._free_pool(pool)
        elif rows is not None and self.memory.fits(rows * self._session_nbytes(pool.capacity_tokens)):
            self._resize_pool(pool, rows)

    def _tick(self) -> None:
        """At each run call: a pool whose rows no step needed all of for ``idle_s``
        shrinks (``_shrink``: freed when empty), and spare buffers kept that long are freed."""
        self._now = now = self.clock()
        for kept in self._free.values():
            while kept and now - self._kept_at.get(id(kept[0]), now) >= self.idle_s:
                self._free_slot(kept.pop(0))
        for pool in list(self._pools.values()):
            if now - pool.busy_at >= self.idle_s:
                self._shrink(pool)
                pool.busy_at = now  # tried: not again for idle_s

    def tidy(self) -> None:
        """Give back the pools and spares idle for ``idle_s`` now, as a run call does (between
        runs: ``edge.compute.local.LocalEngine.tidy``)."""
        self._tick()

    def trim(self) -> int:
        """Free every spare's buffers and every empty pool, and shrink every pool to the rows its
        sessions need, now (what idleness and the bound do by themselves). Returns the bytes freed."""
        before = self.memory.held_bytes
        for kept in self._free.values():
            while kept:
                self._free_slot(kept.pop())
        for pool in list(self._pools.values()):
            self._shrink(pool)
        return before - self.memory.held_bytes

    # ---- KV in and out ----------------------------------------------------------------------

    def read_kv(self, slot: KVSlot, tokens: int | None = None) -> list[np.ndarray]:
        """The first ``tokens`` (default: all held) of the slot's KV as ``2L`` float32 host arrays
        ``[1, Hkv, tokens, D]`` (a copy); a slot in a pool row takes own buffers back first.

        Raises:
            QuotaExceeded: no room for own buffers."""
        n = slot.tokens if tokens is None else tokens
        self._settle(slot)
        return [np.ascontiguousarray(_as_float32(v)[:, :, :n]) for v in slot.kv]

    def write_kv(self, slot: KVSlot, past: Sequence[np.ndarray], start: int = 0) -> None:
        """Make the slot hold ``past`` (``2L`` float32 ``[1, Hkv, T, D]``) after its first ``start``
        tokens: each tensor cast to the KV dtype on the host, uploaded once and copied into its
        place on the device (the held tokens are not read back); the slot takes own buffers back
        (from a pool row) and grows when ``start + T`` exceeds its capacity.

        Raises:
            InvalidRequest: ``past`` is not ``2L`` float32 arrays of the model's shape, ``start``
                exceeds the tokens held, or ``start + T`` exceeds the model's positions.
            QuotaExceeded: no room for own buffers.
        """
        s = self.spec
        t = int(past[0].shape[2]) if len(past) else -1
        want = (1, s.num_kv_heads, t, s.head_dim)
        if len(past) != 2 * s.num_layers or any(a.shape != want or a.dtype != np.float32 for a in past):
            got = [getattr(a, "shape", None) for a in list(past)[:2]]
            raise InvalidRequest(f"past must be {2 * s.num_layers} float32 arrays {want}, got {len(past)} like {got}")
        if not 0 <= start <= slot.tokens:
            raise InvalidRequest(f"KV written after token {start}: the slot holds {slot.tokens}")
        import onnxruntime as ort

        self._own(slot, start + t)
        if t:  # nothing to upload for T = 0
            item, row = self._item_bytes, t * s.head_dim * self._item_bytes  # bytes of one head's T tokens
            # one cast and one upload of every tensor ([2L, 1, Hkv, T, D]), then one copy run: a few
            # calls into ONNX Runtime, not a few per layer (each hands the GIL to the event loop and
            # waits to take it back, while the loop streams the cloud's tokens)
            held = _held(np.stack(past), self.kv_type)
            up = ort.OrtValue.ortvalue_from_numpy(held, self.device, 0)
            base, tensor, head = up.data_ptr(), s.num_kv_heads * row, slot.capacity_tokens * s.head_dim * item
            ranges = [  # head h's tokens [start, start + T) of layer tensor i's [1, Hkv, C, D]
                (base + i * tensor + h * row, v.data_ptr() + h * head + start * s.head_dim * item, row)
                for i, v in enumerate(slot.kv)
                for h in range(s.num_kv_heads)
            ]
            self._copier.copy(ranges)
            del up, held  # the copies ran: the staging buffer goes
        slot.mask_host[:] = 0
        slot.mask_host[0, : start + t] = 1
        slot.tokens = start + t

    def truncate(self, slot: KVSlot, tokens: int) -> None:
        """Keep the first ``tokens`` held (the rest is overwritten by the next run; a pool row's mask
        is made from ``tokens`` at each step), wherever the KV lives."""
        tokens = max(0, min(tokens, slot.tokens))
        slot.mask_host[0, tokens:] = 0
        slot.tokens = tokens

    # ---- slots as sessions' KV (``edge.compute.localmodel.LocalModel``) -------------------------------

    def new_kv(self, tokens_hint: int) -> KVSlot:
        """An empty slot for about ``tokens_hint`` tokens: spare buffers of the capacity that fits
        (their CUDA graph reused), else new ones of the next power of two from ``MIN_SLOT_TOKENS``.

        Raises:
            InvalidRequest: ``tokens_hint`` exceeds the model's positions.
            QuotaExceeded: no room for new buffers within ``max_kv_bytes``."""
        return self._spare(self._capacity_for(max(1, tokens_hint)))

    def reserve_kv(self, slot: KVSlot, tokens: int) -> None:
        """Make ``slot`` hold ``tokens`` tokens without growing later (a turn's prompt and output,
        before its prefill, so a growth that does not fit is refused then, not mid-decode): grown
        into own buffers now where its capacity is smaller; one that holds them stays where it is.

        Raises:
            InvalidRequest: ``tokens`` exceeds the model's positions.
            QuotaExceeded: no room for the bigger buffers beside the held ones; nothing changes then."""
        if tokens > slot.capacity_tokens:
            self._own(slot, tokens)

    @property
    def graphs(self) -> int:
        """Graph ids bound for decode steps so far (at most ``max_graphs``)."""
        return self._graphs

    @property
    def setup_runs(self) -> int:
        """Runs so far that set a CUDA graph up, the sampler's included (``GraphThread.note``):
        each takes tens of ms once, and the engine keeps them out of its measured rates."""
        return self.graph_thread.setup_runs

    def warm_capacities(self) -> list[int]:
        """The KV capacities above the first (``min_slot_tokens``) whose decode-step CUDA graphs a
        warm-up should set up, smallest first: none without CUDA graphs; else ``plan_warm_capacities``
        over this model's slot capacities up to ``WARM_MAX_TOKENS`` (the last one cut to the model's
        positions included), within half of ``max_kv_bytes`` (a warmed capacity keeps a pool row
        and a spare slot of its buffers, which later turns reuse with their graphs)."""
        return self._planned_capacities() if self.cuda_graph else []

    def _planned_capacities(self) -> list[int]:
        """``plan_warm_capacities`` over this model's slot capacities up to ``WARM_MAX_TOKENS`` (the
        last one cut to the model's positions included), within half of ``max_kv_bytes``."""
        budget = math.inf if self.memory.max_bytes is None else self.memory.max_bytes / 2
        caps = [c for c in self._capacities() if c <= WARM_MAX_TOKENS]
        return plan_warm_capacities(caps, self._session_nbytes, budget)

    @property
    def thread_bound(self) -> bool:
        """Whether every run must come from one thread: decode steps replay CUDA graphs, which ONNX
        Runtime keeps per thread (``GraphThread``)."""
        return self.cuda_graph

    @property
    def max_kv_bytes(self) -> int | None:
        """The bound on every KV buffer held (``local_kv_bytes``); None: unbounded."""
        return self.memory.max_bytes

    def turn_kv_bytes(self, tokens: int) -> int:
        """Bytes one session of ``tokens`` tokens needs alone: the buffers of the capacity that holds
        them (``turn_capacity_tokens``, ``new_kv``; KV, mask, step input and outputs).

        Raises:
            InvalidRequest: ``tokens`` exceeds the model's positions."""
        return self._session_nbytes(self.turn_capacity_tokens(tokens))

    def turn_capacity_tokens(self, tokens: int) -> int:
        """The capacity of the slot one session of ``tokens`` tokens holds: the power of two from
        ``min_slot_tokens`` (256, or past the sliding window) that holds them, the last one cut to
        the model's positions (``_capacity_for``).

        Raises:
            InvalidRequest: ``tokens`` exceeds the model's positions."""
        return self._capacity_for(max(1, tokens))

    def max_turn_tokens(self) -> int:
        """The most tokens one session can hold within ``max_kv_bytes`` with nothing else held (the
        model's positions when unbounded; 0 when not even the smallest slot fits)."""
        most = 0
        for cap in self._capacities():
            if self.max_kv_bytes is not None and self._session_nbytes(cap) > self.max_kv_bytes:
                break
            most = cap
        return most

    def release(self, slot: KVSlot) -> None:
        """The session is gone: its pool row is freed (the KV dropped), its own buffers become a
        spare for the next session of that capacity (up to ``FREE_SLOTS_PER_CAPACITY`` per
        capacity; freed beyond). Releasing twice does nothing."""
        if not slot.live:
            return
        if slot.pool is not None:
            self._leave(slot.pool, slot)
        if slot.kv:
            self._give_up(slot)
        slot.tokens, slot.capacity_tokens = 0, 0

    def _capacity_for(self, tokens: int) -> int:
        """The power of two from ``MIN_SLOT_TOKENS`` that holds ``tokens``, within the model's positions.

        Raises:
            InvalidRequest: ``tokens`` exceeds the model's positions."""
        if tokens > self.spec.context_tokens:
            raise InvalidRequest(f"{tokens} tokens exceed the model's {self.spec.context_tokens} positions")
        return next(cap for cap in self._capacities() if cap >= tokens)

    def _capacities(self) -> Iterator[int]:
        """Every slot capacity, smallest first: the powers of two from ``MIN_SLOT_TOKENS`` (or the
        sliding window's), the last one cut to the model's positions."""
        cap = self.min_slot_tokens
        while cap < self.spec.context_tokens:
            yield cap
            cap *= 2
        yield self.spec.context_tokens

    def _fit(self, slot: KVSlot, tokens: int) -> None:
        """Grow ``slot`` (not in a pool) in place to hold ``tokens``: buffers of the next fitting
        capacity (a spare's, else new with a new CUDA graph), the held KV copied over on the
        device, the old buffers kept as a spare. Growth doubles the capacity, so a session grows a
        few times at most.

        Raises:
            InvalidRequest: ``tokens`` exceeds the model's positions.
            QuotaExceeded: no room for the bigger buffers; nothing changes then."""
        if tokens <= slot.capacity_tokens:
            return
        bigger = self._spare(self._capacity_for(tokens))
        held = slot.tokens
        self._copier.copy(
            self._head_ranges(_ptrs(slot.kv), slot.capacity_tokens, _ptrs(bigger.kv), bigger.capacity_tokens, held)
        )
        bigger.tokens = held
        bigger.mask_host[0, :held] = 1
        old = KVSlot(**{f: getattr(slot, f) for f in KVSlot.__dataclass_fields__})
        for f in KVSlot.__dataclass_fields__:
            setattr(slot, f, getattr(bigger, f))
        self._keep_spare(old)


def plan_warm_capacities(
    capacities: Sequence[int], session_nbytes: Callable[[int], int], budget_bytes: float
) -> list[int]:
    """``capacities[1:]`` (a decoder's slot capacities, smallest first; the first is warmed
    already), smallest first, while the buffers each warmed capacity keeps (twice
    ``session_nbytes(capacity)``: a pool row and a spare slot), those of ``capacities[0]`` counted
    first, fit in ``budget_bytes``."""
    if not capacities:
        return []
    used = 2 * session_nbytes(capacities[0])
    caps: list[int] = []
    for cap in capacities[1:]:
        used += 2 * session_nbytes(cap)
        if used > budget_bytes:
            break
        caps.append(cap)
    return caps


def _ptrs(kv: list[Any]) -> list[int]:
    """The addresses of ``kv``'s tensors."""
    return [v.data_ptr() for v in kv]


def _values_nbytes(values: Sequence[Any]) -> int:
    """Bytes of the tensors ``values`` (None skipped)."""
    return sum(int(np.prod(v.shape())) * ITEM_BYTES[v.data_type()] for v in values if v is not None)


def _clear_buffers(slot: KVSlot) -> None:
    """Drop ``slot``'s references to its own buffers (and the binding that holds them)."""
    slot.kv, slot.mask, slot.step_ids, slot.step_logits, slot.step_next = [], None, None, None, None
    slot.graph_id, slot.binding = 0, None


def _window_tokens(model_dir: Path) -> int:
    """The graph's largest sliding window as preparation recorded it (``tandem_build.json``), or 0
    for a graph without a build record."""
    try:
        return load_build(Path(model_dir)).window_tokens
    except (FileNotFoundError, ValueError):
        return 0


def _storage(onnx_type: str) -> type:
    """The numpy dtype a tensor of ``onnx_type`` is held in (bfloat16: its uint16 bit patterns)."""
    return {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(bfloat16)": np.uint16}[onnx_type]


def _last_row(logits: np.ndarray) -> np.ndarray:
    return np.asarray(logits[0, -1], np.float32)


def _as_float32(v: Any) -> np.ndarray:
    """A tensor (device or host; bfloat16 held as uint16) as a float32 host array; bfloat16 widens exactly."""
    a = v.numpy()
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


def _held(host: np.ndarray, onnx_type: str) -> np.ndarray:
    """Float32 ``host`` as a contiguous array of ``onnx_type``'s storage (bfloat16: its uint16 bit
    patterns, rounded to nearest even)."""
    if onnx_type == "tensor(bfloat16)":
        bits = np.ascontiguousarray(host, np.float32).view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.ascontiguousarray(host, _storage(onnx_type))
