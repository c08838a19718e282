"""The real system on CPU: vLLM engines (tail + decode), grpc.aio gateway and edge daemon on
loopback ports, ONNX Runtime head, real SmolLM2. Greedy outputs of the split path must
equal the unsplit HF model's and plain vLLM's; where they part, the parting token must
be a near-tie in the reference (top-2 log-prob gap < 1e-3)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from dataclasses import replace

import grpc
import numpy as np
import pytest

from tandem import AsyncClient, TandemClientError
from tandem.common.wire import chunks as wire
from tandem.common.wire.messages import KVBlock
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc
from tests.doubles import TamperLink, rechunk
from tests.helpers import TANDEM_BENCH, SplitClient
from tests.references import LONG, MAX_NEW, PROMPTS, assert_same_or_near_tie, hf_greedy, prompt_ids, vllm_plain

pytestmark = [pytest.mark.engines]


def cloud_channel(stack) -> grpc.aio.Channel:
    """A raw channel to the stack's cloud as its edge: the edge's client certificate, to go with its
    edge key (``edge_metadata``; a key is bound to the certificate subject it was issued for)."""
    from tandem.common.runtime.grpc_setup import channel_credentials

    tls = stack["tls"]
    creds = channel_credentials(tls.ca_file, *tls.edge_client)
    return grpc.aio.secure_channel(f"127.0.0.1:{stack['cloud_port']}", creds)


def edge_metadata(stack) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {stack['tls'].edge_key}"),)


def keyed_session_id(stack, session: str) -> str:
    """The id under which the edge keeps an app's ``session`` (its own table, and at the cloud):
    scoped by the app's API key."""
    from tandem.common.runtime.security import ApiKeys, Principal, scoped

    key = stack["tls"].app_key
    name = ApiKeys([key]).identify(key)
    assert name is not None
    return scoped(Principal("key", name), session)


async def restart_cloud(stack) -> None:
    """Stop the cloud's gRPC server and gateway and start new ones on the same port, with the same
    engines and block store directory: to the edge, a cloud process restart that kept its store."""
    from tandem.cloud.server import create_cloud

    await stack["cloud"].stop(0)
    cloud = await create_cloud(stack["cfg"].model_copy(update={"port": stack["cloud_port"]}), stack["engines"])
    stack.update(cloud=cloud, gateway=cloud.gateway)


@pytest.mark.parametrize("idx", range(len(PROMPTS)))
async def test_split_equals_unsplit_references(stack, hf_model, tokenizer, idx):
    p = PROMPTS[idx]
    ids = prompt_ids(tokenizer, p)
    res = await stack["client"].complete(
        p.get("messages"), prompt=p.get("prompt"), max_new_tokens=MAX_NEW, mode="split"
    )
    got = list(res.output_token_ids)
    ref, gaps = hf_greedy(hf_model, ids, MAX_NEW)
    assert_same_or_near_tie(got, ref, gaps, "split vs HF")
    plain, pgaps = await vllm_plain(stack["engines"], ids, MAX_NEW)
    assert_same_or_near_tie(got, plain, pgaps, "split vs plain vLLM")
    # the decode engine loaded the whole aligned prefix from the connector, not recomputed it
    bs = stack["gateway"].params.kv_block_size_tokens
    assert res.prompt_tokens == len(ids) and res.head_tokens == len(ids)
    assert res.external_tokens == len(ids) // bs * bs  # decode prompt = ids + the tail engine's first token
    if idx == 3:
        assert len(ids) > 200 and res.external_tokens >= 192
    if idx == 0:
        assert len(ids) < bs and res.external_tokens == 0


async def test_a_whole_reply_turn_in_auto_mode_equals_the_reference(stack, hf_model, tokenizer):
    """Auto chooses a whole-reply turn's mode by its predicted end-to-end time (the reason says so);
    whichever mode that is, the tokens are the unsplit model's."""
    p = PROMPTS[1]
    ids = prompt_ids(tokenizer, p)
    res = await stack["client"].complete(p["messages"], max_new_tokens=MAX_NEW, mode="auto", whole_reply=True)
    assert "end-to-end" in res.mode_reason, res.mode_reason
    ref, gaps = hf_greedy(hf_model, ids, MAX_NEW)
    assert_same_or_near_tie(list(res.output_token_ids), ref, gaps, f"auto ({res.mode}) vs HF")


async def test_three_turn_chat(stack, hf_model, tokenizer):
    """Each turn of a three-turn split chat equals HF's greedy reply (or parts at a near-tie), the cloud loads
    every full block of the prompt, and later turns run the head only over new tokens."""
    client, session = stack["client"], f"chat-{uuid.uuid4().hex}"
    messages = [{"role": "user", "content": "Name a famous bridge in San Francisco."}]
    follow = ["How long is it, roughly?", "What colour is it painted?"]
    head_tokens = []
    for turn in range(3):
        res = await client.complete(messages, max_new_tokens=MAX_NEW, session_id=session)
        ids = prompt_ids(tokenizer, {"messages": messages})
        ref, gaps = hf_greedy(hf_model, ids, MAX_NEW)
        assert_same_or_near_tie(list(res.output_token_ids), ref, gaps, f"turn {turn + 1} vs HF")
        assert res.external_tokens == len(ids) // 32 * 32
        head_tokens.append((res.head_tokens, len(ids)))
        if turn < 2:
            messages += [{"role": "assistant", "content": res.text}, {"role": "user", "content": follow[turn]}]
    # later turns ran the head only over tokens the edge had not processed
    assert head_tokens[0][0] == head_tokens[0][1]
    assert all(h < n for h, n in head_tokens[1:]), head_tokens


async def test_every_engine_exports_its_vllm_metrics(stack):
    """The engines start together (``VllmEngines.start``); each still exports its ``vllm:`` metrics,
    told apart by ``model_name`` (one engine's logger unregisters every ``vllm:`` collector)."""
    from tandem.cloud.engines import vllm_metrics
    from tandem.common.runtime.metrics import REGISTRY

    names = {
        s.labels.get("model_name")
        for f in REGISTRY.collect()
        if f.name == "vllm:num_requests_running"
        for s in f.samples
    }
    assert len(names) == 3 and any(n.endswith("split-k4/tail") for n in names), names  # 2 tails, 1 decode
    # what GetServerInfo reports as the KV cache use: the highest engine's, read from its gauge alone
    usage = [s.value for f in REGISTRY.collect() if f.name == "vllm:kv_cache_usage_perc" for s in f.samples]
    assert len(usage) == 3 and vllm_metrics.vllm_kv_cache_usage() == max(usage)


async def test_decode_engine_uses_the_loaded_kv(stack, tokenizer, manifest):
    """Put deliberately wrong head KV in the store for a prompt: the split decode must change,
    which it cannot if the engine recomputed the prefix instead of loading it."""
    from tandem.cloud.engines.kvparams import KVTransferSpec, PartSpec
    from tandem.common.protocol.params import Sampling
    from tandem.common.wire.kvblocks import LayerRange, block_hashes, hash_seed

    gw, engines = stack["gateway"], stack["engines"]
    ids = prompt_ids(tokenizer, PROMPTS[2])
    bs, k, L = gw.params.kv_block_size_tokens, manifest.split_layer, manifest.shape.num_layers
    keys = tuple(block_hashes(ids, bs, hash_seed(f"poison-{uuid.uuid4().hex}", bs)))  # keys no real request uses
    rng = np.random.default_rng(0)
    spec = KVTransferSpec(loads=(PartSpec(LayerRange(lo=0, hi=k), keys), PartSpec(LayerRange(lo=k, hi=L), keys)))
    for part in spec.loads:
        shape = (part.layers.num_layers, 2, manifest.shape.num_kv_heads, bs, manifest.shape.head_dim)
        for j in range(len(keys)):
            gw.store.put(part.store_key(j), rng.standard_normal(shape).astype(np.float32).tobytes())
    steps = [s async for s in engines.decode(uuid.uuid4().hex, ids, spec, Sampling(max_new_tokens=16))]
    loaded = [t for s in steps for t in s.token_ids]
    plain, _ = await vllm_plain(engines, ids, 16)
    assert steps[-1].external_tokens == (len(ids) - 1) // bs * bs > 0
    assert loaded != plain


@contextlib.contextmanager
def tampered(stack, fn):
    """Every uplink item of the edge passes through ``fn(item, attempt)`` (a wrapped link)."""
    conn = stack["edge"].node.conn
    inner = conn.link
    conn.link = TamperLink(inner, fn)
    try:
        yield
    finally:
        conn.link = inner


def flip_first_transmission(kind: type):
    def tamper(item, attempt: int):
        if attempt == 1 and isinstance(item, kind):
            if isinstance(item, wire.Chunk) and item.seq != 0 or isinstance(item, KVBlock) and item.leaf_index != 1:
                return item
            return replace(item, payload=bytes([item.payload[0] ^ 0xFF]) + item.payload[1:])
        return item

    return tamper


@pytest.mark.parametrize("kind,counter", [(wire.Chunk, "resent_chunks"), (KVBlock, "repaired_blocks")])
async def test_corruption_is_detected_resent_and_answer_unchanged(stack, kind, counter):
    p = PROMPTS[3]["messages"]
    clean = await stack["client"].complete(p, max_new_tokens=16)
    with tampered(stack, flip_first_transmission(kind)):
        dirty = await stack["client"].complete(p, max_new_tokens=16)
    assert dirty.sent_bytes[counter] == 1
    assert dirty.output_token_ids == clean.output_token_ids


async def test_persistent_chunk_corruption_is_data_loss(stack):
    def always(item, attempt):
        return replace(item, crc32c=item.crc32c ^ 1) if isinstance(item, wire.Chunk) else item

    with tampered(stack, always), pytest.raises(TandemClientError) as e:
        await stack["client"].complete(PROMPTS[1]["messages"], max_new_tokens=4)
    assert e.value.code == grpc.StatusCode.DATA_LOSS


async def generate_raw(stack, msgs: list[pb.Uplink]) -> grpc.StatusCode:
    async with cloud_channel(stack) as ch:
        call = pb_grpc.CloudStub(ch).Generate(iter(msgs), metadata=edge_metadata(stack))
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as e:
            return e.code()
        return grpc.StatusCode.OK


async def test_bad_uplink_gets_clear_status_and_spares_other_sessions(stack, tokenizer):
    gw = stack["gateway"]
    v = gw.params.params_version
    ok_ids = prompt_ids(tokenizer, PROMPTS[1])
    sp = pb.SamplingParams(max_new_tokens=4)

    def header(**kw):
        base = dict(
            request_id="r", session_id="victim", params_version=v, split_layer=0, prompt_token_ids=ok_ids, sampling=sp
        )
        return pb.Uplink(header=pb.RequestHeader(**{**base, **kw}))

    session = f"keep-{uuid.uuid4().hex}"
    first = await stack["client"].complete(PROMPTS[1]["messages"], max_new_tokens=8, session_id=session)
    cases = {
        grpc.StatusCode.INVALID_ARGUMENT: [
            [pb.Uplink(commit=pb.Commit())],  # no header first
            [header(prompt_token_ids=[10**6])],  # token id beyond the vocabulary
            [header(prompt_token_ids=[])],  # empty prompt
            [header(sampling=pb.SamplingParams(max_new_tokens=10**6))],  # beyond negotiated max_new_tokens
            [header(split_layer=7)],  # a split this cloud does not serve
            [header(split_layer=gw.manifest.split_layer, num_chunks=99)],  # chunk count inconsistent
            [
                header(split_layer=gw.manifest.split_layer, num_chunks=1),  # chunk outside the prompt
                pb.Uplink(chunk=pb.ActivationChunk(seq=0, token_offset=5000, num_tokens=1, wire_dtype=1, codec=1)),
            ],
            [header(split_layer=gw.manifest.split_layer, num_chunks=1)],  # uplink ends early
        ],
        grpc.StatusCode.FAILED_PRECONDITION: [
            [header(params_version=v + 10**6)],  # a version this link never had (the controller may add v+1)
            [  # the session's first 3 tokens are other ids than the header's
                header(
                    split_layer=gw.manifest.split_layer,
                    session_id=keyed_session_id(stack, session),
                    prompt_token_ids=[ok_ids[0] + 1, *ok_ids[1:]],
                    cached_tokens=3,
                    num_chunks=1,
                )
            ],
        ],
        grpc.StatusCode.NOT_FOUND: [  # the app's session id outside its key's namespace names nothing
            [header(split_layer=gw.manifest.split_layer, session_id=session, cached_tokens=3, num_chunks=1)],
        ],
    }
    for code, bad in cases.items():
        for i, msgs in enumerate(bad):
            got = await generate_raw(stack, msgs)
            assert got == code, f"case {i} of {code.name}: got {got.name}"
    # the session that was running before is intact: its next turn still loads only new tokens
    messages = PROMPTS[1]["messages"] + [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = await stack["client"].complete(messages, max_new_tokens=8, session_id=session)
    assert second.head_tokens < second.prompt_tokens and second.output_tokens > 0


async def test_concurrent_requests_all_complete(stack):
    """Six concurrent requests all complete, each running exactly one head row."""
    client = stack["client"]
    batchers = [h.batcher for h in stack["edge"].node.heads.values()]
    rows_before = sum(b.rows_run for b in batchers)
    results = await asyncio.gather(
        *[
            client.complete([{"role": "user", "content": f"Count from {i} to {i + 5}."}], max_new_tokens=12)
            for i in range(6)
        ]
    )
    assert all(r.output_tokens > 0 for r in results)
    assert sum(b.rows_run for b in batchers) - rows_before == 6  # one head row per request, whichever k


async def test_direct_mode_matches_split(stack):
    p = PROMPTS[2]["messages"]
    split = await stack["client"].complete(p, max_new_tokens=MAX_NEW, mode="split")
    direct = await stack["client"].complete(p, max_new_tokens=MAX_NEW, mode="direct")
    assert direct.split_layer == 0 and direct.external_tokens == 0 and direct.head_tokens == 0
    assert split.output_token_ids == direct.output_token_ids


def rewrite_activations(fn):
    """Tamper hook: replace every chunk's values (CRC recomputed, so it arrives 'intact')."""

    def tamper(item, attempt: int):
        if not isinstance(item, wire.Chunk):
            return item
        h = np.frombuffer(item.payload, np.float32).reshape(item.num_tokens, -1)
        return rechunk(item, fn(h))

    return tamper


async def test_garbage_upload_cannot_poison_other_sessions(stack):
    """Intact but wrong activations only ever affect the uploader's own request: block ids are
    scoped to the session, so the same prompt in another session is computed from its own upload."""
    p = PROMPTS[2]["messages"]
    clean = await stack["client"].complete(p, max_new_tokens=16, session_id=f"victim-{uuid.uuid4().hex}")
    rng = np.random.default_rng(0)
    with tampered(stack, rewrite_activations(lambda h: rng.standard_normal(h.shape) * 50)):
        garbage = await stack["client"].complete(p, max_new_tokens=16, session_id="attacker")
    assert garbage.output_token_ids != clean.output_token_ids  # the attacker did get garbage in
    for session in (None, f"victim2-{uuid.uuid4().hex}"):
        again = await stack["client"].complete(p, max_new_tokens=16, session_id=session)
        assert again.output_token_ids == clean.output_token_ids


async def test_nan_activations_are_invalid_argument(stack):
    nan_at_7 = rewrite_activations(lambda h: np.where(np.arange(h.size).reshape(h.shape) == 7, np.nan, h))
    with tampered(stack, nan_at_7), pytest.raises(TandemClientError) as e:
        await stack["client"].complete(PROMPTS[1]["messages"], max_new_tokens=4)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in e.value.details
    ok = await stack["client"].complete(PROMPTS[1]["messages"], max_new_tokens=8)
    assert ok.output_tokens > 0 and ok.text.strip()


async def test_stalled_uploads_neither_lock_out_the_session_nor_hang(stack, tokenizer):
    """Two streams send a valid header for a session and then nothing; the session's
    owner is served meanwhile, and a stalled stream ends at its deadline with DEADLINE_EXCEEDED."""
    gw, session = stack["gateway"], f"stalled-{uuid.uuid4().hex}"
    await stack["client"].complete(PROMPTS[1]["messages"], max_new_tokens=4, session_id=session)
    ids = prompt_ids(tokenizer, PROMPTS[1])
    header = pb.RequestHeader(
        request_id="stall",
        session_id=keyed_session_id(stack, session),  # the edge's session, as the edge names it
        params_version=gw.params.params_version,
        split_layer=gw.manifest.split_layer,
        prompt_token_ids=ids,
        num_chunks=1,
        num_kv_blocks=len(ids) // 32,
        sampling=pb.SamplingParams(max_new_tokens=4),
    )

    async def stall():
        yield pb.Uplink(header=header)
        await asyncio.sleep(60)

    async def stalled_call(ch, timeout_s):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in pb_grpc.CloudStub(ch).Generate(stall(), timeout=timeout_s, metadata=edge_metadata(stack)):
                pass
        return e.value.code()

    async with cloud_channel(stack) as ch:
        stalls = [asyncio.create_task(stalled_call(ch, t)) for t in (20.0, 20.0)]
        await asyncio.sleep(0.5)
        messages = PROMPTS[1]["messages"] + [
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "Why?"},
        ]
        res = await stack["client"].complete(messages, max_new_tokens=4, session_id=session)
        assert res.output_tokens > 0 and not any(t.done() for t in stalls)
        assert await stalled_call(ch, 2.0) == grpc.StatusCode.DEADLINE_EXCEEDED
        for t in stalls:
            t.cancel()
        await asyncio.gather(*stalls, return_exceptions=True)


async def test_cloud_restart_mid_session_loses_no_turn(stack, hf_model, tokenizer):
    """Two turns, restart the cloud (same store), a third turn through
    the same edge: the edge renegotiates, syncs the session with the new instance (SyncSession), and
    sends only the new tokens: the restarted cloud serves the rest from its store. The client gets
    the reference answer."""
    client, session = stack["client"], f"restart-{uuid.uuid4().hex}"
    messages = [{"role": "user", "content": LONG + "What is this text about?"}]
    for turn in range(3):
        if turn == 2:
            await restart_cloud(stack)
        res = await client.complete(messages, max_new_tokens=12, session_id=session)
        if turn == 0:
            per_token = res.sent_bytes["activations"] / res.prompt_tokens
        if turn == 1:
            held = res.prompt_tokens
        messages += [{"role": "assistant", "content": res.text}, {"role": "user", "content": "Say more."}]
    ids = prompt_ids(tokenizer, {"messages": messages[:-2]})
    ref, gaps = hf_greedy(hf_model, ids, 12)
    assert_same_or_near_tie(list(res.output_token_ids), ref, gaps, "turn 3 after a cloud restart")
    assert res.head_tokens < res.prompt_tokens  # the edge kept its head work
    sent_tokens = res.sent_bytes["activations"] / per_token
    assert sent_tokens < res.prompt_tokens - held + 2, (sent_tokens, res.prompt_tokens, held)


async def test_a_turn_resumes_across_a_cloud_restart_mid_decode(stack, hf_model, tokenizer):
    """The cloud process goes away after some tokens reached the client (its
    server stops, every stream cut) and comes back with the same store: the edge waits for it,
    syncs the session and continues from the prompt plus the tokens emitted. The client's one
    stream holds each token once and equals the reference's."""
    client, session = stack["client"], f"resume-{uuid.uuid4().hex}"
    messages = [{"role": "user", "content": LONG + "Retell this text in your own words, at length."}]
    ids = prompt_ids(tokenizer, {"messages": messages})
    stream = client.chat(messages, max_new_tokens=64, session_id=session, ignore_eos=True)
    streamed: list[int] = []
    text = ""
    async for delta in stream:
        streamed += delta.token_ids
        text += delta.text
        if len(streamed) >= 4 and stack["cloud"] is not None and not stack.get("resumed"):
            stack["resumed"] = True
            await restart_cloud(stack)
    stack.pop("resumed")
    res = stream.result
    assert res.resumes == 1 and res.output_tokens == len(res.output_token_ids) == 64
    # what the client read is the whole output once (deltas carry the ids of tokens with text only)
    assert text == tokenizer.decode(list(res.output_token_ids), skip_special_tokens=True)
    ref, gaps = hf_greedy(hf_model, ids, 64)
    got = list(res.output_token_ids)[: len(ref)]  # the reference stops at end-of-sequence; this ignores it
    assert_same_or_near_tie(got, ref, gaps, "a resumed turn")


async def test_a_session_moves_to_another_replica_when_its_replica_dies(stack, hf_model, tokenizer):
    """A second cloud replica (its own gateway, port and instance; the same Redis
    block store; in this test it shares the first one's engine processes) and an edge configured
    with both. The session's replica is stopped between turns: the next turn moves to the other,
    which loads the session from Redis, syncs by root, receives only the new tokens, and answers
    with the reference tokens."""
    from tandem.cloud.server import create_cloud
    from tandem.edge.server import create_edge

    replica_b = await create_cloud(
        stack["cfg"].model_copy(update={"port": 0, "cloud_id": "replica-b"}), stack["engines"]
    )
    a_target = f"127.0.0.1:{stack['cloud_port']}"
    edge_cfg = stack["edge_cfg"].model_copy(update={"cloud_replicas": [f"127.0.0.1:{replica_b.port}"], "port": 0})
    edge = await create_edge(edge_cfg)
    client = SplitClient(f"127.0.0.1:{edge.port}", ca_file=stack["tls"].ca_file, api_key=stack["tls"].app_key)
    stopped_a = False
    try:
        assert await edge.node.conn.wait_connected(30)
        assert [t for t, up in edge.node.conn.status()] == [a_target, f"127.0.0.1:{replica_b.port}"]
        session = f"move-{uuid.uuid4().hex}"
        messages = [{"role": "user", "content": LONG + "What is this text about?"}]
        first = await client.complete(messages, max_new_tokens=8, session_id=session)
        first_ids = prompt_ids(tokenizer, {"messages": messages})

        def holds(gw) -> bool:
            return any((s := gw.sessions.get(k)) is not None and s.token_ids == first_ids for k in gw.sessions.keys())

        gateways = {"a": stack["gateway"], "b": replica_b.gateway}
        (home,) = [name for name, gw in gateways.items() if holds(gw)]
        if home == "a":
            await stack["cloud"].stop(0)
            stopped_a = True
        else:
            await replica_b.stop(0)
        other = gateways["b" if home == "a" else "a"]
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Say more."}]
        res = await client.complete(messages, max_new_tokens=12, session_id=session)
        ids = prompt_ids(tokenizer, {"messages": messages})
        ref, gaps = hf_greedy(hf_model, ids, 12)
        assert_same_or_near_tie(list(res.output_token_ids), ref, gaps, f"turn 2 after replica {home} died")
        assert any(s.token_ids == ids for k in other.sessions.keys() if (s := other.sessions.get(k)) is not None)
        per_token = first.sent_bytes["activations"] / first.prompt_tokens
        assert res.sent_bytes["activations"] / per_token < len(ids) - len(first_ids) + 2, res.sent_bytes
    finally:
        await client.close()
        await edge.stop(0)
        await replica_b.stop(0)
        if stopped_a:  # bring the stack's cloud back, and its edge with it, before the next test
            await restart_cloud(stack)
            conn = stack["edge"].node.conn
            conn.renegotiate_soon("the test restarted the cloud")
            assert await conn.wait_connected(60)


async def test_a_corrupt_kv_block_in_the_store_is_recomputed_never_served(stack, hf_model, tokenizer):
    """Every head KV block of a session flipped by one bit on disk: the engines'
    connectors read them as missing (the BLAKE3 seal fails) and vLLM recomputes them; the next
    turn's answer is the reference's."""
    from tandem.common.wire.kvblocks import LayerRange, part_key

    client, session = stack["client"], f"corrupt-{uuid.uuid4().hex}"
    messages = [{"role": "user", "content": LONG + "What is this text about?"}]
    res = await client.complete(messages, max_new_tokens=8, session_id=session)
    gw = stack["gateway"]
    first_ids = prompt_ids(tokenizer, {"messages": messages})
    cloud = next(s for k in gw.sessions.keys() if (s := gw.sessions.get(k)).token_ids == first_ids)
    for leaf in cloud.leaves:
        assert gw.store.corrupt_for_test(part_key(leaf, LayerRange(lo=0, hi=4)), 1000)
    before = gw.store.corrupt_reads
    messages += [{"role": "assistant", "content": res.text}, {"role": "user", "content": "Say more."}]
    res = await client.complete(messages, max_new_tokens=12, session_id=session)
    ids = prompt_ids(tokenizer, {"messages": messages})
    ref, gaps = hf_greedy(hf_model, ids, 12)
    assert_same_or_near_tie(list(res.output_token_ids), ref, gaps, "after corrupting the session's KV at rest")
    assert not any(gw.store.contains(part_key(leaf, LayerRange(lo=0, hi=4))) for leaf in cloud.leaves[:1])
    assert gw.store.corrupt_reads == before  # the readers were the engines' connectors, in their processes


async def test_an_edit_and_a_regeneration_resend_only_what_changed(stack, hf_model, tokenizer):
    """Editing the end of a long message, then regenerating the answer, sends only
    the activations past the edit (one token for the regeneration) and the KV blocks that hold them;
    both answers are the reference's."""
    client, session = stack["client"], f"edit-{uuid.uuid4().hex}"
    first = await client.complete(
        [{"role": "user", "content": LONG + "What is this about?"}], max_new_tokens=8, session_id=session
    )
    edited = [{"role": "user", "content": LONG + "Who made the first printing press?"}]
    ids = prompt_ids(tokenizer, {"messages": edited})
    per_token = first.sent_bytes["activations"] / first.prompt_tokens
    ref, gaps = hf_greedy(hf_model, ids, 8)
    for what in ("edit", "regeneration"):
        res = await client.complete(edited, max_new_tokens=8, session_id=session)
        assert_same_or_near_tie(list(res.output_token_ids), ref, gaps, what)
        sent_tokens = res.sent_bytes["activations"] / per_token
        assert sent_tokens < (20 if what == "edit" else 2), (what, res.sent_bytes, first.sent_bytes)
        assert res.sent_bytes["kv"] <= first.sent_bytes["kv"] / (first.prompt_tokens // 32) * 2.01, what
        assert res.external_tokens == len(ids) // 32 * 32


async def test_resend_from_token_0_never_reuses_tail_kv_of_other_activations(stack, tokenizer):
    """In one session, ids X with X's activations; then, from token 0, the same ids X
    with the activations of another prompt Y: the answer equals a cold (stateless) request with ids X
    and Y's activations; the tail KV of the first upload is never loaded for it."""
    from tandem.edge.compute.head import HeadInput

    svc, client, session = stack["edge"].node, stack["client"], f"tailkv-{uuid.uuid4().hex}"
    x = PROMPTS[3]["messages"]
    y_ids = prompt_ids(tokenizer, {"prompt": LONG.upper() + LONG})
    y_hidden = (await svc.heads[4].batcher.run(HeadInput(np.asarray(y_ids, np.int64)))).hidden

    def to_y(item, attempt):
        if isinstance(item, wire.Chunk):
            return rechunk(item, y_hidden[item.token_offset : item.token_offset + item.num_tokens])
        return item

    honest = await client.complete(x, max_new_tokens=12, session_id=session)
    svc.sessions.discard(keyed_session_id(stack, session))  # the edge lost its session state: it resends from token 0
    with tampered(stack, to_y):
        resent = await client.complete(x, max_new_tokens=12, session_id=session)
        cold = await client.complete(x, max_new_tokens=12)
    assert resent.head_tokens == resent.prompt_tokens
    assert resent.output_token_ids == cold.output_token_ids
    assert resent.output_token_ids != honest.output_token_ids  # Y's activations did reach the tail


# ---------------------------------------------------------------- modes, split layers, auto


async def test_the_edge_reports_every_mode_and_both_split_layers(stack):
    info = await stack["client"].info()
    assert set(info.modes) == {"local", "split", "direct", "remote_prefill"} and info.split_layers == (4, 8)
    assert info.cloud_connected and info.degraded == ""


@pytest.mark.parametrize("idx", [0, 2, 3])
async def test_local_mode_equals_the_unsplit_reference(stack, hf_model, tokenizer, idx):
    p = PROMPTS[idx]
    ids = prompt_ids(tokenizer, p)
    res = await stack["client"].complete(p.get("messages"), prompt=p.get("prompt"), max_new_tokens=16, mode="local")
    ref, gaps = hf_greedy(hf_model, ids, 16)
    assert_same_or_near_tie(list(res.output_token_ids), ref, gaps, "local vs HF")
    assert (res.mode, res.split_layer, res.head_tokens, res.sent_bytes, res.params_version) == ("local", 0, 0, {}, 0)
    assert res.ttft_ms > 0 and res.mode_reason == "requested"


async def test_split_at_k8_equals_the_reference_and_a_session_may_change_its_split_layer(stack, hf_model, tokenizer):
    client, session = stack["client"], f"k8-{uuid.uuid4().hex}"
    messages = [{"role": "user", "content": "Name a famous bridge in San Francisco."}]
    first = await client.complete(messages, max_new_tokens=12, session_id=session, split_layer=8)
    ref, gaps = hf_greedy(hf_model, prompt_ids(tokenizer, {"messages": messages}), 12)
    assert_same_or_near_tie(list(first.output_token_ids), ref, gaps, "split k=8 vs HF")
    assert first.split_layer == 8 and first.head_tokens == first.prompt_tokens
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "How long is it?"}]
    second = await client.complete(messages, max_new_tokens=12, session_id=session, split_layer=4)
    ref, gaps = hf_greedy(hf_model, prompt_ids(tokenizer, {"messages": messages}), 12)
    assert_same_or_near_tie(list(second.output_token_ids), ref, gaps, "split k=4 after k=8 vs HF")
    assert second.split_layer == 4 and second.head_tokens == second.prompt_tokens  # another head: start over


async def test_auto_mode_reports_its_choice_and_serves_the_reference(stack, hf_model, tokenizer):
    """Auto picks per request; whichever mode it picks, greedy tokens equal the reference, and the
    result names the mode, the prediction and the measured TTFT."""
    modes = set()
    for p in PROMPTS:
        ids = prompt_ids(tokenizer, p)
        res = await stack["client"].complete(p.get("messages"), prompt=p.get("prompt"), max_new_tokens=12, mode="auto")
        ref, gaps = hf_greedy(hf_model, ids, 12)
        assert_same_or_near_tie(list(res.output_token_ids), ref, gaps, f"auto ({res.mode}) vs HF")
        assert res.mode in ("local", "split", "direct") and res.mode_reason.startswith("auto")
        assert res.predicted_ttft_ms > 0 and res.ttft_ms > 0
        modes.add(res.mode)
    assert modes


async def test_an_edge_starts_without_its_cloud_serves_local_and_splits_once_the_cloud_is_up(stack, split_dir):
    """No fragile start-up. The edge starts against a port nobody serves yet (local
    mode, degraded), then a cloud appears there: the edge negotiates and serves split."""
    import socket

    from tandem.cloud.server import create_cloud
    from tandem.edge.server import create_edge

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = stack["edge_cfg"].model_copy(
        update=dict(extra_split_dirs=[], cloud_target=f"127.0.0.1:{port}", connect_timeout_s=0.5, poll_s=0.5)
    )
    edge = await create_edge(cfg)
    second = None
    try:
        async with AsyncClient(
            f"127.0.0.1:{edge.port}", ca_file=stack["tls"].ca_file, api_key=stack["tls"].app_key
        ) as c:
            info = await c.info()
            assert info.modes == ("local",) and not info.cloud_connected and "not connected" in info.degraded
            res = await c.complete(PROMPTS[1]["messages"], max_new_tokens=4)
            assert res.mode == "local"
            with pytest.raises(TandemClientError) as e:
                await c.complete(PROMPTS[1]["messages"], max_new_tokens=4, mode="split")
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
            second = await create_cloud(stack["cfg"].model_copy(update={"port": port}), stack["engines"])
            assert await edge.node.conn.wait_connected(30)
            res = await c.complete(PROMPTS[1]["messages"], max_new_tokens=4, mode="split")
            assert res.mode == "split" and res.split_layer == 4
    finally:
        await edge.stop(1)
        if second is not None:
            await second.stop(0)


async def test_capacity_benchmark_smoke(stack, split_dir, tmp_path):
    """``tandem-bench capacity`` with tiny arguments against this run's running edge (``--edge-target``:
    no engines of its own), so the script does not rot; its numbers mean nothing here."""
    import subprocess
    from pathlib import Path

    out, tls = tmp_path / "capacity", stack["tls"]
    cmd = [
        TANDEM_BENCH, "capacity", "--model-dir", str(split_dir.parent),
        "--edge-target", f"127.0.0.1:{stack['edge'].port}", "--ca-file", str(tls.ca_file), "--api-key", tls.app_key,
        "--split-layers", "4", "--rates", "2", "--requests", "2", "--prompt-tokens", "32",
        "--max-new-tokens", "2", "--out", str(out),
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).parents[2]
    )
    so, se = await asyncio.wait_for(proc.communicate(), 600)
    assert proc.returncode == 0, se.decode()[-3000:]
    md = (out / "capacity.md").read_text()
    for mode in ("cloud-only", "split-k4", "edge-only", "remote-prefill", "auto"):
        assert f"| {mode} | 2 | 2 | 2 |" in md, md  # every request served
    assert "auto at least the best fixed mode's goodput at" in md
    samples = json.loads((out / "capacity.json").read_text())["samples"]
    assert {s["served_mode"] for s in samples if s["mode"] == "split-k4"} == {"split"}
    assert (out / "capacity.png").stat().st_size > 0
