"""Start-up checks: every setting that can be checked without a model is checked before one loads.

Each case runs a daemon's command line in this process (``tandem.cloud.cli.app`` /
``tandem.edge.cli.app``) with every loader replaced by one that fails the test: the engines, the
edge's heads and models, serving itself. A bad setting must give one line on stderr and exit code
2 at once; the same command line with the setting fixed must reach serving (so the cases do not
pass by failing on something else). Split directories are toy manifests with empty parts (the
checks read manifests, never weights)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tandem.common.manifest import EngineAgreement, SplitManifest
from tests.doubles import toy_manifest

KEY = "k" * 24


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("TANDEM_CLOUD_", "TANDEM_EDGE_")):
            monkeypatch.delenv(k)


def split_dir(root: Path, name: str = "split", manifest: SplitManifest | None = None) -> Path:
    """A split directory: a toy manifest and its parts (empty)."""
    m = manifest or toy_manifest()
    d = root / name
    for sub in (m.full_checkpoint, m.tail_checkpoint):
        (d / sub).mkdir(parents=True, exist_ok=True)
    (d / m.head_onnx).write_bytes(b"")
    m.save(d)
    return d


@pytest.fixture
def served(monkeypatch) -> list[str]:
    """The daemons' ``serve`` replaced by a recorder, and every loader by one that fails the test."""
    reached: list[str] = []

    def refuse(*args, **kwargs):
        raise AssertionError("a model or engine loader was called before the settings were checked")

    async def cloud_serve(cfg, ready_file=None, grace_s=5.0) -> int:
        reached.append("cloud")
        return 0

    async def edge_serve(cfg, ready_file, grace_s=None) -> None:
        reached.append("edge")

    monkeypatch.setattr("tandem.cloud.engines.VllmEngines.__init__", refuse)
    monkeypatch.setattr("tandem.cloud.server.create_cloud", refuse)
    monkeypatch.setattr("tandem.edge.server.create_edge", refuse)
    monkeypatch.setattr("tandem.edge.head_runner.OnnxHead.__init__", refuse)
    monkeypatch.setattr("tandem.cloud.cli.serve", cloud_serve)
    monkeypatch.setattr("tandem.edge.cli.serve", edge_serve)
    return reached


def run(app, argv: list[str], capsys) -> tuple[int, str, float]:
    t0 = time.monotonic()
    code = app(argv)
    return code, capsys.readouterr().err, time.monotonic() - t0


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _fill(argv: list[str], tmp: Path, tls) -> list[str]:
    """Placeholders of the case tables: ``{tmp}``, ``{other}`` (a split dir of another model),
    ``{longrope}`` (a split prepared for engines of at most 1024 tokens, as a LongRoPE model's short
    factors are), ``{garbage}`` (a file that is not PEM) and the test PKI's files (conftest's ``tls``)."""
    other = split_dir(tmp, "other", toy_manifest().model_copy(update={"weights_blake3": "another-model"}))
    short_rope = EngineAgreement(
        max_model_len_max_tokens=1024,
        notes=("longrope: max_model_len 1024 <= original_max_position_embeddings 1024: the short factors",),
    )
    longrope = split_dir(tmp, "longrope", toy_manifest().model_copy(update={"engine_agreement": short_rope}))
    files = {
        "tmp": tmp,
        "other": other,
        "longrope": longrope,
        "garbage": _write(tmp / "garbage.pem", "not a certificate\n"),
        "cloud_cert": tls.cloud[0],
        "cloud_key": tls.cloud[1],
        "edge_cert": tls.edge_client[0],
        "edge_key": tls.edge_client[1],
        "edge_server_cert": tls.edge_server[0],
    }
    return [a.format(**{k: str(v) for k, v in files.items()}) for a in argv]


# (case, extra argv, environment, words of the error)
CLOUD_CASES = [
    ("edge key of 5 characters", [], {"TANDEM_CLOUD_EDGE_KEYS": '{"edge-a": "short"}'}, "shorter than 16"),
    ("edge key with a space", [], {"TANDEM_CLOUD_EDGE_KEYS": '{"edge-a": "sixteen chars ok!"}'}, "ASCII"),
    ("edge key of no name", [], {"TANDEM_CLOUD_EDGE_KEYS": f'{{"": "{KEY}"}}'}, "name"),
    ("rate in no notation", ["--edge-rate-limit", "5/fortnight"], {}, "edge_rate_limit"),
    ("store URL of another scheme", ["--store-url", "http://cache:6379"], {}, "redis://"),
    ("store URL with a password", ["--store-url", "redis://:secret@cache:6379/0"], {}, "password"),
    ("store URL with a bad port", ["--store-url", "redis://cache:99999/0"], {}, "store URL"),
    (
        "certificate with another's key",
        ["--tls-cert-file", "{cloud_cert}", "--tls-key-file", "{edge_key}"],
        {},
        "tls_cert_file",
    ),
    ("certificate that is not PEM", ["--tls-cert-file", "{garbage}", "--tls-key-file", "{cloud_key}"], {}, "PEM"),
    (
        "client CA that is not PEM",
        ["--tls-cert-file", "{cloud_cert}", "--tls-key-file", "{cloud_key}", "--tls-client-ca-file", "{garbage}"],
        {},
        "tls_client_ca_file",
    ),
    ("missing key file", ["--tls-cert-file", "{cloud_cert}", "--tls-key-file", "{tmp}/no.key"], {}, "cannot read"),
    ("metrics on the gRPC port", ["--port", "50999", "--metrics-port", "50999"], {}, "metrics_port and port"),
    ("trace file in no directory", ["--slo-trace-file", "{tmp}/no/trace.jsonl"], {}, "does not exist"),
    ("extra split dir of another model", ["--extra-split-dirs", "{other}"], {}, "another model"),
    ("max_model_len beyond the model", ["--engine.max-model-len-tokens", "8192"], {}, "4096 positions"),
    (
        "max_model_len past the range the manifest was checked for",
        ["--split-dir", "{longrope}"],
        {},
        "outside 2..1024, the range this model was prepared and checked for (longrope",
    ),
    ("KV cache too small for max_model_len", ["--engine.kv-cache-bytes", "256KiB"], {}, "cannot hold one sequence"),
]

EDGE_CASES = [
    ("app key of 5 characters", [], {"TANDEM_EDGE_API_KEYS": '["short"]'}, "shorter than 16"),
    ("HTTP key of 5 characters", [], {"TANDEM_EDGE_HTTP_API_KEYS": '["short"]'}, "shorter than 16"),
    ("cloud key of 5 characters", [], {"TANDEM_EDGE_CLOUD_API_KEY": "short"}, "cloud_api_key"),
    ("cloud key not ASCII", [], {"TANDEM_EDGE_CLOUD_API_KEY": "é" * 16}, "ASCII"),
    ("cloud target without a port", ["--cloud", "localhost"], {}, "host:port"),
    ("cloud replica with a bad port", ["--cloud-replicas", "localhost:0"], {}, "cloud_replicas"),
    (
        "client certificate with another's key",
        ["--cloud-cert-file", "{edge_cert}", "--cloud-key-file", "{cloud_key}"],
        {},
        "cloud_cert_file",
    ),
    ("cloud CA that is not PEM", ["--cloud-ca-file", "{garbage}"], {}, "cloud_ca_file"),
    (
        "server certificate with another's key",
        ["--tls-cert-file", "{edge_server_cert}", "--tls-key-file", "{cloud_key}"],
        {},
        "tls_cert_file",
    ),
    ("HTTP API on the gRPC port", ["--port", "50998", "--http-port", "50998"], {}, "http_port and port"),
    ("extra split dir of another model", ["--extra-split-dirs", "{other}"], {}, "another model"),
    ("local model that is not there", ["--local-model", "{tmp}/none.onnx"], {}, "local_model"),
]


def check_refused(app, prog: str, base: list[str], argv: list[str], env: dict[str, str], words: str, capsys, mp):
    for k, v in env.items():
        mp.setenv(k, v)
    code, err, took_s = run(app, [*base, *argv], capsys)
    assert code == 2, err
    assert err.startswith(f"{prog}: error: ") and err.count("\n") == 1 and words in err, err
    assert took_s < 2.0


@pytest.mark.parametrize(("case", "argv", "env", "words"), CLOUD_CASES, ids=[c[0] for c in CLOUD_CASES])
def test_cloud_refuses_bad_settings_before_any_engine_starts(
    tmp_path, tls, served, capsys, monkeypatch, case, argv, env, words
):
    """Found by an attack run: an edge key shorter than 16 characters was found after the engines
    loaded (40 s, a traceback, exit 1)."""
    from tandem.cloud.cli import app

    base = ["--split-dir", str(split_dir(tmp_path)), "--store-dir", str(tmp_path / "kv")]
    assert run(app, base, capsys)[0] == 0 and served == ["cloud"]  # the base command line is good
    check_refused(app, "tandem-cloud", base, _fill(argv, tmp_path, tls), env, words, capsys, monkeypatch)
    assert served == ["cloud"]


@pytest.mark.parametrize(("case", "argv", "env", "words"), EDGE_CASES, ids=[c[0] for c in EDGE_CASES])
def test_edge_refuses_bad_settings_before_any_model_loads(
    tmp_path, tls, served, capsys, monkeypatch, case, argv, env, words
):
    """Found by an attack run: an API key shorter than 16 characters was found after the heads and
    the local model loaded (exit 1 after 6 s)."""
    from tandem.edge.cli import app

    base = ["--split-dir", str(split_dir(tmp_path))]
    assert run(app, base, capsys)[0] == 0 and served == ["edge"]
    check_refused(app, "tandem-edge", base, _fill(argv, tmp_path, tls), env, words, capsys, monkeypatch)
    assert served == ["edge"]
