"""Binding a server's listening address before anything else starts.

A server that owns a store binds its port first and opens the store after: a start that fails
because the port is taken must leave the file as it was (no new file, no run that never ends).
:func:`bind` takes the address and nothing more; the server starts accepting on the returned
sockets once everything else is ready.
"""

from __future__ import annotations

import socket

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
            sock.bind((address[0], chosen, *address[2:]))
            chosen = int(sock.getsockname()[1])
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


__all__ = ["bind", "bound_port", "close_all"]
