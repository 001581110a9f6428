"""How a process that serves a store starts and stops: bind first, stop on a signal.

A server that owns a store binds its port first and opens the store after: a start that fails
because the port is taken must leave the file as it was (no new file, no run that never ends).
:func:`bind` takes the address and nothing more; the server starts accepting on the returned
sockets once everything else is ready.

Whatever a process serves (the receiver alone, or with the dashboard beside it), SIGINT and
SIGTERM take the same orderly path: :func:`stop_signals` turns them into a wake-up of the main
thread, which then stops each server and closes the store. A signal never ends the process
with acknowledged rows still queued.
"""

from __future__ import annotations

import errno
import logging
import os
import select
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvscope.errors import KvscopeError


def bind(host: str, port: int) -> list[socket.socket]:
    """Bind ``host:port`` (every address ``host`` resolves to) without listening yet.

    ``port`` 0 picks a free port, the same one on every address. Raises
    :class:`~kvscope.errors.KvscopeError` naming the address when it cannot be bound (in use,
    not an address of this machine, unknown host).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise KvscopeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sockets: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    chosen = port
    try:
        for family, kind, proto, _, address in infos:
            if (family, address[0]) in seen:
                continue
            seen.add((family, address[0]))
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            # A restart must not wait for the previous process's connections in TIME_WAIT;
            # on Linux this still refuses a port another socket listens on.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((address[0], chosen, *address[2:]))
            except OSError as exc:
                # IPv6 switched off on this machine: serve the other addresses (as asyncio's
                # create_server does), unless there are none.
                if family != socket.AF_INET6 or exc.errno != errno.EADDRNOTAVAIL:
                    raise
                sockets.pop().close()
                continue
            chosen = int(sock.getsockname()[1])
        if not sockets:
            raise OSError(errno.EADDRNOTAVAIL, "no address of this machine")
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise KvscopeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sockets


def bound_port(sockets: list[socket.socket]) -> int:
    """The port the sockets from :func:`bind` hold."""
    return int(sockets[0].getsockname()[1])


def close_all(sockets: list[socket.socket]) -> None:
    """Close sockets from :func:`bind` that will not be served after all."""
    for sock in sockets:
        sock.close()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Longest a client may take to send one request body (then 408): every kvscope server.
BODY_READ_TIMEOUT_S = 30.0


@contextmanager
def stop_signals() -> Iterator[Callable[..., int]]:
    """Catch SIGINT and SIGTERM while inside; yield a function that waits for one of them.

    The waiting function blocks the (main) thread until a signal arrives and returns its number;
    one that arrived earlier, since the block was entered, returns at once. ``wait(timeout_s)``
    gives up after ``timeout_s`` seconds and returns 0. The signal's number reaches a pipe
    through :func:`signal.set_wakeup_fd`, written by the C-level handler in whichever thread
    the kernel delivered the signal to: a Python handler runs only on the main thread, and only
    once it runs bytecode again, so a SIGTERM delivered to another thread (a DuckDB or server
    thread) left the main thread blocked in its read for ever (``kvscope dashboard`` under load,
    2 of 8 runs). The Python handlers do nothing but replace the default actions (exit,
    KeyboardInterrupt); nothing takes a lock. The previous handlers and wake-up fd are restored
    on the way out.
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def handler(signum: int, frame: object) -> None:
        """The wake-up byte is already written (set_wakeup_fd)."""

    def wait(timeout_s: float | None = None) -> int:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if deadline is not None and not select.select(
                    [read_fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return 0
            signum = os.read(read_fd, 1)[0]
            if signum in STOP_SIGNALS:  # the wake-up fd carries every Python-handled signal
                return signum

    previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    try:
        yield wait
    finally:
        signal.set_wakeup_fd(previous_fd)
        for signum, before in previous.items():
            signal.signal(signum, before)
        os.close(read_fd)
        os.close(write_fd)


class _OneLineMalformedRequests(logging.Filter):
    """aiohttp's server logs a request it cannot parse at ERROR with a ten-line traceback:
    every malformed request a client sends. It becomes one WARNING line naming the client and
    what was wrong (aiohttp has already answered 400)."""

    def __init__(self, malformed: type[BaseException]) -> None:
        super().__init__()
        self.malformed = malformed

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, self.malformed):
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            said = record.getMessage()
            record.msg = "%s: malformed HTTP request (%s)"
            record.args = (said, " ".join(lines[:2]) or type(exc).__name__)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def one_line_malformed_requests() -> None:
    """Make aiohttp's server log a malformed request in one WARNING line (idempotent)."""
    from aiohttp.http_exceptions import HttpProcessingError

    server_logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _OneLineMalformedRequests) for f in server_logger.filters):
        server_logger.addFilter(_OneLineMalformedRequests(HttpProcessingError))


__all__ = ["BODY_READ_TIMEOUT_S", "STOP_SIGNALS", "bind", "bound_port", "close_all",
           "one_line_malformed_requests", "stop_signals"]
