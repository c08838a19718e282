"""``tandem-bench exactness``: remote prefill's greedy replies against direct and local mode's.

One ``tandem-cloud`` (real vLLM engines) and one ``tandem-edge`` (ONNX Runtime), child processes
on this machine, fp32 in the engines and on the wire (activations and KV blocks). Every chat of
the fixed set (``benchmarks/data/fidelity_prompts.jsonl``, 200 chats) runs once per mode, one
request at a time (vLLM's CPU kernels are deterministic for a fixed batch), greedy, up to
``--max-new-tokens`` tokens (EOS ends a reply). Then ``--chats`` multi-turn sessions, one per mode
and chat: turn 1 is a chat of the set (remote prefill hands the decode to the edge there), each
further turn appends the mode's own reply and a follow-up question, in the same session (remote
prefill then brings down only the blocks the edge's session lacks).

Counted: replies equal token for token in all three modes, and where they part, which pair
differs; for the sessions, turns and whole sessions equal in all three modes, and the turns the
edge took over. Writes ``exactness.md`` (the counts and the command) and ``exactness.json``
(every reply's token ids per mode) into ``--out``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from tandem.daemons import Daemons, cloud_command, edge_command, work_dir

app = typer.Typer(add_completion=False, help=__doc__)

PROMPTS = Path(__file__).parent / "data" / "fidelity_prompts.jsonl"
MODES = ("remote_prefill", "direct", "local")
FOLLOW_UPS = ("Tell me more about that.", "Now say it in one sentence.", "Give one example.")
FP32 = ["--wire-dtypes", "fp32", "--kv-wire-dtypes", "fp32"]


@dataclass
class Reply:
    token_ids: list[int]
    edge_decoded_tokens: int = 0
    received_kv_bytes: int = 0


@dataclass
class Counts:
    """What ``count`` finds (see module doc)."""

    chats: int = 0
    equal: int = 0  # replies equal in all three modes
    remote_prefill_vs_direct: int = 0  # pairs that are equal
    remote_prefill_vs_local: int = 0
    direct_vs_local: int = 0
    taken_over: int = 0  # remote-prefill replies the edge decoded part of
    sessions: int = 0
    session_turns: int = 0
    turns_equal: int = 0
    sessions_equal: int = 0  # every turn equal in all three modes
    turns_taken_over: int = 0
    differing: list[str] = field(default_factory=list)  # chat ids (and turn) where the modes part

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


async def one(client: Any, messages: list[dict], mode: str, max_new: int, session: str = "") -> Reply:
    r = await client.complete(messages, max_new_tokens=max_new, mode=mode, session_id=session)
    if r.mode != mode:
        raise RuntimeError(f"asked for {mode}, served in {r.mode} ({r.mode_reason})")
    return Reply(list(r.output_token_ids), r.edge_decoded_tokens, r.received_bytes.get("kv", 0))


async def run_chats(
    port: int, prompts: list[dict], max_new: int, into: dict | None = None, done: Callable[[], None] = lambda: None
) -> dict[str, dict[str, Reply]]:
    """Every chat once per mode, one request at a time: ``{chat id: {mode: Reply}}`` (``into``,
    filled chat by chat; ``done`` is called after each)."""
    from tandem import AsyncClient

    out: dict[str, dict[str, Reply]] = {} if into is None else into
    async with AsyncClient(f"127.0.0.1:{port}", timeout_s=600) as client:
        for p in prompts:
            out[p["id"]] = {m: await one(client, p["messages"], m, max_new) for m in MODES}
            done()
    return out


async def run_sessions(
    port: int,
    prompts: list[dict],
    turns: int,
    max_new: int,
    tokenizer: Any,
    into: dict | None = None,
    done: Callable[[], None] = lambda: None,
) -> dict[str, dict[str, list[Reply]]]:
    """``turns`` turns of a session per chat and mode (see module doc): ``{chat id: {mode: [Reply]}}``
    (``into``, filled chat by chat; ``done`` is called after each)."""
    from tandem import AsyncClient

    out: dict[str, dict[str, list[Reply]]] = {} if into is None else into
    async with AsyncClient(f"127.0.0.1:{port}", timeout_s=600) as client:
        for p in prompts:
            per_mode: dict[str, list[Reply]] = {}
            for m in MODES:
                session, messages, replies = f"exact-{m}-{p['id']}-{time.time_ns()}", list(p["messages"]), []
                for t in range(turns):
                    r = await one(client, messages, m, max_new, session)
                    replies.append(r)
                    text = tokenizer.decode(r.token_ids, skip_special_tokens=True)
                    follow = FOLLOW_UPS[t % len(FOLLOW_UPS)]
                    messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": follow}]
                per_mode[m] = replies
                await client.end_session(session)
            out[p["id"]] = per_mode
            done()
    return out


def count(chats: dict[str, dict[str, Reply]], sessions: dict[str, dict[str, list[Reply]]]) -> Counts:
    c = Counts(chats=len(chats), sessions=len(sessions))
    for cid, r in chats.items():
        rp, d, lo = (r[m].token_ids for m in MODES)
        c.equal += rp == d == lo
        c.remote_prefill_vs_direct += rp == d
        c.remote_prefill_vs_local += rp == lo
        c.direct_vs_local += d == lo
        c.taken_over += r["remote_prefill"].edge_decoded_tokens > 0
        if not rp == d == lo:
            c.differing.append(cid)
    for cid, per_mode in sessions.items():
        same = True
        for t, rp_turn in enumerate(per_mode["remote_prefill"]):
            c.session_turns += 1
            eq = rp_turn.token_ids == per_mode["direct"][t].token_ids == per_mode["local"][t].token_ids
            c.turns_equal += eq
            c.turns_taken_over += rp_turn.edge_decoded_tokens > 0
            if not eq:
                c.differing.append(f"{cid} turn {t + 1}")
            same = same and eq
            if not eq:
                break  # the histories part from here on
        c.sessions_equal += same
    return c


def table(c: Counts, command: str, max_new: int, turns: int) -> str:
    return "\n".join(
        [
            f"`{command}`",
            "",
            f"fp32 engines and wire, greedy, up to {max_new} tokens (EOS ends a reply), one request at a time.",
            "",
            "| set | count | equal in all three modes | remote prefill = direct | remote prefill = local | "
            "direct = local | the edge took over |",
            "|---|---|---|---|---|---|---|",
            f"| chats (`fidelity_prompts.jsonl`) | {c.chats} | {c.equal} | {c.remote_prefill_vs_direct} | "
            f"{c.remote_prefill_vs_local} | {c.direct_vs_local} | {c.taken_over} |",
            f"| session turns ({c.sessions} sessions x {turns} turns, compared up to the first that parts) | "
            f"{c.session_turns} | {c.turns_equal} | | | | {c.turns_taken_over} |",
            f"| whole sessions | {c.sessions} | {c.sessions_equal} | | | | |",
            "",
            f"Where the modes part: {', '.join(c.differing) or 'nowhere'}.",
        ]
    )


@app.command()
def main(
    model_dir: Annotated[Path, typer.Option(help="prepared model directory")] = Path("models/smollm2-135m"),
    prompts_file: Annotated[Path, typer.Option(help="JSONL chat set")] = PROMPTS,
    limit: Annotated[int, typer.Option(help="first N chats only (0 = all)")] = 0,
    chats: Annotated[int, typer.Option(help="multi-turn sessions: the first N chats of the set")] = 20,
    turns: Annotated[int, typer.Option(help="turns per session")] = 3,
    max_new_tokens: int = 32,
    out: Annotated[Path, typer.Option(help="output directory")] = Path("bench-results/exactness"),
    edge: Annotated[str, typer.Option(help="port of a running fp32 tandem-edge (default: start both daemons)")] = "",
    resume: Annotated[
        bool, typer.Option(help="keep the chats and sessions of OUT/exactness.json and run only the rest")
    ] = False,
) -> None:
    """Run the chats and sessions in the three modes and write the counts."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from tandem.benchmarks.fidelity import load_prompts
    from tandem.common.protocol.manifest import SplitManifest

    prompts = load_prompts(prompts_file, limit)
    out.mkdir(parents=True, exist_ok=True)
    split_dir = model_dir / "split-k4"
    tokenizer = AutoTokenizer.from_pretrained(SplitManifest.load(split_dir).tokenizer_dir(split_dir))
    args = sys.argv[1:]  # after the subcommand under tandem-bench, all of them under python -m
    command = " ".join(["tandem-bench exactness", *(args[1:] if args[:1] == ["exactness"] else args)])
    w = work_dir("tandem-exactness-")
    print(f"tandem-bench exactness: {len(prompts)} chats x 3 modes, {chats} sessions; logs in {w}", file=sys.stderr)
    t0 = time.perf_counter()
    replies, sessions = load_results(out / "exactness.json") if resume else ({}, {})
    todo_sessions = [p for p in prompts[:chats] if p["id"] not in sessions]
    todo_chats = [p for p in prompts if p["id"] not in replies]

    def save() -> None:
        """The counts so far (a run cut short leaves what it finished)."""
        c = count(replies, sessions)
        (out / "exactness.md").write_text(table(c, command, max_new_tokens, turns) + "\n")
        data = {
            "counts": c.as_dict(),
            "wall_s": round(time.perf_counter() - t0, 1),
            "chats": {k: {m: r.__dict__ for m, r in v.items()} for k, v in replies.items()},
            "sessions": {k: {m: [r.__dict__ for r in rs] for m, rs in v.items()} for k, v in sessions.items()},
        }
        (out / "exactness.json").write_text(json.dumps(data))

    with Daemons() as daemons:
        if not edge:
            extra = ["--max-num-seqs", "4", "--engine.dtype", "float32", *FP32]
            c = daemons.spawn("tandem-cloud", cloud_command(split_dir, w / "kv", extra=extra), w / "cloud.log", w / "c")
            target = f"127.0.0.1:{c.wait_ready(900)}"
            e = daemons.spawn("tandem-edge", edge_command(split_dir, target, extra=FP32), w / "edge.log", w / "e")
            edge = str(e.wait_ready(600))
        port = int(edge)
        asyncio.run(wait_serving(port))
        with tqdm(total=len(todo_chats) + len(todo_sessions), desc="chats", unit="chat") as bar:

            def done() -> None:
                save()
                bar.update(1)

            # the sessions first: a run cut short still has some of both
            asyncio.run(run_sessions(port, todo_sessions, turns, max_new_tokens, tokenizer, sessions, done))
            asyncio.run(run_chats(port, todo_chats, max_new_tokens, replies, done))
    save()
    print((out / "exactness.md").read_text())
    print(f"results in {out}: exactness.md, exactness.json", file=sys.stderr)


def load_results(path: Path) -> tuple[dict[str, dict[str, Reply]], dict[str, dict[str, list[Reply]]]]:
    """The chats and sessions of an earlier run's ``exactness.json`` (``--resume``); none where it
    does not exist.

    Raises: ValueError (the file is not an exactness result)."""
    if not path.is_file():
        return {}, {}
    try:
        data = json.loads(path.read_text())
        chats = {cid: {m: Reply(**r) for m, r in per.items()} for cid, per in data["chats"].items()}
        sessions = {
            cid: {m: [Reply(**r) for r in rs] for m, rs in per.items()} for cid, per in data["sessions"].items()
        }
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path}: not a tandem-bench exactness result: {e!r}") from None
    return chats, sessions


async def wait_serving(port: int, timeout_s: float = 600.0) -> None:
    """Until the edge at ``port`` serves all three modes.

    Raises:
        TimeoutError: it did not within ``timeout_s``."""
    from tandem import AsyncClient

    t0 = time.monotonic()
    async with AsyncClient(f"127.0.0.1:{port}") as c:
        while time.monotonic() - t0 < timeout_s:
            try:
                info = await c.info()
                if info.cloud_connected and set(MODES) <= set(info.modes):
                    return
            except Exception:  # noqa: BLE001 - not serving yet
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"the edge at port {port} did not serve {', '.join(MODES)} within {timeout_s:.0f} s")


if __name__ == "__main__":
    app()
