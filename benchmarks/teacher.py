"""Teacher-forced next-token distributions of one split turn under one wire format pair, computed
in this process with the parts the split path runs (``tandem-bench fidelity``).

The split path of a turn with prompt ``P`` (``T`` tokens, ``Tf = B * floor(T / B)`` of them in
full KV blocks) and reply ``R`` (``n`` tokens):

1. the edge's ONNX head (``edge.compute.head.OnnxHead``, the exported ``head.onnx``) gives ``h_k``
   float32 ``[T, H]`` and the head KV ``[k, 2, Hkv, T, D]``;
2. ``h_k`` crosses the wire in the link's activation format and the full KV blocks
   ``[k, 2, Hkv, B, D]`` in its KV format (``common.wire.formats``: encode, then decode);
3. the tail engine runs the tail checkpoint (layers ``[k, L)`` renumbered) on the decoded ``h_k``:
   its last position's distribution gives ``R[0]``, and its KV of the full blocks is stored;
4. the decode engine runs the full checkpoint on ``P[Tf:] + R`` with the full blocks' KV loaded
   (layers ``[0, k)`` from the decoded head KV, ``[k, L)`` from step 3): its distributions give
   ``R[1:]``.

Here steps 3 and 4 run in Hugging Face transformers (float32 by default, or the engines' compute
dtype such as bfloat16, on the CPU or a GPU; on the same checkpoints vLLM loads) instead of vLLM:
the same computation, since vLLM's output depends only on the checkpoint, the input embeddings or
ids and the KV it loads, the kernels differing in rounding only (``tandem-bench fidelity``
measures that difference; why in-process and why teacher forcing: docs/design-decisions.md,
"Wire formats"). The full vocabulary's distribution is available at every position, so KL
divergences here are exact.

Shapes: ``V`` vocabulary, ``n`` reply tokens; ``TurnDists.logprobs`` is float32 ``[n, V]``: row
``j`` is the log-distribution the system samples ``R[j]`` from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tandem.common.protocol.manifest import SplitManifest
from tandem.common.protocol.params import WireDtype
from tandem.common.wire.chunks import decode_dtype, encode_dtype
from tandem.common.wire.kvwire import decode_kv, encode_kv


@dataclass(frozen=True)
class HeadPass:
    """The edge head's output over one prompt: ``hidden`` float32 ``[T, H]``, ``kv`` float32
    ``[k, 2, Hkv, T, D]``."""

    prompt: list[int]
    hidden: np.ndarray
    kv: np.ndarray


def round_trip_hidden(h: np.ndarray, dtype: WireDtype) -> np.ndarray:
    """``h`` float32 ``[T, H]`` through the activation format ``dtype`` (encode, decode)."""
    return h if dtype == WireDtype.FP32 else decode_dtype(encode_dtype(h, dtype), dtype, *h.shape)


def round_trip_kv(kv: np.ndarray, dtype: WireDtype, block_tokens: int) -> np.ndarray:
    """The full blocks of ``kv`` float32 ``[k, 2, Hkv, T, D]`` through the KV format ``dtype``, one
    block of ``block_tokens`` at a time (as the edge frames them): float32 ``[k, 2, Hkv, Tf, D]``."""
    tf = block_tokens * (kv.shape[3] // block_tokens)
    out = np.array(kv[:, :, :, :tf], np.float32)
    if dtype == WireDtype.FP32:
        return out
    for lo in range(0, tf, block_tokens):
        blk = np.ascontiguousarray(kv[:, :, :, lo : lo + block_tokens])
        out[:, :, :, lo : lo + block_tokens] = decode_kv(encode_kv(blk, dtype), dtype, blk.shape)
    return out


def _torch_settings(device: str, dtype: str, threads: int) -> tuple[Any, Any]:
    """(torch device, torch dtype) of a teacher; ``threads`` torch threads where not 0.

    Raises:
        ValueError: ``dtype`` is neither float32 nor bfloat16."""
    import torch

    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"teacher dtype {dtype!r}: float32 or bfloat16")
    if threads:
        torch.set_num_threads(threads)
    return torch.device(device), getattr(torch, dtype)


def _load(checkpoint: Path, device: Any, dtype: Any) -> Any:
    """An HF checkpoint in transformers (SDPA attention) in ``dtype`` on ``device``, in eval mode."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


class SplitTeacher:
    """The split path's parts for one split directory (``split-k<k>``): the ONNX head (float32, as
    the edge runs it; on ONNX Runtime's CUDA provider where there is one), the tail checkpoint and
    the full checkpoint in transformers in ``dtype`` (``float32`` or ``bfloat16``: the cloud
    engines' compute dtype) on ``device`` (``cpu``, ``cuda``).

    Raises:
        ValueError: ``dtype`` is neither float32 nor bfloat16."""

    def __init__(
        self, split_dir: Path, block_tokens: int = 32, threads: int = 0, device: str = "cpu", dtype: str = "float32"
    ) -> None:
        from tandem.edge.compute.head import OnnxHead

        m = SplitManifest.load(split_dir)
        self.manifest, self.k, self.block_tokens = m, m.split_layer, block_tokens
        self.device, self.dtype = _torch_settings(device, dtype, threads)
        self.head = OnnxHead(split_dir, intra_op_threads=threads)
        tail, full = (m.resolve(split_dir, c) for c in (m.tail_checkpoint, m.full_checkpoint))
        self.tail, self.full = (_load(c, self.device, self.dtype) for c in (tail, full))

    def _on(self, t):
        """A float32 CPU tensor in the teacher's dtype on its device."""
        return t.to(self.device, self.dtype)

    def head_pass(self, prompt: list[int]) -> HeadPass:
        """The ONNX head over the whole prompt."""
        from tandem.edge.compute.head import HeadInput

        out = self.head.run([HeadInput(np.asarray(prompt, np.int64))])[0]
        return HeadPass(prompt, out.hidden, out.kv)

    def tail_pass(self, hp: HeadPass, acts: list[WireDtype]):
        """The tail on ``hp.hidden`` through each of ``acts``, batched: (log-distributions of the
        first reply token, float32 ``[len(acts), V]``; the tail's ``DynamicCache`` of ``L - k``
        layers, one batch row per format)."""
        import torch

        h = self._on(torch.from_numpy(np.stack([round_trip_hidden(hp.hidden, a) for a in acts])))
        with torch.inference_mode():
            o = self.tail(inputs_embeds=h, use_cache=True, logits_to_keep=1)
        return torch.log_softmax(o.logits[:, -1].float(), -1).cpu().numpy(), o.past_key_values

    def _cache(self, hp: HeadPass, pairs: list[tuple[WireDtype, WireDtype]], acts: list[WireDtype], tail_cache):
        """The decode engine's loaded KV for each pair (one batch row each): full blocks only,
        layers [0, k) from the decoded head KV, [k, L) from the tail's cache of the pair's activation
        format; (None, 0) when the prompt has no full block."""
        import torch
        from transformers import DynamicCache

        tf = self.block_tokens * (len(hp.prompt) // self.block_tokens)
        if tf == 0:
            return None, 0
        by_kv = {kv: torch.from_numpy(round_trip_kv(hp.kv, kv, self.block_tokens)) for kv in {kv for _, kv in pairs}}
        head = self._on(torch.stack([by_kv[kv] for _, kv in pairs]))  # [P, k, 2, Hkv, Tf, D]
        rows = torch.tensor([acts.index(a) for a, _ in pairs], device=self.device)
        cache = DynamicCache(config=self.full.config)
        for i in range(self.k):
            cache.update(head[:, i, 0].contiguous(), head[:, i, 1].contiguous(), i)
        for j, layer in enumerate(tail_cache.layers):
            cache.update(layer.keys[rows, :, :tf].contiguous(), layer.values[rows, :, :tf].contiguous(), self.k + j)
        return cache, tf

    def forced(self, hp: HeadPass, reply: list[int], pairs: list[tuple[WireDtype, WireDtype]]) -> np.ndarray:
        """Teacher-forced log-distributions of ``reply`` (``n >= 1`` tokens) under each
        (activation, KV) format pair, batched: float32 ``[len(pairs), n, V]``, row ``[p, j]`` the
        distribution ``reply[j]`` is sampled from under pair ``p``."""
        import torch

        acts = list(dict.fromkeys(a for a, _ in pairs))
        first, tail_cache = self.tail_pass(hp, acts)
        out = np.empty((len(pairs), len(reply), first.shape[1]), np.float32)
        out[:, 0] = first[[acts.index(a) for a, _ in pairs]]
        if len(reply) > 1:
            cache, tf = self._cache(hp, pairs, acts, tail_cache)
            ids = torch.tensor([hp.prompt[tf:] + reply[:-1]] * len(pairs), device=self.device)
            pos = torch.arange(tf, tf + ids.shape[1], device=self.device)[None].expand(len(pairs), -1)
            keep = len(reply) - 1
            with torch.inference_mode():
                o = self.full(input_ids=ids, position_ids=pos, past_key_values=cache, logits_to_keep=keep)
            out[:, 1:] = torch.log_softmax(o.logits.float(), -1).cpu().numpy()
        return out


class RemotePrefillTeacher:
    """Remote prefill's downlink for one full checkpoint: the cloud's prefill (the checkpoint in
    transformers, ``dtype`` on ``device``) gives the first reply token and the KV of every layer;
    the prompt's full blocks ``[L, 2, Hkv, B, D]`` cross the downlink in a KV format (encode,
    decode); the continuation runs on that KV. As ``SplitTeacher`` measures the split's wire
    formats with the tail in transformers, this measures the downlink's format alone (the edge's
    own model is ``tandem-bench fidelity``'s edge row).

    Raises:
        ValueError: ``dtype`` is neither float32 nor bfloat16."""

    def __init__(
        self, checkpoint: Path, block_tokens: int = 32, threads: int = 0, device: str = "cpu", dtype: str = "float32"
    ) -> None:
        self.block_tokens = block_tokens
        self.device, self.dtype = _torch_settings(device, dtype, threads)
        self.full = _load(checkpoint, self.device, self.dtype)

    def forced(self, prompt: list[int], reply: list[int], kvs: list[WireDtype]) -> np.ndarray:
        """Teacher-forced log-distributions of ``reply`` (``n >= 1`` tokens) after a remote prefill
        of ``prompt`` whose full KV blocks came down in each of ``kvs``, batched: float32
        ``[len(kvs), n, V]``. Row ``[f, 0]`` is the cloud's (the same for every format); the rest
        run on the prompt's full blocks as format ``f`` carried them, the partial last block and
        the reply computed on top (what the edge computes after the takeover)."""
        import torch
        from transformers import DynamicCache

        with torch.inference_mode():
            o = self.full(input_ids=torch.tensor([prompt], device=self.device), use_cache=True)
        first = torch.log_softmax(o.logits[0, -1].float(), -1).cpu().numpy()
        out = np.empty((len(kvs), len(reply), first.shape[0]), np.float32)
        out[:, 0] = first
        if len(reply) == 1:
            return out
        tf = self.block_tokens * (len(prompt) // self.block_tokens)
        cache = DynamicCache(config=self.full.config)
        if tf:
            layers = o.past_key_values.layers
            stacked = torch.stack([torch.stack([lay.keys[0, :, :tf], lay.values[0, :, :tf]]) for lay in layers])
            kv = stacked.float().cpu().numpy()  # [L, 2, Hkv, Tf, D]
            came = torch.from_numpy(np.stack([round_trip_kv(kv, f, self.block_tokens) for f in kvs]))
            came = came.to(self.device, self.dtype)  # [F, L, 2, Hkv, Tf, D]
            for i in range(came.shape[1]):
                cache.update(came[:, i, 0].contiguous(), came[:, i, 1].contiguous(), i)
        ids = torch.tensor([prompt[tf:] + reply[:-1]] * len(kvs), device=self.device)
        pos = torch.arange(tf, tf + ids.shape[1], device=self.device)[None].expand(len(kvs), -1)
        with torch.inference_mode():
            o = self.full(
                input_ids=ids, position_ids=pos, past_key_values=cache if tf else None, logits_to_keep=len(reply) - 1
            )
        out[:, 1:] = torch.log_softmax(o.logits.float(), -1).cpu().numpy()
        return out
