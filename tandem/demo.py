"""``make run``: start tandem-cloud and tandem-edge locally, chat through the SDK,
print where the time went and the bytes sent, compare with plain vLLM (direct
mode: token ids up, the decode engine computes every layer), shut down.

Only the SDK is imported here; the daemons run as child processes, the way
they are deployed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.client import ChatResult, Client

PROMPT = (
    "I am planning a weekend trip to Lisbon with two kids. Suggest a plan for Saturday "
    "with one museum, one outdoor activity and a place for lunch, in a few sentences."
)
FOLLOW_UP = "Now do the same for Sunday, but keep it cheaper."

STAGES = [  # (label, key in timings_ms)
    ("tokenize (edge)", "tokenize_ms"),
    ("edge head: ONNX layers [0,k)", "edge_head_ms"),
    ("encode: chunks+CRC32C, KV blocks+BLAKE3", "encode_ms"),
    ("uplink: send until cloud verified", "uplink_ms"),
    ("cloud: store put of head KV", "cloud_store_put_ms"),
    ("cloud: tail prefill + 1st token (vLLM)", "cloud_tail_prefill_ms"),
    ("cloud: KV handoff + decode engine's 1st step", "cloud_decode_first_token_ms"),
    ("time to first token (client)", "ttft_ms"),
    ("end to end", "total_ms"),
]


def wait_ready(proc: subprocess.Popen, ready: Path, what: str, timeout_s: float) -> int:
    """Wait for a daemon's ready file (its port), showing progress. Raises RuntimeError if it dies."""
    t0 = time.monotonic()
    while not ready.exists() or not ready.read_text().strip():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see its log")
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s")
        print(f"\r  starting {what} ... {time.monotonic() - t0:5.1f} s", end="", file=sys.stderr, flush=True)
        time.sleep(0.5)
    print(f"\r  {what} ready in {time.monotonic() - t0:.1f} s          ", file=sys.stderr)
    return int(ready.read_text())


def stream(
    client: Client, messages: list[dict], session: str | None, mode: str, max_new: int, show: bool
) -> ChatResult:
    s = client.chat(messages, max_new_tokens=max_new, session_id=session, mode=mode)
    for d in s:
        if show:
            print(d.text, end="", flush=True)
    if show:
        print()
    return s.result


def report(results: dict[str, ChatResult]) -> None:
    names = list(results)
    print("\nPer-stage latency (ms)")
    print(f"{'stage':<44}" + "".join(f"{n:>16}" for n in names))
    for label, key in STAGES:
        print(
            f"{label:<44}"
            + "".join(
                f"{results[n].timings_ms[key]:>16.1f}" if key in results[n].timings_ms else f"{'-':>16}" for n in names
            )
        )
    print(f"{'decode rate (tokens/s)':<44}" + "".join(f"{decode_rate(results[n]):>16.1f}" for n in names))
    print("\nTokens and bytes")
    rows = [
        ("prompt tokens", lambda r: r.prompt_tokens),
        ("tokens through the edge head", lambda r: r.head_tokens),
        ("prompt tokens loaded via KV connector", lambda r: r.external_tokens),
        ("output tokens", lambda r: r.output_tokens),
        ("bytes sent: activations", lambda r: r.sent_bytes.get("activations", 0)),
        ("bytes sent: KV blocks", lambda r: r.sent_bytes.get("kv", 0)),
        ("bytes sent: header+commit", lambda r: r.sent_bytes.get("header", 0)),
        (
            "bytes per new prompt token",
            lambda r: round(
                sum(r.sent_bytes.get(k, 0) for k in ("activations", "kv", "header"))
                / max(1, r.head_tokens or r.prompt_tokens)
            ),
        ),
    ]
    for label, f in rows:
        print(f"{label:<44}" + "".join(f"{f(results[n]):>16}" for n in names))


def bytes_per_new_token(r: ChatResult) -> int:
    sent = sum(r.sent_bytes.get(k, 0) for k in ("activations", "kv", "header"))
    return round(sent / max(1, r.head_tokens or r.prompt_tokens))


def decode_rate(r: ChatResult) -> float:
    span_ms = r.timings_ms.get("total_ms", 0) - r.timings_ms.get("ttft_ms", 0)
    return (r.output_tokens - 1) / (span_ms / 1e3) if span_ms > 0 and r.output_tokens > 1 else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--split-dir", default="models/smollm2-135m/split-k4")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt", default=PROMPT)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tandem-run-"))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    bindir = Path(sys.executable).parent
    procs: list[subprocess.Popen] = []
    ok = False
    try:
        print(f"tandem: cloud and edge on this machine (logs in {tmp}, removed on success)", file=sys.stderr)
        cloud = subprocess.Popen(
            [
                bindir / "tandem-cloud",
                "--split-dir",
                args.split_dir,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--store-dir",
                str(tmp / "kv"),
                "--ready-file",
                str(tmp / "cloud.port"),
            ],
            stdout=open(tmp / "cloud.log", "w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        procs.append(cloud)
        cport = wait_ready(cloud, tmp / "cloud.port", "tandem-cloud (two vLLM engines)", 600)
        edge = subprocess.Popen(
            [
                bindir / "tandem-edge",
                "--split-dir",
                args.split_dir,
                "--cloud",
                f"127.0.0.1:{cport}",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--ready-file",
                str(tmp / "edge.port"),
            ],
            stdout=open(tmp / "edge.log", "w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        procs.append(edge)
        eport = wait_ready(edge, tmp / "edge.port", "tandem-edge (ONNX Runtime head)", 300)
        with Client(f"127.0.0.1:{eport}") as c:
            msgs = [{"role": "user", "content": args.prompt}]
            stream(c, [{"role": "user", "content": "Hi"}], None, "split", 4, False)  # warm both paths once
            stream(c, [{"role": "user", "content": "Hi"}], None, "direct", 4, False)
            print(f"\nuser> {args.prompt}\nassistant (split, streamed)> ", end="", flush=True)
            split = stream(c, msgs, "demo", "split", args.max_new_tokens, True)
            msgs2 = msgs + [{"role": "assistant", "content": split.text}, {"role": "user", "content": FOLLOW_UP}]
            print(f"\nuser> {FOLLOW_UP}\nassistant (split, turn 2)> ", end="", flush=True)
            turn2 = stream(c, msgs2, "demo", "split", args.max_new_tokens, True)
            direct = stream(c, msgs, None, "direct", args.max_new_tokens, False)
        report({f"split k={split.split_layer}": split, "split turn 2": turn2, "plain vLLM": direct})
        same = "same" if direct.output_token_ids == split.output_token_ids else "DIFFERENT"
        ratio = split.timings_ms["ttft_ms"] / direct.timings_ms["ttft_ms"]
        print(
            f"\nsplit answer vs plain vLLM on the same prompt: {same} tokens; "
            f"TTFT split/plain = {ratio:.2f}x (loopback, CPU)"
        )
        ok = True
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        print("tandem: edge and cloud stopped", file=sys.stderr)
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)  # logs and KV store are kept only when something failed
        else:
            print(f"tandem: logs kept in {tmp}", file=sys.stderr)


if __name__ == "__main__":
    main()
