"""A model of a real size on the GPU: a random-weight checkpoint of Llama-3.2-1B's exact shape (16
layers, hidden 2048, 8 KV heads of 64, vocabulary 128256; the embedded tokenizer) prepared by
``tandem-model`` at k = 4 and served by CUDA engines in fp32 (weights, engines, wire), so split mode
must give direct mode's greedy tokens. ``TANDEM_GPU_REALSIZE_DIR`` names a prepared output of
``tandem-model`` (the folder holding ``split-k4/``); without it the model is prepared into a
temporary folder first (a minute or two on a GPU host)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu.stacks import cloud_and_edge
from tests.references import LONG, assert_same_or_near_tie, vllm_plain

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM's CUDA build"),
]
SHAPE, K, MAX_NEW = "llama-3.2-1b", 4, 16


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.fail(f"{' '.join(argv)} exited {r.returncode}:\n{r.stderr[-4000:]}")


@pytest.fixture(scope="module")
def realsize_split_dir(manifest, split_dir, tmp_path_factory) -> Path:
    """``split-k4/`` of the 1B shape: ``TANDEM_GPU_REALSIZE_DIR``'s, or one prepared here (the random
    checkpoint drawn on the GPU, the head exported for ONNX Runtime, no whole-model export)."""
    given = os.environ.get("TANDEM_GPU_REALSIZE_DIR", "")
    if given and (Path(given) / f"split-k{K}" / "manifest.json").is_file():
        return Path(given) / f"split-k{K}"
    root = tmp_path_factory.mktemp("realsize")
    ckpt, out = root / "ckpt", root / "model"
    tok = manifest.tokenizer_dir(split_dir)
    _run([
        sys.executable, "-m", "tandem.benchmarks.realsize", "--shape", SHAPE, "--out", str(ckpt),
        "--tokenizer", str(tok),
    ])  # fmt: skip
    _run([
        sys.executable, "-m", "tandem.common.model.prepare", "--checkpoint", str(ckpt), "--out", str(out),
        "--split-layers", str(K), "--no-bundles", "--no-edge-full",
    ])  # fmt: skip
    return out / f"split-k{K}"


@pytest.fixture(scope="module")
async def realsize_stack(realsize_split_dir, tmp_path_factory):
    """fp32 CUDA engines (tail at k = 4 and decode, eager) on the 1B shape, its gateway and an edge on
    loopback, fp32 on the wire."""
    from tandem.cloud.config import CloudConfig, EngineConfig

    cfg = CloudConfig(
        split_dir=realsize_split_dir,
        host="127.0.0.1",
        port=0,
        store_dir=tmp_path_factory.mktemp("kv-1b"),
        engine=EngineConfig(
            max_num_seqs=4, kv_cache_bytes=4 << 30, dtype="float32", enforce_eager=True, max_model_len_tokens=4096
        ),
        wire_dtypes=["fp32"],
        kv_wire_dtypes=["fp32"],
    )
    async with cloud_and_edge(cfg, realsize_split_dir) as stack:
        yield stack


@pytest.mark.parametrize("repeat", [1, 8], ids=["short", "long"])
async def test_a_real_size_shape_split_on_cuda_engines_equals_direct_and_plain_vllm(realsize_stack, repeat):
    """A chat prompt of about 130 and 1000 tokens: split (head on ONNX Runtime's CUDA provider, the
    tail engine, the decode engine loading the whole block-aligned prefix from the store) gives
    direct's and plain vLLM's greedy tokens, or parts only at a near-tie of plain vLLM."""
    from transformers import AutoTokenizer

    from tandem.common.protocol.chat import prompt_token_ids
    from tandem.common.protocol.manifest import SplitManifest

    client = realsize_stack["client"]
    split_dir = realsize_stack["engines"].cfg.split_dir
    m = SplitManifest.load(split_dir)
    tok = AutoTokenizer.from_pretrained(m.tokenizer_dir(split_dir))
    messages = [{"role": "user", "content": LONG * repeat + "Summarise this text."}]
    ids = prompt_token_ids(tok, messages, None)
    split = await client.complete(messages, max_new_tokens=MAX_NEW, mode="split", split_layer=K)
    direct = await client.complete(messages, max_new_tokens=MAX_NEW, mode="direct")
    assert split.split_layer == K and split.prompt_tokens == len(ids)
    assert split.external_tokens == len(ids) // 32 * 32  # loaded from the store, not recomputed
    plain, gaps = await vllm_plain(realsize_stack["engines"], ids, MAX_NEW)
    assert_same_or_near_tie(list(direct.output_token_ids), plain, gaps, "1B direct vs plain vLLM")
    assert_same_or_near_tie(list(split.output_token_ids), plain, gaps, "1B split vs plain vLLM")
    print(f"1B shape, {len(ids)} tokens: split TTFT {split.ttft_ms:.1f} ms, direct {direct.ttft_ms:.1f} ms")
