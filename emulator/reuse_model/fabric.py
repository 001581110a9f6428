"""Which decode engine answers a side-channel address: the NIXL handshake's view of the nodes."""

from __future__ import annotations

from kvscope.emulator.reuse_model.decode import DecodeNode


class Fabric:
    """Which decode engine answers a side-channel address (the NIXL handshake's view)."""

    def __init__(self) -> None:
        self._by_address: dict[tuple[str, int], DecodeNode] = {}

    def register(self, node: DecodeNode, hosts: tuple[str, ...] = ()) -> None:
        """Make ``node`` reachable at its side-channel host and any aliases in ``hosts``."""
        for host in (node.config.side_channel_host, *hosts):
            self._by_address[(host, node.config.side_channel_port)] = node

    def resolve(self, host: object, port: object, engine_id: object) -> DecodeNode | None:
        """The node a handshake to ``host:port`` reaches, if it is engine ``engine_id``."""
        if not isinstance(host, str) or not isinstance(port, int):
            return None
        node = self._by_address.get((host, port))
        if node is None or node.config.engine_id != engine_id:
            return None
        return node


__all__ = ["Fabric"]
