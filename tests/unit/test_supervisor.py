"""Fast checks of process-fault handling without vLLM: the engine supervisor with a fake
engine set, server keepalive acceptance on a silent stream, and the engine lifeline."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import grpc
import pytest

from tandem.cloud.engines.supervisor import EngineSupervisor
from tandem.cloud.engines.vllm_engines import DECODE, EngineRole
from tandem.common.protocol.errors import EngineError
from tandem.common.runtime.grpc_setup import channel_options, start_server


class FakeEngines:
    """Dies on ``kill()``; ``restart`` fails ``fail_restarts`` times before succeeding."""

    def __init__(self, fail_restarts: int = 0) -> None:
        self.alive, self.closed, self.fail_restarts, self.restart_calls = True, False, fail_restarts, 0

    def kill(self) -> None:
        self.alive = False

    def is_alive(self) -> bool:
        return self.alive

    async def restart(self) -> None:
        self.restart_calls += 1
        await asyncio.sleep(0.05)
        if self.fail_restarts:
            self.fail_restarts -= 1
            raise EngineError("engine did not start")
        self.alive = True


async def wait_for(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_supervisor_marks_not_serving_restarts_and_serves_again():
    engines, states = FakeEngines(fail_restarts=1), []

    async def set_serving(serving: bool) -> None:
        states.append(serving)

    sup = EngineSupervisor(engines, set_serving, poll_s=0.01, backoff_s=0.01)
    sup.start()
    await asyncio.sleep(0.05)
    assert states == [] and engines.restart_calls == 0
    engines.kill()
    await wait_for(lambda: states == [False, True])
    assert engines.restart_calls == 2 and sup.restarts == 1 and not sup.gave_up.is_set()
    engines.closed = True  # shutdown on purpose: the supervisor ends by itself
    await wait_for(lambda: sup._task is not None and sup._task.done())
    await sup.stop()


async def test_supervisor_gives_up_after_repeated_failures():
    engines, states, gave_up = FakeEngines(fail_restarts=10), [], []

    async def set_serving(serving: bool) -> None:
        states.append(serving)

    sup = EngineSupervisor(
        engines, set_serving, poll_s=0.01, max_failures=3, backoff_s=0.01, on_give_up=lambda: gave_up.append(1)
    )
    sup.start()
    engines.kill()
    await asyncio.wait_for(sup.gave_up.wait(), 5)
    assert states == [False] and engines.restart_calls == 3 and gave_up == [1]
    await sup.stop()


async def test_server_accepts_client_keepalive_on_a_silent_stream():
    """Client pings every second on a call to which the server sends nothing for 8 s. With
    gRPC core's server defaults (a ping without data every 5 min at most, 2 strikes) the
    server answers GOAWAY too_many_pings after about 5 pings and the call fails UNAVAILABLE."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    release = asyncio.Event()

    async def silent(request, context):
        await release.wait()
        return b"done"

    def add(server: grpc.aio.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(silent)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Silent", {"Wait": handler}),))

    server, port, _ = await start_server([add], ["test.Silent"], "127.0.0.1", 0, 1 << 20)
    try:
        opts = channel_options(1.0, 5.0, 1 << 20)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
            call = ch.unary_unary("/test.Silent/Wait")(b"")
            states = []
            for _ in range(16):
                await asyncio.sleep(0.5)
                states.append(ch.get_state())
            assert not call.done(), "the silent call ended early"
            release.set()
            assert await call == b"done"
            assert grpc.ChannelConnectivity.TRANSIENT_FAILURE not in states
            check = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="test.Silent"))
            assert check.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)


def test_lifeline_exits_engine_processes_when_the_gateway_dies(tmp_path):
    """gateway -> engine -> worker, as vLLM's tree; kill -9 the gateway: engine and worker exit."""
    pids = tmp_path / "pids"
    worker = textwrap.dedent(
        f"""
        import os, sys, time
        from tandem.cloud.engines import lifeline
        lifeline.watch_parent(int(sys.argv[1]), interval_s=0.2)
        open({str(pids)!r}, "a").write(f"{{os.getpid()}}\\n")
        time.sleep(60)
        """
    )
    engine = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        from tandem.cloud.engines import lifeline
        lifeline.watch_parent(int(sys.argv[1]), interval_s=0.2)
        subprocess.Popen([sys.executable, "-c", {worker!r}, sys.argv[1]])
        open({str(pids)!r}, "a").write(f"{{os.getpid()}}\\n")
        time.sleep(60)
        """
    )
    gateway = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {engine!r}, str(os.getpid())])
        time.sleep(60)
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    gw = subprocess.Popen([sys.executable, "-c", gateway], env=env)
    started: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while len(started) < 2:
            assert time.monotonic() < deadline, "engine and worker did not start"
            time.sleep(0.05)
            started = [int(x) for x in pids.read_text().split()] if pids.exists() else []
        gw.kill()
        gw.wait()
        deadline = time.monotonic() + 10
        while any(_running(p) for p in started):
            assert time.monotonic() < deadline, f"still running: {[p for p in started if _running(p)]}"
            time.sleep(0.05)
    finally:
        for p in started:
            if _running(p):
                os.kill(p, 9)


def _running(pid: int) -> bool:
    psutil = pytest.importorskip("psutil")
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class _Started:
    def __init__(self, role: EngineRole, log: list[str]) -> None:
        self.role, self.log = role, log

    def shutdown(self, timeout_s: float) -> None:
        self.log.append(f"shutdown {self.role.name}")


def _engine_set(fail: EngineRole | None = None):
    """``VllmEngines`` whose engine starts are stand-ins: each waits until every role has begun
    (so the test fails if they run one after another) and ``fail`` raises."""
    import threading

    from tandem.cloud.engines.vllm_engines import VllmEngines

    roles = (EngineRole.tail(4), EngineRole.tail(8), DECODE)
    began = threading.Barrier(len(roles), timeout=5)
    log: list[str] = []

    class Engines(VllmEngines):
        def __init__(self) -> None:  # no config, no manifests: only the start logic is under test
            self.ROLES = roles
            self._engines = dict.fromkeys(roles)
            self._resources = {}
            self._closed = True
            self._lock = threading.Lock()

        def _new_engine(self, role: EngineRole):
            began.wait()  # BrokenBarrierError (a failed start) if the starts do not overlap
            if role == fail:
                raise EngineError(f"{role.name} did not start")
            return _Started(role, log)

    return Engines(), log


def test_engines_start_together_and_a_failed_start_stops_the_others():
    engines, log = _engine_set()
    engines.start()
    assert {r: e.role for r, e in engines._engines.items()} == {r: r for r in engines.ROLES} and not log
    assert not engines.closed

    engines, log = _engine_set(fail=EngineRole.tail(8))
    with pytest.raises(EngineError, match="tail-k8 did not start"):
        engines.start()
    assert sorted(log) == ["shutdown decode", "shutdown tail-k4"]  # nothing left running
    assert all(e is None for e in engines._engines.values())


def test_engine_roles_carry_the_names_their_logs_use():
    assert [r.name for r in (EngineRole.tail(4), EngineRole.tail(12), DECODE)] == ["tail-k4", "tail-k12", "decode"]
    assert str(EngineRole.tail(4)) == "tail-k4" and EngineRole.tail(4) == EngineRole("tail", 4)
    for bad in (("tail", 0), ("decode", 4)):
        with pytest.raises(ValueError):
            EngineRole(*bad)  # type: ignore[arg-type]
