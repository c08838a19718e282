"""Checkpoints whose behaviour switches with the length or the layer, end to end on the real engines
(vLLM's CPU build, ONNX Runtime, grpc.aio on loopback): split, direct and local greedy fp32 output
equal to HF's on prompts on both sides of the switch (``common.model.switches``, ``tests.families``).

* A LongRoPE Phi3 (threshold 64 tokens) on engines of 512 tokens: vLLM uses the long factors at
  every position, the graphs were exported with them; HF computes the same for a prompt past the
  threshold, and with the deployment's factors (the manifest's export overrides) for a shorter one.
* A Llama whose config sets an 8-token ``sliding_window``, which HF's Llama attention ignores: the
  engines start without it (the manifest's ``hf_overrides``), so every mode equals HF's forward past
  the window. (HF's ``generate`` with its default cache is no reference here: the cache reads
  ``sliding_window`` and keeps only the last 8 tokens from the first decode step on.)

Each stack starts two vLLM engines (about a minute each on 2 cores)."""

from __future__ import annotations

import pytest

from tandem import AsyncClient
from tandem.common.model import onnx_export
from tandem.common.protocol.manifest import SplitManifest
from tests.families import ORIGINAL_POSITIONS, TOKENIZER_DIR
from tests.references import assert_same_or_near_tie, hf_greedy, prompt_ids

pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(not TOKENIZER_DIR.is_dir(), reason="no models/smollm2-135m/tokenizer: make model"),
]

SPLIT = 1
MAX_NEW = 12
MAX_MODEL_LEN = 512  # past the LongRoPE checkpoint's 64-token threshold
SHORT = [{"role": "user", "content": "What is the capital of France?"}]
LONG = [
    {
        "role": "user",
        "content": "The printing press spread across Europe within fifty years, and scholars could compare "
        "identical copies, correct errors in later editions and share new ideas faster than ever before. "
        "Newspapers, pamphlets and maps followed. Summarise this text in one sentence.",
    }
]
MODES = [("split", SPLIT), ("direct", 0), ("local", 0)]


@pytest.fixture(scope="module", params=["phi3-longrope", "llama-window"])
async def switched(request, tmp_path_factory, prepared_families):
    """(name, model directory, tokenizer, client) of one checkpoint's running stack."""
    from transformers import AutoTokenizer

    from tandem.cloud.config import CloudConfig, EngineConfig, check_engines_fit
    from tandem.cloud.engines.vllm_engines import VllmEngines
    from tandem.cloud.server import create_cloud
    from tandem.edge.config import EdgeConfig
    from tandem.edge.server import create_edge

    name = request.param
    out = prepared_families(name)
    split = out / f"split-k{SPLIT}"
    cfg = CloudConfig(
        split_dir=split,
        host="127.0.0.1",
        port=0,
        store_dir=tmp_path_factory.mktemp(name) / "kv",
        engine=EngineConfig(max_num_seqs=4, max_model_len_tokens=MAX_MODEL_LEN, kv_cache_bytes=64 << 20),
        wire_dtypes=["fp32"],
        kv_wire_dtypes=["fp32"],
    )
    check_engines_fit(cfg)  # what tandem-cloud checks before its engines start
    engines = VllmEngines(cfg)
    engines.start()
    cloud = await create_cloud(cfg, engines)
    edge = await create_edge(
        EdgeConfig(split_dir=split, cloud_target=f"127.0.0.1:{cloud.port}", host="127.0.0.1", port=0)
    )
    client = AsyncClient(f"127.0.0.1:{edge.port}")
    yield name, out, AutoTokenizer.from_pretrained(out / "tokenizer"), client
    await client.close()
    await edge.stop(1)
    await cloud.stop(1)
    engines.shutdown()


@pytest.mark.parametrize("chat", [SHORT, LONG], ids=["short", "long"])
async def test_every_mode_equals_hf_on_both_sides_of_the_switch(switched, chat):
    name, out, tokenizer, client = switched
    ids = prompt_ids(tokenizer, {"messages": chat})
    native = onnx_export.load_hf(out / "hf")
    deployed = onnx_export.load_hf(out / "hf", SplitManifest.load(out / f"split-k{SPLIT}").agreement.export_overrides)
    ref, gaps = hf_greedy(deployed, ids, MAX_NEW, use_cache=False)
    if name == "phi3-longrope":
        assert (len(ids) > ORIGINAL_POSITIONS) == (chat is LONG), len(ids)
        if chat is LONG:  # past the threshold HF itself uses the long factors: the same function
            assert hf_greedy(native, ids, MAX_NEW)[0] == ref
    else:
        assert hf_greedy(native, ids, MAX_NEW, use_cache=False)[0] == ref  # no export overrides: HF as it is
    for mode, k in MODES:
        res = await client.complete(chat, max_new_tokens=MAX_NEW, mode=mode, split_layer=k)
        assert (res.mode, res.split_layer) == (mode, k)
        assert_same_or_near_tie(
            list(res.output_token_ids), ref, gaps, f"{name} {mode} ({len(ids)} prompt tokens) vs HF"
        )
