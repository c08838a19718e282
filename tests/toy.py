"""The toy split model of the fast tiers (unit and in-process tests, the fuzzing of ``tests/fuzz``): 6 layers split at
k=2, hidden size 8, one KV head of dim 4, 32-token KV blocks, 1000-token vocabulary; no files behind it. Served by
the in-memory engines (``cloud.engines.memory``) and head (``edge.compute.head.MemoryHead``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.common.protocol.manifest import ExportCheck, ModelShape, SplitManifest

K, HKV, D, H, B, VOCAB = 2, 1, 4, 8, 32, 1000


def toy_manifest(vocab_size: int = VOCAB, max_position_embeddings: int = 4096) -> SplitManifest:
    """A split manifest of the toy shape (``K``, ``HKV``, ``D``, ``H`` above)."""
    shape = ModelShape(
        num_layers=6,
        hidden_size=H,
        num_heads=2,
        num_kv_heads=HKV,
        head_dim=D,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
    )
    return SplitManifest(
        model_id="toy",
        split_layer=K,
        dtype="float32",
        shape=shape,
        full_checkpoint="hf",
        checkpoint_blake3="x",
        head_onnx="h.onnx",
        head_blake3="y",
        tail_checkpoint="t",
        tail_blake3="z",
        onnx_opset=17,
        architecture="toy",
        # the toy head and tail are one function (``cloud.engines.memory.ToyLM``): exact by construction
        head_check=ExportCheck(architecture="toy", max_abs_error=0.0, tolerance=0.0, tokens=0, passed=True),
    )


MANIFEST = toy_manifest()


class ToyTokenizer:
    """Characters to ids; a chat message is ``[role] + chars + [2]`` and the generation prompt is the
    assistant's role token, so a next turn extends the previous prompt, as real chat templates do."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [5 + ord(c) % 90 for c in text]}

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **_: Any
    ) -> list[int]:
        ids: list[int] = []
        roles = {"system": 1, "user": 3, "assistant": 4}
        for m in messages:
            ids += [roles[m["role"]], *self(m["content"])["input_ids"], 2]
        return ids + ([4] if add_generation_prompt else [])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)
