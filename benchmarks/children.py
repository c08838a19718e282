"""Benchmark child processes that write output files and exit (one vLLM engine each, e.g.
``benchmarks.engine_logprobs``), judged by their outputs rather than by their exit status alone.

A vLLM engine may abort while the interpreter exits (status -6, or 134 through a shell) after
every output is written. ``run_child`` accepts such a run where every expected output loads
completely, with a warning naming the status; otherwise it raises ``ChildFailed`` with the status,
its signal and the lines of the child's log that name an error. The child writes each output with
``write_npz``: to a temporary file beside it, then renamed, so an output that exists is whole.

Not here: long-running daemons (``tandem.daemons``) and processes whose output is their stdout.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import zipfile
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

log = logging.getLogger(__name__)

T = TypeVar("T")

# what a loader raises for a missing, truncated or incomplete output
LOAD_ERRORS: tuple[type[Exception], ...] = (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zlib.error)
ERROR_MARKS = ("Error", "Traceback", "Exception")


class ChildFailed(RuntimeError):
    """A child exited without writing all its outputs: ``returncode``, and the message has the
    status, its signal and the log lines that name an error, then the log's last lines."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


def describe_status(returncode: int) -> str:
    """``-6`` -> ``"status -6 (SIGABRT)"``, ``134`` -> ``"status 134 (128 + SIGABRT)"``, ``1`` -> ``"status 1"``."""

    def name(n: int) -> str | None:
        try:
            return signal.Signals(n).name
        except ValueError:
            return None

    if returncode < 0 and (sig := name(-returncode)):
        return f"status {returncode} ({sig})"
    if 128 < returncode < 160 and (sig := name(returncode - 128)):
        return f"status {returncode} (128 + {sig})"
    return f"status {returncode}"


def log_excerpt(text: str, marked: int = 40, last: int = 20) -> str:
    """The last ``marked`` lines of ``text`` that name an error (``ERROR_MARKS``) or belong to a
    traceback, then its last ``last`` lines, in log order; a gap shows how many lines it leaves out."""
    lines = text.splitlines()
    hits: list[int] = []
    in_traceback = False
    for i, line in enumerate(lines):
        if in_traceback or any(m in line for m in ERROR_MARKS):
            hits.append(i)
        if line.startswith("Traceback"):
            in_traceback = True
        elif in_traceback and not line[:1].isspace():
            in_traceback = False  # the exception's own line ends the traceback
    shown = sorted(set(hits[-marked:]) | set(range(max(0, len(lines) - last), len(lines))))
    out, prev = [], -1
    for i in shown:
        if i != prev + 1:
            out.append(f"[... {i - prev - 1} lines ...]")
        out.append(lines[i])
        prev = i
    return "\n".join(out)


def run_child(
    name: str,
    cmd: Sequence[str],
    log_path: Path,
    outputs: Sequence[Path],
    load: Callable[[Path], T],
    env: Mapping[str, str] | None = None,
) -> list[T]:
    """Run ``cmd`` (stdout and stderr into ``log_path``) and return ``load(path)`` for each of
    ``outputs``, which are removed first so none is left from an earlier run. ``load`` reads one
    output completely and raises one of ``LOAD_ERRORS`` where it is missing or incomplete. A child
    that exits non-zero but whose outputs all load is accepted with a warning. ``name`` names the
    run in the messages.

    Raises:
        ChildFailed: an output is missing or incomplete (whatever the status), with the status and
            the log's excerpt.
    """
    for path in outputs:
        path.unlink(missing_ok=True)
    with open(log_path, "w") as f:
        rc = subprocess.run(list(cmd), stdout=f, stderr=subprocess.STDOUT, env=None if env is None else dict(env))
    loaded: list[T] = []
    for path in outputs:
        try:
            loaded.append(load(path))
        except LOAD_ERRORS as e:
            excerpt = log_excerpt(log_path.read_text(errors="replace"))
            raise ChildFailed(
                f"{name} exited with {describe_status(rc.returncode)} "
                f"and its output {path} is missing or incomplete ({type(e).__name__}: {e}); "
                f"log {log_path}:\n{excerpt}",
                rc.returncode,
            ) from e
    if rc.returncode:
        log.warning(
            "%s exited with %s after writing its outputs; using them (log %s)",
            name,
            describe_status(rc.returncode),
            log_path,
        )
    return loaded


def write_npz(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """``np.savez_compressed`` into a temporary file beside ``path``, then renamed over it: a
    reader never sees a partly written ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            kw: dict[str, Any] = dict(arrays)  # Any: numpy's stubs check **kwds against allow_pickle's bool
            np.savez_compressed(f, **kw)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
