"""The plaintext health-only port (``health_port``) Kubernetes' gRPC probes call: it answers what the
main server's health answers (readiness follows the cloud's serving state, through a drain) and
``liveness`` stays SERVING while the process answers."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common.runtime.grpc_setup import LIVENESS_SERVICE, set_health, start_health_server, start_server


async def status(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return reply.status


async def test_the_health_port_follows_readiness_and_keeps_liveness_through_a_drain():
    server, _, hs = await start_server([], ["tandem.v1.Cloud"], "127.0.0.1", 0, 1 << 20)
    probe, port = await start_health_server(hs, "127.0.0.1", 0)
    try:
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        assert await status(port, "tandem.v1.Cloud") == serving and await status(port, LIVENESS_SERVICE) == serving
        await set_health(hs, False, ["", "tandem.v1.Cloud"])  # a drain, or engines restarting
        assert await status(port, "tandem.v1.Cloud") == not_serving and await status(port, "") == not_serving
        assert await status(port, LIVENESS_SERVICE) == serving  # not a reason to restart the pod
    finally:
        await probe.stop(0)
        await server.stop(0)
