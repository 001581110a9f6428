"""Raw HTTP/1.1 over a socket, for what a client library will not send (a body cut short)."""

from __future__ import annotations

import socket


def post_head(path: str, length: int, content_type: str = "application/json") -> bytes:
    """The head of a POST to ``path`` that announces ``length`` body bytes."""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def partial_body_answer(host: str, port: int, path: str,
                        content_type: str = "application/json") -> bytes:
    """The first bytes a server answers a POST that announces 1000 body bytes and sends one."""
    with socket.create_connection((host, port)) as sock:
        sock.sendall(post_head(path, 1000, content_type) + b"{")
        sock.settimeout(10)
        return sock.recv(4096)
