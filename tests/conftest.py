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
    cloud's and the edge's server certificates (for ``127.0.0.1`` and ``localhost``), client
    certificates for the edge and for raw test calls, the edge's key at the cloud and an app key."""
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
        raw_client=leaf("raw-test-client"),
        edge_key="edge-1-key-" + "0" * 16,
        app_key="app-key-" + "1" * 16,
    )
