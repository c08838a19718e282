"""Start-up checks: every setting that can be checked without a model is checked before one loads.

Each case runs a daemon's command line in this process (``tandem.cloud.cli.app`` /
``tandem.edge.cli.app``) with every loader replaced by one that fails the test: the engines, the
edge's heads and models, serving itself. A bad setting must give one line on stderr and exit code
2 at once; the same command line with the setting fixed must reach serving (so the cases do not
pass by failing on something else). Split directories are toy manifests over tiny parts whose
BLAKE3 the manifest records, as ``tandem-model`` writes them (the checks hash parts, never load
them). Files that would block (a FIFO) run under a time bound that unblocks them and fails.

The kinds are tried member by member: every file setting of either daemon is given a FIFO, a
device and a directory; every port setting a port in use; the split parts are emptied, stripped
of weights and altered; the store URL is taken apart."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.common.protocol.errors import EngineError, InvalidRequest
from tandem.common.protocol.files import open_regular, read_regular
from tandem.common.protocol.manifest import EngineAgreement, SplitManifest, part_blake3
from tandem.common.runtime.startup import FileRole, check_bind, settings_paths
from tests.doubles import toy_manifest

KEY = "k" * 24


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("TANDEM_CLOUD_", "TANDEM_EDGE_")):
            monkeypatch.delenv(k)


def split_dir(root: Path, name: str = "split", manifest: SplitManifest | None = None) -> Path:
    """A split directory: a toy manifest, its parts (a head file, tail and full checkpoints of a
    ``config.json`` and a ``*.safetensors`` file of a few bytes, the tokenizer's files in the full
    checkpoint) and their BLAKE3 in the manifest."""
    m = manifest or toy_manifest()
    d = root / name
    for sub in (m.full_checkpoint, m.tail_checkpoint):
        (d / sub).mkdir(parents=True, exist_ok=True)
        (d / sub / "config.json").write_text('{"model_type": "toy"}')
        (d / sub / "model.safetensors").write_bytes(f"{name}/{sub} weights".encode())
    (d / m.full_checkpoint / "tokenizer.json").write_text("{}")
    (d / m.head_onnx).write_bytes(b"toy head")
    hashes = {
        "head_blake3": part_blake3(d / m.head_onnx),
        "tail_blake3": part_blake3(d / m.tail_checkpoint),
        "checkpoint_blake3": part_blake3(d / m.full_checkpoint),
    }
    m.model_copy(update=hashes).save(d)
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

    monkeypatch.setattr("tandem.cloud.engines.vllm_engines.VllmEngines.__init__", refuse)
    monkeypatch.setattr("tandem.cloud.server.create_cloud", refuse)
    monkeypatch.setattr("tandem.edge.server.create_edge", refuse)
    monkeypatch.setattr("tandem.edge.compute.head.OnnxHead.__init__", refuse)
    monkeypatch.setattr("tandem.cloud.cli.serve", cloud_serve)
    monkeypatch.setattr("tandem.edge.cli.serve", edge_serve)
    return reached


LIMIT_S = 2.0  # a refusal comes at once: the engines take a minute, the edge's models seconds


def run(app, argv: list[str], capsys, limit_s: float = 30.0) -> tuple[int, str, float]:
    """Run ``app(argv)`` under a time bound: a start that blocks (a FIFO opened for reading) is
    released by opening every FIFO under the test's folders for writing, and the test fails."""
    result: list[int] = []
    t0 = time.monotonic()
    worker = threading.Thread(target=lambda: result.append(app(argv)), daemon=True)
    worker.start()
    worker.join(limit_s)
    if worker.is_alive():
        _release_fifos(argv)
        worker.join(5)
        pytest.fail(f"the start blocked for more than {limit_s} s: {capsys.readouterr().err}")
    return result[0], capsys.readouterr().err, time.monotonic() - t0


def _release_fifos(argv: list[str]) -> None:
    for a in argv:
        if Path(a).is_fifo():
            fd = os.open(a, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port another socket listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port bound by a socket that does not listen: connections to it are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def _fill(argv: list[str], tmp: Path, tls, **more) -> list[str]:
    """Placeholders of the case tables: ``{tmp}``, ``{other}`` (a split dir of another model),
    ``{longrope}`` (a split prepared for engines of at most 1024 tokens, as a LongRoPE model's short
    factors are), ``{garbage}`` (a file that is not PEM), the test PKI's files (conftest's ``tls``)
    and ``more``."""
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
        "notjson": _write(tmp / "table.json", "{not json"),
        "ca": tls.ca_file,
        "cloud_cert": tls.cloud[0],
        "cloud_key": tls.cloud[1],
        "edge_cert": tls.edge_client[0],
        "edge_key": tls.edge_client[1],
        "edge_server_cert": tls.edge_server[0],
        **more,
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
    ("store URL of port 0", ["--store-url", "redis://cache:0/0"], {}, "port 0"),
    ("store URL with no host", ["--store-url", "redis://"], {}, "no host"),
    ("store URL with a port but no host", ["--store-url", "redis://:6379/0"], {}, "no host"),
    ("store URL with a db that is not a number", ["--store-url", "redis://cache:6379/notadb"], {}, "not a number"),
    ("store URL with a negative db", ["--store-url", "redis://cache:6379/-1"], {}, "not a number"),
    ("store URL with a db path of two parts", ["--store-url", "redis://cache:6379/0/1"], {}, "not a number"),
    ("store URL with an unknown parameter", ["--store-url", "redis://cache:6379/0?foo=bar"], {}, "query"),
    ("store URL with a db parameter", ["--store-url", "redis://cache:6379?db=3"], {}, "query"),
    ("store URL with a fragment", ["--store-url", "redis://cache:6379/0#x"], {}, "fragment"),
    ("cluster URL with a database", ["--store-url", "redis+cluster://a:7000,b:7001/2"], {}, "no databases"),
    ("cluster URL with an unknown parameter", ["--store-url", "redis+cluster://a:7000?foo=bar"], {}, "query"),
    ("cluster URL with a node of no port", ["--store-url", "redis+cluster://a:7000,b"], {}, "host:port"),
    ("sentinel URL without its service", ["--store-url", "redis+sentinel://s:26379"], {}, "service"),
    ("sentinel URL with a db not a number", ["--store-url", "redis+sentinel://s:26379/svc/x"], {}, "not a number"),
    ("sentinel URL with a longer path", ["--store-url", "redis+sentinel://s:26379/svc/0/1"], {}, "/SERVICE[/DB]"),
    ("store URL of no server", ["--store-url", "redis://127.0.0.1:{closed_port}/0"], {}, "cannot connect"),
    ("store URL with a db beyond the server's", ["--store-url", "redis://127.0.0.1:{redis_port}/99999"], {}, "range"),
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
    ("gRPC port in use", ["--port", "{busy_port}"], {}, "port: cannot bind 127.0.0.1:{busy_port}: the port is in use"),
    ("metrics port in use", ["--metrics-port", "{busy_port}"], {}, "metrics_port: cannot bind"),
    ("gRPC host of another machine", ["--host", "192.0.2.1", "--insecure", "--port", "50999"], {}, "cannot bind"),
    ("gRPC host that does not resolve", ["--host", "no-such-host.invalid", "--insecure"], {}, "does not resolve"),
    ("trace file in no directory", ["--slo-trace-file", "{tmp}/no/trace.jsonl"], {}, "does not exist"),
    ("trace file that is a directory", ["--slo-trace-file", "{tmp}"], {}, "a directory"),
    ("fidelity table that is not JSON", ["--fidelity-tables", "{notjson}"], {}, "not JSON"),
    ("fidelity table that is missing", ["--fidelity-tables", "{tmp}/none.json"], {}, "fidelity_tables"),
    ("store dir that is a file", ["--store-dir", "{garbage}"], {}, "store_dir"),
    ("ready file in no directory", ["--ready-file", "{tmp}/no/ready"], {}, "--ready-file"),
    ("ready file that is a FIFO", ["--ready-file", "{fifo}"], {}, "is a FIFO"),
    ("config file that is a FIFO", ["--config", "{fifo}"], {}, "not a file"),
    ("config file that is a device", ["--config", "/dev/zero"], {}, "not a file"),
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
    ("HTTP port in use", ["--http-port", "{busy_port}"], {}, "http_port: cannot bind 127.0.0.1:{busy_port}"),
    ("gRPC port in use", ["--port", "{busy_port}"], {}, "port: cannot bind 127.0.0.1:{busy_port}"),
    ("extra split dir of another model", ["--extra-split-dirs", "{other}"], {}, "another model"),
    ("local model that is not there", ["--local-model", "{tmp}/none.onnx"], {}, "local_model"),
    ("ready file that is a directory", ["--ready-file", "{tmp}"], {}, "--ready-file"),
    ("config file that is a FIFO", ["--config", "{fifo}"], {}, "not a file"),
]


def check_refused(app, prog: str, base: list[str], argv: list[str], env: dict[str, str], words: str, capsys, mp) -> str:
    for k, v in env.items():
        mp.setenv(k, v)
    code, err, took_s = run(app, [*base, *argv], capsys)
    assert code == 2, err
    assert err.startswith(f"{prog}: error: ") and err.count("\n") == 1 and words in err, err
    assert took_s < LIMIT_S, took_s
    return err


def cloud_base(tmp_path: Path) -> list[str]:
    return ["--split-dir", str(split_dir(tmp_path)), "--store-dir", str(tmp_path / "kv")]


def edge_base(tmp_path: Path) -> list[str]:
    return ["--split-dir", str(split_dir(tmp_path))]


@pytest.mark.parametrize(("case", "argv", "env", "words"), CLOUD_CASES, ids=[c[0] for c in CLOUD_CASES])
def test_cloud_refuses_bad_settings_before_any_engine_starts(
    tmp_path, tls, served, capsys, monkeypatch, busy_port, closed_port, redis_server, fifo, case, argv, env, words
):
    """An edge key shorter than 16 characters, a store URL with no host, a db that is not a number
    (never read as db 0), a db out of range, an unknown query parameter, the gRPC port in use: each
    stops the cloud with exit 2 and one line naming it, before any engine starts."""
    from tandem.cloud.cli import app

    base = cloud_base(tmp_path)
    assert run(app, base, capsys)[0] == 0 and served == ["cloud"]  # the base command line is good
    more = {"busy_port": busy_port, "closed_port": closed_port, "redis_port": redis_server.port, "fifo": fifo}
    words = words.format(busy_port=busy_port)
    check_refused(app, "tandem-cloud", base, _fill(argv, tmp_path, tls, **more), env, words, capsys, monkeypatch)
    assert served == ["cloud"]


def test_cloud_starts_with_a_reachable_store(tmp_path, served, capsys, redis_server):
    """The store checks pass a good URL through: the refusals above are of the URL, not of Redis."""
    from tandem.cloud.cli import app

    code, err, _ = run(app, [*cloud_base(tmp_path), "--store-url", redis_server.url], capsys)
    assert code == 0 and served == ["cloud"], err


@pytest.mark.parametrize(("case", "argv", "env", "words"), EDGE_CASES, ids=[c[0] for c in EDGE_CASES])
def test_edge_refuses_bad_settings_before_any_model_loads(
    tmp_path, tls, served, capsys, monkeypatch, busy_port, fifo, case, argv, env, words
):
    """A bad setting (an API key shorter than 16 characters, the HTTP port in use...) stops the edge
    with exit 2 and one line naming it (the port, for a port in use), before any model loads."""
    from tandem.edge.cli import app

    base = edge_base(tmp_path)
    assert run(app, base, capsys)[0] == 0 and served == ["edge"]
    words = words.format(busy_port=busy_port)
    argv = _fill(argv, tmp_path, tls, busy_port=busy_port, fifo=fifo)
    check_refused(app, "tandem-edge", base, argv, env, words, capsys, monkeypatch)
    assert served == ["edge"]


# ---------------------------------------------------------------- every file setting, every port


def _file_settings(settings_cls) -> list[tuple[str, FileRole | None]]:
    """(setting name, role) of every field of ``settings_cls`` (nested too) whose type holds a Path."""
    from pydantic import BaseModel

    out = []
    for name, field in settings_cls.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += [(f"{name}.{n}", r) for n, r in _file_settings(ann)]
        elif "Path" in str(ann):
            out.append((name, next((m for m in field.metadata if isinstance(m, FileRole)), None)))
    return out


def test_every_path_setting_declares_how_it_is_checked():
    """A Path setting without a ``FileRole`` would skip the start-up check of its file."""
    from tandem.cloud.config import CloudConfig
    from tandem.edge.config import EdgeConfig

    for cls in (CloudConfig, EdgeConfig):
        found = _file_settings(cls)
        assert found and all(role is not None for _, role in found), found


# Files that go together: a setting is tried with its companions set to good files (the test PKI's).
COMPANIONS = {
    "tls_cert_file": {"tls_key_file": "{own_key}"},
    "tls_key_file": {"tls_cert_file": "{own_cert}"},
    "tls_client_ca_file": {"tls_cert_file": "{own_cert}", "tls_key_file": "{own_key}"},
    "cloud_cert_file": {"cloud_key_file": "{edge_key}"},
    "cloud_key_file": {"cloud_cert_file": "{edge_cert}"},
}


def _input_settings(settings_cls) -> list[tuple[str, FileRole]]:
    roles = (FileRole.INPUT, FileRole.MODEL)
    return [(name, role) for name, role in _file_settings(settings_cls) if role in roles]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _file_cases() -> list[tuple[str, str, str]]:
    from tandem.cloud.config import CloudConfig
    from tandem.edge.config import EdgeConfig

    cases = []
    for daemon, cls in (("cloud", CloudConfig), ("edge", EdgeConfig)):
        for name, role in _input_settings(cls):  # a model may be a folder: one holding a FIFO is refused
            folder = "directory" if role is FileRole.INPUT else "directory with a FIFO"
            cases += [(daemon, name, kind) for kind in ("fifo", "device", folder)]
    return cases


@pytest.mark.parametrize(("daemon", "setting", "kind"), _file_cases(), ids=lambda v: str(v))
def test_every_input_file_setting_refuses_what_is_not_a_regular_file(
    tmp_path, tls, served, capsys, monkeypatch, fifo, daemon, setting, kind
):
    """A FIFO given as a TLS file hung the start (its read never returned). Every file setting of
    either daemon, given a FIFO, a device or a directory, is refused by the file's type at once,
    with its setting named; the FIFO is never opened."""
    from tandem.cloud.cli import app as cloud_app
    from tandem.edge.cli import app as edge_app

    app, prog, base = (
        (cloud_app, "tandem-cloud", cloud_base(tmp_path))
        if daemon == "cloud"
        else (edge_app, "tandem-edge", edge_base(tmp_path))
    )
    own = tls.cloud if daemon == "cloud" else tls.edge_server
    holder = tmp_path / "model-folder"
    holder.mkdir()
    os.mkfifo(holder / "model.onnx")
    bad = {"fifo": fifo, "device": Path(os.devnull), "directory": tmp_path, "directory with a FIFO": holder}[kind]
    argv = [_flag(setting), str(bad)]
    for other, value in COMPANIONS.get(setting, {}).items():
        argv += [_flag(other), value]
    argv = _fill(argv, tmp_path, tls, own_cert=own[0], own_key=own[1])
    err = check_refused(app, prog, base, argv, {}, setting, capsys, monkeypatch)
    words = {"fifo": "is a FIFO", "device": "is a character device", "directory": "is a directory"}
    assert words.get(kind, "model.onnx is a FIFO") in err, err


def _port_cases() -> list[tuple[str, str]]:
    from tandem.cloud.config import CloudConfig
    from tandem.common.runtime.startup import SERVER_PORTS
    from tandem.edge.config import EdgeConfig

    return [
        (daemon, port_name)
        for daemon, cls in (("cloud", CloudConfig), ("edge", EdgeConfig))
        for port_name, _host in SERVER_PORTS
        if port_name in cls.model_fields
    ]


def test_every_port_setting_is_a_server_the_check_binds():
    """A port setting outside ``SERVER_PORTS`` would be neither bound at start nor kept apart from
    the others."""
    from tandem.cloud.config import CloudConfig
    from tandem.common.runtime.startup import SERVER_PORTS
    from tandem.edge.config import EdgeConfig

    for cls in (CloudConfig, EdgeConfig):
        ports = {n for n in cls.model_fields if n == "port" or n.endswith("_port")}
        assert ports == {p for p, h in SERVER_PORTS if p in cls.model_fields}, ports
        assert all(h in cls.model_fields for p, h in SERVER_PORTS if p in cls.model_fields)


@pytest.mark.parametrize(("daemon", "setting"), _port_cases(), ids=lambda v: str(v))
def test_every_port_setting_in_use_is_refused_naming_the_port(
    tmp_path, served, capsys, monkeypatch, busy_port, daemon, setting
):
    """Every port setting of either daemon that is in use stops it with exit 2 and one line naming
    the setting and the port: each server's port is bound once before any model loads."""
    from tandem.cloud.cli import app as cloud_app
    from tandem.edge.cli import app as edge_app

    app, prog, base = (
        (cloud_app, "tandem-cloud", cloud_base(tmp_path))
        if daemon == "cloud"
        else (edge_app, "tandem-edge", edge_base(tmp_path))
    )
    words = f"{setting}: cannot bind 127.0.0.1:{busy_port}: the port is in use"
    check_refused(app, prog, base, [_flag(setting), str(busy_port)], {}, words, capsys, monkeypatch)


# ---------------------------------------------------------------- split directories


def _empty(d: Path) -> None:
    for p in d.iterdir():
        p.unlink()


SPLIT_CASES = [
    # (case, daemons, change to the split dir, words)
    ("tail folder empty", ("cloud",), lambda d: _empty(d / "t"), "has no config.json"),
    ("tail without weights", ("cloud",), lambda d: (d / "t" / "model.safetensors").unlink(), "no *.safetensors"),
    ("tail weights altered", ("cloud",), lambda d: (d / "t" / "model.safetensors").write_bytes(b"x"), "BLAKE3"),
    ("tail folder missing", ("cloud",), lambda d: [_empty(d / "t"), (d / "t").rmdir()], "is missing"),
    ("tail folder is a file", ("cloud",), lambda d: [_empty(d / "t"), (d / "t").rmdir(), _write(d / "t", "")], "not a"),
    ("FIFO in the tail", ("cloud",), lambda d: os.mkfifo(d / "t" / "model-2.safetensors"), "a FIFO"),
    ("full checkpoint altered", ("cloud",), lambda d: _write(d / "hf" / "config.json", "{}"), "BLAKE3"),
    ("head altered", ("edge",), lambda d: (d / "h.onnx").write_bytes(b"other head"), "BLAKE3"),
    ("head is a FIFO", ("edge",), lambda d: [(d / "h.onnx").unlink(), os.mkfifo(d / "h.onnx")], "a FIFO"),
    ("tokenizer files missing", ("edge",), lambda d: (d / "hf" / "tokenizer.json").unlink(), "tokenizer.json"),
    (
        "manifest is a FIFO",
        ("cloud", "edge"),
        lambda d: [(d / "manifest.json").unlink(), os.mkfifo(d / "manifest.json")],
        "a FIFO",
    ),
    ("manifest not JSON", ("cloud", "edge"), lambda d: _write(d / "manifest.json", "{"), "unreadable manifest.json"),
]


@pytest.mark.parametrize(
    ("case", "daemon", "change", "words"),
    [(c, d, f, w) for c, ds, f, w in SPLIT_CASES for d in ds],
    ids=[f"{c}-{d}" for c, ds, _, _ in SPLIT_CASES for d in ds],
)
def test_split_dir_parts_are_checked_against_the_manifest_before_any_model_loads(
    tmp_path, served, capsys, monkeypatch, case, daemon, change, words
):
    """Each part of a split dir a daemon loads must be present, of regular files, and of the BLAKE3
    its manifest records: an empty or missing tail folder, missing or altered weights, a FIFO stop
    the daemon with exit 2 and one line, before any model loads."""
    from tandem.cloud.cli import app as cloud_app
    from tandem.edge.cli import app as edge_app

    app, prog, base = (
        (cloud_app, "tandem-cloud", cloud_base(tmp_path))
        if daemon == "cloud"
        else (edge_app, "tandem-edge", edge_base(tmp_path))
    )
    change(tmp_path / "split")
    check_refused(app, prog, base, [], {}, words, capsys, monkeypatch)
    assert served == []


def test_a_direct_manifest_has_no_head_or_tail_to_check(tmp_path, served, capsys):
    """A direct-mode split (k = 0) names no head and no tail: only the full checkpoint is checked."""
    from tandem.cloud.cli import app

    d = split_dir(tmp_path)
    m = SplitManifest.load(d).model_copy(
        update={"split_layer": 0, "head_onnx": "", "tail_checkpoint": "", "tail_blake3": ""}
    )
    m.save(d)
    code, err, _ = run(app, ["--split-dir", str(d), "--store-dir", str(tmp_path / "kv")], capsys)
    assert code == 0 and served == ["cloud"], err


def test_the_real_model_passes_its_own_check(served, capsys, tmp_path):
    """The prepared model's split directories pass, hashes and all, well within the bound."""
    from tandem.cloud.cli import app as cloud_app
    from tandem.edge.cli import app as edge_app
    from tests.helpers import SPLIT_DIR

    if not (SPLIT_DIR / "manifest.json").is_file():
        pytest.skip("no prepared model (make model)")
    code, err, took_s = run(cloud_app, ["--split-dir", str(SPLIT_DIR), "--store-dir", str(tmp_path / "kv")], capsys)
    assert code == 0, err
    code, err, _ = run(edge_app, ["--split-dir", str(SPLIT_DIR)], capsys)
    assert code == 0 and served == ["cloud", "edge"], err
    assert took_s < 10.0, took_s


# ---------------------------------------------------------------- the pieces


def test_open_regular_refuses_by_type_without_opening(tmp_path, fifo):
    """A FIFO with no writer would block ``open``; it is refused by its type, and a regular file reads."""
    t0 = time.monotonic()
    for path, kind in ((fifo, "a FIFO"), (Path(os.devnull), "a character device"), (tmp_path, "a directory")):
        with pytest.raises(InvalidRequest, match=f"is {kind}, not a regular file"):
            open_regular(path, "some_file")
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(InvalidRequest, match="some_file: cannot read"):
        read_regular(tmp_path / "none", "some_file")
    assert read_regular(_write(tmp_path / "f", "abc"), "f") == b"abc"


def test_tls_file_reads_refuse_a_fifo_at_run_time_too(fifo):
    """The servers' credentials read their PEM files with the same reader."""
    from tandem.common.runtime.grpc_setup import server_credentials

    with pytest.raises(InvalidRequest, match="tls_key_file: .* is a FIFO"):
        server_credentials(fifo, fifo, None)


def test_check_bind_names_the_port_in_use(busy_port):
    with pytest.raises(InvalidRequest, match=f"grpc: cannot bind 127.0.0.1:{busy_port}: the port is in use"):
        check_bind("127.0.0.1", busy_port, "grpc")
    check_bind("127.0.0.1", 0, "any")  # a free port binds
    check_bind("localhost", 0, "any")


def test_store_reachability_is_checked_without_changing_the_server(redis_server):
    import redis

    from tandem.cloud.store.redis_store import check_store_reachable

    r = redis.Redis.from_url(redis_server.url)
    before = r.config_get("maxmemory*")
    check_store_reachable(redis_server.url)
    assert r.config_get("maxmemory*") == before
    with pytest.raises(InvalidRequest, match="DB index is out of range"):
        check_store_reachable(f"redis://127.0.0.1:{redis_server.port}/99999")
    with pytest.raises(EngineError, match="cannot connect"):
        check_store_reachable("redis://127.0.0.1:1/0", timeout_s=0.5)
    r.close()


def test_a_store_password_the_server_refuses_is_found_at_start(tmp_path, monkeypatch):
    from tandem.cloud.store.blocks import PASSWORD_ENV
    from tandem.cloud.store.redis_store import check_store_reachable
    from tests.helpers import RedisServer

    server = RedisServer(tmp_path, password="right-password-16")
    try:
        for given in ("", "wrong-password-16"):
            monkeypatch.setenv(PASSWORD_ENV, given)
            with pytest.raises(InvalidRequest, match="the server refused"):
                check_store_reachable(server.url)
        monkeypatch.setenv(PASSWORD_ENV, "right-password-16")
        check_store_reachable(server.url)
    finally:
        server.stop()


def test_settings_paths_walks_nested_and_listed_paths(tmp_path):
    from tandem.cloud.config import CloudConfig

    cfg = CloudConfig(fidelity_tables=[tmp_path / "a.json", tmp_path / "b.json"], slo_trace_file=tmp_path / "t")
    found = {(name, role) for name, _path, role in settings_paths(cfg)}
    assert ("fidelity_tables", FileRole.INPUT) in found and ("slo_trace_file", FileRole.APPEND) in found
    assert sum(1 for name, _p, _r in settings_paths(cfg) if name == "fidelity_tables") == 2


def test_a_stale_ready_file_is_removed_before_serving(tmp_path, served, capsys):
    """A ready file left by an earlier run would say "serving" before this process does."""
    from tandem.cloud.cli import app as cloud_app
    from tandem.edge.cli import app as edge_app

    for app, base in ((cloud_app, cloud_base(tmp_path)), (edge_app, edge_base(tmp_path))):
        ready = _write(tmp_path / "ready", "50051")
        code, err, _ = run(app, [*base, "--ready-file", str(ready)], capsys)
        assert code == 0 and not ready.exists(), err  # serve (replaced here) writes it
    assert served == ["cloud", "edge"]


def test_the_default_local_model_is_checked_by_type_too(tmp_path, served, capsys, monkeypatch):
    """Without ``local_model``, the edge reads ``edge-decoder/`` or ``edge-full.onnx`` beside the split
    directory: a FIFO there is refused before anything reads it."""
    from tandem.common.protocol.manifest import FULL_ONNX
    from tandem.edge.cli import app

    base = edge_base(tmp_path)
    os.mkfifo(tmp_path / FULL_ONNX)
    check_refused(app, "tandem-edge", base, [], {}, "local model", capsys, monkeypatch)
    code, err, _ = run(app, [*base, "--no-local"], capsys)  # local mode off: not read, not checked
    assert code == 0 and served == ["edge"], err


def test_a_builder_head_the_manifest_names_is_checked_by_type_too(tmp_path, served, capsys, monkeypatch):
    """The edge reads the builder head a split's manifest names (``split-k<k>/head-builder/``): a FIFO
    in it is refused before anything reads it; with ``--no-builder-head`` it is not read."""
    from tandem.edge.cli import app

    d = split_dir(tmp_path, manifest=toy_manifest().model_copy(update={"builder_head": "head-builder"}))
    (d / "head-builder").mkdir()
    (d / "head-builder" / "genai_config.json").write_text("{}")
    os.mkfifo(d / "head-builder" / "model.onnx")
    check_refused(
        app, "tandem-edge", ["--split-dir", str(d), "--no-local"], [], {}, "builder head", capsys, monkeypatch
    )
    code, err, _ = run(app, ["--split-dir", str(d), "--no-local", "--no-builder-head"], capsys)
    assert code == 0 and served == ["edge"], err
