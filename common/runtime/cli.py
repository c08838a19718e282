"""A daemon's command line: the argparse parser with a flag per setting (pydantic-settings'
``CliSettingsSource``) and ``--version``, ``--config``, ``--ready-file`` (``parse_command_line``);
``run_cli``, which turns every user error (bad value, unknown flag or key, missing or malformed config
file, and whatever ``tandem.common.runtime.startup.check_start`` finds before any model loads) into one line
on stderr, ``PROG: error: ...``, and exit code 2; logging, tracing and the metrics endpoint."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, NoReturn, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    SettingsError,
)

from tandem.common.runtime.settings import _CONFIG_FILE, UserError, config_env_var, config_file

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


def setup_observability(settings: Any, service_name: str) -> None:
    """Logging (``log_format``, ``log_level``), OpenTelemetry spans when ``otel_enabled`` (named
    ``service_name``, to ``otel_endpoint``), and the metrics endpoint when ``metrics_port`` is set.

    Raises:
        UserError: the metrics endpoint cannot start.
    """
    from tandem.common.runtime.logs import setup_logging
    from tandem.common.runtime.tracing import setup_tracing

    setup_logging(settings.log_format, settings.log_level)
    setup_tracing(settings.otel_enabled, service_name, settings.otel_endpoint)
    if settings.metrics_port:
        try:
            from tandem.common.runtime.metrics import start_metrics_server
        except ImportError as e:
            raise UserError(f"metrics_port is set but this build has no metrics server ({e})") from None
        try:
            start_metrics_server(settings.metrics_host, settings.metrics_port)
        except OSError as e:
            raise UserError(
                f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: {e.strerror or e}"
            ) from None
