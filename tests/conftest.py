"""Shared fixtures, and each test's tier marked by its folder: ``tests/<tier>/...`` gets the marker
``<tier>`` (``unit``, ``inprocess``, ``engines``, ``install``, ``gpu``, ``fuzz``), so ``-m engines``
and ``-m "not engines and not install and not gpu"`` select by folder; a test file in ``tests/``
itself keeps only the markers it sets. The prepared model comes from `make model`
(models/smollm2-135m)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import SPLIT_DIR, RedisServer, tier_of


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def split_dir() -> Path:
    if not (SPLIT_DIR / "manifest.json").is_file():
        pytest.fail(f"no prepared model at {SPLIT_DIR}: run `make model` (make test does it)")
    return SPLIT_DIR


@pytest.fixture(scope="session")
def decoder_dir(split_dir) -> Path:
    """The whole model as the model builder wrote it (``edge-decoder/`` beside the split)."""
    path = split_dir.parent / "edge-decoder"
    if not (path / "genai_config.json").is_file():
        pytest.fail(f"no {path}: run `make model` (make test does it)")
    return path


@pytest.fixture(scope="session")
def manifest(split_dir):
    from tandem.common.protocol.manifest import SplitManifest

    return SplitManifest.load(split_dir)


@pytest.fixture(scope="session")
def hf_dir(manifest, split_dir):
    """The full HF checkpoint the split was prepared from."""
    return manifest.resolve(split_dir, manifest.full_checkpoint)


@pytest.fixture(scope="session")
def hf_model(hf_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


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


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def prepared_families(tmp_path_factory):
    """``prepare(name) -> Path``: family ``name``'s tiny checkpoint (``tests.families``) prepared by
    ``tandem-model`` at ``FAMILY_SPLITS`` (heads, ``edge-full.onnx``, checks, bundles), once per test
    run: the in-process family tests and the engines' end-to-end tests read the same directories
    (tests copy before they change one)."""
    from tandem.common.model import prepare as modelprep
    from tests.families import FAMILY_SPLITS, build_checkpoint

    root = tmp_path_factory.mktemp("families")
    done: dict[str, Path] = {}

    def prepare(name: str) -> Path:
        if name not in done:
            out = root / name
            ckpt = build_checkpoint(name, root / f"{name}-ckpt")
            modelprep.prepare_model(out, ckpt, ",".join(map(str, FAMILY_SPLITS)), model_id=f"tiny-{name}")
            done[name] = out
        return done[name]

    return prepare
