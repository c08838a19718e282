"""Reading the files a daemon is given (the split manifest, the parts it names, every path among the
settings): regular files only, refused by their type before they are opened, and opened without
blocking, so a FIFO or a device named by mistake fails with one line instead of hanging.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tandem.common.protocol.errors import InvalidRequest

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str:
    """``"a FIFO"``, ``"a directory"``... for an ``st_mode``; ``"a regular file"`` for one."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: Path | str, what: str) -> int:
    """A read-only descriptor of the regular file ``path`` (following links), opened without
    blocking. Anything else is refused by its type before it is opened: a FIFO would block the
    open or every read, a device must not be opened. The type is checked again on the descriptor,
    so a file swapped for a FIFO in between is refused too. The caller closes the descriptor.

    Raises:
        InvalidRequest: missing, unreadable or not a regular file (the message names ``what``).
    """
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidRequest(f"{what}: {path} is {file_kind(st.st_mode)}, not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise InvalidRequest(f"{what}: cannot read {path}: {e.strerror or e}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise InvalidRequest(f"{what}: {path} is {file_kind(mode)}, not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_regular(path: Path | str, what: str) -> bytes:
    """The bytes of the regular file ``path`` (``open_regular``'s rules).

    Raises:
        InvalidRequest: missing, unreadable or not a regular file.
    """
    fd = open_regular(path, what)
    try:
        with os.fdopen(fd, "rb", closefd=True) as f:
            return f.read()
    except OSError as e:
        raise InvalidRequest(f"{what}: cannot read {path}: {e.strerror or e}") from None
