"""Shared fixtures. The prepared model comes from `make model` (models/smollm2-135m)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = Path(os.environ.get("TANDEM_MODEL_DIR", ROOT / "models" / "smollm2-135m"))
SPLIT_DIR = MODEL_DIR / "split-k4"


@pytest.fixture(scope="session")
def split_dir() -> Path:
    if not (SPLIT_DIR / "manifest.json").is_file():
        pytest.fail(f"no prepared model at {SPLIT_DIR}: run `make model` (make test does it)")
    return SPLIT_DIR


@pytest.fixture(scope="session")
def manifest(split_dir):
    from tandem.common.manifest import SplitManifest

    return SplitManifest.load(split_dir)


@pytest.fixture(scope="session")
def hf_model(manifest, split_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        manifest.resolve(split_dir, manifest.full_checkpoint), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def tokenizer(manifest, split_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(manifest.tokenizer_dir(split_dir))


@pytest.fixture(scope="session")
def tls(tmp_path_factory):
    """A throwaway PKI (trustme) for the real stack, as an operator would set it up: a CA, the
    cloud's and the edge's server certificates (for ``127.0.0.1`` and ``localhost``), the edge's
    client certificate (subject ``edge-1``, the name of its key at the cloud), the edge's key at the
    cloud and an app key."""
    from types import SimpleNamespace

    import trustme

    root, ca = tmp_path_factory.mktemp("tls"), trustme.CA()

    def leaf(name: str, *ids: str) -> tuple[Path, Path]:
        cert = ca.issue_cert(*(ids or (name,)), common_name=name)
        (root / f"{name}.pem").write_bytes(b"".join(b.bytes() for b in cert.cert_chain_pems))
        (root / f"{name}.key").write_bytes(cert.private_key_pem.bytes())
        return root / f"{name}.pem", root / f"{name}.key"

    (root / "ca.pem").write_bytes(ca.cert_pem.bytes())
    return SimpleNamespace(
        ca_file=root / "ca.pem",
        cloud=leaf("cloud", "127.0.0.1", "localhost"),
        edge_server=leaf("edge", "127.0.0.1", "localhost"),
        edge_client=leaf("edge-1"),
        edge_key="edge-1-key-" + "0" * 16,
        app_key="app-key-" + "1" * 16,
    )


class RedisServer:
    """A real redis-server (Debian's package, installed by ``make test``) on a free loopback port,
    without persistence; ``url`` names database 0."""

    def __init__(self, directory: Path, maxmemory_bytes: int = 0, password: str = "") -> None:
        import shutil
        import socket
        import subprocess
        import time

        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: `make test` (or `make redis-server`) installs it")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(directory)]
        if password:
            args += ["--requirepass", password]
        if maxmemory_bytes:
            args += ["--maxmemory", str(maxmemory_bytes), "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()
