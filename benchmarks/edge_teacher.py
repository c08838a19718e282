"""Teacher-forced next-token distributions of the edge's whole model: the graph ONNX Runtime
GenAI's model builder writes (``edge-decoder/``, ``common.model.builder_export``), run the way the
edge runs a turn (``tandem-bench fidelity``'s edge row).

The edge's local mode and remote prefill compute with ``edge.compute.decoder.DecoderGraph``: the
prompt ``P`` in one run (its last row's logits give the distribution of ``R[0]``), then one decode
step per token (on ONNX Runtime's CUDA provider a replayed CUDA graph). Teacher forcing feeds the
reference reply ``R``'s tokens to those steps, so row ``j`` is the distribution the edge samples
``R[j]`` from after ``P + R[:j]``, computed by the edge's own runs in the graph's own precision
(fp32 on a CPU build, bf16 on a GPU). The full vocabulary is known at every position.

Not here: the comparison with the references (``benchmarks.fidelity``), sessions and sampling
(``edge.compute.local``).

Shapes: ``n`` reply tokens, ``V`` vocabulary; ``EdgeTeacher.forced`` returns float32 ``[n, V]``
log-probabilities, row ``j`` the distribution ``R[j]`` is sampled from.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tandem.common.model.builder_export import decoder_problem, load_build

PROVIDERS = {"cpu": ["CPUExecutionProvider"], "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}
KV_PRECISION = {"tensor(float)": "fp32", "tensor(float16)": "fp16", "tensor(bfloat16)": "bf16"}


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of float ``[..., V]`` logits (computed in float64): float32 ``[..., V]``."""
    x = logits.astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)


class EdgeTeacher:
    """One built decoder (``edge-decoder/``) in a ``DecoderGraph`` on ``device`` (``cpu``: ONNX
    Runtime's CPU provider; ``cuda``: its CUDA provider, with the edge's CUDA graphs).

    Raises:
        ValueError: ``device`` is neither cpu nor cuda; the directory holds no checked build
            (``builder_export.decoder_problem``); the build is for another device than ``device``;
            ONNX Runtime here has no CUDA provider for ``cuda``.
    """

    def __init__(self, decoder_dir: Path, device: str = "cpu", threads: int = 0) -> None:
        from tandem.edge.compute.decoder import DecoderGraph

        if device not in PROVIDERS:
            raise ValueError(f"edge decoder device {device!r}: cpu or cuda")
        problem = decoder_problem(Path(decoder_dir))
        if problem:
            raise ValueError(problem)
        build = load_build(Path(decoder_dir))
        if build.execution_provider != device:
            raise ValueError(
                f"{decoder_dir} is built for {build.execution_provider} ({build.precision}), not {device}: "
                f"prepare the model on a {device} host (tandem-model) or run on {build.execution_provider}"
            )
        self.graph = DecoderGraph(Path(decoder_dir), providers=PROVIDERS[device], intra_op_threads=threads)
        if self.graph.device != device:
            raise ValueError(f"ONNX Runtime here has no {device} provider (it has {self.graph.providers})")
        self.decoder_dir, self.device = Path(decoder_dir), device
        self.precision = KV_PRECISION.get(self.graph.kv_type, build.precision)
        self.weights = build.precision  # the builder's precision (int4: 4-bit weights)

    @property
    def title(self) -> str:
        """The row's name, e.g. ``edge whole model (builder graph, bf16 on cuda)``."""
        kind = self.precision if self.weights == self.precision else f"{self.weights} weights, {self.precision} KV"
        return f"edge whole model (builder graph, {kind} on {self.device})"

    def forced(self, prompt: list[int], reply: list[int]) -> np.ndarray:
        """Teacher-forced log-distributions of ``reply`` (``n >= 1`` tokens) after ``prompt``: the
        prompt in one run, then ``reply[:-1]`` one decode step at a time, in one slot sized for the
        turn as the edge sizes it: float32 ``[n, V]``.

        Raises:
            InvalidRequest: the turn exceeds the model's positions (``DecoderGraph.run``).
        """
        g = self.graph
        slot = g.new_kv(len(prompt) + len(reply))
        rows = []
        try:
            for ids in [list(map(int, prompt)), *([int(t)] for t in reply[:-1])]:
                _, logits, _ms = g.run(slot, ids, greedy=False)
                if logits is None:
                    raise RuntimeError("DecoderGraph.run gave no logits for a non-greedy run")
                rows.append(logits)
        finally:
            g.release(slot)
        return log_softmax(np.stack(rows))
