"""Convert OpenTelemetry SDK spans and metric data into store rows (the in-process path)."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.sdk.metrics.export import Gauge, MetricsData, Sum
from opentelemetry.sdk.trace import ReadableSpan

from kvscope.store.rows import Attrs, GaugeRows, TraceRows, stringify
from kvscope.store.schema import SPAN_KIND_NAMES, STATUS_CODE_NAMES

_SERVICE_NAME = "service.name"


def _attrs(attributes: object) -> Attrs:
    if not attributes:
        return []
    return [
        (k, v if isinstance(v, str) else stringify(v))
        for k, v in attributes.items()  # type: ignore[attr-defined]
    ]


def spans_to_rows(spans: Sequence[ReadableSpan], rows: TraceRows | None = None) -> TraceRows:
    """Append SDK spans to ``rows`` (a new TraceRows when None) in otel_traces' shape."""
    rows = rows if rows is not None else TraceRows()
    resource_cache: dict[int, tuple[str, Attrs]] = {}
    for span in spans:
        ctx = span.context
        if ctx is None:
            continue
        resource = span.resource
        cached = resource_cache.get(id(resource))
        if cached is None:
            res_attrs = _attrs(resource.attributes)
            cached = (str(resource.attributes.get(_SERVICE_NAME, "")), res_attrs)
            resource_cache[id(resource)] = cached
        service, res_attrs = cached
        parent = span.parent
        scope = span.instrumentation_scope
        start = span.start_time or 0
        end = span.end_time or start
        status = span.status
        events = [(e.timestamp, e.name, _attrs(e.attributes)) for e in span.events]
        links = [
            (
                format(link.context.trace_id, "032x"),
                format(link.context.span_id, "016x"),
                link.context.trace_state.to_header() if link.context.trace_state else "",
                _attrs(link.attributes),
            )
            for link in span.links
        ]
        rows.add(
            timestamp_ns=start,
            trace_id=format(ctx.trace_id, "032x"),
            span_id=format(ctx.span_id, "016x"),
            parent_span_id=format(parent.span_id, "016x") if parent is not None else "",
            trace_state=ctx.trace_state.to_header() if ctx.trace_state else "",
            span_name=span.name,
            span_kind=SPAN_KIND_NAMES.get(span.kind.value + 1, ""),
            service_name=service,
            resource_attributes=res_attrs,
            scope_name=scope.name if scope else "",
            scope_version=(scope.version or "") if scope else "",
            span_attributes=_attrs(span.attributes),
            duration_ns=end - start,
            status_code=STATUS_CODE_NAMES.get(status.status_code.value, ""),
            status_message=status.description or "",
            events=events,
            links=links,
        )
    return rows


def metrics_to_rows(data: MetricsData, rows: GaugeRows | None = None) -> GaugeRows:
    """Append gauge (and non-monotonic sum) points from SDK metric data to ``rows``.

    kvscope's own metrics are all gauges; other instrument kinds are not stored.
    """
    rows = rows if rows is not None else GaugeRows()
    for resource_metrics in data.resource_metrics:
        resource = resource_metrics.resource
        res_attrs = _attrs(resource.attributes)
        service = str(resource.attributes.get(_SERVICE_NAME, ""))
        for scope_metrics in resource_metrics.scope_metrics:
            scope = scope_metrics.scope
            for metric in scope_metrics.metrics:
                points = metric.data
                if not isinstance(points, Gauge | Sum):
                    continue
                if isinstance(points, Sum) and points.is_monotonic:
                    continue
                for point in points.data_points:
                    rows.add(
                        resource_attributes=res_attrs,
                        resource_schema_url=resource_metrics.schema_url or "",
                        scope_name=scope.name,
                        scope_version=scope.version or "",
                        scope_attributes=_attrs(getattr(scope, "attributes", None)),
                        scope_dropped_attr_count=0,
                        scope_schema_url=scope_metrics.schema_url or "",
                        service_name=service,
                        metric_name=metric.name,
                        metric_description=metric.description or "",
                        metric_unit=metric.unit or "",
                        attributes=_attrs(point.attributes),
                        start_time_ns=getattr(point, "start_time_unix_nano", 0) or 0,
                        time_ns=point.time_unix_nano,
                        value=float(point.value),
                        flags=0,
                    )
    return rows
