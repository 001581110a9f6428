"""One KV transfer attempt (or decline) between prefill and decode, as the nodes report it."""

from __future__ import annotations

from dataclasses import dataclass


# Per turn: not frozen (see docs/architecture.md, "Value classes on hot paths").
@dataclass(slots=True)
class TransferRecord:
    """One D→P READ attempt (or decline) by P's worker."""

    direction: str
    status: str
    tokens: int
    blocks: int
    bytes: int
    remote_engine_id: str
    stale_handle: bool = False


__all__ = ["TransferRecord"]
