"""Edge-only generation: the whole model in ONNX Runtime on the edge, no network.

The baseline that the latency benchmarks compare the split against. Batch 1,
greedy or temperature sampling, KV cache kept as ONNX Runtime inputs/outputs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tandem.common.head_io import io_names
from tandem.common.manifest import ModelShape


@dataclass(frozen=True)
class LocalStep:
    token_id: int
    t_s: float  # perf_counter() when the token was sampled


class LocalGenerator:
    """``edge-full.onnx`` (see ``common.modelprep``) driven token by token."""

    def __init__(self, onnx_path: Path, shape: ModelShape, intra_op_threads: int = 0) -> None:
        import onnxruntime as ort

        from tandem.edge.head_runner import default_providers

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = intra_op_threads
        self.session = ort.InferenceSession(str(onnx_path), opts, providers=default_providers())
        self.shape = shape
        self.inputs, outputs = io_names(shape.num_layers)
        self.outputs = ["logits", *outputs[1:]]

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        eos_token_id: int | None = None,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> Iterator[LocalStep]:
        """Yield sampled tokens; stops at ``eos_token_id`` (yielded) or ``max_new_tokens``."""
        s, L = self.shape, self.shape.num_layers
        rng = np.random.default_rng(seed)
        past = [np.zeros((1, s.num_kv_heads, 0, s.head_dim), np.float32) for _ in range(2 * L)]
        ids = np.asarray([prompt_ids], np.int64)
        pos = 0
        for _ in range(max_new_tokens):
            t = ids.shape[1]
            feeds = {
                "input_ids": ids,
                "position_ids": np.arange(pos, pos + t, dtype=np.int64)[None],
                "attention_mask": np.ones((1, pos + t), np.int64),
            }
            feeds.update(zip(self.inputs[3:], past, strict=True))
            logits, *past = self.session.run(self.outputs, feeds)
            pos += t
            if temperature > 0:
                z = logits[0] / temperature
                p = np.exp(z - z.max())
                tok = int(rng.choice(len(p), p=p / p.sum()))
            else:
                tok = int(np.argmax(logits[0]))
            yield LocalStep(tok, time.perf_counter())
            if tok == eos_token_id:
                return
            ids = np.asarray([[tok]], np.int64)
