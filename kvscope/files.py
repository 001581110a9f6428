"""Reading a file kvscope was pointed at: a regular file only, never more than a stated size.

Every file a command reads whole (ingest sources, the boundary hash key, workload traces) goes
through :func:`read_limited`. A path can name something that is not a file: a symlink to
``/dev/zero`` reads forever and a FIFO blocks its reader until a writer comes, so the file is
opened without blocking and its type checked on the open descriptor (what a symlink points to,
checked after the open so that it cannot be swapped in between). A sparse or growing file is
cut off at its limit, not read into memory whole.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvscope.errors import KvscopeError

__all__ = ["read_limited"]


def _size(limit_bytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if limit_bytes >= scale:
            return f"{limit_bytes / scale:g} {unit}"
    return f"{limit_bytes} bytes"


def read_limited(path: str | Path, limit_bytes: int, what: str,
                 error: type[KvscopeError], *, head: bool = False) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit_bytes`` of them.

    Raises ``error`` with one line naming ``what`` and ``path`` when the file is missing,
    unreadable, not a regular file (a device, FIFO, socket or folder, symlinked or not) or
    larger than ``limit_bytes``. ``head``: return the file's first ``limit_bytes`` bytes
    instead of refusing a larger file (enough to tell what a file is).
    """
    where = f"{what} {path}"
    try:
        # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{where}: cannot read: no such file") from None
    except OSError as exc:
        raise error(f"{where}: cannot read: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = ("a folder" if stat.S_ISDIR(info.st_mode)
                    else "a FIFO" if stat.S_ISFIFO(info.st_mode)
                    else "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)
                    else "a socket" if stat.S_ISSOCK(info.st_mode)
                    else "not a regular file")
            raise error(f"{where}: is {kind}, not a regular file")
        if info.st_size > limit_bytes and not head:
            raise error(f"{where}: {info.st_size} bytes, larger than the "
                        f"{_size(limit_bytes)} kvscope reads")
        os.set_blocking(fd, True)
        chunks: list[bytes] = []
        # One byte more tells a file that grew past the limit.
        left = limit_bytes if head else limit_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0 and not head:
            raise error(f"{where}: grew past the {_size(limit_bytes)} kvscope reads")
        return b"".join(chunks)
    except OSError as exc:
        raise error(f"{where}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
