"""Decode OTLP export requests (protobuf or OTLP/JSON) into store rows (the receiver's path).

The rows are the ones :mod:`kvscope.collector.convert` builds from SDK spans for the same data:
attribute values go through the same :func:`~kvscope.store.rows.stringify`, ids become lowercase
hex, SpanKind/StatusCode become the ClickHouse exporter's strings. OTLP/JSON is first normalised
(hex ids to protobuf-JSON bytes) and parsed into the same protobuf classes, so both encodings
share one decoder and one set of checks.

What is refused, and how:

* a body that cannot be decoded at all (bad protobuf, bad JSON, a wrongly typed field, a
  non-hex id in JSON) raises :class:`~kvscope.errors.PayloadError` naming the place;
* a span with an id of the wrong length (or an all-zero id), or a timestamp past the year 2262,
  is rejected on its own and counted; the rest of the request is kept (OTLP partial success);
* metric points other than gauges and non-monotonic sums are counted as rejected with a reason,
  as are number points without a value;
* an attribute value (span, event, link or resource) longer than :data:`MAX_VALUE_CHARS` is
  stored cut to that length with :data:`TRUNCATED_MARK` after it, and counted: the OTLP answer's
  ``partial_success`` says how many values were cut (nothing rejected), and the receiver's
  ``/metrics`` counts them. DuckDB keeps the memory of the bytes a process has stored (measured
  in docs/benchmarks.md: no ``memory_limit`` bounds it), so what one value may add is bounded
  here, as the SDK's attribute value length limit bounds what a producer sends. kvscope's own
  spans never come near it (no prompt text is ever an attribute).
"""

from __future__ import annotations

import codecs
import json
import re
from base64 import b64encode
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Generic, Literal, TypeVar

import pyarrow as pa
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import Span as _Span

from kvscope import semconv
from kvscope.errors import PayloadError
from kvscope.store.rows import Attrs, GaugeRows, TraceRows, stringify
from kvscope.store.schema import SPAN_KIND_NAMES, STATUS_CODE_NAMES

Encoding = Literal["protobuf", "json"]
Link = _Span.Link

_SERVICE_NAME = "service.name"
# TIMESTAMP_NS is a signed 64-bit count of nanoseconds; OTLP's fixed64 can go past it.
_MAX_TIME_NS = 2**63 - 1
# The longest attribute value stored, in characters (as the SDK's attribute value length limit);
# a longer one is cut and marked.
MAX_VALUE_CHARS = 64 * 1024
TRUNCATED_MARK = "…[truncated by kvscope]"
# How many individual reasons one partial-success message lists before summarising.
_MAX_REASONS = 3
_HEX = re.compile(r"[0-9a-fA-F]*")


Rows = TypeVar("Rows", TraceRows, GaugeRows)


@dataclass
class DecodedBatch(Generic[Rows]):
    """Decoded rows ready for the store, and what was rejected (``noun``: what one row is)."""

    rows: Rows
    noun: str
    rejected: int = 0
    reasons: list[str] = field(default_factory=list)  # the first _MAX_REASONS
    reason_count: int = 0  # every reason given, kept or not
    truncated: int = 0  # attribute values cut to MAX_VALUE_CHARS (distinct per request)

    def reject(self, count: int, where: str, reason: str) -> None:
        """Count ``count`` rejected items; the first few reasons are kept for the message."""
        self.rejected += count
        if count:
            self.reason_count += 1
            if len(self.reasons) < _MAX_REASONS:
                self.reasons.append(f"{where}: {reason}")

    @property
    def error_message(self) -> str:
        """One line for OTLP partial success ('' when nothing was rejected)."""
        count, reasons = self.rejected, self.reasons
        cut = (f"{self.truncated} attribute value{'' if self.truncated == 1 else 's'} longer "
               f"than {MAX_VALUE_CHARS} characters stored truncated") if self.truncated else ""
        if not count:
            return cut
        shown = "; ".join(reasons)
        hidden = self.reason_count - len(reasons)
        more = f" (and {hidden} more)" if hidden > 0 else ""
        line = f"{count} {self.noun}{'' if count == 1 else 's'} rejected: {shown}{more}"
        return f"{line}; {cut}" if cut else line

    def to_arrow(self) -> pa.Table:
        """The rows as an Arrow table; PayloadError when a value cannot be stored."""
        try:
            return self.rows.to_arrow()
        except (pa.ArrowException, OverflowError, UnicodeError, ValueError, TypeError) as exc:
            raise PayloadError(f"a value cannot be stored: {exc}") from None


TraceBatch = DecodedBatch[TraceRows]
GaugeBatch = DecodedBatch[GaugeRows]


# --- values ------------------------------------------------------------------------------------


def _value(any_value: Any) -> Any:
    """An OTLP AnyValue as the Python value the SDK would have held."""
    kind = any_value.WhichOneof("value")
    if kind == "string_value":
        return any_value.string_value
    if kind == "int_value":
        return any_value.int_value
    if kind == "double_value":
        return any_value.double_value
    if kind == "bool_value":
        return any_value.bool_value
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in any_value.kvlist_value.values}
    if kind == "bytes_value":
        return any_value.bytes_value
    return None


def _string(value: Any) -> str:
    """One AnyValue as the SDK path stores it (what stringify() makes of the SDK's value)."""
    kind = value.WhichOneof("value")
    # Scalars are stringified inline, exactly as stringify() does, because this runs once per
    # distinct attribute of every request and is the receiver's hottest code.
    if kind == "string_value":
        return value.string_value
    if kind == "int_value":
        return repr(value.int_value)
    if kind == "double_value":
        return repr(value.double_value)
    if kind == "bool_value":
        return "true" if value.bool_value else "false"
    if kind is None:
        return ""
    return stringify(_value(value))


def _attrs(key_values: Iterable[Any]) -> Attrs:
    """Key/value pairs stringified as the SDK path stores them; a repeated key keeps its last
    value (a MAP cannot hold a key twice, and the SDK's dict would also keep the last). Values
    are not cut here: :func:`cut_long_values` does that for a whole batch."""
    return list({kv.key: _string(kv.value) for kv in key_values}.items())


def _cut(value: str) -> str:
    return value[:MAX_VALUE_CHARS] + TRUNCATED_MARK


def _cut_attrs(attrs: Attrs) -> tuple[Attrs, int]:
    if all(len(v) <= MAX_VALUE_CHARS for _, v in attrs):
        return attrs, 0
    return [(k, _cut(v) if len(v) > MAX_VALUE_CHARS else v) for k, v in attrs], sum(
        len(v) > MAX_VALUE_CHARS for _, v in attrs)


def _id_problem(raw: bytes, size: int, what: str, optional: bool = False) -> str | None:
    if len(raw) != size:
        if optional and not raw:
            return None
        return f"{what} is {len(raw)} bytes, expected {size}"
    if not any(raw):
        return f"{what} is all zeros"
    return None


# --- traces ------------------------------------------------------------------------------------


# The span path reads each attribute as the raw bytes of its KeyValue (a wire-compatible view of
# trace.proto in which ``attributes`` is ``repeated bytes``): identical KeyValues, which most
# attributes of a batch are (model, instance, router result, small counts), are then decoded once
# per request instead of once per span, and no wrapper object is made per attribute. Fields are
# declared with the numbers and wire types of opentelemetry/proto/trace/v1/trace.proto.
_LITE_PACKAGE = "kvscope_otlp_lite"
_F = descriptor_pb2.FieldDescriptorProto
_LITE_MESSAGES: dict[str, list[tuple[int, str, int, bool, str]]] = {
    # message: [(number, name, type, repeated, message type)]
    "Request": [(1, "resource_spans", _F.TYPE_MESSAGE, True, "ResourceSpans")],
    "ResourceSpans": [
        (1, "resource", _F.TYPE_BYTES, False, ""),
        (2, "scope_spans", _F.TYPE_MESSAGE, True, "ScopeSpans"),
    ],
    "ScopeSpans": [
        (1, "scope", _F.TYPE_BYTES, False, ""),
        (2, "spans", _F.TYPE_MESSAGE, True, "Span"),
    ],
    "Span": [
        (1, "trace_id", _F.TYPE_BYTES, False, ""),
        (2, "span_id", _F.TYPE_BYTES, False, ""),
        (3, "trace_state", _F.TYPE_STRING, False, ""),
        (4, "parent_span_id", _F.TYPE_BYTES, False, ""),
        (5, "name", _F.TYPE_STRING, False, ""),
        (6, "kind", _F.TYPE_INT32, False, ""),  # an enum on the wire: a varint
        (7, "start_time_unix_nano", _F.TYPE_FIXED64, False, ""),
        (8, "end_time_unix_nano", _F.TYPE_FIXED64, False, ""),
        (9, "attributes", _F.TYPE_BYTES, True, ""),
        (11, "events", _F.TYPE_MESSAGE, True, "Event"),
        (13, "links", _F.TYPE_BYTES, True, ""),
        (15, "status", _F.TYPE_MESSAGE, False, "Status"),
    ],
    "Event": [
        (1, "time_unix_nano", _F.TYPE_FIXED64, False, ""),
        (2, "name", _F.TYPE_STRING, False, ""),
        (3, "attributes", _F.TYPE_BYTES, True, ""),
    ],
    "Status": [(2, "message", _F.TYPE_STRING, False, ""), (3, "code", _F.TYPE_INT32, False, "")],
}


@cache
def _lite_request_class() -> Any:
    proto = descriptor_pb2.FileDescriptorProto(
        name="kvscope_otlp_lite_trace.proto", package=_LITE_PACKAGE, syntax="proto3"
    )
    for message_name, fields in _LITE_MESSAGES.items():
        message = proto.message_type.add(name=message_name)
        for number, name, kind, repeated, type_name in fields:
            declared = message.field.add(
                name=name,
                number=number,
                type=kind,
                label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL,
            )
            if type_name:
                declared.type_name = f".{_LITE_PACKAGE}.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_LITE_PACKAGE}.Request"))


def _raw_attrs(raw: Sequence[bytes], cache: dict[bytes, tuple[str, str]]) -> Attrs:
    """Attributes given as serialized KeyValues, each distinct one decoded once per request."""
    get = cache.get
    pairs = [get(blob) for blob in raw]
    if None in pairs:
        pairs = [
            pair if pair is not None else _decode_key_value(blob, cache)
            for pair, blob in zip(pairs, raw, strict=True)
        ]
    if len(pairs) > 1:
        unique = dict(pairs)  # type: ignore[arg-type]
        if len(unique) != len(pairs):
            return list(unique.items())
    return pairs  # type: ignore[return-value]


def _decode_key_value(blob: bytes, cache: dict[bytes, tuple[str, str]]) -> tuple[str, str]:
    big = _big_string(blob) if len(blob) > _BIG_STRING_BYTES else None
    if big is not None:
        cache[blob] = big
        return big
    kv = KeyValue.FromString(blob)
    value = _string(kv.value)
    if len(value) > MAX_VALUE_CHARS:
        value = _cut(value)
    pair = cache[blob] = (kv.key, value)
    return pair


# A UTF-8 string of more bytes than this has more than MAX_VALUE_CHARS characters: it is cut.
_BIG_STRING_BYTES = 4 * MAX_VALUE_CHARS
# How much of a big string is decoded at a time (checked, then dropped but for its head).
_CHUNK_BYTES = 1 << 20


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The protobuf varint at ``pos`` and the position after it (IndexError past the end)."""
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


def _big_string(blob: bytes) -> tuple[str, str] | None:
    """A serialized ``KeyValue`` whose value is one ``string_value`` longer than
    :data:`_BIG_STRING_BYTES`: ``(key, value cut and marked)``, read off the wire without the
    whole value ever being a message field or a ``str`` (a 60 MiB value once made four 60 MiB
    copies at once: the message's, the parsed one's, the string and the request body). The
    whole value is still checked as UTF-8, as the parser checks it. ``None`` for any other shape
    or anything irregular: the full parse then decides, errors included."""
    key: str | None = None
    value: tuple[int, int] | None = None
    pos, end = 0, len(blob)
    try:
        while pos < end:
            tag, pos = _varint(blob, pos)
            if tag not in (0x0A, 0x12):  # KeyValue: 1 key, 2 value (both length-delimited)
                return None
            size, pos = _varint(blob, pos)
            if pos + size > end:
                return None
            if tag == 0x0A and key is None:
                key = blob[pos:pos + size].decode("utf-8")
            elif tag == 0x12 and value is None:
                value = (pos, pos + size)
            else:
                return None  # a field twice: proto's merge rules, left to the parser
            pos += size
        if key is None or value is None:
            return None
        pos, end = value
        tag, pos = _varint(blob, pos)
        size, pos = _varint(blob, pos)
    except (IndexError, UnicodeDecodeError):
        return None
    # AnyValue: its one field is 1, string_value, and fills it.
    if tag != 0x0A or pos + size != end or size <= _BIG_STRING_BYTES:
        return None
    decoder = codecs.getincrementaldecoder("utf-8")()
    head = ""
    view = memoryview(blob)
    try:
        for start in range(pos, end, _CHUNK_BYTES):
            stop = min(start + _CHUNK_BYTES, end)
            text = decoder.decode(view[start:stop], final=stop == end)
            if len(head) < MAX_VALUE_CHARS:
                head += text[:MAX_VALUE_CHARS - len(head)]
    except UnicodeDecodeError:
        return None
    return key, head + TRUNCATED_MARK


def decode_traces(request: ExportTraceServiceRequest, run_id: str | None = None) -> TraceBatch:
    """Decode a parsed ``ExportTraceServiceRequest`` into rows; bad spans are counted apart."""
    return decode_trace_bytes(request.SerializeToString(), run_id)


def _with_run(res_attrs: Attrs, run_id: str | None) -> Attrs:
    """The resource's attributes, naming ``run_id`` when the sender named no run itself."""
    if run_id is None or any(key == semconv.RUN_ID for key, _ in res_attrs):
        return res_attrs
    return [*res_attrs, (semconv.RUN_ID, run_id)]


def decode_trace_bytes(body: bytes, run_id: str | None = None) -> TraceBatch:
    """Decode a serialized ``ExportTraceServiceRequest`` into rows; bad spans are counted apart.

    Appends straight to the column lists (the shape :meth:`TraceRows.add` produces; a test
    compares both paths) because a keyword call per span costs more than the span's fields.
    """
    try:
        request = _lite_request_class().FromString(body)
    except (DecodeError, RuntimeError, ValueError) as exc:
        # upb names the wire-compatible view's type; the cause is the last part.
        cause = str(exc).rsplit(": ", 1)[-1]
        raise PayloadError(
            f"malformed or truncated protobuf ExportTraceServiceRequest: {cause}"
        ) from None
    try:
        return _decode_lite(request, run_id)
    except DecodeError as exc:
        # A nested message (resource, scope, attribute, link) that does not parse.
        raise PayloadError(
            f"malformed protobuf ExportTraceServiceRequest (nested message): {exc}"
        ) from None


def _decode_lite(request: Any, run_id: str | None = None) -> TraceBatch:
    rows = TraceRows()
    batch = TraceBatch(rows, "span")
    cache: dict[bytes, tuple[str, str]] = {}
    kind_names = SPAN_KIND_NAMES
    status_names = STATUS_CODE_NAMES
    put_timestamp = rows.timestamp_ns.append
    put_trace_id = rows.trace_id.append
    put_span_id = rows.span_id.append
    put_parent = rows.parent_span_id.append
    put_trace_state = rows.trace_state.append
    put_name = rows.span_name.append
    put_kind = rows.span_kind.append
    put_service = rows.service_name.append
    put_resource = rows.resource_attributes.append
    put_scope_name = rows.scope_name.append
    put_scope_version = rows.scope_version.append
    put_attributes = rows.span_attributes.append
    put_duration = rows.duration_ns.append
    put_status_code = rows.status_code.append
    put_status_message = rows.status_message.append
    put_events = rows.events.append
    put_links = rows.links.append
    for r, resource_spans in enumerate(request.resource_spans):
        res_attrs, cut = _cut_attrs(_with_run(
            _attrs(Resource.FromString(resource_spans.resource).attributes), run_id))
        batch.truncated += cut
        service = dict(res_attrs).get(_SERVICE_NAME, "")
        for s, scope_spans in enumerate(resource_spans.scope_spans):
            scope = InstrumentationScope.FromString(scope_spans.scope)
            scope_name = scope.name
            scope_version = scope.version
            for i, span in enumerate(scope_spans.spans):
                trace_id = span.trace_id
                span_id = span.span_id
                parent_id = span.parent_span_id
                start = span.start_time_unix_nano
                end = span.end_time_unix_nano
                problem = None
                if len(trace_id) != 16 or len(span_id) != 8 or len(parent_id) not in (0, 8):
                    problem = (
                        _id_problem(trace_id, 16, "traceId")
                        or _id_problem(span_id, 8, "spanId")
                        or _id_problem(parent_id, 8, "parentSpanId", optional=True)
                    )
                elif not any(trace_id) or not any(span_id):
                    problem = _id_problem(trace_id, 16, "traceId") or _id_problem(
                        span_id, 8, "spanId"
                    )
                elif start > _MAX_TIME_NS or end > _MAX_TIME_NS:
                    problem = "start or end time is past the year 2262"
                elif end < start:
                    # A negative duration would be stored as 0 without a word.
                    problem = (f"endTimeUnixNano {end} is before startTimeUnixNano {start}")
                elif span.kind not in kind_names:
                    problem = f"kind {span.kind} is not a SpanKind"
                events: list[dict[str, Any]] = []
                links: list[dict[str, Any]] = []
                if problem is None and span.events:
                    for event in span.events:
                        if event.time_unix_nano > _MAX_TIME_NS:
                            problem = f"event {event.name!r} time is past the year 2262"
                            break
                        events.append(
                            {
                                "Timestamp": event.time_unix_nano,
                                "Name": event.name,
                                "Attributes": _raw_attrs(event.attributes, cache)
                                if event.attributes
                                else [],
                            }
                        )
                if problem is None and span.links:
                    for blob in span.links:
                        link = Link.FromString(blob)
                        problem = _id_problem(link.trace_id, 16, "link traceId") or _id_problem(
                            link.span_id, 8, "link spanId"
                        )
                        if problem:
                            break
                        links.append(
                            {
                                "TraceId": link.trace_id.hex(),
                                "SpanId": link.span_id.hex(),
                                "TraceState": link.trace_state,
                                "Attributes": _linked_attrs(link.attributes, batch),
                            }
                        )
                if problem is not None:
                    batch.reject(1, f"resourceSpans[{r}].scopeSpans[{s}].spans[{i}]", problem)
                    continue
                status = span.status
                put_timestamp(start)
                put_trace_id(trace_id.hex())
                put_span_id(span_id.hex())
                put_parent(parent_id.hex())
                put_trace_state(span.trace_state)
                put_name(span.name)
                put_kind(kind_names[span.kind])
                put_service(service)
                put_resource(res_attrs)
                put_scope_name(scope_name)
                put_scope_version(scope_version)
                put_attributes(_raw_attrs(span.attributes, cache))
                put_duration(end - start if end > start else 0)
                put_status_code(status_names.get(status.code, ""))
                put_status_message(status.message)
                put_events(events)
                put_links(links)
    batch.truncated += sum(1 for _, value in cache.values() if value.endswith(TRUNCATED_MARK))
    return batch


def _linked_attrs(key_values: Iterable[Any], batch: TraceBatch) -> Attrs:
    attrs, cut = _cut_attrs(_attrs(key_values))
    batch.truncated += cut
    return attrs


# --- metrics -----------------------------------------------------------------------------------

_UNSTORED_KINDS = {
    "histogram": "histogram points are not stored",
    "exponential_histogram": "exponential histogram points are not stored",
    "summary": "summary points are not stored",
}


def decode_metrics(request: ExportMetricsServiceRequest, run_id: str | None = None
                   ) -> GaugeBatch:
    """Decode gauge and non-monotonic sum points; count every other point as rejected."""
    batch = GaugeBatch(GaugeRows(), "data point")
    add = batch.rows.add
    reject = batch.reject

    for r, resource_metrics in enumerate(request.resource_metrics):
        res_attrs = _with_run(_attrs(resource_metrics.resource.attributes), run_id)
        service = dict(res_attrs).get(_SERVICE_NAME, "")
        resource_schema_url = resource_metrics.schema_url
        for s, scope_metrics in enumerate(resource_metrics.scope_metrics):
            scope = scope_metrics.scope
            scope_attrs = _attrs(scope.attributes)
            for m, metric in enumerate(scope_metrics.metrics):
                where = f"resourceMetrics[{r}].scopeMetrics[{s}].metrics[{m}] ({metric.name!r})"
                kind = metric.WhichOneof("data")
                if kind is None:
                    continue
                data = getattr(metric, kind)
                if kind in _UNSTORED_KINDS:
                    reject(len(data.data_points), where, _UNSTORED_KINDS[kind])
                    continue
                if kind == "sum" and data.is_monotonic:
                    reject(len(data.data_points), where, "monotonic sum points are not stored")
                    continue
                for point in data.data_points:
                    which = point.WhichOneof("value")
                    if which is None:
                        reject(1, where, "data point has no value")
                        continue
                    if (
                        point.time_unix_nano > _MAX_TIME_NS
                        or point.start_time_unix_nano > _MAX_TIME_NS
                    ):
                        reject(1, where, "data point time is out of range")
                        continue
                    add(
                        resource_attributes=res_attrs,
                        resource_schema_url=resource_schema_url,
                        scope_name=scope.name,
                        scope_version=scope.version,
                        scope_attributes=scope_attrs,
                        scope_dropped_attr_count=scope.dropped_attributes_count,
                        scope_schema_url=scope_metrics.schema_url,
                        service_name=service,
                        metric_name=metric.name,
                        metric_description=metric.description,
                        metric_unit=metric.unit,
                        attributes=_attrs(point.attributes),
                        start_time_ns=point.start_time_unix_nano,
                        time_ns=point.time_unix_nano,
                        value=float(point.as_double if which == "as_double" else point.as_int),
                        flags=point.flags,
                    )
    return batch


# --- request bodies ----------------------------------------------------------------------------


def _parse_protobuf(body: bytes, message: Message) -> None:
    try:
        message.ParseFromString(body)
    except (DecodeError, RuntimeError, ValueError) as exc:
        name = message.DESCRIPTOR.name
        raise PayloadError(f"malformed or truncated protobuf {name}: {exc}") from None


def _parse_json(body: bytes, message: Message, normalise: Callable[[Any], None]) -> None:
    name = message.DESCRIPTOR.name
    try:
        # OTLP/JSON is UTF-8; json.loads(bytes) would also guess UTF-16/32 from a BOM.
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise PayloadError(f"{name} JSON is not UTF-8: {exc.reason} at byte {exc.start}") from None
    except json.JSONDecodeError as exc:
        raise PayloadError(
            f"invalid {name} JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    except RecursionError:
        raise PayloadError(f"{name} JSON is nested too deeply") from None
    if not isinstance(data, dict):
        raise PayloadError(f"{name} JSON must be an object, got {type(data).__name__}")
    normalise(data)
    try:
        json_format.ParseDict(data, message, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        # protobuf nests "Failed to parse X field: " once per level; the last part names the
        # problem and the path (when it gives one) names the place.
        text = str(exc).rstrip(".")
        raise PayloadError(f"{name} JSON: {_readable(text)}") from None
    except (RecursionError, ValueError, TypeError) as exc:
        raise PayloadError(f"{name} JSON: {exc}") from None


def _readable(text: str) -> str:
    parts = text.split(": ")
    fields = [p.removeprefix("Failed to parse ").removesuffix(" field") for p in parts
              if p.startswith("Failed to parse ") and p.endswith(" field")]
    rest = ": ".join(p for p in parts if not (p.startswith("Failed to parse ")
                                             and p.endswith(" field")))
    message = f"{'.'.join(fields)}: {rest}" if fields else rest
    return " ".join(message.split())  # one line: protobuf quotes the bad value, newlines too


def _get(obj: dict[str, Any], camel: str, snake: str) -> Any:
    value = obj.get(camel)
    return obj.get(snake) if value is None else value


def _hex_ids(obj: Any, where: str, names: tuple[tuple[str, str], ...]) -> None:
    """Rewrite OTLP/JSON hex ids as the base64 that protobuf's JSON parser expects."""
    if not isinstance(obj, dict):
        return
    for camel, snake in names:
        for key in (camel, snake):
            raw = obj.get(key)
            if not isinstance(raw, str):
                continue  # missing, or wrongly typed: ParseDict names the problem
            if len(raw) % 2 or not _HEX.fullmatch(raw):
                raise PayloadError(f"{where}.{camel}: {raw[:40]!r} is not a hex-encoded id")
            obj[key] = b64encode(bytes.fromhex(raw)).decode("ascii")


def _dicts(obj: dict[str, Any], camel: str, snake: str) -> Iterable[tuple[int, dict[str, Any]]]:
    items = _get(obj, camel, snake)
    if isinstance(items, list):
        return ((i, item) for i, item in enumerate(items) if isinstance(item, dict))
    return ()


_SPAN_IDS = (("traceId", "trace_id"), ("spanId", "span_id"), ("parentSpanId", "parent_span_id"))
_LINK_IDS = (("traceId", "trace_id"), ("spanId", "span_id"))


def _normalise_traces(data: dict[str, Any]) -> None:
    for r, rs in _dicts(data, "resourceSpans", "resource_spans"):
        for s, ss in _dicts(rs, "scopeSpans", "scope_spans"):
            for i, span in _dicts(ss, "spans", "spans"):
                where = f"resourceSpans[{r}].scopeSpans[{s}].spans[{i}]"
                _hex_ids(span, where, _SPAN_IDS)
                for k, link in _dicts(span, "links", "links"):
                    _hex_ids(link, f"{where}.links[{k}]", _LINK_IDS)


_POINT_KINDS = (
    ("gauge", "gauge"),
    ("sum", "sum"),
    ("histogram", "histogram"),
    ("exponentialHistogram", "exponential_histogram"),
)


def _normalise_metrics(data: dict[str, Any]) -> None:
    for r, rm in _dicts(data, "resourceMetrics", "resource_metrics"):
        for s, sm in _dicts(rm, "scopeMetrics", "scope_metrics"):
            for m, metric in _dicts(sm, "metrics", "metrics"):
                for camel, snake in _POINT_KINDS:
                    kind = _get(metric, camel, snake)
                    if not isinstance(kind, dict):
                        continue
                    for p, point in _dicts(kind, "dataPoints", "data_points"):
                        for e, exemplar in _dicts(point, "exemplars", "exemplars"):
                            where = (
                                f"resourceMetrics[{r}].scopeMetrics[{s}].metrics[{m}]"
                                f".{camel}.dataPoints[{p}].exemplars[{e}]"
                            )
                            _hex_ids(exemplar, where, _LINK_IDS)


_Request = TypeVar("_Request", ExportTraceServiceRequest, ExportMetricsServiceRequest)


def _parse(request: _Request, body: bytes, encoding: Encoding,
           normalise: Callable[[Any], None]) -> _Request:
    if encoding == "json":
        _parse_json(body, request, normalise)
    else:
        _parse_protobuf(body, request)
    return request


def parse_trace_request(body: bytes, encoding: Encoding) -> ExportTraceServiceRequest:
    """Parse an OTLP/HTTP traces body; PayloadError names what is wrong."""
    return _parse(ExportTraceServiceRequest(), body, encoding, _normalise_traces)


def parse_metrics_request(body: bytes, encoding: Encoding) -> ExportMetricsServiceRequest:
    """Parse an OTLP/HTTP metrics body; PayloadError names what is wrong."""
    return _parse(ExportMetricsServiceRequest(), body, encoding, _normalise_metrics)


def decode_trace_request(body: bytes, encoding: Encoding, run_id: str | None = None
                         ) -> TraceBatch:
    """Parse and decode an OTLP/HTTP traces body (protobuf or JSON) into rows.

    ``run_id``, when given, names the run of every resource that does not name its own.
    """
    if encoding == "json":
        # JSON is checked field by field by protobuf's parser, then takes the protobuf path.
        return decode_trace_bytes(parse_trace_request(body, "json").SerializeToString(), run_id)
    return decode_trace_bytes(body, run_id)


def decode_metrics_request(body: bytes, encoding: Encoding, run_id: str | None = None
                           ) -> GaugeBatch:
    """Parse and decode an OTLP/HTTP metrics body (protobuf or JSON) into gauge rows."""
    return decode_metrics(parse_metrics_request(body, encoding), run_id)


__all__ = ["DecodedBatch", "Encoding", "GaugeBatch", "Link", "MAX_VALUE_CHARS", "TRUNCATED_MARK",
    "TraceBatch", "decode_metrics", "decode_metrics_request", "decode_trace_bytes",
    "decode_trace_request", "decode_traces", "parse_metrics_request", "parse_trace_request"]
