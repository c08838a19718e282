"""Split mode with the head ONNX Runtime GenAI's model builder wrote (``split-k4/head-builder``, run by
``edge.compute.builder_head.BuilderHead``) on the real engines (vLLM's CPU build for the tail and the
decode engine, grpc.aio on loopback, the real SmolLM2): greedy fp32 output equals the unsplit HF
model's and plain vLLM's over the reference prompts, and a session's second turn (the head fed its
first turn's KV) equals HF's over the whole conversation.

The edge runs a copy of the prepared split k=4 (links to its parts) with the builder head built and
named in its manifest; the cloud serves the prepared split as it is (the manifests' compatibility
keys are equal: a head's build is not part of the key)."""

from __future__ import annotations

import uuid

import pytest

from tandem import AsyncClient
from tandem.common.model.builder_head import HEAD_BUILDER_DIR, prepare_builder_head
from tests.references import MAX_NEW, PROMPTS, assert_same_or_near_tie, hf_greedy, prompt_ids, vllm_plain

pytestmark = [pytest.mark.engines]
K = 4


@pytest.fixture(scope="module")
async def builder_stack(split_dir, manifest, tmp_path_factory):
    """(engines, client, edge) of a stack whose edge runs the builder head at k=4."""
    from tandem.cloud.config import CloudConfig, EngineConfig
    from tandem.cloud.engines.vllm_engines import VllmEngines
    from tandem.cloud.server import create_cloud
    from tandem.edge.config import EdgeConfig
    from tandem.edge.server import create_edge

    root = tmp_path_factory.mktemp("builder-head-model")
    for name in ("hf", "tokenizer"):
        (root / name).symlink_to((split_dir.parent / name).resolve())
    edge_split = root / f"split-k{K}"
    edge_split.mkdir()
    for name in ("head.onnx", "tail"):
        (edge_split / name).symlink_to((split_dir / name).resolve())
    why = prepare_builder_head(
        edge_split, root / "hf", K, "fp32", manifest.agreement, manifest.shape.vocab_size, manifest.checkpoint_blake3
    )
    assert why == ""
    manifest.model_copy(update={"builder_head": HEAD_BUILDER_DIR}).save(edge_split)
    cfg = CloudConfig(
        split_dir=split_dir,
        host="127.0.0.1",
        port=0,
        store_dir=tmp_path_factory.mktemp("kv"),
        engine=EngineConfig(max_num_seqs=4, kv_cache_bytes=256 << 20),
        wire_dtypes=["fp32"],  # exactness: the split's greedy tokens must equal the unsplit references
        kv_wire_dtypes=["fp32"],
    )
    engines = VllmEngines(cfg)
    engines.start()
    cloud = await create_cloud(cfg, engines)
    edge = await create_edge(
        EdgeConfig(split_dir=edge_split, cloud_target=f"127.0.0.1:{cloud.port}", host="127.0.0.1", port=0, local=False)
    )
    client = AsyncClient(f"127.0.0.1:{edge.port}")
    yield engines, client, edge
    await client.close()
    await edge.stop(1)
    await cloud.stop(1)
    engines.shutdown()


async def test_the_edge_runs_the_builder_head(builder_stack):
    from tandem.edge.compute.builder_head import BuilderHead

    _, _, edge = builder_stack
    assert isinstance(edge.node.heads[K].batcher.head, BuilderHead)


@pytest.mark.parametrize("idx", range(len(PROMPTS)))
async def test_split_with_the_builder_head_equals_the_unsplit_references(builder_stack, hf_model, tokenizer, idx):
    engines, client, _ = builder_stack
    p = PROMPTS[idx]
    ids = prompt_ids(tokenizer, p)
    res = await client.complete(
        p.get("messages"), prompt=p.get("prompt"), max_new_tokens=MAX_NEW, mode="split", split_layer=K
    )
    assert (res.mode, res.split_layer, res.head_tokens) == ("split", K, len(ids))
    got = list(res.output_token_ids)
    ref, gaps = hf_greedy(hf_model, ids, MAX_NEW)
    assert_same_or_near_tie(got, ref, gaps, "split (builder head) vs HF")
    plain, pgaps = await vllm_plain(engines, ids, MAX_NEW)
    assert_same_or_near_tie(got, plain, pgaps, "split (builder head) vs plain vLLM")


async def test_a_second_turn_through_the_builder_heads_past_kv_equals_hf(builder_stack, hf_model, tokenizer):
    _, client, _ = builder_stack
    session = f"builder-{uuid.uuid4().hex}"
    messages = [{"role": "user", "content": "Name two primary colours."}]
    for turn in range(2):
        res = await client.complete(messages, max_new_tokens=12, mode="split", split_layer=K, session_id=session)
        ids = prompt_ids(tokenizer, {"messages": messages})
        ref, gaps = hf_greedy(hf_model, ids, 12)
        assert_same_or_near_tie(list(res.output_token_ids), ref, gaps, f"builder head turn {turn + 1} vs HF")
        if turn:
            assert res.head_tokens < len(ids)  # the head ran only the new tokens, after turn 1's KV
        messages += [{"role": "assistant", "content": res.text}, {"role": "user", "content": "And a third?"}]
