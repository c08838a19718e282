"""The GPU tier at the GPU defaults: the cloud's engines as ``tandem-cloud`` starts them on a GPU
(CUDA graphs and torch.compile, ``dtype auto``: bf16) and the edge as ``tandem-edge`` starts there
(the model builder's bf16 head and decoder, CUDA graphs, the wire formats the link negotiates,
remote prefill's prompt KV as the cost model plans it). Every mode's greedy reply against plain
vLLM on the same engines: equal, or parting first where vLLM's top-2 log-prob gap is within bf16's
reach (``NEAR_TIE_BF16``, the fidelity method's near-tie); each divergence's index and gap is
printed, so that a near-tie can be told from an error. ``test_gpu.py`` holds the exactness tests
(fp32, eager engines). Skipped where no CUDA device is present.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.stacks import cloud_and_edge
from tests.references import MAX_NEW, PROMPTS, assert_same_or_near_tie, prompt_ids, vllm_plain

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM's CUDA build"),
]

NEAR_TIE_BF16 = 0.5  # nats: the fidelity method's near-tie (benchmarks/fidelity.py), for bf16 arithmetic
MODES = [("direct", {}), ("split", {"split_layer": 4}), ("local", {}), ("remote_prefill", {})]


@pytest.fixture(scope="module")
async def defaults_stack(split_dir, tmp_path_factory):
    """A cloud and an edge on loopback, each at its GPU defaults but for the engines' KV cache size."""
    from tandem.cloud.config import CloudConfig, EngineConfig

    cfg = CloudConfig(
        split_dir=split_dir,
        host="127.0.0.1",
        port=0,
        store_dir=tmp_path_factory.mktemp("kv-defaults"),
        engine=EngineConfig(max_num_seqs=8, kv_cache_bytes=1 << 30),
    )
    assert not cfg.engine.enforce_eager and cfg.engine.dtype == "auto"  # the GPU build's defaults
    async with cloud_and_edge(cfg, split_dir) as stack:
        yield stack


def first_divergence(got: list[int], ref: list[int], gaps: list[float]) -> tuple[int, float] | None:
    """The first output token where ``got`` parts from ``ref``, with the reference's top-2 gap there
    (None where they agree over the shorter)."""
    for i, (a, b) in enumerate(zip(got, ref, strict=False)):
        if a != b:
            return i, gaps[i]
    return None


@pytest.mark.parametrize("idx", range(len(PROMPTS)))
async def test_every_mode_at_the_gpu_defaults_agrees_with_plain_vllm(defaults_stack, tokenizer, idx):
    """Direct, split at k = 4, local and remote prefill at the GPU defaults against plain vLLM's
    greedy reply on the same (bf16, CUDA-graph) engines (direct too: its prefill may find the plain
    run's blocks in vLLM's prefix cache and take another kernel path)."""
    p, client = PROMPTS[idx], defaults_stack["client"]
    ids = prompt_ids(tokenizer, p)
    plain, gaps = await vllm_plain(defaults_stack["engines"], ids, MAX_NEW)
    kw = {"prompt": p.get("prompt"), "max_new_tokens": MAX_NEW}
    for mode, extra in MODES:
        got = await client.complete(p.get("messages"), mode=mode, **kw, **extra)
        assert got.mode == mode, (mode, got.mode)
        tokens = list(got.output_token_ids)
        parted = first_divergence(tokens, plain, gaps)
        where = "agrees" if parted is None else f"parts at token {parted[0]}, vLLM's top-2 gap {parted[1]:.3f} nats"
        print(f"prompt {idx} ({len(ids)} tokens), {mode}: {where}")
        assert_same_or_near_tie(tokens, plain, gaps, f"prompt {idx}: {mode} at the GPU defaults", near=NEAR_TIE_BF16)
