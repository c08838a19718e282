"""The GPU tier: tandem's CUDA paths on a real GPU (vLLM's CUDA build, its attention backends' paged
KV layout, CUDA engines serving the split) against the unsplit references. Skipped where no CUDA device
is present; CI runs on CPU, a GPU host runs this tier with ``python -m pytest -m gpu tests/gpu``
(``docs/testing.md``: how the H200 kit installs the stack and where the prepared model comes from).
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from tests.references import MAX_NEW, PROMPTS, assert_same_or_near_tie, hf_greedy, prompt_ids, vllm_plain

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM's CUDA build"),
]

HKV, B, D, NUM_BLOCKS = 3, 32, 64, 16  # SmolLM2-135M's KV heads and head size, the GPU engines' block size


def _packed_cache(dtype: torch.dtype, memory: str) -> torch.Tensor:
    """A layer's paged cache as vLLM hands it to the connector: logical ``[num_blocks, Hkv, B, 2*D]``,
    memory in HND order or (``NHD``) ``[num_blocks, B, Hkv, 2*D]`` permuted to the logical shape."""
    if memory == "HND":
        return torch.zeros(NUM_BLOCKS, HKV, B, 2 * D, dtype=dtype, device="cuda")
    return torch.zeros(NUM_BLOCKS, B, HKV, 2 * D, dtype=dtype, device="cuda").permute(0, 2, 1, 3)


@pytest.mark.parametrize("memory", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_the_packed_layout_reads_what_vllms_cuda_kernel_wrote_and_writes_it_back(dtype, memory):
    """vLLM's own write kernel (``reshape_and_cache_flash``, through the K and V views FlashAttention's
    ``do_kv_cache_update`` makes) puts tokens in the cache; the connector's layout reads them back as
    canonical ``[n, 2, Hkv, B, D]`` blocks, and writing those blocks into an empty cache gives the same
    cache, byte for byte."""
    from vllm import _custom_ops as ops

    from tandem.cloud.engines.kv_layout import layout_for, read_blocks

    cache = _packed_cache(dtype, memory)
    key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)  # each [num_blocks, B, Hkv, D]
    ids = [5, 2, 11]
    gen = torch.Generator(device="cuda").manual_seed(7)
    k = torch.randn(len(ids) * B, HKV, D, device="cuda", generator=gen).to(dtype)  # [tokens, Hkv, D]
    v = torch.randn(len(ids) * B, HKV, D, device="cuda", generator=gen).to(dtype)
    slots = (torch.tensor(ids)[:, None] * B + torch.arange(B)).reshape(-1).to("cuda")
    one = torch.ones(1, device="cuda", dtype=torch.float32)
    ops.reshape_and_cache_flash(k, v, key_cache, value_cache, slots, "auto", one, one)

    lay = layout_for(cache, HKV, B, D, "FLASH_ATTN")
    got = read_blocks(lay, cache, ids)  # [n, 2, Hkv, B, D] float32
    # slot s = block * B + position: token t of block n is k[n * B + t]
    np.testing.assert_array_equal(got[:, 0], k.view(len(ids), B, HKV, D).permute(0, 2, 1, 3).float().cpu().numpy())
    np.testing.assert_array_equal(got[:, 1], v.view(len(ids), B, HKV, D).permute(0, 2, 1, 3).float().cpu().numpy())

    fresh = torch.zeros_like(cache)  # same strides (memory order) as ``cache``
    assert fresh.stride() == cache.stride()
    lay.write_blocks(fresh, ids, torch.from_numpy(got))
    assert torch.equal(fresh, cache)


@pytest.fixture(scope="module")
async def gpu_stack(split_dir, tmp_path_factory):
    """The cloud's CUDA engines in fp32 (tail at k = 4 and decode, eager), its gateway and an edge on
    loopback, fp32 on the wire, the fp32 torch.onnx head and the fp32 whole model (``edge-full.onnx``)
    as the edge's local model (a GPU build's builder head and decoder are bf16:
    ``test_the_builder_head_on_cuda_gives_hfs_residual_and_kv``,
    ``test_remote_prefill_onto_the_bf16_builder_decoder_agrees_with_fp32_vllm``): split and remote
    prefill output must equal the unsplit references; its remote prefill downloads every block.
    ``bf16_client`` reaches a second edge on the same cloud with the GPU build's defaults (the bf16
    builder decoder, remote prefill's prompt KV as the cost model plans it)."""
    from tandem import AsyncClient
    from tandem.cloud.config import CloudConfig, EngineConfig
    from tandem.cloud.engines.vllm_engines import VllmEngines
    from tandem.cloud.server import create_cloud
    from tandem.edge.config import EdgeConfig
    from tandem.edge.server import create_edge

    cfg = CloudConfig(
        split_dir=split_dir,
        host="127.0.0.1",
        port=0,
        store_dir=tmp_path_factory.mktemp("kv"),
        engine=EngineConfig(max_num_seqs=8, kv_cache_bytes=1 << 30, dtype="float32", enforce_eager=True),
        wire_dtypes=["fp32"],
        kv_wire_dtypes=["fp32"],
    )
    engines = VllmEngines(cfg)
    engines.start()
    cloud = await create_cloud(cfg, engines)
    target = f"127.0.0.1:{cloud.port}"
    full = split_dir.parent / "edge-full.onnx"
    edge = await create_edge(
        EdgeConfig(
            split_dir=split_dir,
            cloud_target=target,
            port=0,
            builder_head=False,
            local_model=full,
            remote_prefill_prompt_kv="download",  # the prompt's KV through the CUDA layout and down the link
        )
    )
    bf16_edge = await create_edge(EdgeConfig(split_dir=split_dir, cloud_target=target, port=0, builder_head=False))
    client = AsyncClient(f"127.0.0.1:{edge.port}")
    bf16_client = AsyncClient(f"127.0.0.1:{bf16_edge.port}")
    yield {
        "engines": engines,
        "cloud": cloud,
        "edge": edge,
        "client": client,
        "bf16_edge": bf16_edge,
        "bf16_client": bf16_client,
    }
    await client.close()
    await bf16_client.close()
    await bf16_edge.stop(1)
    await edge.stop(1)
    await cloud.stop(1)
    engines.shutdown()


@pytest.mark.parametrize("idx", range(len(PROMPTS)))
async def test_split_on_cuda_engines_equals_direct_plain_vllm_and_hf(gpu_stack, hf_model, tokenizer, idx):
    """The decode engine loads the whole block-aligned prompt prefix (head KV from the edge, tail KV
    the tail engine saved through the CUDA layout) and its greedy fp32 output equals direct mode's,
    plain vLLM's on the same GPU and HF's on the CPU (or parts only at a near-tie of the reference)."""
    p, client = PROMPTS[idx], gpu_stack["client"]
    ids = prompt_ids(tokenizer, p)
    split = await client.complete(
        p.get("messages"), prompt=p.get("prompt"), max_new_tokens=MAX_NEW, mode="split", split_layer=4
    )
    direct = await client.complete(p.get("messages"), prompt=p.get("prompt"), max_new_tokens=MAX_NEW, mode="direct")
    assert split.split_layer == 4 and direct.split_layer == 0
    assert split.external_tokens == len(ids) // B * B  # loaded from the store, not recomputed
    plain, plain_gaps = await vllm_plain(gpu_stack["engines"], ids, MAX_NEW)
    assert_same_or_near_tie(list(direct.output_token_ids), plain, plain_gaps, "direct vs plain vLLM")
    assert_same_or_near_tie(list(split.output_token_ids), plain, plain_gaps, "split vs plain vLLM")
    ref, gaps = hf_greedy(hf_model, ids, MAX_NEW)
    assert_same_or_near_tie(list(split.output_token_ids), ref, gaps, "split vs HF")


@pytest.mark.parametrize("idx", range(len(PROMPTS)))
async def test_remote_prefill_on_cuda_engines_equals_direct_and_plain_vllm(gpu_stack, tokenizer, idx):
    """The decode engine prefills and saves every layer's KV through the CUDA layout, the gateway
    streams it down, the edge verifies it and decodes the rest on ONNX Runtime's CUDA provider: the
    streamed greedy fp32 tokens equal direct mode's and plain vLLM's (or part only at a near-tie of
    plain vLLM), and the edge took over wherever the prompt holds a full KV block."""
    p, client = PROMPTS[idx], gpu_stack["client"]
    ids = prompt_ids(tokenizer, p)
    kw = {"prompt": p.get("prompt"), "max_new_tokens": MAX_NEW}
    got = await client.complete(p.get("messages"), mode="remote_prefill", **kw)
    direct = await client.complete(p.get("messages"), mode="direct", **kw)
    assert got.mode == "remote_prefill" and direct.mode == "direct"
    if len(ids) >= B:
        assert got.edge_decoded_tokens > 0 and got.received_bytes.get("kv", 0) > 0, "the edge never took over"
    plain, plain_gaps = await vllm_plain(gpu_stack["engines"], ids, MAX_NEW)
    assert_same_or_near_tie(list(direct.output_token_ids), plain, plain_gaps, "direct vs plain vLLM")
    assert_same_or_near_tie(list(got.output_token_ids), plain, plain_gaps, "remote prefill vs plain vLLM")


NEAR_TIE_BF16 = 0.5  # nats: the fidelity method's near-tie (benchmarks/fidelity.py), for bf16 arithmetic


@pytest.mark.parametrize("policy", ["download", "auto"])
@pytest.mark.parametrize("idx", range(len(PROMPTS)))
async def test_remote_prefill_onto_the_bf16_builder_decoder_agrees_with_fp32_vllm(gpu_stack, tokenizer, idx, policy):
    """The GPU edge's default local model, the builder decoder in bf16 with CUDA graphs, takes the
    fp32 KV the cloud prefilled (``download``: written into its bf16 buffers) or the KV it computed
    itself beside the cloud's prefill (``auto``, the default: on this GPU the cost model plans at
    least part of the prompt here) and decodes the rest: the tokens equal plain fp32 vLLM's, or part
    from them only where vLLM's top-2 gap is within bf16's reach (``NEAR_TIE_BF16``); KV written
    wrong parts at once, at a wide gap. The agreement of the bf16 edge with direct over many chats
    is measured by ``tandem-bench fidelity`` (its edge row)."""
    from tandem.edge.routing.occupancy import PromptKV

    p = PROMPTS[idx]
    ids = prompt_ids(tokenizer, p)
    occupancy = gpu_stack["bf16_edge"].node.router.occupancy
    occupancy.prompt_kv = PromptKV(policy)
    try:
        got = await gpu_stack["bf16_client"].complete(
            p.get("messages"), prompt=p.get("prompt"), max_new_tokens=MAX_NEW, mode="remote_prefill"
        )
    finally:
        occupancy.prompt_kv = PromptKV.AUTO
    assert got.mode == "remote_prefill"
    if len(ids) >= B:
        assert got.edge_decoded_tokens > 0, "the edge never took over"
        if policy == "download":
            assert got.received_bytes.get("kv", 0) > 0, "no KV came down"
    plain, plain_gaps = await vllm_plain(gpu_stack["engines"], ids, MAX_NEW)
    what = "remote prefill onto the bf16 decoder vs plain fp32 vLLM"
    assert_same_or_near_tie(list(got.output_token_ids), plain, plain_gaps, what, near=NEAR_TIE_BF16)


async def test_a_second_turn_on_cuda_engines_loads_the_first_turns_kv(gpu_stack, hf_model, tokenizer):
    """Turn 2 of a session runs the head only over its new tokens and the engines load turn 1's head
    and tail KV from the store; its output equals HF's over the whole conversation."""
    client, session = gpu_stack["client"], f"gpu-{uuid.uuid4().hex}"
    messages = [{"role": "user", "content": "Name a famous bridge in San Francisco."}]
    first = await client.complete(messages, max_new_tokens=MAX_NEW, session_id=session, mode="split", split_layer=4)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "How long is it?"}]
    second = await client.complete(messages, max_new_tokens=MAX_NEW, session_id=session, mode="split", split_layer=4)
    ids = prompt_ids(tokenizer, {"messages": messages})
    assert second.head_tokens < len(ids) and second.external_tokens == len(ids) // B * B
    ref, gaps = hf_greedy(hf_model, ids, MAX_NEW)
    assert_same_or_near_tie(list(second.output_token_ids), ref, gaps, "turn 2 vs HF")


def test_the_builder_head_on_cuda_gives_hfs_residual_and_kv(split_dir, manifest, hf_model, tokenizer):
    """The split's builder head as a GPU build writes it (``head-builder/``, bf16 on ONNX Runtime's
    CUDA provider) under ``BuilderHead``: the hidden state of a prompt's tokens and of a second call
    on its KV are HF fp32's residual entering layer ``k``, and the KV HF's first ``k`` layers cache,
    within bf16's rounding (2% of the largest value)."""
    import onnxruntime as ort

    from tandem.edge.compute.builder_head import BuilderHead
    from tandem.edge.compute.head import HeadInput

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu's CUDA provider is not installed")
    if not manifest.builder_head:
        pytest.fail(f"{split_dir}: no builder head ({manifest.builder_head_note}); tandem-model builds one")
    head = BuilderHead(split_dir)
    assert head.graph.on_cuda and head.graph.kv_type in ("tensor(bfloat16)", "tensor(float16)")
    ids = prompt_ids(tokenizer, PROMPTS[0])
    cut = len(ids) // 2
    first = head.run([HeadInput(token_ids=np.asarray(ids[:cut], np.int64))])[0]
    second = head.run([HeadInput(token_ids=np.asarray(ids[cut:], np.int64), past_kv=first.kv)])[0]
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), output_hidden_states=True, use_cache=True)
    k = manifest.split_layer
    want = out.hidden_states[k][0].numpy()
    got = np.concatenate([first.hidden, second.hidden])
    assert got.shape == want.shape and got.dtype == np.float32
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= 0.02 * scale, (float(np.abs(got - want).max()), scale)
    cache = out.past_key_values
    for layer in range(k):
        keys, values = (t[0].numpy() for t in (cache.layers[layer].keys, cache.layers[layer].values))
        for j, ref in enumerate((keys, values)):
            err = float(np.abs(second.kv[layer, j] - ref).max())
            assert err <= 0.02 * float(np.abs(ref).max()) + 1e-3, (layer, j, err)


async def test_the_builder_decoder_serves_local_turns_from_cuda_graphs(split_dir, manifest, hf_model, tokenizer):
    """The whole model as ONNX Runtime GenAI's builder wrote it (``edge-decoder/``, bf16 for CUDA) under
    ``LocalEngine``: a session's KV is one CUDA slot, the decode steps replay its CUDA graph, and the
    greedy output equals HF's fp32 one (or parts only at a near-tie of the reference), over two turns
    with an idle gap between them longer than a stepper's linger: every captured run comes from the
    engine's one thread (ONNX Runtime keeps CUDA graphs per thread)."""
    import asyncio

    import onnxruntime as ort

    from tandem.common.protocol.params import Sampling
    from tandem.edge.compute.decoder import DecoderGraph
    from tandem.edge.compute.local import LocalEngine
    from tandem.edge.compute.stepper import LINGER_S

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu's CUDA provider is not installed")
    path = split_dir.parent / "edge-decoder"
    if not (path / "tandem_build.json").is_file():
        pytest.fail(f"no {path}: tandem-model builds it (bf16 where ONNX Runtime has its CUDA provider)")
    eos = hf_model.generation_config.eos_token_id
    engine = LocalEngine(path, manifest.shape, eos if isinstance(eos, list) else [eos])
    assert isinstance(engine.model, DecoderGraph) and engine.model.cuda_graph and engine.kv_device == "cuda"
    messages = [{"role": "user", "content": "Name a famous bridge in San Francisco."}]
    sid = f"decoder-{uuid.uuid4().hex}"
    for turn in range(2):
        ids = prompt_ids(tokenizer, {"messages": messages})
        out = [t.token_id async for t in engine.generate(ids, Sampling(max_new_tokens=MAX_NEW), sid)]
        ref, gaps = hf_greedy(hf_model, ids, MAX_NEW)
        assert_same_or_near_tie(out, ref, gaps, f"builder decoder on CUDA, turn {turn + 1}, vs HF", near=0.25)
        sess = engine.sessions.peek(sid)
        assert sess is not None and sess.kv.tokens == len(sess.token_ids)
        assert bool(sess.kv.kv) != (sess.kv.pool is not None)  # its own buffers or a pool row, not both
        assert all(v.device_name() == "cuda" for v in sess.kv.kv or sess.kv.pool.kv)
        assert any(1 in pool.graph_ids for pool in engine.model._pools.values())  # its steps replayed a graph
        messages += [
            {"role": "assistant", "content": tokenizer.decode(out, skip_special_tokens=True)},
            {"role": "user", "content": "How long is it?"},
        ]
        await asyncio.sleep(3 * LINGER_S)  # idle: the engine's thread stays
    assert engine.last_reused_tokens > 0
    assert engine.model.thread_bound and len(engine.model.graph_thread.threads) == 1
    assert engine.model.idle_s == float("inf")  # buffers with a captured graph are kept, not re-captured
    assert engine._stepper.threads_started == 1
    await engine.close()


def test_bucketed_prefills_on_cuda_agree_with_exact_runs(split_dir):
    """On the CUDA provider the decoder's default plan is the bucketed one (runs of at most 512
    tokens, padded, the mask over the slot: ``edge.compute.prefill``) and its warm-up runs every
    shape on each warmed capacity. A 700-token prompt (a chunk, then 188 tokens padded to 256) and 5
    tokens after it (padded to 8): the padding and the capacity-wide mask change nothing, so the
    logits and every held token's KV equal exact-length runs in the same chunks within bf16's
    rounding (2% of the largest value; on an H100 they are the same bits); against one exact run
    of the whole prompt the chunk boundary changes the kernels' rounding, which compounds through
    the layers (KV up to 5% of a layer's largest value on an H100), so there the logits agree within
    2% and the argmax where the exact run's top two are not within that rounding."""
    import onnxruntime as ort

    from tandem.edge.compute.decoder import DecoderGraph
    from tandem.edge.compute.prefill import CHUNK_TOKENS, PrefillPlan

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu's CUDA provider is not installed")
    path = split_dir.parent / "edge-decoder"
    bucketed = DecoderGraph(path)
    chunked = DecoderGraph(path, prefill=PrefillPlan(chunk_tokens=CHUNK_TOKENS))
    exact = DecoderGraph(path, prefill=PrefillPlan.EXACT)
    assert bucketed.on_cuda and bucketed.prefill == PrefillPlan.bucketed()
    caps = bucketed.warm_prefills()
    assert caps and caps[0] == bucketed.turn_capacity_tokens(1)
    ids = [int(x) for x in np.random.default_rng(11).integers(3, 32000, 705)]
    graphs = (bucketed, chunked, exact)
    slots = {g: g.new_kv(len(ids)) for g in graphs}
    for lo, hi in ((0, 700), (700, 705)):
        got, same_chunks, whole = (g.run(slots[g], ids[lo:hi], greedy=False)[1] for g in graphs)
        for want in (same_chunks, whole):
            scale = float(np.abs(want).max())
            assert float(np.abs(got - want).max()) <= 0.02 * scale, (hi, float(np.abs(got - want).max()), scale)
            top2 = np.sort(want)[-2:]
            if top2[1] - top2[0] > 0.02 * scale:
                assert int(np.argmax(got)) == int(np.argmax(want)), hi
    assert all(slot.tokens == len(ids) for slot in slots.values())
    for i, (a, b) in enumerate(zip(bucketed.read_kv(slots[bucketed]), chunked.read_kv(slots[chunked]), strict=True)):
        assert float(np.abs(a - b).max()) <= 0.02 * float(np.abs(b).max()) + 1e-3, i


async def test_the_builder_decoder_batches_concurrent_turns_in_cuda_graphs(split_dir, manifest, hf_model, tokenizer):
    """Concurrent local turns on ``edge-decoder/`` decode in batched steps: each bucket's step is a
    CUDA graph over the pool's rows, bf16 KV bound by address, and each turn's greedy output equals
    HF's (or parts only at a near-tie of the reference); a turn alone afterwards still does."""
    import asyncio

    import onnxruntime as ort

    from tandem.common.protocol.params import Sampling
    from tandem.edge.compute.local import LocalEngine

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu's CUDA provider is not installed")
    path = split_dir.parent / "edge-decoder"
    if not (path / "tandem_build.json").is_file():
        pytest.fail(f"no {path}: tandem-model builds it (bf16 where ONNX Runtime has its CUDA provider)")
    eos = hf_model.generation_config.eos_token_id
    engine = LocalEngine(path, manifest.shape, eos if isinstance(eos, list) else [eos])
    assert engine.model.batched_decode and engine.model.cuda_graph
    prompts = [prompt_ids(tokenizer, p) for p in PROMPTS[:4]]

    async def one(ids: list[int]) -> list[int]:
        return [t.token_id async for t in engine.generate(ids, Sampling(max_new_tokens=MAX_NEW))]

    outs = await asyncio.gather(*(one(ids) for ids in prompts))
    for i, (ids, out) in enumerate(zip(prompts, outs, strict=True)):
        ref, gaps = hf_greedy(hf_model, ids, MAX_NEW)
        assert_same_or_near_tie(out, ref, gaps, f"turn {i} of 4 in batched CUDA graphs vs HF", near=0.25)
    alone = await one(prompts[0])
    ref, gaps = hf_greedy(hf_model, prompts[0], MAX_NEW)
    assert_same_or_near_tie(alone, ref, gaps, "a turn alone after the batch vs HF", near=0.25)
    pools = list(engine.model._pools.values())
    assert any(4 in p.graph_ids for p in pools) and all(v.device_name() == "cuda" for p in pools for v in p.kv)


def test_the_builder_decoder_on_cuda_holds_pooled_kv_once_and_gives_idle_pools_back(split_dir, hf_model, tokenizer):
    """On CUDA with graphs: sessions decoding in a pool hold their KV in its rows only; when three
    end, the fourth decodes on alone in its row (uncaptured) until its pool shrinks to one row, and
    its next batched step captures the new pool's graph; once every session ends the pool is freed
    after ``IDLE_S`` (a clock of the test's; set, since a CUDA-graph decoder's default keeps idle
    buffers and their graphs); every output equals HF's (or parts at a near-tie). With
    ``max_kv_bytes`` room for two sessions, a third is refused and the two step alone."""
    import onnxruntime as ort

    from tandem.common.protocol.errors import QuotaExceeded
    from tandem.edge.compute.decoder import DecoderGraph
    from tandem.edge.compute.decoder_batch import IDLE_S

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu's CUDA provider is not installed")
    path = split_dir.parent / "edge-decoder"
    now = [0.0]
    assert DecoderGraph(path).idle_s == float("inf")
    g = DecoderGraph(path, clock=lambda: now[0], idle_s=IDLE_S)
    assert g.cuda_graph
    prompts = [prompt_ids(tokenizer, p) for p in PROMPTS[:4]]
    # one capacity for all four (a pool holds sessions of one capacity; the prompts are 5 to 222 tokens)
    slots = [g.new_kv(max(map(len, prompts)) + 4 * MAX_NEW) for _ in prompts]
    got = [[g.run(s, p, greedy=True)[0]] for s, p in zip(slots, prompts, strict=True)]
    for _ in range(MAX_NEW - 1):
        toks, _, _ = g.run_batch(slots, [x[-1] for x in got], [True] * len(slots))
        for x, t in zip(got, toks, strict=True):
            x.append(t)
    pool = slots[0].pool
    assert pool is not None and 4 in pool.graph_ids
    assert all(s.pool is pool and s.kv == [] and s.nbytes() == pool.row_nbytes for s in slots)
    for i in range(1, 4):
        g.release(slots[i])
    keep, tok = slots[0], got[0][-1]
    for _ in range(8):
        now[0] += IDLE_S / 6
        tok, _, _ = g.run(keep, [tok], greedy=True)
        got[0].append(tok)
    assert keep.pool is not None and keep.pool is not pool and keep.pool.rows == 1 and keep.kv == []
    for _ in range(3):
        toks, _, _ = g.run_batch([keep], [got[0][-1]], [True])
        got[0].append(toks[0])
    assert 1 in keep.pool.graph_ids
    for i, (ids, out) in enumerate(zip(prompts, got, strict=True)):
        ref, gaps = hf_greedy(hf_model, ids, len(out))
        assert_same_or_near_tie(out[: len(ref)], ref, gaps, f"session {i} through pools on CUDA vs HF", near=0.25)
    g.release(keep)
    other = g.new_kv(64)
    tok = g.run(other, prompts[1], greedy=True)[0]
    now[0] += IDLE_S
    g.run(other, [tok], greedy=True)
    assert not g._pools
    g.release(other)
    g.trim()
    assert g.memory.held_bytes == 0

    one = g._session_nbytes(g.min_slot_tokens)
    bounded = DecoderGraph(path, max_kv_bytes=2 * one)
    x, y = bounded.new_kv(64), bounded.new_kv(64)
    with pytest.raises(QuotaExceeded, match="local_kv_bytes"):
        bounded.new_kv(64)
    firsts = [bounded.run(s, p, greedy=True)[0] for s, p in zip((x, y), prompts, strict=False)]
    toks, _, _ = bounded.run_batch([x, y], firsts, [True, True])  # no room for a pool: each steps alone
    assert x.pool is None and y.pool is None and bounded.memory.held_bytes <= 2 * one
    for ids, out in zip(prompts, zip(firsts, toks, strict=True), strict=False):
        ref, gaps = hf_greedy(hf_model, ids, 2)
        assert_same_or_near_tie(list(out)[: len(ref)], ref, gaps, "a session beside the bound on CUDA", near=0.25)


async def test_the_builder_decoder_samples_on_the_device_by_the_host_rule(split_dir, manifest, tokenizer):
    """On CUDA the prepared builder graph carries the sampler: two slots fed the same tokens, one
    returning its logits and one sampling at the same seeded draws, give the host rule's token
    (``sample_token`` on those logits) at every step of a CUDA graph, or, where they differ, a token
    the host rule gives within 1e-4 of the draw (the draw on the boundary of two tokens' cumulative
    mass, where the device's float32 ``exp`` and numpy's may round apart), the sampler's own run
    replayed as a CUDA graph; and four seeded sampled turns decode together in batched CUDA graphs,
    each with its full length."""
    import asyncio

    import onnxruntime as ort

    from tandem.common.protocol.params import Sampling
    from tandem.edge.compute.decoder import DecoderGraph
    from tandem.edge.compute.local import LocalEngine, draw_uniform, sample_token, sampling_rng
    from tandem.edge.compute.localmodel import Draw

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu's CUDA provider is not installed")
    path = split_dir.parent / "edge-decoder"
    g = DecoderGraph(path)
    assert g.cuda_graph and g.has_sampling, "a CUDA build has the sampler"
    assert g.sampler is not None and g.sampler.captured, g.sampler.capture_note if g.sampler else ""
    steps, boundary = 0, 0
    for i, s in enumerate(
        [
            Sampling(temperature=1.0, seed=1),
            Sampling(temperature=0.8, top_k=50, top_p=0.95, seed=2),
            Sampling(temperature=1.5, top_p=0.9, seed=3),
        ]
    ):
        ids = prompt_ids(tokenizer, PROMPTS[i % len(PROMPTS)])
        rng = sampling_rng(s.seed)
        host_slot, device_slot = g.new_slot(len(ids) + MAX_NEW), g.new_slot(len(ids) + MAX_NEW)
        new = ids
        for _ in range(MAX_NEW):
            u = draw_uniform(rng)
            draw = Draw(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, uniform=u)
            _, logits, _ = g.run(host_slot, new, greedy=False)
            token, none, _ = g.run(device_slot, new, greedy=False, draw=draw)
            assert logits is not None and none is None and token is not None
            host = sample_token(logits, s, u)
            if token != host:
                near = {sample_token(logits, s, min(max(u + d, 0.0), 0.99999994)) for d in (-1e-4, 1e-4)}
                assert token in near, f"step {steps}: device {token}, host {host} at u={u}, near {near}"
                boundary += 1
            steps += 1
            new = [token]
        g.release(host_slot)
        g.release(device_slot)
    assert boundary <= steps // 20, f"{boundary} of {steps} steps on a boundary"
    eos = tokenizer.eos_token_id
    engine = LocalEngine(path, manifest.shape, [eos])
    prompts = [prompt_ids(tokenizer, p) for p in PROMPTS[:4]]
    sampled = Sampling(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)

    async def one(ids: list[int]) -> list[int]:
        return [t.token_id async for t in engine.generate(ids, sampled)]

    outs = await asyncio.gather(*(one(ids) for ids in prompts))
    assert all(len(o) == MAX_NEW for o in outs)
    assert any(4 in p.graph_ids for p in engine.model._pools.values())
    assert any(rows == 4 for _, rows, _, _ in engine.model.sampler.whole._bound), "the batched steps' sampler graph"


async def test_the_local_model_on_onnx_runtimes_cuda_provider_keeps_its_kv_on_the_gpu(
    split_dir, manifest, hf_model, tokenizer
):
    """The edge's whole model (``edge-full.onnx``) on ONNX Runtime's CUDA provider binds its KV on the
    device: a session's KV is CUDA ``OrtValue`` tensors between decode steps and turns, and its greedy
    fp32 output equals HF's on the CPU (or parts only at a near-tie of the reference), over two turns."""
    import onnxruntime as ort

    from tandem.common.protocol.params import Sampling
    from tandem.edge.compute.local import LocalEngine

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu's CUDA provider is not installed")
    eos = hf_model.generation_config.eos_token_id
    engine = LocalEngine(split_dir.parent / "edge-full.onnx", manifest.shape, eos if isinstance(eos, list) else [eos])
    assert engine.providers[0] == "CUDAExecutionProvider" and engine.kv_device == "cuda"
    messages = [{"role": "user", "content": "Name a famous bridge in San Francisco."}]
    sid = f"local-{uuid.uuid4().hex}"
    for turn in range(2):
        ids = prompt_ids(tokenizer, {"messages": messages})
        out = [t.token_id async for t in engine.generate(ids, Sampling(max_new_tokens=MAX_NEW), sid)]
        ref, gaps = hf_greedy(hf_model, ids, MAX_NEW)
        assert_same_or_near_tie(out, ref, gaps, f"local on CUDA, turn {turn + 1}, vs HF")
        sess = engine.sessions.peek(sid)
        assert sess is not None and all(isinstance(a, ort.OrtValue) and a.device_name() == "cuda" for a in sess.kv.past)
        messages += [
            {"role": "assistant", "content": tokenizer.decode(out, skip_special_tokens=True)},
            {"role": "user", "content": "How long is it?"},
        ]
    assert engine.last_reused_tokens > 0  # turn 2 ran over its new tokens only
