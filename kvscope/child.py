"""Helper processes that report back: start, "ready" handshake, errors raised in the parent.

The proxy's export process and the simulator's row writer both run a function in a spawned
child connected by a duplex pipe, and both must know before going on whether the child got its
destination open. :func:`start_child` spawns ``target(conn, *args)`` and waits until the child
calls :func:`report_ready` or :func:`report_error` (or :func:`spawn_child` now and
:func:`wait_ready` later); :func:`raise_reported` re-raises a reported
error in the parent as the child's own kvscope error class (``StoreLockedError`` stays
``StoreLockedError``), anything else as :class:`KvscopeError`.
"""

from __future__ import annotations

import contextlib
import logging
import marshal
import multiprocessing as mp
import os
import pickle
import socket
import sys
import threading
import types
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

from kvscope import errors
from kvscope.errors import KvscopeError

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0


class ChildStartError(KvscopeError):
    """The child exited or stayed silent before reporting (it never got to run its target)."""


def start_child(target: Callable[..., None], args: tuple[Any, ...], *, name: str,
                timeout_s: float = READY_TIMEOUT_S) -> tuple[BaseProcess, Connection]:
    """Spawn ``target(conn, *args)`` and return once it reported ready (see :func:`wait_ready`).
    """
    process, conn = spawn_child(target, args, name=name)
    wait_ready(process, conn, name=name, timeout_s=timeout_s)
    return process, conn


def spawn_child(target: Callable[..., None], args: tuple[Any, ...], *, name: str
                ) -> tuple[BaseProcess, Connection]:
    """Spawn ``target(conn, *args)`` without waiting for it (call :func:`wait_ready` before
    relying on it: the parent can do other work while the child imports and opens)."""
    ctx = mp.get_context("spawn")  # fork would copy the parent's threads' locks
    conn, child_conn = ctx.Pipe(duplex=True)
    process = ctx.Process(target=target, args=(child_conn, *args), name=name, daemon=True)
    try:
        with _main_left_out(target):
            process.start()
    finally:
        child_conn.close()
    return process, conn


_MAIN_SWAP = threading.Lock()


@contextlib.contextmanager
def _main_left_out(target: Callable[..., None]) -> Iterator[None]:
    """Start a spawned child without the caller's main module, when its target lives elsewhere.

    Under spawn, a child first re-runs the parent's main script (as ``__mp_main__``) so that
    objects defined there can be unpickled. A script without an ``if __name__ ==
    "__main__":`` guard then runs its work again in the child, which tries to start its own
    child while still importing and exits with multiprocessing's bootstrapping RuntimeError (a
    traceback per start). kvscope's children run kvscope functions on plain arguments and need
    nothing of the main module, so while the child is started ``sys.modules["__main__"]`` is a
    bare module: multiprocessing then tells the child to import no main at all.
    """
    # One swap at a time: two threads starting children at once must not save each other's
    # bare module as the real main.
    with _MAIN_SWAP:
        main = sys.modules.get("__main__")
        if main is None or target.__module__ == "__main__":
            yield
            return
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            sys.modules["__main__"] = main


def pack(value: Any) -> bytes:
    """``value`` as one message for a child: ``marshal`` when it holds only plain values (str,
    bytes, int, float, bool, None, tuples, lists, dicts, sets: about twice as fast as pickle
    both ways, and the same interpreter reads it), pickle otherwise (subclasses of those types
    included; any other bytes-like object comes back as ``bytes``). The first byte says which,
    so a message never starts with ``b"F"`` or is empty (free for control messages)."""
    try:
        return b"M" + marshal.dumps(value)
    except ValueError:  # a value of another type
        return b"P" + pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes) -> Any:
    """The value :func:`pack` made ``data`` from."""
    body = memoryview(data)[1:]
    if data[:1] == b"M":
        return marshal.loads(body)
    if data[:1] == b"P":
        return pickle.loads(body)
    raise ValueError(f"not a packed message (first byte {data[:1]!r})")


def set_send_buffer(conn: Connection, size: int) -> None:
    """Ask the kernel for a ``size``-byte send buffer on ``conn`` (a duplex pipe is a Unix
    socket pair): a sender of large messages then blocks less often. Best effort: the kernel
    caps it (``net.core.wmem_max``) and a failure only leaves the default."""
    try:
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
    except OSError:
        logger.debug("could not set the send buffer of a child pipe", exc_info=True)


def wait_ready(process: BaseProcess, conn: Connection, *, name: str,
               timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait until a spawned child reported ready.

    Raises :class:`ChildStartError` when the child exits or stays silent first, and the
    child's reported error otherwise; the child is stopped in both cases.
    """
    try:
        if not conn.poll(timeout_s):
            raise ChildStartError(f"{name}: no answer in {timeout_s:.0f} s")
        status, detail = conn.recv()
    except (EOFError, OSError) as exc:
        stop_child(process, conn)
        raise ChildStartError(f"{name} exited at start (code {process.exitcode})") from exc
    except ChildStartError:
        stop_child(process, conn)
        raise
    if status != "ready":
        stop_child(process, conn)
        raise_reported(detail, name)


def stop_child(process: BaseProcess, conn: Connection) -> None:
    """Terminate the child if it still runs, and close the pipe (idempotent)."""
    if process.is_alive():
        process.terminate()
        process.join(10)
    conn.close()


def report_ready(conn: Connection) -> None:
    """In the child: the destination is open, the parent may go on."""
    conn.send(("ready", None))


def report_error(conn: Connection, exc: BaseException) -> None:
    """In the child: say what failed, for :func:`raise_reported` in the parent."""
    conn.send(("error", (type(exc).__name__, str(exc))))


def raise_reported(detail: tuple[str, str], where: str) -> NoReturn:
    """Raise a child's reported error in the parent (same class when it is kvscope's)."""
    name, message = detail
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, KvscopeError):
        raise cls(message)
    raise KvscopeError(f"{where}: {name}: {message}")


__all__ = ["ChildStartError", "READY_TIMEOUT_S", "pack", "raise_reported", "report_error",
    "report_ready", "set_send_buffer", "spawn_child", "start_child", "stop_child", "unpack",
    "wait_ready"]
