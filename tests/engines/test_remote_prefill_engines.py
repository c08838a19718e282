"""Remote prefill on the real system on CPU: vLLM's decode engine prefills (its connector saving
every layer of the prompt's full blocks), the gateway streams tokens and the KV down over grpc.aio
on loopback (the engines tier's shared stack, ``tests/engines/conftest.py``), the edge verifies it
and takes the decode over on ``edge-full.onnx``. In fp32 (engine, KV wire format) the greedy tokens
must equal direct mode's and local mode's; where they part, the parting token must be a near-tie of
the unsplit HF model (top-2 log-prob gap < 1e-3). Faults: the downlink cut mid-KV, a corrupt block,
the cloud gone after the takeover, the edge restarted between turns."""

from __future__ import annotations

import contextlib
import uuid

import pytest

from tandem.common.protocol.errors import LinkLost
from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import Sampling
from tandem.common.wire.kvcodec import KVBlock
from tandem.common.wire.kvdown import Takeover
from tandem.edge.events import ChatTurn, TextOut, TurnDone
from tandem.edge.routing.occupancy import PromptKV
from tandem.stages import Stage
from tests.references import LONG, PROMPTS, assert_same_or_near_tie, hf_greedy, prompt_ids
from tests.remote_doubles import DownTamperLink

pytestmark = [pytest.mark.engines]
MAX_NEW = 32


def turn(p: dict, mode: Mode, session: str = "", n: int = MAX_NEW) -> ChatTurn:
    msgs = tuple((m["role"], m["content"]) for m in p.get("messages", ()))
    return ChatTurn(
        messages=msgs, prompt=p.get("prompt", ""), session_id=session, sampling=Sampling(max_new_tokens=n), mode=mode
    )


async def stream(node, t: ChatTurn) -> tuple[list[int], TurnDone]:
    """The turn's output tokens and its ``TurnDone``; the tokens streamed with text are the same,
    in order (a last end-of-sequence token has no text)."""
    streamed, done = [], None
    async for ev in node.chat(t):
        if isinstance(ev, TextOut):
            streamed += ev.token_ids
        else:
            done = ev
    assert done is not None
    out = list(done.output_token_ids)
    assert streamed == out[: len(streamed)] and len(out) - len(streamed) <= 1
    return out, done


@contextlib.contextmanager
def tampered(stack, **kw):
    conn = stack["edge"].node.conn
    inner = conn.link
    conn.link = link = DownTamperLink(inner, **kw)
    try:
        yield link
    finally:
        conn.link = inner


async def test_remote_prefill_equals_direct_and_local(stack, hf_model, tokenizer):
    """Every prompt: remote prefill's streamed tokens (the cloud's, then the edge's) against direct,
    local and the HF reference; the edge took over for the prompts with at least one full block
    (where the cloud decoded the whole short reply before the edge had adopted the KV, as on a host
    under load, a reply 8x longer, whose start must match the reference too, shows the takeover)."""
    node, exact = stack["edge"].node, 0
    for i, p in enumerate(PROMPTS):
        direct, d_done = await stream(node, turn(p, Mode.DIRECT))
        local, _ = await stream(node, turn(p, Mode.LOCAL))
        got, done = await stream(node, turn(p, Mode.REMOTE_PREFILL))
        assert done.mode is Mode.REMOTE_PREFILL
        ref, gaps = hf_greedy(hf_model, prompt_ids(tokenizer, p), MAX_NEW)
        for name, toks in (("remote prefill", got), ("direct", direct), ("local", local)):
            assert_same_or_near_tie(toks, ref, gaps, f"prompt {i}: {name} vs HF")
        exact += got == direct == local
        if done.edge_decoded_tokens == 0:  # the cloud decoded all MAX_NEW before the KV was adopted (a loaded host)
            longer, done = await stream(node, turn(p, Mode.REMOTE_PREFILL, n=8 * MAX_NEW))
            assert_same_or_near_tie(longer[:MAX_NEW], ref, gaps, f"prompt {i}: a longer remote prefill vs HF")
        assert done.edge_decoded_tokens > 0, f"prompt {i}: the edge never took over ({done.timings})"
        t = {k.value: round(v, 1) for k, v in done.timings.items()}
        direct_ms = d_done.timings.get(Stage.CLOUD_DECODE, 0.0)
        print(
            f"prompt {i}: {done.prompt_tokens} tokens, {done.received_kv_bytes} KV bytes down, "
            f"{done.edge_decoded_tokens} decoded on the edge; direct's cloud_decode_ms {direct_ms:.1f}; {t}"
        )
    print(f"remote prefill == direct == local on {exact} of {len(PROMPTS)} prompts")
    assert exact >= len(PROMPTS) - 1


@pytest.mark.parametrize("policy", [PromptKV.COMPUTE, PromptKV.AUTO])
async def test_a_prompt_computed_on_the_edge_beside_the_clouds_prefill_gives_directs_reply(stack, policy):
    """The edge runs the prompt itself beside the cloud's prefill (``compute``: no block comes down;
    ``auto``: the cost model's split of computed and downloaded blocks, whatever it is here), then
    takes the decode over (a reply 4x longer than direct's here, so that it does on a loaded host):
    its start equals direct mode's reply."""
    node, p = stack["edge"].node, PROMPTS[3]
    direct, _ = await stream(node, turn(p, Mode.DIRECT))
    occupancy = node.router.occupancy
    occupancy.prompt_kv = policy
    try:
        got, done = await stream(node, turn(p, Mode.REMOTE_PREFILL, n=4 * MAX_NEW))
    finally:
        occupancy.prompt_kv = PromptKV.DOWNLOAD
    assert got[:MAX_NEW] == direct[:MAX_NEW] and done.edge_decoded_tokens > 0
    if policy is PromptKV.COMPUTE:
        assert done.received_kv_bytes == 0 and done.timings[Stage.EDGE_PREFILL] > 0
    print(f"{policy}: {done.received_kv_bytes} KV bytes down, {done.edge_decoded_tokens} decoded on the edge")


async def test_a_two_turn_chat_brings_down_only_the_new_blocks(stack, tokenizer):
    node, session = stack["edge"].node, f"chat-{uuid.uuid4().hex}"
    first = {"messages": [{"role": "user", "content": LONG + "Summarise this text in two sentences."}]}
    got1, done1 = await stream(node, turn(first, Mode.REMOTE_PREFILL, session))
    second = {
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": tokenizer.decode(got1, skip_special_tokens=True)},
            {"role": "user", "content": "Now in one sentence."},
        ]
    }
    direct, _ = await stream(node, turn(second, Mode.DIRECT))
    got2, done2 = await stream(node, turn(second, Mode.REMOTE_PREFILL, session))
    assert got2 == direct
    print(
        f"turn 2: {done2.prompt_tokens} tokens, {done2.received_kv_bytes} KV bytes down, timings "
        f"{ {k.value: round(v, 1) for k, v in done2.timings.items()} }"
    )
    n1, n2 = (len(prompt_ids(tokenizer, p)) // 32 for p in (first, second))
    per_block = done1.received_kv_bytes // n1
    assert done2.received_kv_bytes <= (n2 - n1) * per_block  # only blocks past what the edge holds
    # the cloud's prefill loaded turn 1's stored blocks, whether the edge took over or the cloud finished
    assert done2.external_tokens == n1 * 32 > 0


async def test_a_downlink_cut_mid_kv_leaves_the_reply_to_the_cloud(stack):
    node, p = stack["edge"].node, PROMPTS[3]
    direct, _ = await stream(node, turn(p, Mode.DIRECT))
    with tampered(stack, down=lambda ev, n: None if isinstance(ev, KVBlock) and n > 2 else ev):
        got, done = await stream(node, turn(p, Mode.REMOTE_PREFILL))
    assert got == direct and done.edge_decoded_tokens == 0 and done.finish_reason == "length"


async def test_a_corrupt_block_is_asked_again_and_never_used(stack):
    node, p = stack["edge"].node, PROMPTS[3]
    direct, _ = await stream(node, turn(p, Mode.DIRECT))

    def corrupt_once(ev, n):
        if isinstance(ev, KVBlock) and n == 2:
            return type(ev)(**{**ev.__dict__, "payload": bytes([ev.payload[0] ^ 0xFF]) + ev.payload[1:]})
        return ev

    with tampered(stack, down=corrupt_once) as link:
        got, done = await stream(node, turn(p, Mode.REMOTE_PREFILL))
    resends = [a for a in link.sent if getattr(a, "resend_blocks", ())]
    assert len(resends) == 1 and got == direct and done.edge_decoded_tokens > 0


async def test_the_reply_completes_on_the_edge_when_the_cloud_goes_after_the_takeover(stack):
    node, p = stack["edge"].node, PROMPTS[3]
    direct, _ = await stream(node, turn(p, Mode.DIRECT))

    def gone(item):
        if isinstance(item, Takeover):
            raise LinkLost("the cloud went away after the takeover")
        return item

    with tampered(stack, up=gone):
        got, done = await stream(node, turn(p, Mode.REMOTE_PREFILL))
    assert got == direct and done.edge_decoded_tokens > 0


async def test_a_restarted_edge_resyncs_its_session(stack, tokenizer):
    """The edge loses its sessions (a restart): the next turn brings down every block again, from
    the cloud's store, and the reply is unchanged."""
    node, session = stack["edge"].node, f"chat-{uuid.uuid4().hex}"
    p = PROMPTS[3]
    _, first = await stream(node, turn(p, Mode.REMOTE_PREFILL, session))
    node.local.sessions.clear()
    direct, _ = await stream(node, turn(p, Mode.DIRECT))
    got, again = await stream(node, turn(p, Mode.REMOTE_PREFILL, session))
    assert got == direct and again.received_kv_bytes == first.received_kv_bytes > 0
