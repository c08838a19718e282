"""Settings of both daemons: precedence (flag > env > config file > default), nested engine
settings, sizes with units, ``--version``, one-line user errors with exit code 2, and
docs/configuration.md being the generated reference. No model is loaded, no engine started."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ByteSize, ValidationError

from tandem import __version__
from tandem.cloud.config import CloudConfig, EngineConfig
from tandem.common.protocol.params import Codec, WireDtype
from tandem.common.runtime.cli import parse_command_line
from tandem.common.runtime.settings import ConfigFileError, UserError
from tandem.edge.config import EdgeConfig

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No TANDEM_CLOUD_* / TANDEM_EDGE_* from the caller's environment."""
    for k in list(os.environ):
        if k.startswith(("TANDEM_CLOUD_", "TANDEM_EDGE_")):
            monkeypatch.delenv(k)


def toml(tmp_path: Path, text: str, name: str = "cfg.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def cloud(argv: list[str]) -> CloudConfig:
    return parse_command_line(CloudConfig, "tandem-cloud", argv).settings


def edge(argv: list[str]) -> EdgeConfig:
    return parse_command_line(EdgeConfig, "tandem-edge", argv).settings


# --- precedence -------------------------------------------------------------------------------


def test_cloud_precedence_flag_env_file_default(tmp_path, monkeypatch):
    f = toml(
        tmp_path, "port = 1111\nstore_bytes = '2GiB'\nmax_prompt_tokens = 100\nhost = '10.0.0.1'\ninsecure = true\n"
    )
    monkeypatch.setenv("TANDEM_CLOUD_PORT", "2222")
    monkeypatch.setenv("TANDEM_CLOUD_STORE_BYTES", "3GiB")
    cfg = cloud(["--config", str(f), "--port", "3333"])
    assert cfg.port == 3333  # flag > env > file
    assert cfg.store_bytes == 3 << 30  # env > file
    assert cfg.max_prompt_tokens == 100  # file > default
    assert cfg.host == "10.0.0.1"
    assert cfg.max_new_tokens == 512  # default
    monkeypatch.delenv("TANDEM_CLOUD_PORT")
    assert cloud(["--config", str(f)]).port == 1111
    assert cloud([]).port == 50051


def test_edge_precedence_flag_env_file_default(tmp_path, monkeypatch):
    f = toml(
        tmp_path,
        "cloud_insecure = true\ncloud_target = 'file:1'\nsession_bytes = '64MiB'\nturn_timeout_s = 10\nmax_batch = 2\n",
    )
    monkeypatch.setenv("TANDEM_EDGE_CONFIG", str(f))  # the file named by the environment
    monkeypatch.setenv("TANDEM_EDGE_CLOUD_TARGET", "env:2")
    monkeypatch.setenv("TANDEM_EDGE_SESSION_BYTES", "128MiB")
    cfg = edge(["--cloud", "flag:3"])
    assert cfg.cloud_target == "flag:3"
    assert cfg.session_bytes == 128 << 20
    assert cfg.turn_timeout_s == 10.0
    assert cfg.max_batch == 2
    assert cfg.keepalive_time_s == 5.0
    assert edge(["--cloud-target", "flag:4"]).cloud_target == "flag:4"
    assert edge([]).cloud_target == "env:2"


def test_config_flag_beats_config_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CLOUD_CONFIG", str(toml(tmp_path, "port = 1\n", "env.toml")))
    run = parse_command_line(CloudConfig, "tandem-cloud", ["--config", str(toml(tmp_path, "port = 2\n"))])
    assert run.settings.port == 2 and run.config_file == tmp_path / "cfg.toml"
    assert cloud([]).port == 1


def test_keyword_arguments_rank_first_in_code(monkeypatch):
    monkeypatch.setenv("TANDEM_CLOUD_PORT", "2222")
    monkeypatch.setenv("TANDEM_CLOUD_CHUNK_TOKENS", "32")
    cfg = CloudConfig(split_dir=Path("/x"), port=0)
    assert cfg.port == 0 and cfg.chunk_tokens == 32


def test_nested_engine_from_flag_env_and_file(tmp_path, monkeypatch):
    f = toml(tmp_path, "[engine]\nmax_num_seqs = 3\nkv_cache_bytes = '512MiB'\nmax_model_len_tokens = 1024\n")
    monkeypatch.setenv("TANDEM_CLOUD_ENGINE__MAX_NUM_SEQS", "4")
    monkeypatch.setenv("TANDEM_CLOUD_ENGINE__DTYPE", "bfloat16")
    cfg = cloud(["--config", str(f), "--engine.block-size-tokens", "64", "--no-engine.enforce-eager"])
    e = cfg.engine
    assert (e.max_num_seqs, e.kv_cache_bytes, e.max_model_len_tokens) == (4, 512 << 20, 1024)
    assert (e.block_size_tokens, e.enforce_eager, e.dtype) == (64, False, "bfloat16")
    assert e.max_num_batched_tokens == 4096
    # the flat aliases (tandem/daemons.py and the benchmarks pass them)
    e = cloud(["--max-num-seqs", "5", "--kv-cache-bytes", str(256 << 20)]).engine
    assert (e.max_num_seqs, e.kv_cache_bytes) == (5, 256 << 20)
    # dotted TOML keys are the same keys
    monkeypatch.delenv("TANDEM_CLOUD_ENGINE__MAX_NUM_SEQS")
    assert cloud(["--config", str(toml(tmp_path, "engine.max_num_seqs = 7\n", "d.toml"))]).engine.max_num_seqs == 7


# --- values -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,n", [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("1.5GiB", 3 << 29), ("2GB", 2 * 10**9), ("1234", 1234)]
)
def test_sizes_with_units(text, n, monkeypatch):
    """Byte settings accept binary and decimal units (GiB, MiB, GB) and plain numbers, on the command line and
    in the environment."""
    assert cloud(["--store-bytes", text]).store_bytes == n
    monkeypatch.setenv("TANDEM_EDGE_SESSION_BYTES", text)
    assert edge([]).session_bytes == n


def test_sizes_are_ints_and_keyword_ints_still_work():
    cfg = CloudConfig(
        split_dir=Path("/x"), port=0, store_bytes=1 << 30, engine=EngineConfig(max_num_seqs=8, kv_cache_bytes=512 << 20)
    )
    assert isinstance(cfg.engine.kv_cache_bytes, ByteSize) and isinstance(cfg.engine.kv_cache_bytes, int)
    assert cfg.engine.kv_cache_bytes == 512 << 20 and cfg.store_bytes // (1 << 20) == 1024
    assert isinstance(EngineConfig().kv_cache_bytes, ByteSize) and EngineConfig().kv_cache_bytes == 1 << 30
    assert (
        EdgeConfig(
            split_dir=Path("/x"), cloud_target="h:1", cloud_insecure=True, host="127.0.0.1", port=0
        ).session_bytes
        == 512 << 20
    )
    with pytest.raises(ValidationError):
        CloudConfig(store_bytes="4 parsecs")


def test_defaults_and_safe_bind_addresses():
    c, e = CloudConfig(), EdgeConfig()
    assert c.host == e.host == "127.0.0.1"
    for cfg in (c, e):
        assert (cfg.metrics_port, cfg.metrics_host, cfg.log_format, cfg.log_level) == (0, "127.0.0.1", "text", "INFO")
        assert (cfg.otel_enabled, cfg.otel_endpoint, cfg.drain_grace_s) == (False, None, 30.0)
    assert (e.http_port, e.http_host) == (None, "127.0.0.1")
    # fp16 first, fp32, then the formats the fidelity tables qualify (test_fidelity.py checks which);
    # KV blocks also bf16: a bf16 engine's KV goes down remote prefill's downlink unchanged
    assert c.wire_dtypes[:2] == [WireDtype.FP16, WireDtype.FP32]
    assert c.kv_wire_dtypes[:3] == e.kv_wire_dtypes[:3] == [WireDtype.FP16, WireDtype.BF16, WireDtype.FP32]
    assert c.codecs == [Codec.NONE, Codec.ZSTD] and c.fidelity_tables == []
    assert e.wire_dtypes[0] == e.kv_wire_dtypes[0] == WireDtype.FP16
    assert (e.local, e.local_model, e.extra_split_dirs, c.extra_split_dirs) == (True, None, [], [])


def test_enums_bools_optionals_and_levels(monkeypatch):
    cfg = cloud(["--wire-dtypes", "fp16,FP32", "--codecs", "ZSTD", "--otel-enabled", "--log-level", "debug"])
    assert (cfg.wire_dtypes, cfg.codecs) == ([WireDtype.FP16, WireDtype.FP32], [Codec.ZSTD])
    assert (cfg.otel_enabled, cfg.log_level) == (True, "DEBUG")
    assert cloud(["--extra-split-dirs", "a", "--extra-split-dirs", "b"]).extra_split_dirs == [Path("a"), Path("b")]
    monkeypatch.setenv("TANDEM_EDGE_HTTP_PORT", "8080")
    monkeypatch.setenv("TANDEM_EDGE_OTEL_ENABLED", "true")
    assert edge([]).http_port == 8080 and edge([]).otel_enabled
    assert edge(["--http-port", "none", "--no-otel-enabled"]).http_port is None
    monkeypatch.setenv("TANDEM_EDGE_HTTP_PORT", "none")
    monkeypatch.setenv("TANDEM_EDGE_OTEL_ENDPOINT", "http://collector:4317")
    assert edge([]).http_port is None and edge([]).otel_endpoint == "http://collector:4317"
    assert edge(["--otel-endpoint", "None"]).otel_endpoint is None
    with pytest.raises(UserError, match="log_level"):
        cloud(["--log-level", "loud"])
    # an unknown name is refused with the names a user can write, not the enum's numbers
    names = r"must be one of fp32, fp16, bf16, int8, int4, int8_hadamard, int4_hadamard \(got 'fp33'\)"
    with pytest.raises(UserError, match=r"wire_dtypes\.0: " + names):
        edge(["--wire-dtypes", "fp33"])
    with pytest.raises(UserError, match=r"kv_wire_dtypes\.1: " + names):
        cloud(["--kv-wire-dtypes", "fp16,fp33"])
    with pytest.raises(UserError, match=r"codecs\.0: must be one of none, zstd"):
        cloud(["--codecs", "lz5"])


def test_settings_are_frozen():
    with pytest.raises(ValidationError):
        CloudConfig().port = 1  # type: ignore[misc]


def test_in_process_errors(tmp_path):
    """Unknown flags, a missing or invalid config file, an unknown setting in it and out-of-range values raise
    UserError or ConfigFileError naming the problem."""
    with pytest.raises(UserError, match="unrecognized arguments: --nope"):
        cloud(["--nope", "1"])
    with pytest.raises(ConfigFileError, match="no such file"):
        cloud(["--config", str(tmp_path / "missing.toml")])
    with pytest.raises(ConfigFileError, match="invalid TOML"):
        edge(["--config", str(toml(tmp_path, "port = [\n"))])
    with pytest.raises(UserError, match="unknown setting 'engine.bogus'"):
        cloud(["--config", str(toml(tmp_path, "[engine]\nbogus = 1\n", "x.toml"))])
    with pytest.raises(UserError, match=r"port: Input should be less than or equal to 65535"):
        edge(["--port", "70000"])


# --- console scripts --------------------------------------------------------------------------


def run_script(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_CLOUD_", "TANDEM_EDGE_"))}
    return subprocess.run([str(BIN / name), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.parametrize("name", ["tandem-cloud", "tandem-edge"])
def test_version(name):
    """--version prints tandem and the package version and exits 0."""
    r = run_script(name, "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"tandem {__version__}"


def _cases(tmp: Path) -> list[tuple[list[str], str]]:
    (tmp / "bad.toml").write_text("port = [\n")
    (tmp / "empty-split").mkdir(exist_ok=True)
    return [
        (["--port", "not-a-port"], "port"),
        (["--session-bytes", "4 parsecs"], "session_bytes"),
        (["--no-such-flag"], "unrecognized arguments"),
        (["--config", str(tmp / "missing.toml")], "no such file"),
        (["--config", str(tmp / "bad.toml")], "invalid TOML"),
        (["--split-dir", str(tmp / "empty-split")], "manifest.json"),
    ]


@pytest.mark.parametrize("name", ["tandem-cloud", "tandem-edge"])
def test_user_errors_are_one_line_and_exit_2(name, tmp_path):
    for args, what in _cases(tmp_path):
        r = run_script(name, *args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, (args, r.stderr)
        assert lines[0].startswith(f"{name}: error: ") and what in lines[0], (args, lines[0])


def test_user_error_in_process_loads_no_engine(tmp_path, capsys):
    from tandem.cloud.cli import app as cloud_app
    from tandem.edge.cli import app as edge_app

    for app, name in ((cloud_app, "tandem-cloud"), (edge_app, "tandem-edge")):
        assert app(["--split-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"{name}: error: split dir") and err.count("\n") == 1


def test_help_lists_every_setting():
    r = run_script("tandem-cloud", "--help")
    assert r.returncode == 0
    for flag in ("--config", "--ready-file", "--version", "--engine.max-num-seqs", "--drain-grace-s", "--metrics-port"):
        assert flag in r.stdout


# --- docs/configuration.md --------------------------------------------------------------------


def _gen_configuration():
    spec = importlib.util.spec_from_file_location("gen_configuration", ROOT / "docs" / "gen_configuration.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_configuration_reference_is_generated_and_current():
    section = (ROOT / "docs" / "configuration.md").read_text()
    assert section == _gen_configuration().render(), "stale: run `python docs/gen_configuration.py` (make docs)"
    for cls in (CloudConfig, EdgeConfig):
        for name, info in cls.model_fields.items():
            assert info.description, f"{cls.__name__}.{name} has no description"
            assert f"`{name}`" in section or name == "engine"
    for name, info in EngineConfig.model_fields.items():
        assert info.description and f"`engine.{name}`" in section


def test_configuration_check_fails_on_a_stale_file(tmp_path):
    gen = _gen_configuration()
    out = tmp_path / "configuration.md"
    assert gen.main(["--check", "--out", str(out)]) == 1  # missing
    assert gen.main(["--out", str(out)]) == 0 and gen.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text() + "| a row no model has |\n")
    assert gen.main(["--check", "--out", str(out)]) == 1


def test_common_imports_neither_daemon():
    """``tandem.common`` is shared by both daemons: none of its modules imports ``tandem.edge`` or
    ``tandem.cloud`` (the configuration reference's generator lives in docs/)."""
    offenders = [
        f"{p.name}:{n}"
        for p in sorted((ROOT / "common").glob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.match(r"\s*(from|import)\s+tandem\.(edge|cloud)\b", line)
    ]
    assert not offenders, offenders


@pytest.mark.parametrize("cpu", [True, False], ids=["cpu-build", "gpu-build"])
def test_engine_defaults_follow_the_installed_vllm_build(monkeypatch, cpu):
    """The CPU build runs fp32 and eager with a 1 GiB cache per engine; a GPU runs the checkpoint's
    dtype with CUDA graphs and compilation, each engine sized by its memory share on its device."""
    from tandem.cloud import config

    monkeypatch.setattr(config, "vllm_is_cpu_build", lambda: cpu)
    e = config.EngineConfig()
    tail, decode = e.for_engine("tail", cpu=cpu), e.for_engine("decode", cpu=cpu)
    if cpu:
        assert (tail.dtype, tail.enforce_eager, tail.kv_cache_bytes, tail.gpu) == ("float32", True, 1 << 30, None)
    else:
        assert (tail.dtype, tail.enforce_eager, tail.kv_cache_bytes) == ("auto", False, None)
        assert (tail.gpu, decode.gpu, tail.gpu_memory_utilization, decode.gpu_memory_utilization) == (0, 0, 0.2, 0.5)
    pinned = config.EngineConfig(dtype="bfloat16", enforce_eager=True, kv_cache_bytes=1 << 28, decode_gpu=1)
    d = pinned.for_engine("decode", cpu=cpu)
    assert (d.dtype, d.enforce_eager, d.kv_cache_bytes, d.gpu) == ("bfloat16", True, 1 << 28, None if cpu else 1)


def test_engines_on_one_gpu_must_fit_it_together():
    from tandem.cloud.config import EngineConfig

    EngineConfig().check_gpu_shares(2)  # 0.2 + 0.2 + 0.5
    with pytest.raises(ValueError, match=r"GPU 0 would hold tail 0.2 \+ tail 0.2 \+ tail 0.2 \+ decode 0.5 = 1.10"):
        EngineConfig().check_gpu_shares(3)
    EngineConfig(decode_gpu=1).check_gpu_shares(3)  # separate GPUs: 0.6 and 0.5
    with pytest.raises(ValueError, match="GPU 1 would hold"):
        EngineConfig(tail_gpu_memory_utilization=0.5, decode_gpu=1, tensor_parallel_size=2).check_gpu_shares(1)


def test_an_engine_is_placed_on_its_devices_among_those_visible(monkeypatch):
    from tandem.cloud.engines.start import placed_on, visible_devices
    from tandem.common.protocol.errors import EngineError

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_devices(1, 2) == "1,2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    assert visible_devices(1, 2) == "6,7"
    with pytest.raises(EngineError, match="CUDA_VISIBLE_DEVICES=4,6,7"):
        visible_devices(2, 2)
    import os

    with placed_on(1, 1):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6,7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with placed_on(0, 1):
        assert "CUDA_VISIBLE_DEVICES" not in os.environ  # device 0 alone: nothing to change
    with placed_on(None, 1):
        assert "CUDA_VISIBLE_DEVICES" not in os.environ  # the CPU build
