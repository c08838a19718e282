"""Every supported decoder family end to end on the real engines (vLLM's CPU build for the tails and
the decode engine, ONNX Runtime heads and ``edge-full.onnx``, grpc.aio on loopback): a tiny
random-weight checkpoint per family (``tests.families``, prepared once per test run with the
in-process family tests, which check both heads at both split layers against HF), then split,
direct, local and remote prefill greedy fp32 output against HF's over chat prompts longer than the
sliding windows (in remote prefill the edge decodes on from every layer's KV as the cloud's engine
saved it, sliding and global layers alike), and a second turn of a session in split mode. One
stack per family: a tail engine at ``k = 1`` (an odd layer offset with three of the four layers: the
tail must keep the alternation of sliding and global layers) and the decode engine; and a tiny
GPT-2, which tandem cannot split, prepared with ``--direct-only`` and served in direct mode (the
decode engine alone).

Each family's stack starts two vLLM engines (about a minute on 2 cores), so ``make test`` runs the
family whose tail differs most from SmolLM2's Llama (``CI_FAMILIES``: Gemma 3's alternating
sliding and global layers with their own RoPE bases, q/k norms and embedding scale) and
``make test-families`` (``TANDEM_TEST_FAMILIES=all``) every one."""

from __future__ import annotations

import os
import uuid

import pytest

from tandem import AsyncClient, TandemClientError
from tandem.common.model import onnx_export
from tandem.common.model import prepare as modelprep
from tests.families import FAMILY_NAMES, FAMILY_SPLITS, TOKENIZER_DIR
from tests.references import assert_same_or_near_tie, hf_greedy, prompt_ids

pytestmark = [
    pytest.mark.engines,
    pytest.mark.skipif(not TOKENIZER_DIR.is_dir(), reason="no models/smollm2-135m/tokenizer: make model"),
]

CI_FAMILIES = ("gemma3",)
E2E_FAMILIES = FAMILY_NAMES if os.environ.get("TANDEM_TEST_FAMILIES") == "all" else CI_FAMILIES
SPLIT = 1  # the tail engine's split layer (the checkpoints are prepared at FAMILY_SPLITS)
MAX_NEW = 12
MAX_NEW_REMOTE_PREFILL = 32  # long enough that the edge takes the decode over
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name two primary colours and say why they are called primary."},
    ],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
FOLLOW_UP = "And why is that?"


@pytest.fixture(scope="module", params=E2E_FAMILIES)
async def family(request, tmp_path_factory, prepared_families):
    """(name, HF reference model, tokenizer, SDK client) of one family's running stack."""
    from transformers import AutoTokenizer

    from tandem.cloud.config import CloudConfig, EngineConfig
    from tandem.cloud.engines.vllm_engines import VllmEngines
    from tandem.cloud.server import create_cloud
    from tandem.edge.config import EdgeConfig
    from tandem.edge.server import create_edge

    assert SPLIT in FAMILY_SPLITS
    name = request.param
    root = tmp_path_factory.mktemp(name)
    out = prepared_families(name)
    split = out / f"split-k{SPLIT}"
    cfg = CloudConfig(
        split_dir=split,
        host="127.0.0.1",
        port=0,
        store_dir=root / "kv",
        engine=EngineConfig(max_num_seqs=4, max_model_len_tokens=512, kv_cache_bytes=64 << 20),
        wire_dtypes=["fp32"],  # exactness: greedy fp32 output must equal HF's
        kv_wire_dtypes=["fp32"],
    )
    engines = VllmEngines(cfg)
    engines.start()
    cloud = await create_cloud(cfg, engines)
    edge = await create_edge(
        EdgeConfig(
            split_dir=split,
            cloud_target=f"127.0.0.1:{cloud.port}",
            host="127.0.0.1",
            port=0,
        )
    )
    client = AsyncClient(f"127.0.0.1:{edge.port}")
    yield name, onnx_export.load_hf(out / "hf"), AutoTokenizer.from_pretrained(out / "tokenizer"), client
    await client.close()
    await edge.stop(1)
    await cloud.stop(1)
    engines.shutdown()


MODES = [("split", SPLIT), ("direct", 0), ("local", 0)]


@pytest.mark.parametrize("idx", range(len(CHATS)))
async def test_split_direct_and_local_equal_hf(family, idx):
    name, model, tokenizer, client = family
    ids = prompt_ids(tokenizer, {"messages": CHATS[idx]})
    ref, gaps = hf_greedy(model, ids, MAX_NEW)
    for mode, k in MODES:
        res = await client.complete(CHATS[idx], max_new_tokens=MAX_NEW, mode=mode, split_layer=k)
        assert (res.mode, res.split_layer) == (mode, k)
        assert_same_or_near_tie(list(res.output_token_ids), ref, gaps, f"{name} {mode} k={k} vs HF")


@pytest.mark.parametrize("idx", range(len(CHATS)))
async def test_remote_prefill_equals_hf_after_the_edge_takes_over(family, idx):
    """The cloud prefills, the prompt's KV of every layer comes down, the edge decodes the rest."""
    name, model, tokenizer, client = family
    ids = prompt_ids(tokenizer, {"messages": CHATS[idx]})
    ref, gaps = hf_greedy(model, ids, MAX_NEW_REMOTE_PREFILL)
    res = await client.complete(CHATS[idx], max_new_tokens=MAX_NEW_REMOTE_PREFILL, mode="remote_prefill")
    assert res.mode == "remote_prefill"
    assert_same_or_near_tie(list(res.output_token_ids), ref, gaps, f"{name} remote prefill vs HF")
    assert res.edge_decoded_tokens > 0, f"{name}: the edge never took over ({res.timings_ms})"


async def test_a_second_turn_equals_hf(family):
    name, model, tokenizer, client = family
    k = SPLIT
    session = f"{name}-{uuid.uuid4().hex}"
    messages = list(CHATS[1])
    for turn in range(2):
        res = await client.complete(messages, max_new_tokens=MAX_NEW, mode="split", split_layer=k, session_id=session)
        ref, gaps = hf_greedy(model, prompt_ids(tokenizer, {"messages": messages}), MAX_NEW)
        assert_same_or_near_tie(list(res.output_token_ids), ref, gaps, f"{name} k={k} turn {turn + 1} vs HF")
        messages += [{"role": "assistant", "content": res.text}, {"role": "user", "content": FOLLOW_UP}]
    assert res.head_tokens < len(prompt_ids(tokenizer, {"messages": messages[:-2]}))  # the head reused turn 1's KV


@pytest.fixture(scope="module")
async def direct_only(tmp_path_factory):
    """(HF model, tokenizer, client) of a stack on a tiny GPT-2 prepared with ``--direct-only``: the
    decode engine alone, an edge without heads or local model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tandem.cloud.config import CloudConfig, EngineConfig
    from tandem.cloud.engines.vllm_engines import VllmEngines
    from tandem.cloud.server import create_cloud
    from tandem.edge.config import EdgeConfig
    from tandem.edge.server import create_edge
    from tests.families import gpt2_checkpoint

    root = tmp_path_factory.mktemp("gpt2")
    out = root / "model"
    modelprep.prepare_model(out, gpt2_checkpoint(root / "ckpt"), model_id="tiny-gpt2", direct_only=True)
    cfg = CloudConfig(
        split_dir=out / "direct",
        host="127.0.0.1",
        port=0,
        store_dir=root / "kv",
        engine=EngineConfig(max_num_seqs=4, max_model_len_tokens=512, kv_cache_bytes=64 << 20),
    )
    engines = VllmEngines(cfg)
    engines.start()
    cloud = await create_cloud(cfg, engines)
    edge = await create_edge(
        EdgeConfig(split_dir=out / "direct", cloud_target=f"127.0.0.1:{cloud.port}", host="127.0.0.1", port=0)
    )
    client = AsyncClient(f"127.0.0.1:{edge.port}")
    model = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    yield model, AutoTokenizer.from_pretrained(out / "tokenizer"), client
    await client.close()
    await edge.stop(1)
    await cloud.stop(1)
    engines.shutdown()


async def test_a_checkpoint_tandem_cannot_split_is_served_in_direct_mode(direct_only):
    model, tokenizer, client = direct_only
    for chat in CHATS:
        ref, gaps = hf_greedy(model, prompt_ids(tokenizer, {"messages": chat}), MAX_NEW)
        res = await client.complete(chat, max_new_tokens=MAX_NEW)
        assert (res.mode, res.split_layer, res.head_tokens) == ("direct", 0, 0)
        assert_same_or_near_tie(list(res.output_token_ids), ref, gaps, "GPT-2 direct vs HF")
    info = await client.info()
    assert info.modes == ("direct",) and info.split_layers == ()
    with pytest.raises(TandemClientError):
        await client.complete(CHATS[0], max_new_tokens=MAX_NEW, mode="split")
