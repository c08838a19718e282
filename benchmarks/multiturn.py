"""``tandem-bench multiturn``: bytes on the uplink over multi-turn chats, delta-KV against a
naive resend of the whole history every turn.

One ``tandem-cloud`` (real vLLM engines) and one ``tandem-edge``, child processes on this
machine. Each conversation (``--conversations`` of them, ``--turns`` turns each; the user
messages are fixed, the assistant's are the model's own greedy replies) runs twice per turn,
both in split mode at ``--split-layer``:

* **delta**: the conversation's session id: the edge sends only the activations and KV blocks
  the cloud's session lacks (``TurnHeader.cached_tokens``, Merkle leaves already held);
* **naive**: the same messages without a session (stateless): everything, every turn. This is
  what a system without a delta sync sends, measured here rather than computed.

Both replies must be equal (greedy; a difference is reported). The figure: cumulative uplink
bytes (activations + KV blocks + headers, as sent) per turn, per mode, and the saving at the
last turn; the target is at least 80% saved over 10 turns (the seed article claims 62%).

Writes into ``--out``: ``multiturn.md`` (per-turn table), ``multiturn.json`` and ``multiturn.png``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from tandem.daemons import Daemons, cloud_command, edge_command, work_dir

app = typer.Typer(add_completion=False, help=__doc__)

BAR_SAVED = 0.80
OPENERS = [
    "I am planning a small vegetable garden on a sunny balcony. Where should I start?",
    "Explain how a refrigerator keeps food cold, for someone with no physics background.",
    "Help me write a short story about a lighthouse keeper who finds a message in a bottle.",
]
FOLLOW_UPS = [
    "Can you say more about that?",
    "What would you do first, and why?",
    "Give me a concrete example.",
    "What are the most common mistakes?",
    "How long does that usually take?",
    "Summarise what we said so far in two sentences.",
    "What else should I keep in mind?",
    "Is there a cheaper way to do it?",
    "Thanks. One last question: what is the single most important point?",
]


def sent_total(sent: dict[str, int]) -> int:
    return sum(sent.get(k, 0) for k in ("activations", "kv", "header"))


async def run_conversations(port: int, conversations: int, turns: int, max_new: int, split_layer: int, bar) -> list:
    """Per conversation, per turn: prompt tokens, delta and naive uplink bytes, replies equal."""
    import uuid

    from tandem import AsyncClient
    from tandem.client import ChatOptions

    rows = []
    async with AsyncClient(f"127.0.0.1:{port}") as client:
        for c in range(conversations):
            session = f"multiturn-{c}-{uuid.uuid4().hex[:8]}"
            messages = [{"role": "user", "content": OPENERS[c % len(OPENERS)]}]
            for t in range(turns):
                kw: ChatOptions = {"max_new_tokens": max_new, "mode": "split", "split_layer": split_layer}
                in_session: ChatOptions = {**kw, "session_id": session}
                delta = await client.complete(messages, **in_session)
                naive = await client.complete(messages, **kw)
                rows.append(
                    {
                        "conversation": c,
                        "turn": t + 1,
                        "prompt_tokens": delta.prompt_tokens,
                        "delta_bytes": sent_total(delta.sent_bytes),
                        "naive_bytes": sent_total(naive.sent_bytes),
                        "delta_head_tokens": delta.head_tokens,
                        "same_reply": list(delta.output_token_ids) == list(naive.output_token_ids),
                    }
                )
                bar.update(1)
                messages += [
                    {"role": "assistant", "content": delta.text},
                    {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]},
                ]
    return rows


def summarise(rows: list[dict], turns: int) -> list[dict]:
    """Per turn, over conversations: mean prompt tokens, cumulative delta and naive bytes, saving."""
    out, cum_d, cum_n = [], 0.0, 0.0
    n_conv = len({r["conversation"] for r in rows})
    for t in range(1, turns + 1):
        at = [r for r in rows if r["turn"] == t]
        cum_d += sum(r["delta_bytes"] for r in at) / n_conv
        cum_n += sum(r["naive_bytes"] for r in at) / n_conv
        out.append(
            {
                "turn": t,
                "prompt_tokens": sum(r["prompt_tokens"] for r in at) / n_conv,
                "delta_bytes": sum(r["delta_bytes"] for r in at) / n_conv,
                "naive_bytes": sum(r["naive_bytes"] for r in at) / n_conv,
                "cum_delta_bytes": cum_d,
                "cum_naive_bytes": cum_n,
                "saved": 1 - cum_d / cum_n if cum_n else 0.0,
                "same_replies": all(r["same_reply"] for r in at),
            }
        )
    return out


def plot(path: Path, per_turn: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r["turn"] for r in per_turn]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(turns, [r["cum_naive_bytes"] / 1e6 for r in per_turn], "o-", label="naive: whole history every turn")
    a.plot(turns, [r["cum_delta_bytes"] / 1e6 for r in per_turn], "o-", label="tandem delta (session)")
    a.set_xlabel("turn")
    a.set_ylabel("cumulative uplink MB per conversation")
    a.legend()
    a.set_title("uplink bytes over a multi-turn chat")
    b.bar(turns, [100 * r["saved"] for r in per_turn])
    b.axhline(100 * BAR_SAVED, color="k", ls="--", lw=1, label=f"bar: {BAR_SAVED:.0%}")
    b.set_xlabel("turn")
    b.set_ylabel("% of naive bytes saved (cumulative)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@app.command()
def main(
    model_dir: Annotated[Path, typer.Option(help="prepared model directory")] = Path("models/smollm2-135m"),
    split_layer: Annotated[int, typer.Option(help="split layer k (an exported split-k<k> directory)")] = 4,
    conversations: Annotated[int, typer.Option(help="conversations, each with its own opener")] = 3,
    turns: Annotated[int, typer.Option(help="turns per conversation")] = 10,
    max_new_tokens: Annotated[int, typer.Option(help="tokens per reply (greedy; EOS ends a reply)")] = 48,
    out: Annotated[Path, typer.Option(help="output directory")] = Path("bench-results/multiturn"),
    cloud: Annotated[
        str, typer.Option(help="host:port of a running plaintext tandem-cloud that allows fp32 (default: start one)")
    ] = "",
) -> None:
    """Run the conversations with and without a session and write the per-turn table and figure."""
    from tqdm import tqdm

    if conversations < 1 or turns < 1:
        raise typer.BadParameter("--conversations and --turns must be at least 1")
    out.mkdir(parents=True, exist_ok=True)
    w = work_dir("tandem-multiturn-")  # its block stores are removed at exit, its logs kept
    split_dir = model_dir / f"split-k{split_layer}"
    print(f"tandem-bench multiturn: {conversations} x {turns} turns; logs in {w}", file=sys.stderr)
    daemons = Daemons()
    try:
        fp32 = ["--wire-dtypes", "fp32", "--kv-wire-dtypes", "fp32"]  # the table's bytes are fp32's
        if not cloud:
            c = daemons.spawn("tandem-cloud", cloud_command(split_dir, w / "kv", extra=fp32), w / "cloud.log", w / "c")
            cloud = f"127.0.0.1:{c.wait_ready(900)}"
        edge = daemons.spawn("tandem-edge", edge_command(split_dir, cloud, extra=fp32), w / "edge.log", w / "e")
        port = edge.wait_ready(300)
        with tqdm(total=conversations * turns, desc="turns", unit="turn") as bar:
            rows = asyncio.run(run_conversations(port, conversations, turns, max_new_tokens, split_layer, bar))
    finally:
        daemons.stop()
    per_turn = summarise(rows, turns)
    last = per_turn[-1]
    lines = [
        f"{conversations} conversations x {turns} turns, split at k={split_layer}, greedy, up to {max_new_tokens} "
        f"tokens per reply; uplink bytes (activations + KV blocks + headers, fp32) per conversation",
        "",
        "| turn | prompt tokens | delta B | naive B | cumulative delta B | cumulative naive B | saved | "
        "replies equal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in per_turn:
        lines.append(
            f"| {r['turn']} | {r['prompt_tokens']:.0f} | {r['delta_bytes']:,.0f} | {r['naive_bytes']:,.0f} | "
            f"{r['cum_delta_bytes']:,.0f} | {r['cum_naive_bytes']:,.0f} | {100 * r['saved']:.1f}% | "
            f"{'yes' if r['same_replies'] else 'NO'} |"
        )
    verdict = "meets" if last["saved"] >= BAR_SAVED else "misses"
    lines += ["", f"After {turns} turns: {100 * last['saved']:.1f}% of the naive bytes saved ({verdict} the 80% bar)."]
    (out / "multiturn.md").write_text("\n".join(lines) + "\n")
    (out / "multiturn.json").write_text(json.dumps({"rows": rows, "per_turn": per_turn}, indent=1))
    plot(out / "multiturn.png", per_turn)
    print("\n".join(lines))
    print(f"results in {out}: multiturn.md, multiturn.json, multiturn.png", file=sys.stderr)


if __name__ == "__main__":
    app()
