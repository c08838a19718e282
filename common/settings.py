"""Settings of the daemons: sources and their precedence, the command-line runner, the reference tables.

``tandem-cloud`` and ``tandem-edge`` each read one typed, frozen pydantic-settings model
(``tandem.cloud.config.CloudConfig``, ``tandem.edge.config.EdgeConfig``). Every setting can be set
four ways; the first in this list that sets it wins:

1. a command-line flag (``--store-bytes 8GiB``; nested ``--engine.max-num-seqs 4``),
2. an environment variable, ``TANDEM_CLOUD_`` / ``TANDEM_EDGE_`` + the name in capitals, nested
   settings joined with ``__`` (``TANDEM_CLOUD_ENGINE__MAX_NUM_SEQS=4``),
3. the TOML config file named by ``--config FILE`` or, without the flag, by ``TANDEM_CLOUD_CONFIG`` /
   ``TANDEM_EDGE_CONFIG`` (keys are the field names; nested settings in a table, ``[engine]``),
4. the default in the model.

Built in code (``CloudConfig(port=0, ...)``, as the tests do), keyword arguments take the place of
flags: keyword > environment > config file > default.

Sizes (fields ending ``_bytes``) are ``pydantic.ByteSize``: an int, or a number with a unit
(``512MiB``, ``4GiB``; ``KB``/``MB``/``GB`` are powers of 1000); durations end in ``_s`` or ``_ms``.

``parse_command_line`` builds the flags from the model with pydantic-settings' ``CliSettingsSource``
on an argparse parser that also has ``--version``, ``--config`` and ``--ready-file``; ``run_cli``
turns every user error (bad value, unknown flag or key, missing or malformed config file, a split
directory without a manifest) into one line on stderr, ``PROG: error: ...``, and exit code 2.

``iter_settings`` and ``settings_table`` describe a settings model as reference rows and a markdown
table; ``docs/gen_configuration.py`` (outside the runtime packages) writes ``docs/configuration.md``
from them. This module imports neither daemon's config.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import sys
import tomllib
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Generic, Literal, NoReturn, Self, TypeVar

from pydantic import BaseModel, BeforeValidator, ByteSize, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from tandem.common.errors import InvalidRequest
from tandem.common.security import check_tls_files, is_loopback
from tandem.common.text import find_non_text
from tandem.common.wire import Codec, WireDtype


class UserError(Exception):
    """A mistake in what the user gave (flags, environment, config file, paths): one line, exit code 2."""


class ConfigFileError(UserError):
    """The config file is missing, unreadable or not valid TOML."""


# ---------------------------------------------------------------------------------------------
# Shared field types


def gib(n: int) -> ByteSize:
    return ByteSize(n << 30)


def kib(n: int) -> ByteSize:
    return ByteSize(n << 10)


def mib(n: int) -> ByteSize:
    return ByteSize(n << 20)


def enum_by_name(enum_cls: type[enum.Enum]) -> BeforeValidator:
    """Accept an enum member by its name in any case (``fp16``, ``FP16``) besides its value."""

    def parse(v: Any) -> Any:
        if isinstance(v, str) and not isinstance(v, enum.Enum):
            by_name = {m.name.lower(): m for m in enum_cls}
            if v.strip().lower() in by_name:
                return by_name[v.strip().lower()]
        return v

    return BeforeValidator(parse)


def split_list(v: Any) -> Any:
    """A list setting given as one string, from any source: a JSON list (``'["fp16", "fp32"]'``) or
    a comma list (``fp16,fp32``; spaces around items dropped, ``""`` is the empty list); one item
    that a source already converted (the command line turns ``--codecs ZSTD`` into the enum) is a
    list of it."""
    if v is None or isinstance(v, list | tuple):
        return v
    if not isinstance(v, str):
        return [v]
    text = v.strip()
    if text.startswith("["):
        try:
            return json.loads(text)
        except ValueError as e:
            raise ValueError(f"not a JSON list: {e}") from None
    return [item.strip() for item in text.split(",") if item.strip()]


T = TypeVar("T")
# a list setting: the same forms from flag, environment and config file (``split_list``); NoDecode
# keeps the environment source from insisting on JSON
ListSetting = Annotated[list[T], NoDecode, BeforeValidator(split_list)]

WireDtypeSetting = Annotated[WireDtype, enum_by_name(WireDtype)]  # also "fp16", "FP16"
CodecSetting = Annotated[Codec, enum_by_name(Codec)]


def _log_level(v: Any) -> Any:
    if isinstance(v, str):
        name = v.strip().upper()
        if name not in {"CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"}:
            raise ValueError("log level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
        return name
    return v


def _none_str(v: Any) -> Any:
    return None if isinstance(v, str) and v.strip().lower() in ("", "none") else v


def checked(check: Callable[..., Any], *args: Any) -> Any:
    """``check(*args)``, a check shared with run time that raises ``InvalidRequest``, as a pydantic
    validator: its error becomes a ``ValueError`` (one line of the settings' error)."""
    try:
        return check(*args)
    except InvalidRequest as e:
        raise ValueError(str(e)) from None


# Bounds every setting of a kind shares, from what its consumers accept:
MAX_INT32 = 2**31 - 1  # counts fit the wire's int32 / uint32 fields (chunk tokens, prompt tokens, batch)
MAX_SECONDS = MAX_INT32 / 1000  # 24.8 days: gRPC takes durations as int32 milliseconds (keepalive)
MAX_BYTES = 2**63 - 1  # sizes fit the stores' int64 (sqlite) bookkeeping
Count = Annotated[int, Field(ge=1, le=MAX_INT32)]  # at least one
Count0 = Annotated[int, Field(ge=0, le=MAX_INT32)]  # zero allowed (each field says what 0 means)
Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS, allow_inf_nan=False)]  # a positive, finite duration
Seconds0 = Annotated[float, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False)]
Millis = Annotated[float, Field(gt=0, le=MAX_SECONDS * 1000, allow_inf_nan=False)]
Bytes = Annotated[ByteSize, Field(ge=0, le=MAX_BYTES)]
PositiveBytes = Annotated[ByteSize, Field(gt=0, le=MAX_BYTES)]  # 0 would hold nothing
Port = Annotated[int, Field(ge=0, le=65535)]
# optional settings: `none` (any case) or an empty string clears them, from every source
OptionalPort = Annotated[Port | None, BeforeValidator(_none_str)]
OptionalStr = Annotated[str | None, BeforeValidator(_none_str)]
OptionalPath = Annotated[Path | None, BeforeValidator(_none_str)]
LogFormat = Literal["text", "json"]
LogLevel = Annotated[str, BeforeValidator(_log_level)]


class DaemonSettings(BaseSettings):
    """Base of the daemons' settings: frozen, unknown keys refused, sources in the documented order.

    Subclasses set ``env_prefix`` (``TANDEM_CLOUD_``); the config file's variable is that prefix + ``CONFIG``.
    """

    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",
        validate_default=True,
        env_nested_delimiter="__",
        case_sensitive=False,
        # read by CliSettingsSource (parse_command_line) and by the reference generator
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_avoid_json=True,
        cli_parse_none_str="none",
    )

    # shared by both daemons: drain, logs, metrics, traces
    drain_grace_s: Seconds0 = Field(
        default=30.0,
        description="Seconds requests in flight may take to finish after SIGTERM/SIGINT before the stop.",
    )
    log_format: LogFormat = Field(default="text", description="Log lines as text or as one JSON object per line.")
    log_level: LogLevel = Field(default="INFO", description="Least severe level logged: DEBUG, INFO, WARNING, ERROR.")
    metrics_host: str = Field(default="127.0.0.1", description="Bind address of the Prometheus metrics endpoint.")
    metrics_port: Port = Field(
        default=0, description="Port of the Prometheus metrics endpoint (HTTP); 0 = no endpoint."
    )
    tls_cert_file: OptionalPath = Field(
        default=None, description="TLS certificate chain (PEM) of the gRPC server; with `tls_key_file`, TLS is on."
    )
    tls_key_file: OptionalPath = Field(default=None, description="Private key (PEM) of `tls_cert_file`.")
    tls_client_ca_file: OptionalPath = Field(
        default=None,
        description="CA (PEM) that signs client certificates: mutual TLS; a client without a valid certificate is "
        "refused in the handshake, and its certificate's subject is its identity.",
    )
    insecure: bool = Field(
        default=False,
        description="Allow plaintext gRPC on a non-loopback `host` (without TLS files such a bind is refused).",
    )
    otel_enabled: bool = Field(default=False, description="Export OpenTelemetry traces.")
    otel_endpoint: OptionalStr = Field(
        default=None,
        description="OTLP endpoint of the trace exporter; `none` = the exporter's default (`OTEL_*` variables).",
    )

    @model_validator(mode="after")
    def _tls_consistent(self) -> Self:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        host = getattr(self, "host", None)
        if host is not None and self.tls_cert_file is None and not self.insecure and not is_loopback(host):
            raise ValueError(
                f"host {host!r} is not a loopback address: set tls_cert_file/tls_key_file, or insecure = true "
                "to serve plaintext explicitly"
            )
        names = "tls_cert_file/tls_key_file/tls_client_ca_file"
        checked(check_tls_files, self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file, names)
        return self

    @model_validator(mode="after")
    def _text_only(self) -> Self:
        """Every string setting (nested, in lists and maps too) is text: a lone surrogate (an environment
        variable's undecodable byte) or a NUL would fail where the string is sent or logged."""
        found = find_non_text(self.model_dump(mode="python"))
        if found is not None:
            path, problem = found
            raise ValueError(f"{'.'.join(str(p) for p in path)}: not valid text: {problem}")
        return self

    @model_validator(mode="after")
    def _ports_distinct(self) -> Self:
        """Two servers of this daemon on one port: the second bind would fail after the model loaded."""
        bound: dict[int, tuple[str, str]] = {}
        for port_name, host_name in (("port", "host"), ("metrics_port", "metrics_host"), ("http_port", "http_host")):
            port, host = getattr(self, port_name, None), getattr(self, host_name, None)
            if not port or host is None:
                continue  # off, or any free port
            if port in bound and _hosts_overlap(host, bound[port][1]):
                raise ValueError(f"{port_name} and {bound[port][0]} are both {port}: each server needs its own port")
            bound[port] = (port_name, host)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The CLI source, when there is one, is put in front of these by pydantic-settings.
        return init_settings, env_settings, TomlFileSource(settings_cls, config_file(settings_cls))


def _hosts_overlap(a: str, b: str) -> bool:
    """Binds on ``a`` and ``b`` can collide: the same host, or either is a wildcard address."""
    wild = ("", "0.0.0.0", "::", "[::]")
    return a == b or a in wild or b in wild


# The config file chosen by ``--config`` while ``parse_command_line`` builds the settings.
_CONFIG_FILE: ContextVar[Path | None] = ContextVar("tandem_config_file", default=None)


def config_env_var(settings_cls: type[BaseSettings]) -> str:
    """``TANDEM_CLOUD_CONFIG``: the variable naming ``settings_cls``'s config file."""
    return f"{settings_cls.model_config.get('env_prefix', '')}CONFIG".upper()


def config_file(settings_cls: type[BaseSettings]) -> Path | None:
    """The config file in effect: ``--config`` (while parsing a command line), else ``TANDEM_..._CONFIG``."""
    chosen = _CONFIG_FILE.get()
    if chosen is not None:
        return chosen
    env = os.environ.get(config_env_var(settings_cls))
    return Path(env) if env else None


class TomlFileSource(TomlConfigSettingsSource):
    """The TOML config file as a settings source; a named file that is missing or invalid is a ``ConfigFileError``."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path | None) -> None:
        if path is not None and not path.is_file():
            raise ConfigFileError(f"config file {path}: {'not a file' if path.exists() else 'no such file'}")
        try:
            super().__init__(settings_cls, toml_file=path)
        except tomllib.TOMLDecodeError as e:
            raise ConfigFileError(f"config file {path}: invalid TOML: {e}") from None
        except UnicodeDecodeError:
            raise ConfigFileError(f"config file {path}: invalid TOML: not UTF-8") from None
        except OSError as e:
            raise ConfigFileError(f"config file {path}: {e.strerror or e}") from None


# ---------------------------------------------------------------------------------------------
# Command line

S = TypeVar("S", bound=BaseSettings)


class _Parser(argparse.ArgumentParser):
    """argparse that raises ``UserError`` instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise UserError(message)


@dataclass(frozen=True)
class Invocation(Generic[S]):
    """What a daemon's command line asked for."""

    settings: S
    ready_file: Path | None
    config_file: Path | None


def _version() -> str:
    from tandem import __version__

    return f"tandem {__version__}"


def make_parser(
    settings_cls: type[BaseSettings], prog: str, description: str = ""
) -> tuple[_Parser, CliSettingsSource]:
    """The argparse parser of a daemon: ``--version``, ``--config``, ``--ready-file`` and a flag per setting."""
    parser = _Parser(
        prog=prog,
        description=description,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            f"Precedence: flags > environment ({settings_cls.model_config.get('env_prefix')}...) > config file > "
            "defaults. Sizes take units (512MiB, 4GiB); `none` clears an optional setting."
        ),
    )
    parser.add_argument("--version", action="version", version=_version(), help="print the version and exit")
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help=f"TOML config file (default: ${config_env_var(settings_cls)} if set)",
    )
    parser.add_argument("--ready-file", type=Path, metavar="PATH", help="write the bound port here once serving")
    cli: CliSettingsSource = CliSettingsSource(settings_cls, root_parser=parser, case_sensitive=True)
    return parser, cli


def parse_command_line(
    settings_cls: type[S], prog: str, argv: Sequence[str] | None = None, *, description: str = ""
) -> Invocation[S]:
    """Parse ``argv`` (default ``sys.argv[1:]``) into settings: flags > env > config file > defaults.

    Raises:
        UserError: an unknown flag, a bad value, a missing or malformed config file.
    """
    parser, cli = make_parser(settings_cls, prog, description)
    args = vars(parser.parse_args(list(sys.argv[1:] if argv is None else argv)))
    chosen: Path | None = args.pop("config")
    ready_file: Path | None = args.pop("ready_file")
    token = _CONFIG_FILE.set(chosen)
    try:
        settings = settings_cls(_cli_settings_source=cli(parsed_args=args))
        return Invocation(settings, ready_file, config_file(settings_cls))
    except ValidationError as e:
        raise UserError(format_validation_error(e)) from None
    except SettingsError as e:
        raise UserError(str(e)) from None
    finally:
        _CONFIG_FILE.reset(token)


def format_validation_error(err: ValidationError) -> str:
    """A ``ValidationError`` as one line: ``engine.max_num_seqs: Input should be ... (got 'x'); ...``."""
    parts = []
    for e in err.errors(include_url=False):
        loc = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            parts.append(f"unknown setting {loc!r}")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        got = e.get("input")
        part = f"{loc}: {msg}" if loc else msg
        if got is not None and not isinstance(got, dict | BaseModel) and e["type"] != "missing":
            part += f" (got {got!r})"
        parts.append(part)
    return "invalid settings: " + "; ".join(parts)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def run_cli(prog: str, main: Callable[[], int | None]) -> int:
    """Run a daemon's ``main``; a ``UserError`` becomes ``PROG: error: MESSAGE`` on stderr and exit code 2."""
    try:
        return main() or 0
    except UserError as e:
        print(f"{prog}: error: {one_line(str(e))}", file=sys.stderr)
        return 2


def check_split_dir(split_dir: Path, parts: Sequence[str]) -> None:
    """A split directory with a valid ``manifest.json`` and the manifest's ``parts`` (``head_onnx``...) present.

    Raises:
        UserError: otherwise.
    """
    from tandem.common.manifest import MANIFEST_NAME, SplitManifest

    if not (Path(split_dir) / MANIFEST_NAME).is_file():
        what = "is not a directory" if not Path(split_dir).is_dir() else f"has no {MANIFEST_NAME}"
        raise UserError(f"split dir {split_dir} {what} (prepare the model with `make model` or `tandem-model`)")
    try:
        manifest = SplitManifest.load(split_dir)
    except (OSError, ValueError) as e:  # pydantic.ValidationError and json's errors are ValueErrors
        raise UserError(f"split dir {split_dir}: unreadable {MANIFEST_NAME}: {one_line(str(e))[:300]}") from None
    for part in parts:
        path = manifest.resolve(split_dir, getattr(manifest, part))
        if not path.exists():
            raise UserError(f"split dir {split_dir}: {part} {path} is missing")


def check_split_dirs(split_dirs: Sequence[Path], parts: Sequence[str]) -> None:
    """``check_split_dir`` for each, and all of them cuts of one model (weights and shape), as the
    daemons require when they load them.

    Raises:
        UserError: otherwise.
    """
    from tandem.common.manifest import SplitManifest

    for d in split_dirs:
        check_split_dir(d, parts)
    first = SplitManifest.load(split_dirs[0])
    for d in split_dirs[1:]:
        m = SplitManifest.load(d)
        if m.weights_blake3 != first.weights_blake3 or m.shape != first.shape:
            raise UserError(f"split dir {d} holds another model than {split_dirs[0]}: all must be one model's")


def setup_observability(settings: Any, service_name: str) -> None:
    """Logging (``log_format``, ``log_level``), OpenTelemetry spans when ``otel_enabled`` (named
    ``service_name``, to ``otel_endpoint``), and the metrics endpoint when ``metrics_port`` is set.

    Raises:
        UserError: the metrics endpoint cannot start.
    """
    from tandem.common.logs import setup_logging
    from tandem.common.tracing import setup_tracing

    setup_logging(settings.log_format, settings.log_level)
    setup_tracing(settings.otel_enabled, service_name, settings.otel_endpoint)
    if settings.metrics_port:
        try:
            from tandem.common.metrics import start_metrics_server
        except ImportError as e:
            raise UserError(f"metrics_port is set but this build has no metrics server ({e})") from None
        try:
            start_metrics_server(settings.metrics_host, settings.metrics_port)
        except OSError as e:
            raise UserError(
                f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: {e.strerror or e}"
            ) from None


# ---------------------------------------------------------------------------------------------
# Reference tables


@dataclass(frozen=True)
class SettingDoc:
    """One row of the reference."""

    flags: tuple[str, ...]
    env: str
    toml_key: str
    type: str
    default: str
    description: str


def _kebab(name: str) -> str:
    return name.replace("_", "-")


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _strip_annotated(tp: Any) -> Any:
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _type_doc(name: str, tp: Any) -> str:
    tp = _strip_annotated(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _type_doc(name, args[0]) if len(args) == 1 else " or ".join(_type_doc(name, a) for a in args)
        return f"{inner} or `none`"
    if origin is Literal:
        return ", ".join(f"`{a}`" for a in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return ", ".join(f"`{m.name.lower()}`" for m in tp)
    if isinstance(tp, type) and issubclass(tp, ByteSize):
        return "size (bytes)"
    if tp is bool:
        return "bool"
    if isinstance(tp, type) and issubclass(tp, Path):
        return "path"
    base = getattr(tp, "__name__", str(tp))
    for suffix, unit in (("_s", "seconds"), ("_ms", "ms"), ("_tokens", "tokens"), ("_mbps", "Mbit/s")):
        if name.endswith(suffix):
            return f"{base} ({unit})"
    return base


def _default_doc(value: Any) -> str:
    if value is None:
        return "`none`"
    if isinstance(value, ByteSize):
        return f"`{_fmt_bytes(int(value))}`"
    if isinstance(value, enum.Enum):
        return f"`{value.name.lower()}`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str) and value == "":
        return '`""`'
    if isinstance(value, list | tuple) and value:
        return ", ".join(_default_doc(v) for v in value)
    if isinstance(value, list | tuple):
        return "`[]`"
    return f"`{value}`"


def _default_of(info: FieldInfo) -> Any:
    if info.default is not PydanticUndefined:
        return info.default
    if info.default_factory is not None:
        return info.get_default(call_default_factory=True)
    return PydanticUndefined


def iter_settings(settings_cls: type[BaseSettings]) -> Iterator[SettingDoc]:
    """The reference rows of ``settings_cls``: one per leaf setting, nested models flattened."""
    cfg = settings_cls.model_config
    prefix = str(cfg.get("env_prefix", "")).upper()
    delim = cfg.get("env_nested_delimiter") or "__"
    shortcuts: Mapping[str, str | list[str]] = cfg.get("cli_shortcuts") or {}

    def walk(model: type[BaseModel], path: tuple[str, ...]) -> Iterator[SettingDoc]:
        for name, info in model.model_fields.items():
            tp = _strip_annotated(info.annotation)
            full = (*path, name)
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                yield from walk(tp, full)
                continue
            flag = ".".join(_kebab(p) for p in full)
            extra = shortcuts.get(flag, [])
            names = [flag, *([extra] if isinstance(extra, str) else extra)]
            if tp is bool:
                flags = tuple(f for n in names for f in (f"--{n}", f"--no-{n}"))
            else:
                flags = tuple(f"--{n}" for n in names)
            default = _default_of(info)
            yield SettingDoc(
                flags=flags,
                env=prefix + delim.join(full).upper(),
                toml_key=".".join(full),
                type=_type_doc(name, info.annotation),
                default="(required)" if default is PydanticUndefined else _default_doc(default),
                description=one_line(info.description or ""),
            )

    yield from walk(settings_cls, ())


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def settings_table(settings_cls: type[BaseSettings]) -> str:
    """A markdown table of ``settings_cls``: a header and one row per ``iter_settings`` row."""
    rows = [
        "| flag | environment variable | TOML key | type | default | description |",
        "|---|---|---|---|---|---|",
    ]
    for d in iter_settings(settings_cls):
        flags = " ".join(f"`{f}`" for f in d.flags)
        cells = [flags, f"`{d.env}`", f"`{d.toml_key}`", d.type, d.default, d.description]
        rows.append("| " + " | ".join(_md_cell(c) for c in cells) + " |")
    return "\n".join(rows)
