"""The whole model as ONNX Runtime GenAI's model builder writes it, driven by tandem with ONNX
Runtime: a session's KV in preallocated buffers, bound as past and present at once.

The graph (``onnxruntime_genai.models.builder``; see ``common.model.builder_export``) takes ``input_ids``
int64 ``[1, S]``, ``attention_mask`` int64 ``[1, M]`` and, per layer ``i``, ``past_key_values.i.key``
/ ``.value`` ``[1, Hkv, C, D]``; it returns ``logits`` ``[1, S, V]``, ``present.i.key`` / ``.value``
and (added by tandem's preparation) ``next_token_ids`` int64 ``[1, S]``, the argmax of each row of
the logits. Its attention is ``GroupQueryAttention`` with rotary fused: the positions of the new
tokens come from the mask (``sum(mask) - S`` tokens are already held), and with past and present
bound to one buffer of ``C`` tokens ("past-present share buffer") it writes the new tokens' keys
and values in place after the held ones. Nothing grows per token, so a decode step's inputs and
outputs keep their addresses and ONNX Runtime's CUDA provider can replay it as a CUDA graph
(``enable_cuda_graph``; prefills run uncaptured, ``gpu_graph_id = -1``).

``KVSlot``: one session's buffers (``2L`` KV tensors, the mask, the step's input and outputs) and
the CUDA graph captured on them (one graph id per slot). ``DecoderGraph.run`` computes new tokens
into a slot; greedy turns read back only the token id, others the logits of the last token.

Shapes: ``L`` layers, ``Hkv`` KV heads, ``D`` head dim, ``C`` a slot's capacity in tokens, ``T``
tokens held, ``V`` vocabulary; the KV dtype is the graph's (float32 on the CPU build, float16 or
bfloat16 on a GPU). Not here: sampling, sessions, locks (``edge.compute.local``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tandem.common.model.builder_export import GENAI_CONFIG, NEXT_TOKEN, ONNX_ELEMENT, load_build
from tandem.common.protocol.errors import InvalidRequest

MIN_SLOT_TOKENS = 256  # a session's first slot holds at least this many tokens; slots grow by doubling
FREE_SLOTS_PER_CAPACITY = 4  # released slots kept per capacity for the next sessions, without CUDA graphs
# KV and logits types (ONNX Runtime's name -> ONNX element type); bfloat16 has no numpy dtype, so its
# tensors are held as uint16 bit patterns and bound by address with their ONNX type
ONNX_TYPES = ONNX_ELEMENT
ITEM_BYTES = {"tensor(float)": 4, "tensor(float16)": 2, "tensor(uint16)": 2}  # of the KV as held


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
        )

    def past_names(self) -> list[str]:
        """``2L`` input names, key then value per layer."""
        return [n % i for i in range(self.num_layers) for n in (self.past_key, self.past_value)]

    def present_names(self) -> list[str]:
        return [n % i for i in range(self.num_layers) for n in (self.present_key, self.present_value)]


@dataclass
class KVSlot:
    """One session's KV and step buffers on ``device``, owned by its ``DecoderGraph``.

    kv: ``2L`` tensors ``[1, Hkv, C, D]`` (KV dtype), key then value per layer, each bound as past
        and present; ``tokens`` of them are valid, the rest is scratch.
    mask: int64 ``[1, C]``, ``1`` for the held tokens and the ones being computed, ``0`` after.
    step_ids / step_logits / step_next: a decode step's input ``[1, 1]`` int64 and outputs
        ``[1, 1, V]`` and ``[1, 1]`` int64, at fixed addresses (what a CUDA graph replays).
    graph_id: the CUDA graph id of this slot's decode step (``>= 1``).
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

    def nbytes(self) -> int:
        """Device (or host) bytes of the KV buffers."""
        return sum(int(np.prod(v.shape())) * ITEM_BYTES[v.data_type()] for v in self.kv)


class DecoderGraph:
    """A builder-format decoder in one ONNX Runtime session, run into ``KVSlot`` buffers.

    Who calls: ``edge.compute.local.LocalEngine`` (one run at a time, from a worker thread) and the
    benchmarks. Thread-safety: ``run`` on different slots may not overlap (the engine serialises).
    """

    def __init__(
        self,
        model_dir: Path,
        providers: list[Any] | None = None,
        intra_op_threads: int = 0,
        cuda_graph: bool = True,
    ) -> None:
        """``providers``: ONNX Runtime's (default: CUDA where onnxruntime-gpu has a GPU, then CPU);
        ``cuda_graph``: capture each slot's decode step as a CUDA graph on the CUDA provider (fp32
        MatMuls there run without TF32, as vLLM's fp32 engines do).

        Raises:
            FileNotFoundError / KeyError: see ``DecoderSpec.load``.
            What ``onnxruntime.InferenceSession`` raises for a bad file.
        """
        import onnxruntime as ort

        from tandem.edge.compute.head import default_providers, session_options

        self.spec = DecoderSpec.load(model_dir)
        names = list(providers or default_providers())
        self.on_cuda = any((p if isinstance(p, str) else p[0]) == "CUDAExecutionProvider" for p in names)
        if self.on_cuda:
            opts = {"use_tf32": "0", "enable_cuda_graph": "1" if cuda_graph else "0"}
            names = [("CUDAExecutionProvider", opts) if p == "CUDAExecutionProvider" else p for p in names]
        self.session = ort.InferenceSession(str(self.spec.path), session_options(intra_op_threads), providers=names)
        self.on_cuda = "CUDAExecutionProvider" in self.session.get_providers()
        self.cuda_graph = self.on_cuda and cuda_graph
        self.device = "cuda" if self.on_cuda else "cpu"
        types = {i.name: i.type for i in self.session.get_inputs()}
        self.kv_type = types[self.spec.past_names()[0]]
        self.logits_type = next(o.type for o in self.session.get_outputs() if o.name == "logits")
        for t in (self.kv_type, self.logits_type):
            if t not in ONNX_TYPES:
                raise ValueError(f"{self.spec.path}: KV and logits must be float32, float16 or bfloat16, got {t}")
        self.has_next_token = NEXT_TOKEN in {o.name for o in self.session.get_outputs()}
        self.providers: list[str] = self.session.get_providers()
        # a slot holds more than the graph's sliding window (ONNX Runtime refuses a smaller KV buffer)
        self.min_slot_tokens = max(MIN_SLOT_TOKENS, _window_tokens(model_dir) + 1)
        self._next_graph_id = 1
        self._free: dict[int, list[KVSlot]] = {}

    # ---- slots ------------------------------------------------------------------------------

    def new_slot(self, capacity_tokens: int) -> KVSlot:
        """Allocate a slot of ``capacity_tokens`` (zeroed KV, an all-zero mask).

        Raises:
            ValueError: ``capacity_tokens`` < 1 or beyond the model's positions.
        """
        import onnxruntime as ort

        s = self.spec
        if not 1 <= capacity_tokens <= s.context_tokens:
            raise ValueError(f"capacity_tokens {capacity_tokens}: 1 to the model's {s.context_tokens}")
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
            step_logits=self._empty_logits(1),
            step_next=ort.OrtValue.ortvalue_from_shape_and_type([1, 1], np.int64, dev, 0),
            graph_id=self._next_graph_id,
        )
        self._next_graph_id += 1
        return slot

    def _zeros(self, shape: list[int]) -> Any:
        """A zeroed KV tensor ``shape`` on the device, in the KV dtype's storage type."""
        import onnxruntime as ort

        return ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, _storage(self.kv_type)), self.device, 0)

    def _empty_logits(self, rows: int) -> Any:
        import onnxruntime as ort

        return ort.OrtValue.ortvalue_from_shape_and_type(
            [1, rows, self.spec.vocab_size], _storage(self.logits_type), self.device, 0
        )

    # ---- runs -------------------------------------------------------------------------------

    def run(self, slot: KVSlot, new_ids: list[int], greedy: bool) -> tuple[int | None, np.ndarray | None, float]:
        """Compute ``new_ids`` (``S >= 1`` tokens) after the ``slot.tokens`` the slot holds, in
        place: afterwards the slot holds ``tokens + S`` (grown first where it must).

        Returns ``(token, logits, ms)``: with ``greedy`` and the graph's argmax output the argmax
        token of the last new row and no logits; otherwise ``None`` and the last row's logits,
        float32 ``[V]`` on the host; and the run time in ms.

        Raises:
            InvalidRequest: no new token, or ``tokens + S`` exceeds the model's positions.
        """
        t, n = slot.tokens, len(new_ids)
        if n < 1:
            raise InvalidRequest("a run needs at least one new token")
        self._fit(slot, t + n)
        slot.mask_host[0, t : t + n] = 1
        t0 = time.perf_counter()
        if n == 1 and self.cuda_graph:
            token, logits = self._decode_step(slot, new_ids[0], greedy)
        else:
            token, logits = self._run_unbound(slot, new_ids, greedy)
        slot.tokens = t + n
        return token, logits, (time.perf_counter() - t0) * 1e3

    def _run_unbound(self, slot: KVSlot, new_ids: list[int], greedy: bool) -> tuple[int | None, np.ndarray | None]:
        """A run with a fresh binding: the prefill, or every run where no CUDA graph is captured.
        The mask is bound over the held and new tokens only (``[1, T + S]``)."""
        import onnxruntime as ort

        total = slot.tokens + len(new_ids)
        b = self.session.io_binding()
        b.bind_cpu_input("input_ids", np.asarray([new_ids], np.int64))
        b.bind_cpu_input("attention_mask", np.ascontiguousarray(slot.mask_host[:, :total]))
        self._bind_kv(b, slot)
        want_token = greedy and self.has_next_token
        if want_token:
            b.bind_output(NEXT_TOKEN, "cpu")
        else:
            logits = self._empty_logits(len(new_ids))
            self._bind(b, "logits", logits, self.logits_type, output=True)
        opts = ort.RunOptions()
        if self.cuda_graph:
            opts.add_run_config_entry("gpu_graph_id", "-1")
        self.session.run_with_iobinding(b, opts)
        if want_token:
            return int(b.get_outputs()[-1].numpy()[0, -1]), None  # outputs come back in the order they were bound
        return None, _last_row(_as_float32(logits))

    def run_rows(self, slot: KVSlot, new_ids: list[int]) -> np.ndarray:
        """``run`` that returns the logits of every new token, float32 ``[S, V]`` on the host (the
        preparation's check against HF), uncaptured."""
        import onnxruntime as ort

        t, n = slot.tokens, len(new_ids)
        if n < 1:
            raise InvalidRequest("a run needs at least one new token")
        self._fit(slot, t + n)
        slot.mask_host[0, t : t + n] = 1
        b = self.session.io_binding()
        b.bind_cpu_input("input_ids", np.asarray([new_ids], np.int64))
        b.bind_cpu_input("attention_mask", np.ascontiguousarray(slot.mask_host[:, : t + n]))
        self._bind_kv(b, slot)
        logits = self._empty_logits(n)
        self._bind(b, "logits", logits, self.logits_type, output=True)
        opts = ort.RunOptions()
        if self.cuda_graph:
            opts.add_run_config_entry("gpu_graph_id", "-1")
        self.session.run_with_iobinding(b, opts)
        slot.tokens = t + n
        return _as_float32(logits)[0]

    def _decode_step(self, slot: KVSlot, token_id: int, greedy: bool) -> tuple[int | None, np.ndarray | None]:
        """One token through the slot's captured CUDA graph: the input id and the whole mask
        ``[1, C]`` are copied into their fixed buffers, the graph replays (captured on the first
        step), and only the token id (greedy) or the logits row comes back."""
        import onnxruntime as ort

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
        opts = ort.RunOptions()
        opts.add_run_config_entry("gpu_graph_id", str(slot.graph_id))
        self.session.run_with_iobinding(slot.binding, opts)
        if greedy and self.has_next_token:
            return int(slot.step_next.numpy()[0, -1]), None
        return None, _last_row(_as_float32(slot.step_logits))

    def _bind_kv(self, b: Any, slot: KVSlot) -> None:
        for past, present, v in zip(self.spec.past_names(), self.spec.present_names(), slot.kv, strict=True):
            self._bind(b, past, v, self.kv_type, output=False)
            self._bind(b, present, v, self.kv_type, output=True)

    def _bind(self, b: Any, name: str, v: Any, onnx_type: str, output: bool) -> None:
        """Bind ``v`` as ``name``; a bfloat16 tensor (held as uint16) by its address and ONNX type."""
        if onnx_type != "tensor(bfloat16)":
            (b.bind_ortvalue_output if output else b.bind_ortvalue_input)(name, v)
            return
        bind = b.bind_output if output else b.bind_input
        bind(name, self.device, 0, ONNX_TYPES[onnx_type], v.shape(), v.data_ptr())

    # ---- KV in and out ----------------------------------------------------------------------

    def read_kv(self, slot: KVSlot, tokens: int | None = None) -> list[np.ndarray]:
        """The first ``tokens`` (default: all held) of the slot's KV as ``2L`` float32 host arrays
        ``[1, Hkv, tokens, D]`` (a copy)."""
        n = slot.tokens if tokens is None else tokens
        return [np.ascontiguousarray(_as_float32(v)[:, :, :n]) for v in slot.kv]

    def write_kv(self, slot: KVSlot, past: Sequence[np.ndarray], start: int = 0) -> None:
        """Make the slot hold ``past`` (``2L`` float32 ``[1, Hkv, T, D]``) after its first ``start``
        tokens: one host round trip per layer tensor, cast to the KV dtype; the slot grows when
        ``start + T`` exceeds its capacity.

        Raises:
            InvalidRequest: ``past`` is not ``2L`` float32 arrays of the model's shape, ``start``
                exceeds the tokens held, or ``start + T`` exceeds the model's positions.
        """
        s = self.spec
        t = int(past[0].shape[2]) if len(past) else -1
        want = (1, s.num_kv_heads, t, s.head_dim)
        if len(past) != 2 * s.num_layers or any(a.shape != want or a.dtype != np.float32 for a in past):
            got = [getattr(a, "shape", None) for a in list(past)[:2]]
            raise InvalidRequest(f"past must be {2 * s.num_layers} float32 arrays {want}, got {len(past)} like {got}")
        if not 0 <= start <= slot.tokens:
            raise InvalidRequest(f"KV written after token {start}: the slot holds {slot.tokens}")
        self._fit(slot, start + t)
        for v, a in zip(slot.kv, past, strict=True):
            host = _as_float32(v).copy()
            host[:, :, start : start + t] = a
            _store(v, host, self.kv_type)
        slot.mask_host[:] = 0
        slot.mask_host[0, : start + t] = 1
        slot.tokens = start + t

    def truncate(self, slot: KVSlot, tokens: int) -> None:
        """Keep the first ``tokens`` held (the rest is overwritten by the next run)."""
        tokens = max(0, min(tokens, slot.tokens))
        slot.mask_host[0, tokens:] = 0
        slot.tokens = tokens

    # ---- slots as sessions' KV (``edge.compute.localmodel.LocalModel``) -------------------------------

    def new_kv(self, tokens_hint: int) -> KVSlot:
        """An empty slot for about ``tokens_hint`` tokens: a released slot of the capacity that fits
        (its CUDA graph reused), else a new one of the next power of two from ``MIN_SLOT_TOKENS``."""
        cap = self._capacity_for(max(1, tokens_hint))
        pool = self._free.get(cap)
        return pool.pop() if pool else self.new_slot(cap)

    def release(self, slot: KVSlot) -> None:
        """Give the slot's buffers back for the next session of that capacity. With CUDA graphs every
        released slot is kept (ONNX Runtime cannot drop a captured graph, and the graph replays only
        on the buffers it was captured on), so the slots held are the most sessions ever alive at
        once; without, up to ``FREE_SLOTS_PER_CAPACITY`` per capacity wait and the rest are freed."""
        if not slot.kv:
            return
        spare = KVSlot(**{f: getattr(slot, f) for f in KVSlot.__dataclass_fields__})
        self.truncate(spare, 0)
        pool = self._free.setdefault(spare.capacity_tokens, [])
        if self.cuda_graph or len(pool) < FREE_SLOTS_PER_CAPACITY:
            pool.append(spare)
        slot.kv, slot.tokens, slot.capacity_tokens, slot.binding = [], 0, 0, None

    def _capacity_for(self, tokens: int) -> int:
        """The power of two from ``MIN_SLOT_TOKENS`` that holds ``tokens``, within the model's positions.

        Raises:
            InvalidRequest: ``tokens`` exceeds the model's positions."""
        if tokens > self.spec.context_tokens:
            raise InvalidRequest(f"{tokens} tokens exceed the model's {self.spec.context_tokens} positions")
        cap = self.min_slot_tokens
        while cap < tokens:
            cap *= 2
        return min(cap, self.spec.context_tokens)

    def _fit(self, slot: KVSlot, tokens: int) -> None:
        """Grow ``slot`` in place to hold ``tokens``: new buffers of the next fitting capacity (a new
        CUDA graph), the held KV copied over through the host, the old buffers released. Growth
        doubles the capacity, so a session grows a few times at most.

        Raises:
            InvalidRequest: ``tokens`` exceeds the model's positions."""
        if tokens <= slot.capacity_tokens:
            return
        bigger = self.new_kv(tokens)
        held = slot.tokens
        if held:
            self.write_kv(bigger, self.read_kv(slot, held))
        old = KVSlot(**{f: getattr(slot, f) for f in KVSlot.__dataclass_fields__})
        for f in KVSlot.__dataclass_fields__:
            setattr(slot, f, getattr(bigger, f))
        self.release(old)


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


def _store(v: Any, host: np.ndarray, onnx_type: str) -> None:
    """Copy float32 ``host`` into the tensor ``v`` in its own dtype (bfloat16: rounded to nearest even)."""
    if onnx_type == "tensor(bfloat16)":
        bits = np.ascontiguousarray(host, np.float32).view(np.uint32)
        v.update_inplace(((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16))
    else:
        v.update_inplace(np.ascontiguousarray(host, _storage(onnx_type)))
