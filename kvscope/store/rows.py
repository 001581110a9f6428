"""Column builders: collect raw rows column by column and hand them to the writer as Arrow tables.

Converters (SDK spans, OTLP protobuf, OTLP JSON) fill these; nothing here knows where rows came
from. Attribute values arrive already stringified, as the ClickHouse exporter stores them.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from kvscope.store.schema import GAUGE_ARROW, TRACES_ARROW

Attrs = list[tuple[str, str]]
# (Timestamp ns, Name, Attributes)
Event = tuple[int, str, Attrs]
# (TraceId, SpanId, TraceState, Attributes)
Link = tuple[str, str, str, Attrs]


@dataclass
class TraceRows:
    """Rows for ``otel_traces``, held column-wise."""

    timestamp_ns: list[int] = field(default_factory=list)
    trace_id: list[str] = field(default_factory=list)
    span_id: list[str] = field(default_factory=list)
    parent_span_id: list[str] = field(default_factory=list)
    trace_state: list[str] = field(default_factory=list)
    span_name: list[str] = field(default_factory=list)
    span_kind: list[str] = field(default_factory=list)
    service_name: list[str] = field(default_factory=list)
    resource_attributes: list[Attrs] = field(default_factory=list)
    scope_name: list[str] = field(default_factory=list)
    scope_version: list[str] = field(default_factory=list)
    span_attributes: list[Attrs] = field(default_factory=list)
    duration_ns: list[int] = field(default_factory=list)
    status_code: list[str] = field(default_factory=list)
    status_message: list[str] = field(default_factory=list)
    events: list[list[dict[str, Any]]] = field(default_factory=list)
    links: list[list[dict[str, Any]]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.span_id)

    def add(
        self,
        *,
        timestamp_ns: int,
        trace_id: str,
        span_id: str,
        parent_span_id: str,
        trace_state: str,
        span_name: str,
        span_kind: str,
        service_name: str,
        resource_attributes: Attrs,
        scope_name: str,
        scope_version: str,
        span_attributes: Attrs,
        duration_ns: int,
        status_code: str,
        status_message: str,
        events: list[Event],
        links: list[Link],
    ) -> None:
        """Append one span."""
        self.timestamp_ns.append(timestamp_ns)
        self.trace_id.append(trace_id)
        self.span_id.append(span_id)
        self.parent_span_id.append(parent_span_id)
        self.trace_state.append(trace_state)
        self.span_name.append(span_name)
        self.span_kind.append(span_kind)
        self.service_name.append(service_name)
        self.resource_attributes.append(resource_attributes)
        self.scope_name.append(scope_name)
        self.scope_version.append(scope_version)
        self.span_attributes.append(span_attributes)
        self.duration_ns.append(max(duration_ns, 0))
        self.status_code.append(status_code)
        self.status_message.append(status_message)
        self.events.append(
            [{"Timestamp": t, "Name": n, "Attributes": a} for t, n, a in events] if events else []
        )
        self.links.append(
            [
                {"TraceId": t, "SpanId": s, "TraceState": st, "Attributes": a}
                for t, s, st, a in links
            ]
            if links
            else []
        )

    def to_arrow(self) -> pa.Table:
        """The rows as an Arrow table in ``otel_traces`` column order."""
        columns = [
            self.timestamp_ns,
            self.trace_id,
            self.span_id,
            self.parent_span_id,
            self.trace_state,
            self.span_name,
            self.span_kind,
            self.service_name,
            self.resource_attributes,
            self.scope_name,
            self.scope_version,
            self.span_attributes,
            self.duration_ns,
            self.status_code,
            self.status_message,
            self.events,
            self.links,
        ]
        arrays = [pa.array(col, type=f.type) for col, f in zip(columns, TRACES_ARROW, strict=True)]
        return pa.Table.from_arrays(arrays, schema=TRACES_ARROW)


@dataclass
class GaugeRows:
    """Rows for ``otel_metrics_gauge``, held column-wise."""

    resource_attributes: list[Attrs] = field(default_factory=list)
    resource_schema_url: list[str] = field(default_factory=list)
    scope_name: list[str] = field(default_factory=list)
    scope_version: list[str] = field(default_factory=list)
    scope_attributes: list[Attrs] = field(default_factory=list)
    scope_dropped_attr_count: list[int] = field(default_factory=list)
    scope_schema_url: list[str] = field(default_factory=list)
    service_name: list[str] = field(default_factory=list)
    metric_name: list[str] = field(default_factory=list)
    metric_description: list[str] = field(default_factory=list)
    metric_unit: list[str] = field(default_factory=list)
    attributes: list[Attrs] = field(default_factory=list)
    start_time_ns: list[int] = field(default_factory=list)
    time_ns: list[int] = field(default_factory=list)
    value: list[float] = field(default_factory=list)
    flags: list[int] = field(default_factory=list)
    exemplars: list[list[dict[str, Any]]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.value)

    def add(
        self,
        *,
        resource_attributes: Attrs,
        resource_schema_url: str,
        scope_name: str,
        scope_version: str,
        scope_attributes: Attrs,
        scope_dropped_attr_count: int,
        scope_schema_url: str,
        service_name: str,
        metric_name: str,
        metric_description: str,
        metric_unit: str,
        attributes: Attrs,
        start_time_ns: int,
        time_ns: int,
        value: float,
        flags: int,
    ) -> None:
        """Append one gauge data point (exemplars are not kept)."""
        self.resource_attributes.append(resource_attributes)
        self.resource_schema_url.append(resource_schema_url)
        self.scope_name.append(scope_name)
        self.scope_version.append(scope_version)
        self.scope_attributes.append(scope_attributes)
        self.scope_dropped_attr_count.append(scope_dropped_attr_count)
        self.scope_schema_url.append(scope_schema_url)
        self.service_name.append(service_name)
        self.metric_name.append(metric_name)
        self.metric_description.append(metric_description)
        self.metric_unit.append(metric_unit)
        self.attributes.append(attributes)
        self.start_time_ns.append(start_time_ns)
        self.time_ns.append(time_ns)
        self.value.append(value)
        self.flags.append(flags)
        self.exemplars.append([])

    def to_arrow(self) -> pa.Table:
        """The rows as an Arrow table in ``otel_metrics_gauge`` column order."""
        columns = [
            self.resource_attributes,
            self.resource_schema_url,
            self.scope_name,
            self.scope_version,
            self.scope_attributes,
            self.scope_dropped_attr_count,
            self.scope_schema_url,
            self.service_name,
            self.metric_name,
            self.metric_description,
            self.metric_unit,
            self.attributes,
            self.start_time_ns,
            self.time_ns,
            self.value,
            self.flags,
            self.exemplars,
        ]
        arrays = [pa.array(col, type=f.type) for col, f in zip(columns, GAUGE_ARROW, strict=True)]
        return pa.Table.from_arrays(arrays, schema=GAUGE_ARROW)


def stringify(value: Any) -> str:
    """An attribute value as the ClickHouse exporter stores it (pcommon ``AsString``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, list | tuple):
        return json.dumps(list(value), separators=(",", ":"), default=str)
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"), default=str)
    return str(value)


__all__ = ["Attrs", "Event", "GaugeRows", "Link", "TraceRows", "stringify"]
