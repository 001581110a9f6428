"""In-process OpenTelemetry exporters that write spans and gauge points into a kvscope store.

They follow the SDK's exporter contract: ``export`` returns a result and never raises into the
host. Conversion happens on the caller's (the batch processor's) thread; the DuckDB insert
happens on the :class:`~kvscope.store.StoreWriter` thread, behind its bounded queue.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import pyarrow as pa
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricExportResult,
    MetricsData,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from kvscope.collector.convert import metrics_to_rows, spans_to_rows
from kvscope.store.writer import StoreWriter

logger = logging.getLogger(__name__)


class _StoreSink:
    """What both exporters share: the writer, failures counted (the first logged), one shutdown."""

    def __init__(self, writer: StoreWriter, close_writer: bool, what: str) -> None:
        self._writer = writer
        self._close_writer = close_writer
        self._what = what
        # Spans (span exporter) or export calls (metric exporter) that could not be stored.
        self.failed = 0
        self._warned = False
        self._shutdown = False

    def _submit(self, build: Callable[[], pa.Table], submit: Callable[[pa.Table], bool],
                count: int) -> bool:
        """Hand the rows ``build`` makes to ``submit``; False (and counted) when that fails."""
        if self._shutdown:
            return False
        try:
            return submit(build())
        except Exception:
            self.failed += count
            if not self._warned:
                self._warned = True
                logger.exception("kvscope %s export failed (further failures are counted)",
                                 self._what)
            return False

    def _close(self, timeout_s: float) -> None:
        if self._shutdown:
            return
        self._shutdown = True
        self._writer.flush(timeout_s)
        if self._close_writer:
            self._writer.close()


class DuckDBSpanExporter(_StoreSink, SpanExporter):
    """Writes finished spans to ``otel_traces`` through a store writer."""

    def __init__(self, writer: StoreWriter, *, close_writer: bool = False) -> None:
        _StoreSink.__init__(self, writer, close_writer, "span")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        ok = self._submit(lambda: spans_to_rows(spans).to_arrow(), self._writer.submit_traces,
                          len(spans))
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._writer.flush(timeout_millis / 1000)

    def shutdown(self) -> None:
        self._close(30)


class DuckDBMetricExporter(_StoreSink, MetricExporter):
    """Writes gauge points to ``otel_metrics_gauge`` through a store writer."""

    def __init__(self, writer: StoreWriter, *, close_writer: bool = False) -> None:
        MetricExporter.__init__(
            self, preferred_temporality={},  # gauges have no temporality; keep SDK defaults
        )
        _StoreSink.__init__(self, writer, close_writer, "metric")

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object
    ) -> MetricExportResult:
        ok = self._submit(lambda: metrics_to_rows(metrics_data).to_arrow(),
                          self._writer.submit_gauge, 1)
        return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._writer.flush(timeout_millis / 1000)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        self._close(timeout_millis / 1000)


__all__ = ["DuckDBMetricExporter", "DuckDBSpanExporter"]
