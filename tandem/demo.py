"""``make run``: start tandem-cloud and tandem-edge locally, chat through the SDK,
print where the time went and the bytes sent, compare with plain vLLM (direct
mode: token ids up, the decode engine computes every layer), with the edge alone
(local mode: the whole model in ONNX Runtime) and with auto mode (the edge picks
per request by predicted time to first token), shut down.

Only the SDK is imported here; the daemons run as child processes, the way
they are deployed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

from tandem.client import ChatResult, Client
from tandem.daemons import DaemonFailed, Daemons, cloud_command, edge_command
from tandem.stages import TTFT_STAGES, Stage

PROMPT = (
    "I am planning a weekend trip to Lisbon with two kids. Suggest a plan for Saturday "
    "with one museum, one outdoor activity and a place for lunch, in a few sentences."
)
FOLLOW_UP = "Now do the same for Sunday, but keep it cheaper."

STAGES = [*TTFT_STAGES, Stage.TTFT, Stage.CLOUD_DECODE, Stage.TOTAL]  # rows of the latency table


TABLE_COLUMNS = 100  # the report's tables fit a terminal this wide


def stream(
    client: Client, messages: list[dict], session: str | None, mode: str, max_new: int, show: bool
) -> ChatResult:
    """One turn; with ``show`` its text is printed as it streams, and a reply cut at ``max_new``
    tokens says so."""
    s = client.chat(messages, max_new_tokens=max_new, session_id=session, mode=mode)
    for d in s:
        if show:
            print(d.text, end="", flush=True)
    if show:
        print(cut_note(s.result, max_new))
    return s.result


def cut_note(r: ChatResult, max_new: int) -> str:
    """What follows a printed reply: a note when it stopped at ``max_new`` tokens, else nothing."""
    if r.finish_reason != "length":
        return ""
    return f" [cut at {max_new} tokens: --max-new-tokens]"


def table(title: str, names: list[str], rows: list[tuple[str, list[str]]], label_chars: int, widths: list[int]) -> str:
    """A table: row labels in ``label_chars``, then a right-aligned column per name of ``widths``."""
    lines = [title, " " * label_chars + "".join(f"{n:>{w}}" for n, w in zip(names, widths, strict=True))]
    for label, cells in rows:
        lines.append(f"{label:<{label_chars}}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    return "\n".join(lines)


def report(results: dict[str, ChatResult]) -> str:
    """The latency table and the tokens-and-bytes table of the demo's turns, by column name."""
    names, rs = list(results), list(results.values())

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    latency = [(st.short_label, [ms(r.timings_ms.get(st)) for r in rs]) for st in STAGES]
    latency += [
        ("decode rate (tokens/s)", [f"{decode_rate(r):.1f}" for r in rs]),
        ("mode that served it", [mode_of(r) for r in rs]),
        ("predicted TTFT (ms)", [f"{r.predicted_ttft_ms:.1f}" for r in rs]),
    ]
    counts = [
        ("prompt tokens", [r.prompt_tokens for r in rs]),
        ("tokens through the edge head", [r.head_tokens for r in rs]),
        ("tokens loaded via KV connector", [r.external_tokens for r in rs]),
        ("output tokens", [r.output_tokens for r in rs]),
        ("bytes sent: activations", [r.sent_bytes.get("activations", 0) for r in rs]),
        ("bytes sent: KV blocks", [r.sent_bytes.get("kv", 0) for r in rs]),
        ("bytes sent: header+commit", [r.sent_bytes.get("header", 0) for r in rs]),
        ("bytes per new prompt token", [bytes_per_new_token(r) for r in rs]),
    ]
    tokens = [(label, [str(v) for v in values]) for label, values in counts]
    every = [*latency, *tokens]  # both tables share their columns: each as wide as its widest cell
    label_chars = max(len(label) for label, _ in every) + 1
    widths = [max(len(n), *(len(cells[i]) for _, cells in every)) + 2 for i, n in enumerate(names)]
    return "\n\n".join(
        [
            table("Per-stage latency (ms)", names, latency, label_chars, widths),
            table("Tokens and bytes", names, tokens, label_chars, widths),
        ]
    )


def summary(split: ChatResult, direct: ChatResult, local: ChatResult, auto: ChatResult) -> str:
    """The comparison under the tables, wrapped to ``TABLE_COLUMNS``: split against plain vLLM, and
    what auto chose against the fastest fixed mode."""
    same = "same" if direct.output_token_ids == split.output_token_ids else "DIFFERENT"
    ratio = split.timings_ms[Stage.TTFT] / direct.timings_ms[Stage.TTFT]
    best = min((split, direct, local), key=lambda r: r.timings_ms[Stage.TTFT])
    every = {direct.output_token_ids, local.output_token_ids, auto.output_token_ids} == {split.output_token_ids}
    lines = [
        f"split answer vs plain vLLM on the same prompt: {same} tokens; "
        f"TTFT split/plain = {ratio:.2f}x (one request, loopback, CPU; pooled over many: docs/benchmarks.md)",
        f"auto chose {mode_of(auto)} ({auto.mode_reason}): TTFT {auto.ttft_ms:.0f} ms, predicted "
        f"{auto.predicted_ttft_ms:.0f} ms; the fastest fixed mode on this prompt was {mode_of(best)} "
        f"({best.timings_ms[Stage.TTFT]:.0f} ms); every mode gave the "
        + ("same tokens" if every else "DIFFERENT tokens (see above)"),
    ]
    return "\n".join(textwrap.fill(line, TABLE_COLUMNS, subsequent_indent="  ") for line in lines)


def mode_of(r: ChatResult) -> str:
    return f"split k={r.split_layer}" if r.mode == "split" else r.mode


def bytes_per_new_token(r: ChatResult) -> int:
    sent = sum(r.sent_bytes.get(k, 0) for k in ("activations", "kv", "header"))
    return round(sent / max(1, r.head_tokens or r.prompt_tokens))


def decode_rate(r: ChatResult) -> float:
    span_ms = r.timings_ms.get(Stage.TOTAL, 0) - r.timings_ms.get(Stage.TTFT, 0)
    return (r.output_tokens - 1) / (span_ms / 1e3) if span_ms > 0 and r.output_tokens > 1 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--split-dir", default="models/smollm2-135m/split-k4")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt", default=PROMPT)
    args = ap.parse_args()
    if not Path(args.split_dir).is_dir():
        ap.error(
            f"split dir {args.split_dir} is not a directory (prepare the model with `make model` or `tandem-model`)"
        )
    tmp = Path(tempfile.mkdtemp(prefix="tandem-run-"))
    ok = False
    try:
        print(f"tandem: cloud and edge on this machine (logs in {tmp}, removed on success)", file=sys.stderr)
        with Daemons() as daemons:
            cloud = daemons.spawn(
                "tandem-cloud (two vLLM engines)",
                cloud_command(args.split_dir, tmp / "kv"),
                tmp / "cloud.log",
                tmp / "cloud.port",
            )
            cport = cloud.wait_ready(600)
            edge = daemons.spawn(
                "tandem-edge (ONNX Runtime head)",
                edge_command(args.split_dir, f"127.0.0.1:{cport}"),
                tmp / "edge.log",
                tmp / "edge.port",
            )
            eport = edge.wait_ready(300)
            split, turn2, direct, local, auto = chat(eport, args.prompt, args.max_new_tokens)
        print("tandem: edge and cloud stopped", file=sys.stderr)
        results = {
            f"split k={split.split_layer}": split,
            "split turn 2": turn2,
            "plain vLLM": direct,
            "edge only": local,
            "auto": auto,
        }
        print("\n" + report(results))
        print("\n" + summary(split, direct, local, auto))
        ok = True
    except DaemonFailed as e:  # a daemon exited or did not come up: its log's last lines say why
        print(f"tandem: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)  # logs and KV store are kept only when something failed
        else:
            print(f"tandem: logs kept in {tmp}", file=sys.stderr)


def chat(edge_port: int, prompt: str, max_new_tokens: int) -> tuple[ChatResult, ...]:
    """Two split turns of one session (printed as they stream), then the first turn in direct mode,
    in local mode and in auto mode."""
    with Client(f"127.0.0.1:{edge_port}") as c:
        msgs = [{"role": "user", "content": prompt}]
        stream(c, [{"role": "user", "content": "Hi"}], None, "split", 4, False)  # warm both paths once
        stream(c, [{"role": "user", "content": "Hi"}], None, "direct", 4, False)
        stream(c, [{"role": "user", "content": "Hi"}], None, "local", 4, False)
        print(f"\n{textwrap.fill('user> ' + prompt, TABLE_COLUMNS)}\nassistant (split, streamed)> ", end="", flush=True)
        split = stream(c, msgs, "demo", "split", max_new_tokens, True)
        msgs2 = msgs + [{"role": "assistant", "content": split.text}, {"role": "user", "content": FOLLOW_UP}]
        print(f"\nuser> {FOLLOW_UP}\nassistant (split, turn 2)> ", end="", flush=True)
        turn2 = stream(c, msgs2, "demo", "split", max_new_tokens, True)
        print("\n", file=sys.stderr)
        runs = {}
        for mode, what in (("direct", "plain vLLM (direct)"), ("local", "edge only (local)"), ("auto", "auto")):
            print(f"tandem: the first prompt again, {what}: {max_new_tokens} tokens ...", file=sys.stderr, flush=True)
            runs[mode] = stream(c, msgs, None, mode, max_new_tokens, False)
        direct, local, auto = runs["direct"], runs["local"], runs["auto"]
    return split, turn2, direct, local, auto


if __name__ == "__main__":
    main()
