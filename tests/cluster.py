"""Real parts of a cloud cluster on loopback for the cluster tests (no tests here): ``Dnsmasq``
(Debian's dnsmasq answering one name with several 127.0.0.x addresses, changed while it runs),
``ToyReplica`` (a toy cloud replica in its own process: the gateway over the in-memory engines,
real grpc.aio, a shared Redis block store), ``RedisCluster`` (Debian's redis-server: three
primaries and three replicas made with ``redis-cli --cluster create``) and ``RedisSentinel`` (a
primary, a replica and a Sentinel watching them). Run as
``python -m tests.cluster HOST PORT STORE_URL CLOUD_ID STEP_DELAY_S``, it serves one toy replica."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import ROOT


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _wait(what: str, ready, timeout_s: float = 10.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
            raise RuntimeError(f"{what} did not come up")
        time.sleep(0.05)


# ------------------------------------------------------------------ DNS


class Dnsmasq:
    """dnsmasq on ``127.0.0.1:port`` answering ``name`` (in its own zone ``test``) with the addresses
    given to ``set`` (A records, TTL 0); nothing else, no upstream."""

    def __init__(self, directory: Path, name: str = "tandem-cloud.test") -> None:
        exe = shutil.which("dnsmasq", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")  # not on a user's PATH
        if exe is None:
            raise RuntimeError("dnsmasq is not installed: `make test` (or `make dnsmasq`) installs it")
        self.name, self.hosts = name, directory / "hosts"
        self.hosts.write_text("")
        self.port = free_port()
        args = [exe, "--keep-in-foreground", "--conf-file=/dev/null", f"--port={self.port}"]
        args += ["--listen-address=127.0.0.1", "--bind-interfaces", "--no-resolv", "--no-hosts", "--local=/test/"]
        args += [f"--addn-hosts={self.hosts}", "--local-ttl=0", "--pid-file=", "--log-facility=-"]
        if os.geteuid() == 0:
            args.append("--user=root")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait("dnsmasq", self._answers, proc=self.proc)

    def _answers(self) -> bool:
        import dns.exception
        import dns.resolver

        r = dns.resolver.Resolver(configure=False)
        r.nameservers, r.port, r.lifetime = ["127.0.0.1"], self.port, 0.2
        try:
            r.resolve(self.name, "A")
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return True
        except dns.exception.DNSException:
            return False
        return True

    def target(self, port: int) -> str:
        """The gRPC ``dns:`` target of the name's replicas on ``port``, asking this server."""
        return f"dns://127.0.0.1:{self.port}/{self.name}:{port}"

    def set(self, addresses: list[str]) -> None:
        """Answer the name with ``addresses`` from now on (dnsmasq re-reads its hosts file on SIGHUP)."""
        self.hosts.write_text("".join(f"{a} {self.name}\n" for a in addresses))
        self.proc.send_signal(signal.SIGHUP)
        time.sleep(0.1)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


# ------------------------------------------------------------------ a toy replica in its own process


class ToyReplica:
    """``python -m tests.cluster``: one toy cloud replica on ``host:port`` over the store at ``store_url``."""

    def __init__(self, host: str, port: int, store_url: str, cloud_id: str, step_delay_s: float = 0.0) -> None:
        self.host, self.port, self.cloud_id = host, port, cloud_id
        args = [sys.executable, "-m", "tests.cluster", host, str(port), store_url, cloud_id, str(step_delay_s)]
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "ready" once it serves
        if not line.startswith("ready"):
            self.proc.kill()
            raise RuntimeError(f"toy replica {cloud_id} on {host}:{port} did not start")

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def kill(self) -> None:
        """SIGKILL: the host is gone, nothing drains."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


async def _serve_replica(host: str, port: int, store_url: str, cloud_id: str, step_delay_s: float) -> None:
    from tandem.cloud.engines.memory import MemoryEngines
    from tandem.cloud.server import build_gateway
    from tandem.cloud.service import CloudServicer
    from tandem.cloud.store.blocks import open_store
    from tandem.common.runtime.grpc_setup import add_service, start_server
    from tests.doubles import MANIFEST, VOCAB, B, cloud_config
    from tests.remote_doubles import toy_lm

    store = open_store(store_url, "/nonexistent", 1 << 30)
    engines = MemoryEngines(store, B, VOCAB, toy=toy_lm())  # direct decodes: the toy whole model, exact on resume
    engines.step_delay_s = step_delay_s
    gateway = build_gateway(cloud_config(cloud_id=cloud_id), MANIFEST, engines, store)
    servicer = CloudServicer(gateway, cloud_id)
    server, _, _ = await start_server(
        [lambda s: add_service(s, servicer, "Cloud")],
        ["tandem.v1.Cloud"],
        host,
        port,
        gateway.registry.max_message_bytes(),
    )
    print("ready", flush=True)
    await server.wait_for_termination()


# ------------------------------------------------------------------ Redis Cluster


class RedisCluster:
    """Three primaries and three replicas of Debian's redis-server on loopback ports, made into one
    cluster by ``redis-cli --cluster create`` (node timeout ``node_timeout_ms``: a dead primary's
    replica is promoted a little after it); no persistence."""

    def __init__(self, directory: Path, node_timeout_ms: int = 1000) -> None:
        exe = shutil.which("redis-server")
        if exe is None or shutil.which("redis-cli") is None:
            raise RuntimeError("redis-server is not installed: `make test` (or `make redis-server`) installs it")
        self.ports = [free_port() for _ in range(6)]
        self.procs: dict[int, subprocess.Popen] = {}
        for p in self.ports:
            d = directory / str(p)
            d.mkdir()
            args = [exe, "--port", str(p), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(d)]
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args += ["--cluster-node-timeout", str(node_timeout_ms), "--cluster-port", str(free_port())]
            args += ["--cluster-replica-validity-factor", "0", "--cluster-require-full-coverage", "no"]
            args += ["--repl-diskless-sync", "yes"]
            args += ["--repl-diskless-sync-delay", "0"]
            self.procs[p] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for p in self.ports:
            _wait(f"redis-server on {p}", lambda p=p: self._pings(p), proc=self.procs[p])
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas", "1", "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
        )
        _wait("the cluster", lambda: all(self.info(p).get("cluster_state") == "ok" for p in self.ports), 20)
        _wait("the replicas' first sync", lambda: sum(self._synced(p) for p in self.ports) == 3, 20)
        self.url = "redis+cluster://" + ",".join(nodes[:2])

    @staticmethod
    def _pings(port: int) -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return True
        except OSError:
            return False

    @staticmethod
    def _synced(port: int) -> bool:
        """The node on ``port`` is a replica whose link to its primary is up."""
        import redis

        r = redis.Redis(port=port, socket_timeout=1)
        try:
            info = r.info("replication")
            return info.get("role") == "slave" and info.get("master_link_status") == "up"
        finally:
            r.close()

    def info(self, port: int) -> dict[str, str]:
        out = subprocess.run(
            ["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, text=True, timeout=5
        ).stdout
        return dict(line.strip().split(":", 1) for line in out.splitlines() if ":" in line)

    def primary_of(self, redis_key: str) -> int:
        """The port of the primary serving ``redis_key``'s hash slot now."""
        import redis

        for p in self.live():
            r = redis.Redis(port=p, socket_timeout=1)
            try:
                slot = r.cluster("keyslot", redis_key)
                for lo, hi, primary, *_ in r.cluster("slots"):
                    if lo <= slot <= hi:
                        return int(primary[1])
            except redis.RedisError:
                continue
            finally:
                r.close()
        raise RuntimeError("no node answers")

    def replica_of(self, primary_port: int) -> int:
        import redis

        r = redis.Redis(port=primary_port, socket_timeout=1)
        try:
            info = r.info("replication")
            return int(info["slave0"]["port"])
        finally:
            r.close()

    def live(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def kill(self, port: int) -> None:
        """SIGKILL one node (its data in memory is gone)."""
        self.procs[port].kill()
        self.procs[port].wait()

    def wait_promoted(self, port: int, timeout_s: float = 20.0) -> None:
        """Until the node on ``port`` is a primary and every live node says the cluster is ok."""
        import redis

        def promoted() -> bool:
            r = redis.Redis(port=port, socket_timeout=1)
            try:
                return r.info("replication").get("role") == "master"
            finally:
                r.close()

        _wait(f"the promotion of {port}", promoted, timeout_s)
        self.wait_ok(timeout_s)

    def wait_serving(self, redis_key: str, port: int, timeout_s: float = 20.0) -> int:
        """Until the live nodes' slot table (the first node that answers) names ``port`` as the primary
        of ``redis_key``'s slot (the gossip that follows a promotion reaches the nodes one by one);
        returns the primary the last look found."""
        found = [-1]

        def serving() -> bool:
            found[0] = self.primary_of(redis_key)
            return found[0] == port

        try:
            _wait(f"{port} serving {redis_key!r}", serving, timeout_s)
        except RuntimeError:
            pass  # the caller's assertion names what was found instead
        return found[0]

    def wait_ok(self, timeout_s: float = 20.0) -> None:
        """Until every live node says the cluster is ok (every slot served)."""
        ok = lambda: all(self.info(p).get("cluster_state") == "ok" for p in self.live())  # noqa: E731
        _wait("the cluster's failover", ok, timeout_s)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


class RedisSentinel:
    """A redis-server primary, one replica, and one Sentinel watching them as ``service`` (quorum 1,
    down after ``down_after_ms``) on loopback ports; ``url`` is the store's ``redis+sentinel://``."""

    def __init__(self, directory: Path, service: str = "tandem", down_after_ms: int = 500) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: `make test` (or `make redis-server`) installs it")
        self.primary, self.replica, self.sentinel = free_port(), free_port(), free_port()
        base = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(directory)]
        self.procs = {
            self.primary: subprocess.Popen([exe, "--port", str(self.primary), *base], stdout=subprocess.DEVNULL),
            self.replica: subprocess.Popen(
                [exe, "--port", str(self.replica), *base, "--replicaof", "127.0.0.1", str(self.primary)],
                stdout=subprocess.DEVNULL,
            ),
        }
        for p in (self.primary, self.replica):
            _wait(f"redis-server on {p}", lambda p=p: RedisCluster._pings(p), proc=self.procs[p])
        _wait("the replica's first sync", lambda: RedisCluster._synced(self.replica))
        conf = directory / "sentinel.conf"
        conf.write_text(
            f"port {self.sentinel}\nbind 127.0.0.1\ndir {directory}\n"
            f"sentinel monitor {service} 127.0.0.1 {self.primary} 1\n"
            f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
            f"sentinel failover-timeout {service} 2000\n"
        )
        self.procs[self.sentinel] = subprocess.Popen([exe, str(conf), "--sentinel"], stdout=subprocess.DEVNULL)
        _wait("redis-sentinel", lambda: RedisCluster._pings(self.sentinel), proc=self.procs[self.sentinel])
        self.url = f"redis+sentinel://127.0.0.1:{self.sentinel}/{service}/0"

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


if __name__ == "__main__":
    host, port, store_url, cloud_id, delay = sys.argv[1:6]
    asyncio.run(_serve_replica(host, int(port), store_url, cloud_id, float(delay)))
