"""The counters of a drop-and-count queue between a hot path and the thread that drains it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class QueueCounts:
    """What a bounded queue did with what it was given; read them for drop reporting.

    Kept by :class:`~kvscope.collector.otel.QueueSpanProcessor` (ended spans to the exporter)
    and :class:`~kvscope.collector.engine_telemetry.EngineTelemetry` (engine records to spans).
    """

    queued: int = 0  # taken into the queue
    dropped: int = 0  # refused: the queue was full or closed
    sent: int = 0  # passed on by the draining thread (exported, or built into spans)
    failed: int = 0  # what the draining thread could not pass on


__all__ = ["QueueCounts"]
