"""In-process OpenTelemetry exporters that write spans and gauge points into a kvscope store.

They follow the SDK's exporter contract: ``export`` returns a result and never raises into the
host. Conversion happens on the caller's (the batch processor's) thread; the DuckDB insert
happens on the :class:`~kvscope.store.StoreWriter` thread, behind its bounded queue.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

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


class DuckDBSpanExporter(SpanExporter):
    """Writes finished spans to ``otel_traces`` through a store writer."""

    def __init__(self, writer: StoreWriter, *, close_writer: bool = False) -> None:
        self._writer = writer
        self._close_writer = close_writer
        self.failed_spans = 0
        self._warned = False
        self._shutdown = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown:
            return SpanExportResult.FAILURE
        try:
            rows = spans_to_rows(spans)
            ok = self._writer.submit_traces(rows.to_arrow())
        except Exception:
            self.failed_spans += len(spans)
            if not self._warned:
                self._warned = True
                logger.exception("kvscope span export failed (further failures are counted)")
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._writer.flush(timeout_millis / 1000)

    def shutdown(self) -> None:
        if self._shutdown:
            return
        self._shutdown = True
        self._writer.flush(30)
        if self._close_writer:
            self._writer.close()


class DuckDBMetricExporter(MetricExporter):
    """Writes gauge points to ``otel_metrics_gauge`` through a store writer."""

    def __init__(self, writer: StoreWriter, *, close_writer: bool = False) -> None:
        super().__init__(
            preferred_temporality={},  # gauges have no temporality; keep SDK defaults
        )
        self._writer = writer
        self._close_writer = close_writer
        self.failed_points = 0
        self._warned = False
        self._shutdown = False

    def export(
        self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object
    ) -> MetricExportResult:
        if self._shutdown:
            return MetricExportResult.FAILURE
        try:
            rows = metrics_to_rows(metrics_data)
            ok = self._writer.submit_gauge(rows.to_arrow())
        except Exception:
            self.failed_points += 1
            if not self._warned:
                self._warned = True
                logger.exception("kvscope metric export failed (further failures are counted)")
            return MetricExportResult.FAILURE
        return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._writer.flush(timeout_millis / 1000)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        if self._shutdown:
            return
        self._shutdown = True
        self._writer.flush(timeout_millis / 1000)
        if self._close_writer:
            self._writer.close()


__all__ = ["DuckDBMetricExporter", "DuckDBSpanExporter"]
