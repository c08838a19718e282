"""SIGTERM drains a real ``tandem-cloud``: health NOT_SERVING at once, new calls
refused, a call in flight finishes, the vLLM engines shut down and the process exits by itself
with code 0, leaving no child process. Bounds are correctness bounds, not performance."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.daemons import Daemon, cloud_command
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc

psutil = pytest.importorskip("psutil")
pytestmark = [pytest.mark.engines]

PROMPT_IDS = [504, 3458, 282, 4649, 314]  # "The capital of France is"
EXIT_S = 90.0  # drain grace (30 s) + engine shutdown on a busy 2-core box


def direct_turn(version: int, n: int) -> list[pb.Uplink]:
    header = pb.RequestHeader(
        request_id=f"drain-{n}",
        params_version=version,
        split_layer=0,
        prompt_token_ids=PROMPT_IDS,
        sampling=pb.SamplingParams(max_new_tokens=n, ignore_eos=True),
    )
    return [pb.Uplink(header=header)]


async def test_sigterm_drains_and_exits_cleanly(split_dir, tmp_path):
    extra = ["--kv-cache-bytes", str(256 << 20), "--max-num-seqs", "4", "--drain-grace-s", "30"]
    cmd = cloud_command(split_dir, tmp_path / "kv", extra=extra)
    daemon = Daemon("tandem-cloud", cmd, tmp_path / "cloud.log", tmp_path / "ready")
    gateway = psutil.Process(daemon.proc.pid)
    children: list = []
    try:
        port = daemon.wait_ready(300)
        children = gateway.children(recursive=True)
        assert children, "vLLM engine processes expected"
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.CloudStub(ch)
            offer = pb.NegotiateRequest(edge_id="t", split_layers=[0])
            version = (await stub.Negotiate(offer)).params.params_version
            call = stub.Generate(iter(direct_turn(version, 48)))
            first = await call.read()  # decoding has started
            assert first.WhichOneof("msg") == "tokens"
            daemon.proc.send_signal(signal.SIGTERM)
            health = health_pb2_grpc.HealthStub(ch)
            for _ in range(50):
                r = await health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Cloud"))
                if r.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.1)
            assert r.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Generate(iter(direct_turn(version, 4))):
                    pass
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            n = len(first.tokens.token_ids)
            while (m := await call.read()) is not grpc.aio.EOF:
                if m.WhichOneof("msg") == "tokens":
                    n += len(m.tokens.token_ids)
            assert n == 48  # the call in flight finished
        t0 = time.monotonic()
        while daemon.proc.poll() is None and time.monotonic() - t0 < EXIT_S:
            await asyncio.sleep(0.2)
        assert daemon.proc.returncode == 0, f"exit code {daemon.proc.returncode}"

        def alive() -> list:
            out = []
            for c in children:
                try:
                    if c.is_running() and c.status() != psutil.STATUS_ZOMBIE:
                        out.append(c)
                except psutil.NoSuchProcess:
                    pass
            return out

        t0 = time.monotonic()  # the engines' processes go with the gateway (on a loaded host, within seconds)
        while alive() and time.monotonic() - t0 < EXIT_S:
            await asyncio.sleep(0.2)
        assert not alive(), f"engine processes left: {[c.pid for c in alive()]}"
        log = (tmp_path / "cloud.log").read_text()
        assert "SIGKILL" not in log
        # each vLLM worker exited by itself within vLLM's grace (cloud.engines.vllm_plugin.install_fast_exit)
        assert "workers still running after grace period" not in log
        assert "leaked shared_memory" not in log  # multiprocessing's resource tracker found none to unlink
        assert "Exception ignored in" not in log  # nothing left for the interpreter's teardown to finalize
        assert "Traceback" not in log and "EngineDeadError" not in log  # a normal stop logs no engine error
    finally:
        if daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()
        for c in children:
            try:
                c.kill()
            except psutil.Error:
                pass
