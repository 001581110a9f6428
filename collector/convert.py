"""Convert OpenTelemetry SDK spans and metric data into store rows (the in-process path)."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.sdk.metrics.export import Gauge, MetricsData, Sum
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind, StatusCode

from kvscope.store.rows import Attrs, GaugeRows, TraceRows, stringify
from kvscope.store.schema import SPAN_KIND_NAMES, STATUS_CODE_NAMES

_SERVICE_NAME = "service.name"


def attribute_pairs(attributes: object) -> Attrs:
    if not attributes:
        return []
    out: Attrs = []
    append = out.append
    # Exact-type branches for kvscope's value types (what stringify gives them, without a call:
    # str(int) == repr(int)); anything else, subclasses included, goes through stringify.
    for k, v in attributes.items():  # type: ignore[attr-defined]
        t = type(v)
        if t is str:
            append((k, v))
        elif t is int:
            append((k, str(v)))
        elif t is bool:
            append((k, "true" if v else "false"))
        else:
            append((k, stringify(v)))
    return out


def spans_to_rows(spans: Sequence[ReadableSpan], rows: TraceRows | None = None) -> TraceRows:
    """Append SDK spans to ``rows`` (a new TraceRows when None) in otel_traces' shape.

    This runs on the export thread for every span, so it appends to the column lists directly
    instead of calling :meth:`TraceRows.add` (keyword calls cost more than the work).
    """
    rows = rows if rows is not None else TraceRows()
    resource_cache: dict[int, tuple[str, Attrs]] = {}
    kinds = {kind: SPAN_KIND_NAMES.get(kind.value + 1, "") for kind in SpanKind}
    statuses = {code: STATUS_CODE_NAMES.get(code.value, "") for code in StatusCode}
    timestamp, trace_id, span_id = rows.timestamp_ns, rows.trace_id, rows.span_id
    parent_id, trace_state, span_name = rows.parent_span_id, rows.trace_state, rows.span_name
    span_kind, service_name = rows.span_kind, rows.service_name
    resource_attrs, span_attrs = rows.resource_attributes, rows.span_attributes
    scope_name, scope_version = rows.scope_name, rows.scope_version
    duration, status_code, status_message = rows.duration_ns, rows.status_code, rows.status_message
    events_col, links_col = rows.events, rows.links
    # One-entry memos: consecutive spans mostly share a trace, a parent (a turn's legs), a trace
    # state (usually the SDK's one empty TraceState) and a scope.
    last_trace, last_trace_hex = -1, ""
    last_parent, last_parent_hex = -1, ""
    last_state: object = None
    last_state_header = ""
    last_scope: object = None
    last_scope_name = last_scope_version = ""
    for span in spans:
        ctx = span.context
        if ctx is None:
            continue
        resource = span.resource
        cached = resource_cache.get(id(resource))
        if cached is None:
            cached = (str(resource.attributes.get(_SERVICE_NAME, "")),
                      attribute_pairs(resource.attributes))
            resource_cache[id(resource)] = cached
        parent = span.parent
        scope = span.instrumentation_scope
        start = span.start_time or 0
        end = span.end_time or start
        status = span.status
        timestamp.append(start)
        if ctx.trace_id != last_trace:
            # A turn's spans share a trace and arrive together: format its id once.
            last_trace = ctx.trace_id
            last_trace_hex = f"{last_trace:032x}"
        trace_id.append(last_trace_hex)
        span_id.append(f"{ctx.span_id:016x}")
        if parent is None:
            parent_id.append("")
        else:
            if parent.span_id != last_parent:
                last_parent = parent.span_id
                last_parent_hex = f"{last_parent:016x}"
            parent_id.append(last_parent_hex)
        state = ctx.trace_state
        if state is not last_state:
            last_state = state
            last_state_header = state.to_header() if state else ""
        trace_state.append(last_state_header)
        span_name.append(span.name)
        span_kind.append(kinds[span.kind])
        service_name.append(cached[0])
        resource_attrs.append(cached[1])
        if scope is not last_scope:
            last_scope = scope
            last_scope_name = scope.name if scope else ""
            last_scope_version = (scope.version or "") if scope else ""
        scope_name.append(last_scope_name)
        scope_version.append(last_scope_version)
        span_attrs.append(attribute_pairs(span.attributes))
        duration.append(end - start if end > start else 0)
        status_code.append(statuses[status.status_code])
        status_message.append(status.description or "")
        events = span.events
        events_col.append(
            [{"Timestamp": e.timestamp, "Name": e.name, "Attributes": attribute_pairs(e.attributes)}
             for e in events]
            if events
            else []
        )
        links = span.links
        links_col.append(
            [
                {
                    "TraceId": f"{link.context.trace_id:032x}",
                    "SpanId": f"{link.context.span_id:016x}",
                    "TraceState": (
                        link.context.trace_state.to_header() if link.context.trace_state else ""
                    ),
                    "Attributes": attribute_pairs(link.attributes),
                }
                for link in links
            ]
            if links
            else []
        )
    return rows


def metrics_to_rows(data: MetricsData, rows: GaugeRows | None = None) -> GaugeRows:
    """Append gauge (and non-monotonic sum) points from SDK metric data to ``rows``.

    kvscope's own metrics are all gauges; other instrument kinds are not stored.
    """
    rows = rows if rows is not None else GaugeRows()
    for resource_metrics in data.resource_metrics:
        resource = resource_metrics.resource
        res_attrs = attribute_pairs(resource.attributes)
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
                        scope_attributes=attribute_pairs(getattr(scope, "attributes", None)),
                        scope_dropped_attr_count=0,
                        scope_schema_url=scope_metrics.schema_url or "",
                        service_name=service,
                        metric_name=metric.name,
                        metric_description=metric.description or "",
                        metric_unit=metric.unit or "",
                        attributes=attribute_pairs(point.attributes),
                        start_time_ns=getattr(point, "start_time_unix_nano", 0) or 0,
                        time_ns=point.time_unix_nano,
                        value=float(point.value),
                        flags=0,
                    )
    return rows


__all__ = ["attribute_pairs", "metrics_to_rows", "spans_to_rows"]
