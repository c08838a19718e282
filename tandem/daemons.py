"""The tandem daemons as child processes, for ``make run`` (``tandem.demo``) and the benchmarks.

A ``Daemon`` is a command started with its output in a log file and, where it has
one, a ready file: the daemon is passed ``--ready-file PATH`` and writes its bound
port there once it serves. ``Daemon.wait_ready`` waits for that port, showing
progress on stderr, and raises ``DaemonFailed`` (a ``RuntimeError``) with the log's last
lines if the process exits first or takes too long. ``Daemons`` owns several and stops them
all (SIGTERM, then SIGKILL after a grace period) when its ``with`` block ends.

Standard library only: ``tandem`` is the light SDK package.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Arg = str | os.PathLike[str]


def console_script(name: str) -> str:
    """Path of an installed console script (``tandem-cloud``, ``tandem-edge``): the one next to this
    interpreter (a virtual environment's ``bin/``), else the first on ``PATH`` (an install with
    ``pip --target`` or ``--user`` puts its scripts elsewhere).

    Raises:
        FileNotFoundError: neither place has it; the message names both.
    """
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(
            f"console script {name!r} is neither beside {sys.executable} nor on PATH: install tandem"
        )
    return found


# Daemons started from here drain briefly, so that drain + engine shutdown stay well inside the SIGKILL grace.
DRAIN_GRACE_S = 5.0


def work_dir(prefix: str) -> Path:
    """A new temporary folder for a run's daemons (logs, ports, block stores). At exit the block
    stores in it (``kv*``: gigabytes after a benchmark) are removed; the logs stay for reading."""
    w = Path(tempfile.mkdtemp(prefix=prefix))

    def drop_stores() -> None:
        for kv in w.glob("kv*"):
            shutil.rmtree(kv, ignore_errors=True)

    atexit.register(drop_stores)
    return w


def cloud_command(
    split_dir: Arg, store_dir: Arg, *, host: str = "127.0.0.1", port: int = 0, extra: Sequence[Arg] = ()
) -> list[Arg]:
    """``tandem-cloud`` serving ``split_dir`` with its block store in ``store_dir``; ``port`` 0 = any free port."""
    return [
        console_script("tandem-cloud"),
        *("--split-dir", split_dir, "--store-dir", store_dir, "--host", host, "--port", str(port)),
        *("--drain-grace-s", str(DRAIN_GRACE_S)),
        *extra,
    ]


def edge_command(
    split_dir: Arg, cloud: str, *, host: str = "127.0.0.1", port: int = 0, extra: Sequence[Arg] = ()
) -> list[Arg]:
    """``tandem-edge`` running ``split_dir``'s head against the cloud at ``cloud`` (``host:port``)."""
    return [
        console_script("tandem-edge"),
        *("--split-dir", split_dir, "--cloud", cloud, "--host", host, "--port", str(port)),
        *("--drain-grace-s", str(DRAIN_GRACE_S)),
        *extra,
    ]


class DaemonFailed(RuntimeError):
    """A daemon exited, or did not come up in time (``Daemon.wait_ready``); the message has its log's tail."""


class Daemon:
    """One child process started from ``cmd``, stdout and stderr into ``log``.

    With a ``ready_file``, ``--ready-file PATH`` is appended to ``cmd`` (a stale file is removed
    first). ``env`` defaults to this process's environment with unbuffered Python output; other
    keyword arguments go to ``subprocess.Popen`` (``stdin=subprocess.PIPE``, ...).
    """

    def __init__(
        self,
        name: str,
        cmd: Sequence[Arg],
        log: Path,
        ready_file: Path | None = None,
        *,
        env: dict[str, str] | None = None,
        **popen_kw: Any,
    ) -> None:
        self.name, self.log, self.ready_file = name, Path(log), ready_file
        argv = [os.fspath(c) for c in cmd]
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
            argv += ["--ready-file", os.fspath(ready_file)]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env if env is not None else {**os.environ, "PYTHONUNBUFFERED": "1"},
                **popen_kw,
            )

    def port(self) -> int | None:
        """The port in the ready file, or ``None`` while it is not written yet."""
        if self.ready_file is None:
            raise ValueError(f"{self.name} was started without a ready file")
        try:
            text = self.ready_file.read_text().strip()
        except FileNotFoundError:
            return None
        return int(text) if text.isdigit() else None

    def wait_ready(self, timeout_s: float, poll_s: float = 0.5) -> int:
        """Wait for the daemon's port in its ready file, showing progress on stderr; returns the port.

        Raises:
            DaemonFailed: the process exited, or no port after ``timeout_s``; the message has the log's tail.
        """
        t0 = time.monotonic()
        tty, shown = sys.stderr.isatty(), -1  # on a terminal a live counter; in a log a line per 10 s
        while (port := self.port()) is None:
            waited = time.monotonic() - t0
            if self.proc.poll() is not None or waited > timeout_s:
                print(file=sys.stderr)
                why = f"exited with {self.proc.returncode}" if self.proc.returncode is not None else "not ready"
                raise DaemonFailed(f"{self.name} {why} after {waited:.0f} s; last lines of {self.log}:\n{self.tail()}")
            if tty:
                print(f"\r  starting {self.name} ... {waited:5.1f} s", end="", file=sys.stderr, flush=True)
            elif int(waited // 10) > shown:
                shown = int(waited // 10)
                print(f"  starting {self.name} ... {waited:5.1f} s", file=sys.stderr, flush=True)
            time.sleep(poll_s)
        end = "\r" if tty else ""
        print(f"{end}  {self.name} ready in {time.monotonic() - t0:.1f} s          ", file=sys.stderr)
        return port

    def tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the log."""
        try:
            text = self.log.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL if still running after ``grace_s``."""
        stop_all([self], grace_s)


def stop_all(daemons: Sequence[Daemon], grace_s: float = 30.0) -> None:
    """SIGTERM every daemon still running (last started first), give them ``grace_s`` in all, SIGKILL the rest."""
    for d in reversed(daemons):
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for d in reversed(daemons):
        try:
            d.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()
        if d.proc.stdin is not None:
            with contextlib.suppress(OSError):
                d.proc.stdin.close()


class Daemons:
    """Owns the daemons it spawns; ``stop()`` or leaving the ``with`` block stops them all."""

    def __init__(self, grace_s: float = 30.0) -> None:
        self.grace_s = grace_s
        self.daemons: list[Daemon] = []

    def spawn(self, name: str, cmd: Sequence[Arg], log: Path, ready_file: Path | None = None, **kw: Any) -> Daemon:
        """Start a ``Daemon`` (arguments as its constructor) and own it."""
        d = Daemon(name, cmd, log, ready_file, **kw)
        self.daemons.append(d)
        return d

    def stop(self) -> None:
        stop_all(self.daemons, self.grace_s)
        self.daemons.clear()

    def __enter__(self) -> Daemons:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
