"""Start-up checks: everything a daemon was given is parsed, opened, connected to and bound before
any model loads, so a mistake costs one line and exit code 2, not a minute of engine start.

``check_start`` is the one place each daemon's settings pass through after they parse
(``tandem.common.runtime.cli.parse_command_line`` runs the settings' own validators):

* **files**, by the ``FileRole`` each ``Path`` setting declares in its type (``settings_paths``
  finds them, nested and in lists): an input file is opened for reading without blocking, and
  refused by its type first when it is not a regular file (a FIFO would block the open or the read
  forever, a device must not be opened at all: ``open_regular``); a model is such a file or a
  folder of regular files; a file appended to has a directory this user may write in; a split
  directory has its manifest and every part the daemon loads, each part matching the manifest's
  BLAKE3 (``check_split_dirs``); a private directory is created or checked (``private_dir``);
* **the ready file** (``--ready-file``): a regular file or none yet, in a directory this user may
  write in;
* **binds**: every port the daemon serves on (``server_ports``) is bound once and released
  (``check_bind``), so a port in use is found now and named;
* **the daemon's own checks** (``extra``): connecting to a shared block store, the engines'
  bounds against the manifests, the fidelity tables.

What it does not do: load a model or start an engine, or reach the cloud from the edge (an edge
starts without its cloud and reconnects). Between this check and the daemon's own bind a minute
later another process may still take a port: the daemons report that bind as one line too.
"""

from __future__ import annotations

import enum
import errno
import os
import socket
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from tandem.common.protocol.errors import InvalidRequest, TandemError
from tandem.common.protocol.files import file_kind, open_regular, read_regular

if TYPE_CHECKING:
    from tandem.common.protocol.manifest import SplitManifest


class FileRole(enum.Enum):
    """What a ``Path`` setting names, and so how ``check_start`` checks it (the settings' types
    carry it: ``Annotated[Path, FileRole.INPUT]``)."""

    INPUT = "input"  # a file the daemon reads: a regular file, opened without blocking
    MODEL = "model"  # a model: one regular file, or a folder of regular files (a builder graph)
    APPEND = "append"  # a file the daemon appends to: regular or absent, in a writable directory
    SPLIT_DIR = "split_dir"  # a split directory: manifest and the daemon's parts, BLAKE3 checked
    PRIVATE_DIR = "private_dir"  # a state directory of this user only (created mode 0700)


# ---------------------------------------------------------------------------------------------
# Files


def check_input_file(path: Path, what: str) -> None:
    """``path`` is a regular file this process can open for reading (``open_regular``)."""
    os.close(open_regular(path, what))


def check_model(path: Path, what: str) -> None:
    """``path`` is a model the daemon loads: a regular file (``check_input_file``) or a folder of
    regular files (``check_tree``).

    Raises:
        InvalidRequest: otherwise.
    """
    if Path(path).is_dir():
        check_tree(path, what)
    else:
        check_input_file(path, what)


def check_output_file(path: Path, what: str) -> None:
    """``path`` can be written (appended to): a regular file this user may write, or absent in a
    directory this user may write in. Nothing is opened: a FIFO would block the open.

    Raises:
        InvalidRequest: otherwise.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        parent = Path(path).parent
        if not parent.is_dir():
            raise InvalidRequest(f"{what}: directory {parent} does not exist") from None
        if not os.access(parent, os.W_OK | os.X_OK):
            raise InvalidRequest(f"{what}: cannot create {path}: directory {parent} is not writable") from None
        return
    except OSError as e:
        raise InvalidRequest(f"{what}: {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidRequest(f"{what}: {path} is {file_kind(st.st_mode)}, not a regular file")
    if not os.access(path, os.W_OK):
        raise InvalidRequest(f"{what}: {path} is not writable")


def check_tree(root: Path, what: str) -> None:
    """Every entry under the directory ``root`` (links followed) is a regular file or a directory:
    a loader that lists a folder and reads what it finds would block on a FIFO or read a device.

    Raises:
        InvalidRequest: ``root`` is not a directory, or holds something else.
    """
    try:
        st = os.stat(root)
    except OSError as e:
        raise InvalidRequest(f"{what}: {root}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidRequest(f"{what}: {root} is {file_kind(st.st_mode)}, not a directory")
    for dirpath, _dirs, files in os.walk(root, followlinks=True):
        for name in files:
            p = Path(dirpath) / name
            try:
                mode = os.stat(p).st_mode
            except OSError as e:
                raise InvalidRequest(f"{what}: {p}: {e.strerror or e}") from None
            if not stat.S_ISREG(mode):
                raise InvalidRequest(f"{what}: {p} is {file_kind(mode)}, not a regular file")


# ---------------------------------------------------------------------------------------------
# Settings' paths and ports


def _role(field: Any) -> FileRole | None:
    return next((m for m in field.metadata if isinstance(m, FileRole)), None)


def settings_paths(settings: BaseModel, prefix: str = "") -> Iterator[tuple[str, Path, FileRole | None]]:
    """Every ``Path`` a settings model holds, as (dotted setting name, path, its ``FileRole`` or
    None where the field declares none), nested models and lists included, in field order."""
    for name, field in type(settings).model_fields.items():
        value = getattr(settings, name)
        key = f"{prefix}{name}"
        if isinstance(value, BaseModel):
            yield from settings_paths(value, f"{key}.")
        elif isinstance(value, Path):
            yield key, value, _role(field)
        elif isinstance(value, list | tuple):
            for item in value:
                if isinstance(item, Path):
                    yield key, item, _role(field)


SERVER_PORTS = (
    ("port", "host"),
    ("metrics_port", "metrics_host"),
    ("http_port", "http_host"),
    ("health_port", "health_host"),
)


def server_ports(settings: Any) -> list[tuple[str, str, int | None]]:
    """The servers a daemon's settings start, as (port setting, host, port): every pair of
    ``SERVER_PORTS`` the settings have (a port of None is off, 0 is any free port)."""
    return [
        (port_name, getattr(settings, host_name), getattr(settings, port_name))
        for port_name, host_name in SERVER_PORTS
        if hasattr(settings, port_name) and hasattr(settings, host_name)
    ]


def check_bind(host: str, port: int, what: str) -> None:
    """``host:port`` can be bound for listening now: each address ``host`` resolves to is bound
    (``SO_REUSEADDR``, as gRPC and uvicorn bind) and released. An address family this machine
    lacks (``::1`` without IPv6) is skipped while another address binds.

    Raises:
        InvalidRequest: ``host`` does not resolve, the port is in use or needs privileges, or no
            address binds (the message names ``what``, the host and the port).
    """
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        infos = socket.getaddrinfo(bare or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise InvalidRequest(f"{what}: cannot bind {host}:{port}: the host does not resolve ({e})") from None
    bound, failure = 0, ""
    for family, kind, proto, _name, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
                s.listen(1)
                bound += 1
            except OSError as e:
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    reason = "is in use by another process" if e.errno == errno.EADDRINUSE else "needs privileges"
                    raise InvalidRequest(f"{what}: cannot bind {host}:{port}: the port {reason}") from None
                failure = failure or (e.strerror or str(e))
    if not bound:
        raise InvalidRequest(f"{what}: cannot bind {host}:{port}: {failure or 'no address'}")


# ---------------------------------------------------------------------------------------------
# Split directories


@dataclass(frozen=True)
class SplitPart:
    """A part of a split directory a daemon loads: the manifest field naming it, the manifest
    field holding its BLAKE3 ("" where none is recorded), and whether it is a checkpoint folder
    (``config.json`` and ``*.safetensors`` weights), a tokenizer folder or one file."""

    hash_field: str
    kind: str  # "checkpoint", "tokenizer" or "file"


SPLIT_PARTS: dict[str, SplitPart] = {
    "head_onnx": SplitPart("head_blake3", "file"),
    "tail_checkpoint": SplitPart("tail_blake3", "checkpoint"),
    "full_checkpoint": SplitPart("checkpoint_blake3", "checkpoint"),
    "tokenizer_path": SplitPart("", "tokenizer"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _check_part(path: Path, part: str, what: str) -> None:
    """The part at ``path`` has what its kind needs (``SplitPart``), all regular files."""
    kind = SPLIT_PARTS[part].kind
    if kind == "file":
        check_input_file(path, what)
        return
    check_tree(path, what)
    if kind == "checkpoint":
        if not (path / "config.json").is_file():
            raise InvalidRequest(f"{what}: {path} has no config.json")
        if not any(p.is_file() for p in path.glob("*.safetensors")):
            raise InvalidRequest(f"{what}: {path} has no *.safetensors weights")
    elif not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise InvalidRequest(f"{what}: {path} has none of {', '.join(TOKENIZER_FILES)}")


def check_split_dir(split_dir: Path, parts: Sequence[str], hashed: dict[Path, str] | None = None) -> SplitManifest:
    """A split directory with a valid ``manifest.json`` and every one of the manifest's ``parts``
    (names of ``SPLIT_PARTS``) that the split has (a direct manifest has no head and no tail):
    present, of regular files, with what its kind needs, and with the BLAKE3 the manifest
    records for it. ``hashed``: digests already computed, by resolved path (shared between the
    split directories of one model, whose full checkpoint is one folder). Returns the manifest.

    Raises:
        InvalidRequest: otherwise (the message names the directory, the part and the path).
    """
    from tandem.common.protocol.manifest import MANIFEST_NAME, SplitManifest, part_blake3

    hashed = {} if hashed is None else hashed
    manifest_path = Path(split_dir) / MANIFEST_NAME
    if not Path(split_dir).is_dir() or not manifest_path.exists():
        what = "is not a directory" if not Path(split_dir).is_dir() else f"has no {MANIFEST_NAME}"
        raise InvalidRequest(f"split dir {split_dir} {what} (prepare the model with `make model` or `tandem-model`)")
    try:
        manifest = SplitManifest.load(split_dir)
    except (OSError, ValueError) as e:  # pydantic.ValidationError and json's errors are ValueErrors
        detail = " ".join(str(e).split())[:300]
        raise InvalidRequest(f"split dir {split_dir}: unreadable {MANIFEST_NAME}: {detail}") from None
    for part in parts:
        rel = getattr(manifest, part)
        if not rel:  # not in this split (a direct manifest's head and tail)
            continue
        path = manifest.resolve(split_dir, rel)
        what = f"split dir {split_dir}: {part}"
        if not path.exists():
            raise InvalidRequest(f"{what} {path} is missing")
        _check_part(path, part, what)
        expected = getattr(manifest, SPLIT_PARTS[part].hash_field) if SPLIT_PARTS[part].hash_field else ""
        if expected:
            if path not in hashed:
                hashed[path] = part_blake3(path)
            if hashed[path] != expected:
                raise InvalidRequest(
                    f"{what} {path} is not what the manifest describes (BLAKE3 {hashed[path][:12]}..., the manifest "
                    f"says {expected[:12]}...): prepare the model again with `make model` or `tandem-model`"
                )
    return manifest


def check_split_dirs(split_dirs: Sequence[Path], parts: Sequence[str]) -> None:
    """``check_split_dir`` for each, and all of them cuts of one model (weights and shape), as the
    daemons require when they load them.

    Raises:
        InvalidRequest: otherwise.
    """
    hashed: dict[Path, str] = {}
    manifests = [check_split_dir(d, parts, hashed) for d in split_dirs]
    for d, m in zip(split_dirs[1:], manifests[1:], strict=True):
        if m.weights_blake3 != manifests[0].weights_blake3 or m.shape != manifests[0].shape:
            raise InvalidRequest(f"split dir {d} holds another model than {split_dirs[0]}: all must be one model's")


# ---------------------------------------------------------------------------------------------
# The check


Check = Callable[[], None]


def check_start(
    settings: BaseModel,
    *,
    split_parts: Sequence[str],
    ready_file: Path | None = None,
    extra: Sequence[Check] = (),
) -> None:
    """Check everything ``settings`` name before any model loads (the module docstring's list):
    files by role, split directories with their ``split_parts`` (``head_onnx``, ``tail_checkpoint``...),
    the ready file, the binds, then ``extra``, in that order.

    Raises:
        UserError: the first problem, as one line naming the setting.
    """
    from tandem.common.runtime.security import private_dir
    from tandem.common.runtime.settings import UserError

    split_dirs: list[Path] = []

    def check_private_dir(path: Path, what: str) -> None:
        try:
            private_dir(path)
        except InvalidRequest as e:
            raise InvalidRequest(f"{what}: {e}") from None

    by_role: dict[FileRole, Callable[[Path, str], None]] = {
        FileRole.INPUT: check_input_file,
        FileRole.MODEL: check_model,
        FileRole.APPEND: check_output_file,
        FileRole.SPLIT_DIR: lambda path, what: split_dirs.append(path),
        FileRole.PRIVATE_DIR: check_private_dir,
    }
    try:
        for name, path, role in settings_paths(settings):
            if role is None:
                raise UserError(f"setting {name} names a path of no declared role (a bug of this build)")
            by_role[role](path, name)
        if split_dirs:
            check_split_dirs(split_dirs, split_parts)
        if ready_file is not None:
            check_output_file(ready_file, "--ready-file")
        for port_name, host, port in server_ports(settings):
            if port:  # None: off; 0: any free port
                check_bind(host, port, port_name)
        for check in extra:
            check()
    except (TandemError, OSError) as e:
        raise UserError(str(e) if isinstance(e, TandemError) else f"{type(e).__name__}: {e}") from None


__all__ = [
    "SPLIT_PARTS",
    "FileRole",
    "check_bind",
    "check_input_file",
    "check_model",
    "check_output_file",
    "check_split_dir",
    "check_split_dirs",
    "check_start",
    "check_tree",
    "file_kind",
    "open_regular",
    "read_regular",
    "server_ports",
    "settings_paths",
]
