"""Settings of the daemons: the base model, its sources and their precedence, the units of sizes and durations.

``tandem-cloud`` and ``tandem-edge`` each read one typed, frozen pydantic-settings model
(``tandem.cloud.config.CloudConfig``, ``tandem.edge.config.EdgeConfig``) from four sources, the
first that sets a setting winning: a command-line flag, an environment variable
(``TANDEM_CLOUD_`` / ``TANDEM_EDGE_`` + the name, nested settings joined with ``__``), the TOML
config file, the default. Built in code, keyword arguments take the place of flags. Sizes (fields
ending ``_bytes``) are ``pydantic.ByteSize``; durations end in ``_s`` or ``_ms``. The forms each
source takes: docs/configuration.md (generated from these models).

The command line (``parse_command_line``, ``run_cli``: flags built with pydantic-settings'
``CliSettingsSource``, user errors as one line and exit code 2) is ``tandem.common.runtime.cli``; the
reference rows and table of a settings model (``iter_settings``, ``settings_table``, from which
``docs/gen_configuration.py`` writes ``docs/configuration.md``) are ``tandem.common.runtime.settings_doc``.
This module imports neither daemon's config.
"""

from __future__ import annotations

import enum
import json
import os
import tomllib
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal, Self, TypeVar

from pydantic import BeforeValidator, ByteSize, Field, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.params import Codec, WireDtype
from tandem.common.protocol.text import find_non_text
from tandem.common.runtime.security import check_tls_files, is_loopback
from tandem.common.runtime.startup import FileRole, server_ports


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
    """Accept an enum member by its name in any case (``fp16``, ``FP16``) besides its value. A
    string that is neither a name nor a number is refused with the names (ValueError: ``must be one
    of fp32, fp16, ...``), not with the enum's numeric values."""

    def parse(v: Any) -> Any:
        if isinstance(v, str) and not isinstance(v, enum.Enum):
            by_name = {m.name.lower(): m for m in enum_cls}
            name = v.strip().lower()
            if name in by_name:
                return by_name[name]
            if not name.lstrip("-").isdigit():
                raise ValueError(f"must be one of {', '.join(by_name)}")
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
# paths by what the daemon does with them, which decides how ``common.runtime.startup.check_start`` checks
# them before any model loads; every Path setting has one of these types (tests/unit/test_startup.py)
InputFile = Annotated[Path, FileRole.INPUT]
OptionalInputFile = Annotated[Path | None, BeforeValidator(_none_str), FileRole.INPUT]
OptionalAppendFile = Annotated[Path | None, BeforeValidator(_none_str), FileRole.APPEND]
SplitDir = Annotated[Path, FileRole.SPLIT_DIR]
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
    tls_cert_file: OptionalInputFile = Field(
        default=None, description="TLS certificate chain (PEM) of the gRPC server; with `tls_key_file`, TLS is on."
    )
    tls_key_file: OptionalInputFile = Field(default=None, description="Private key (PEM) of `tls_cert_file`.")
    tls_client_ca_file: OptionalInputFile = Field(
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
        for port_name, host, port in server_ports(self):
            if not port:
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


# ---------------------------------------------------------------------------------------------
# Reference tables
