"""OpenTelemetry set-up for one kvscope process: a tracer and a meter for a named service.

``setup_telemetry`` builds providers that export either into a DuckDB store in this process
(the proxy alone, the demo) or over OTLP/HTTP to a ``kvscope serve`` receiver (engines, several
processes). Spans go through :class:`QueueSpanProcessor`: ``on_end`` only appends to a bounded
queue (drops are counted, never blocking the host); one thread exports batches with
instrumentation suppressed so that the exporter never traces itself.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY
from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import Tracer

from kvscope import __version__, semconv, settings
from kvscope.collector.queue_counts import QueueCounts
from kvscope.errors import SettingError

if TYPE_CHECKING:
    from kvscope.store.writer import StoreWriter

logger = logging.getLogger(__name__)


class QueueSpanProcessor(SpanProcessor):
    """Batches ended spans through a bounded queue; drops (and counts) when it is full."""

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        max_queue_size: int = 65536,
        max_batch_size: int = 8192,
        schedule_delay_s: float = 0.5,
    ) -> None:
        self._exporter = exporter
        self._max_queue_size = max_queue_size
        self._max_batch_size = max_batch_size
        self._delay = schedule_delay_s
        self._queue: deque[ReadableSpan] = deque()
        self._cond = threading.Condition()
        self._flush_requests: list[threading.Event] = []
        self._shutdown = False
        self.stats = QueueCounts()
        self._thread = threading.Thread(target=self._run, name="kvscope-span-export", daemon=True)
        self._thread.start()

    def on_start(self, span: Span, parent_context: otel_context.Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        # Appending under a short lock is the only work on the host's thread.
        with self._cond:
            if self._shutdown or len(self._queue) >= self._max_queue_size:
                self.stats.dropped += 1
                return
            self._queue.append(span)
            self.stats.queued += 1
            if len(self._queue) >= self._max_batch_size:
                self._cond.notify()

    def _drain(self) -> list[ReadableSpan]:
        n = min(len(self._queue), self._max_batch_size)
        return [self._queue.popleft() for _ in range(n)]

    def _export(self, batch: list[ReadableSpan]) -> None:
        token = otel_context.attach(otel_context.set_value(_SUPPRESS_INSTRUMENTATION_KEY, True))
        try:
            result = self._exporter.export(batch)
        except Exception:  # an exporter that breaks its contract still must not kill us
            logger.exception("span exporter raised")
            result = SpanExportResult.FAILURE
        finally:
            otel_context.detach(token)
        if result is SpanExportResult.SUCCESS:
            self.stats.sent += len(batch)
        else:
            self.stats.failed += len(batch)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._shutdown and not self._flush_requests:
                    self._cond.wait(self._delay)
                batch = self._drain()
                flushes = self._flush_requests if not self._queue else []
                if flushes:
                    self._flush_requests = []
                done = self._shutdown and not self._queue
            if batch:
                self._export(batch)
            for event in flushes:
                event.set()
            if done:
                return

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        event = threading.Event()
        with self._cond:
            self._flush_requests.append(event)
            self._cond.notify()
        if not event.wait(timeout_millis / 1000):
            return False
        return bool(self._exporter.force_flush(timeout_millis))

    def shutdown(self) -> None:
        with self._cond:
            if self._shutdown:
                return
            self._shutdown = True
            self._cond.notify()
        self._thread.join(30)
        self._exporter.shutdown()


@dataclass
class Telemetry:
    """The providers of one process, and what to flush and close at exit."""

    service_name: str
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    span_processor: QueueSpanProcessor
    writer: StoreWriter | None = None
    _closed: bool = field(default=False, repr=False)

    def tracer(self, name: str = semconv.SCOPE_NAME) -> Tracer:
        return self.tracer_provider.get_tracer(name, __version__)

    def meter(self, name: str = semconv.SCOPE_NAME) -> Meter:
        return self.meter_provider.get_meter(name, __version__)

    def flush(self, timeout_s: float = 30.0) -> bool:
        ok = self.tracer_provider.force_flush(int(timeout_s * 1000))
        ok = self.meter_provider.force_flush(int(timeout_s * 1000)) and ok
        if self.writer is not None:
            ok = self.writer.flush(timeout_s) and ok
        return ok

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()
        if self.writer is not None:
            self.writer.close()


def _otlp_exporters(endpoint: str) -> tuple[SpanExporter, MetricExporter]:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    base = endpoint.rstrip("/")
    return (
        OTLPSpanExporter(endpoint=f"{base}/v1/traces", timeout=10),
        OTLPMetricExporter(endpoint=f"{base}/v1/metrics", timeout=10),
    )


def setup_telemetry(
    service_name: str,
    *,
    db: str | None = None,
    otlp_endpoint: str | None = None,
    writer: StoreWriter | None = None,
    run_id: str | None = None,
    resource_attributes: Mapping[str, Any] | None = None,
    metric_interval_s: float = 1.0,
) -> Telemetry:
    """Providers for ``service_name`` exporting to a store file, an existing writer, or OTLP.

    Exactly one destination: ``writer`` (share a writer already open in this process), ``db``
    (open the file here) or ``otlp_endpoint`` (a kvscope receiver). Settings not passed resolve
    from the environment (``KVSCOPE_DB``, ``KVSCOPE_OTLP_ENDPOINT``).
    """
    if writer is None and db is None and otlp_endpoint is None:
        db = settings.resolve("db") or None
        otlp_endpoint = settings.resolve("otlp_endpoint") or None
    given = [d for d in (writer, db, otlp_endpoint) if d]
    if len(given) != 1:
        raise SettingError(
            "telemetry needs exactly one destination: --db FILE or --otlp-endpoint URL"
        )
    attrs: dict[str, Any] = {"service.name": service_name}
    if run_id:
        attrs[semconv.RUN_ID] = run_id
    attrs.update(resource_attributes or {})
    resource = Resource.create(attrs)

    owns_writer = False
    if otlp_endpoint:
        span_exporter, metric_exporter = _otlp_exporters(settings.resolve("otlp_endpoint",
                                                                          otlp_endpoint))
    else:
        # The store (DuckDB, Arrow, polars) only where spans go into a file: a vLLM process
        # exporting OTLP never imports it.
        from kvscope.collector.exporters import DuckDBMetricExporter, DuckDBSpanExporter
        from kvscope.store.writer import StoreWriter

        if writer is None:
            writer = StoreWriter.open(
                str(db), max_queue_rows=settings.resolve("export_queue_size") * 4
            )
            owns_writer = True
        span_exporter = DuckDBSpanExporter(writer)
        metric_exporter = DuckDBMetricExporter(writer)

    processor = QueueSpanProcessor(
        span_exporter,
        max_queue_size=settings.resolve("export_queue_size"),
        max_batch_size=settings.resolve("export_batch_size"),
        schedule_delay_s=settings.resolve("export_interval_s"),
    )
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(processor)
    reader = PeriodicExportingMetricReader(
        metric_exporter, export_interval_millis=metric_interval_s * 1000
    )
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
    return Telemetry(
        service_name=service_name,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        span_processor=processor,
        writer=writer if owns_writer else None,
    )


__all__ = ["QueueSpanProcessor", "Telemetry", "setup_telemetry"]
