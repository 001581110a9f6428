"""OTLP request decoding: the receiver's rows equal the in-process path's rows for the same data."""

from __future__ import annotations

import base64
import copy
import json
import math
from dataclasses import asdict
from typing import Any

import pytest
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from kvscope import semconv
from kvscope.collector.convert import metrics_to_rows, spans_to_rows
from kvscope.collector.otlp_decode import (
    decode_metrics_request,
    decode_trace_request,
    decode_traces,
)
from kvscope.errors import PayloadError
from kvscope.store.database import open_store
from kvscope.store.rows import stringify
from kvscope.store.writer import insert_arrow

# --- helpers -----------------------------------------------------------------------------------


def _record(build: Any, resource: dict[str, Any] | None = None) -> list[ReadableSpan]:
    """Run ``build(tracer)`` against a real SDK tracer and return the finished spans."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(resource or {"service.name": "svc"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    build(provider.get_tracer(semconv.SCOPE_NAME, "0.1"))
    provider.shutdown()
    return list(memory.get_finished_spans())


def _rich_spans() -> list[ReadableSpan]:
    def build(tracer: Any) -> None:
        with tracer.start_as_current_span(
            semconv.SPAN_TURN,
            kind=SpanKind.SERVER,
            attributes={
                semconv.GEN_AI_CONVERSATION_ID: "conv-1",
                semconv.TURN_INDEX: 2,
                semconv.TTFT_MS: 35.25,
                semconv.D_METADATA_ATTACHED: True,
                semconv.MESSAGE_BOUNDARY_HASHES: ["ab", "cd"],
                "ints": [1, -2, 3],
                "floats": (0.5, float("nan"), float("inf")),
                "bools": [True, False],
                "empty": "",
            },
        ) as turn:
            turn.add_event(semconv.EVENT_FIRST_TOKEN, {"n": 1, "ok": False})
            with tracer.start_as_current_span(
                semconv.SPAN_GENERATION,
                kind=SpanKind.CLIENT,
                links=[Link(turn.get_span_context(), {"why": "retry"})],
            ) as leg:
                leg.set_status(Status(StatusCode.ERROR, "decode failed"))
            with tracer.start_as_current_span(semconv.SPAN_TOOL_WAIT) as wait:
                wait.set_status(Status(StatusCode.OK))

    spans = _record(build, {"service.name": semconv.SERVICE_PROXY, "host.count": 3})
    spans += _record(
        lambda t: t.start_span(semconv.SPAN_KV_TRANSFER, kind=SpanKind.PRODUCER).end(),
        {"service.name": semconv.SERVICE_DECODE},
    )
    return spans


def _columns(rows: Any) -> dict[str, Any]:
    return asdict(rows)


def _same(a: Any, b: Any) -> bool:
    """Equality that treats NaN == NaN (stored values are strings; this is for floats only)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def _hex_ids(data: dict[str, Any]) -> dict[str, Any]:
    """protobuf's JSON (base64 ids) → OTLP/JSON (hex ids), as the OTLP spec requires."""
    data = copy.deepcopy(data)

    def fix(obj: dict[str, Any], keys: tuple[str, ...]) -> None:
        for key in keys:
            if key in obj:
                obj[key] = base64.b64decode(obj[key]).hex()

    for rs in data.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                fix(span, ("traceId", "spanId", "parentSpanId"))
                for link in span.get("links", []):
                    fix(link, ("traceId", "spanId"))
    return data


def _otlp_json(spans: list[ReadableSpan]) -> bytes:
    return json.dumps(_hex_ids(json_format.MessageToDict(encode_spans(spans)))).encode()


# --- traces: the two paths agree ---------------------------------------------------------------


def test_protobuf_rows_equal_the_in_process_rows() -> None:
    spans = _rich_spans()
    body = encode_spans(spans).SerializeToString()

    batch = decode_trace_request(body, "protobuf")

    assert batch.rejected == 0 and batch.error_message == ""
    assert _columns(batch.rows) == _columns(spans_to_rows(spans))
    # The comparison is not vacuous: every kind of value is there.
    rows = batch.rows
    by_name = {name: i for i, name in enumerate(rows.span_name)}
    turn, leg = by_name[semconv.SPAN_TURN], by_name[semconv.SPAN_GENERATION]
    attrs = dict(rows.span_attributes[turn])
    assert attrs[semconv.TURN_INDEX] == "2"
    assert attrs[semconv.D_METADATA_ATTACHED] == "true"
    assert attrs["floats"] == "[0.5,NaN,Infinity]"
    assert rows.events[turn][0]["Attributes"] == [("n", "1"), ("ok", "false")]
    assert rows.links[leg][0]["Attributes"] == [("why", "retry")]
    assert rows.links[leg][0]["SpanId"] == rows.span_id[turn]
    assert rows.parent_span_id[leg] == rows.span_id[turn]
    assert rows.status_code[leg] == "STATUS_CODE_ERROR"
    assert rows.span_kind[by_name[semconv.SPAN_KV_TRANSFER]] == "SPAN_KIND_PRODUCER"
    assert rows.service_name[by_name[semconv.SPAN_KV_TRANSFER]] == semconv.SERVICE_DECODE


def test_otlp_json_rows_equal_the_in_process_rows() -> None:
    spans = _rich_spans()

    batch = decode_trace_request(_otlp_json(spans), "json")

    assert _columns(batch.rows) == _columns(spans_to_rows(spans))


def test_decode_traces_accepts_a_parsed_request() -> None:
    spans = _rich_spans()
    assert _columns(decode_traces(encode_spans(spans)).rows) == _columns(spans_to_rows(spans))


SPEC_EXAMPLE = {
    # opentelemetry-proto examples/trace.json, plus one attribute of every AnyValue kind.
    "resourceSpans": [
        {
            "resource": {
                "attributes": [{"key": "service.name", "value": {"stringValue": "my.service"}}]
            },
            "scopeSpans": [
                {
                    "scope": {"name": "my.library", "version": "1.0.0"},
                    "spans": [
                        {
                            "traceId": "5B8EFFF798038103D269B633813FC60C",
                            "spanId": "EEE19B7EC3C1B174",
                            "parentSpanId": "EEE19B7EC3C1B173",
                            "name": "I'm a server span",
                            "startTimeUnixNano": "1544712660000000000",
                            "endTimeUnixNano": 1544712661000000000,
                            "kind": 2,
                            "status": {"code": 2, "message": "bad"},
                            "attributes": [
                                {"key": "s", "value": {"stringValue": "some value"}},
                                {"key": "i", "value": {"intValue": "42"}},
                                {"key": "i2", "value": {"intValue": -7}},
                                {"key": "d", "value": {"doubleValue": 1.5}},
                                {"key": "b", "value": {"boolValue": True}},
                                {
                                    "key": "a",
                                    "value": {
                                        "arrayValue": {
                                            "values": [{"intValue": "1"}, {"stringValue": "x"}]
                                        }
                                    },
                                },
                                {
                                    "key": "kv",
                                    "value": {
                                        "kvlistValue": {
                                            "values": [{"key": "k", "value": {"boolValue": False}}]
                                        }
                                    },
                                },
                                {"key": "bytes", "value": {"bytesValue": "AQI="}},
                                {"key": "unset", "value": {}},
                            ],
                            "events": [
                                {"timeUnixNano": "1544712660500000000", "name": "first_token"}
                            ],
                            "someFieldFromTheFuture": {"ignored": True},
                        }
                    ],
                }
            ],
        }
    ]
}

# The example's attributes as stored: every AnyValue kind as its string.
SPEC_ATTRIBUTES = {
    "s": "some value",
    "i": "42",
    "i2": "-7",
    "d": "1.5",
    "b": "true",
    "a": '[1,"x"]',
    "kv": '{"k":false}',
    "bytes": "AQI=",
    "unset": "",
}


def test_the_spec_example_decodes_to_the_expected_row() -> None:
    batch = decode_trace_request(json.dumps(SPEC_EXAMPLE).encode(), "json")

    rows = batch.rows
    assert len(rows) == 1
    assert rows.trace_id == ["5b8efff798038103d269b633813fc60c"]
    assert rows.span_id == ["eee19b7ec3c1b174"]
    assert rows.parent_span_id == ["eee19b7ec3c1b173"]
    assert rows.timestamp_ns == [1544712660000000000]
    assert rows.duration_ns == [1_000_000_000]
    assert rows.span_kind == ["SPAN_KIND_SERVER"]
    assert rows.status_code == ["STATUS_CODE_ERROR"] and rows.status_message == ["bad"]
    assert rows.service_name == ["my.service"]
    assert (rows.scope_name, rows.scope_version) == (["my.library"], ["1.0.0"])
    assert dict(rows.span_attributes[0]) == SPEC_ATTRIBUTES
    assert rows.events == [
        [{"Timestamp": 1544712660500000000, "Name": "first_token", "Attributes": []}]
    ]


# --- traces: what is rejected ------------------------------------------------------------------


def _span(**fields: Any) -> Span:
    base: dict[str, Any] = {
        "trace_id": bytes(range(1, 17)),
        "span_id": bytes(range(1, 9)),
        "name": "ok",
        "start_time_unix_nano": 10,
        "end_time_unix_nano": 20,
    }
    base.update(fields)
    return Span(**base)


def _request(*spans: Span) -> ExportTraceServiceRequest:
    return ExportTraceServiceRequest(
        resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=list(spans))])]
    )


def test_spans_with_bad_ids_are_rejected_one_by_one() -> None:
    request = _request(
        _span(name="good-1"),
        _span(trace_id=b"abc"),
        _span(span_id=bytes(range(1, 8))),
        _span(parent_span_id=b"12345"),
        _span(trace_id=bytes(16)),
        _span(links=[Span.Link(trace_id=bytes(range(1, 17)), span_id=b"x")]),
        _span(start_time_unix_nano=2**64 - 1),
        _span(name="good-2", parent_span_id=bytes(range(2, 10))),
    )

    batch = decode_trace_request(request.SerializeToString(), "protobuf")

    assert batch.rows.span_name == ["good-1", "good-2"]
    assert batch.rejected == 6
    message = batch.error_message
    assert message.startswith("6 spans rejected: ")
    assert "resourceSpans[0].scopeSpans[0].spans[1]: traceId is 3 bytes, expected 16" in message
    assert "spans[2]: spanId is 7 bytes, expected 8" in message
    # Three reasons listed, the other three counted (it once said "and 1 more" for any number).
    assert message.count("spans[") == 3 and message.endswith("(and 3 more)")


def test_negative_durations_and_unknown_kinds_are_rejected_and_counted() -> None:
    """Stored before as a 0 duration and an empty kind, without a word."""
    request = _request(
        _span(name="good"),
        _span(name="backwards", start_time_unix_nano=20, end_time_unix_nano=10),
        _span(name="odd kind", kind=9),
    )
    batch = decode_trace_request(request.SerializeToString(), "protobuf")
    assert batch.rows.span_name == ["good"]
    assert batch.rejected == 2
    assert "spans[1]: endTimeUnixNano 10 is before startTimeUnixNano 20" in batch.error_message
    assert "spans[2]: kind 9 is not a SpanKind" in batch.error_message
    json_body = (b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":'
                 b'"0102030405060708090a0b0c0d0e0f10","spanId":"0102030405060708","name":"j",'
                 b'"kind":7,"startTimeUnixNano":"5","endTimeUnixNano":"6"}]}]}]}')
    assert decode_trace_request(json_body, "json").rejected == 1


def test_a_repeated_attribute_key_keeps_its_last_value() -> None:
    span = _span(
        attributes=[
            KeyValue(key="k", value=AnyValue(int_value=1)),
            KeyValue(key="other", value=AnyValue(string_value="x")),
            KeyValue(key="k", value=AnyValue(int_value=2)),
        ]
    )

    batch = decode_trace_request(_request(span).SerializeToString(), "protobuf")

    assert batch.rows.span_attributes == [[("k", "2"), ("other", "x")]]
    batch.to_arrow()  # a MAP with a repeated key would fail here (and in DuckDB)


def _nested_garbage() -> bytes:
    # A span whose attribute (field 9) is not a KeyValue: tag 0x4a, length 2, bytes ff ff.
    span = _span().SerializeToString() + b"\x4a\x02\xff\xff"
    scope_spans = b"\x12" + bytes([len(span)]) + span
    resource_spans = b"\x12" + bytes([len(scope_spans)]) + scope_spans
    return b"\x0a" + bytes([len(resource_spans)]) + resource_spans


def _bad_utf8_key() -> bytes:
    kv = b"\x0a\x02\xc3\x28"  # KeyValue.key = invalid UTF-8
    span = _span().SerializeToString() + b"\x4a" + bytes([len(kv)]) + kv
    scope_spans = b"\x12" + bytes([len(span)]) + span
    resource_spans = b"\x12" + bytes([len(scope_spans)]) + scope_spans
    return b"\x0a" + bytes([len(resource_spans)]) + resource_spans


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"\xff\xff\xff\xff", "malformed or truncated protobuf ExportTraceServiceRequest"),
        (_nested_garbage(), "malformed protobuf ExportTraceServiceRequest"),
        (_bad_utf8_key(), "malformed protobuf ExportTraceServiceRequest"),
    ],
    ids=["garbage", "nested-garbage", "bad-utf8"],
)
def test_undecodable_protobuf_raises_payload_error(body: bytes, expected: str) -> None:
    with pytest.raises(PayloadError, match=expected):
        decode_trace_request(body, "protobuf")


def test_a_truncated_protobuf_body_is_refused() -> None:
    body = encode_spans(_rich_spans()).SerializeToString()
    with pytest.raises(PayloadError, match="truncated"):
        decode_trace_request(body[: len(body) // 2], "protobuf")


def _with_span(**fields: Any) -> bytes:
    span = {"traceId": "5b8efff798038103d269b633813fc60c", "spanId": "eee19b7ec3c1b174"}
    span.update(fields)
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}).encode()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"{not json", "invalid ExportTraceServiceRequest JSON at line 1 column 2"),
        (b"[1, 2]", "must be an object, got list"),
        (b'{"resourceSpans": {}}', "resourceSpans"),
        (b"\xff\xfe{}", "not UTF-8"),
        (_with_span(name=5), "resourceSpans.scopeSpans.spans.name"),
        (
            _with_span(attributes=[{"key": "a", "value": {"intValue": "abc"}}]),
            "attributes.value.intValue",
        ),
        (_with_span(kind=[2]), "spans.kind"),
        (_with_span(traceId="zz" * 16), r"spans\[0\]\.traceId: 'zzzz"),
        (_with_span(spanId="abc"), r"spans\[0\]\.spanId: 'abc' is not a hex-encoded id"),
        (_with_span(startTimeUnixNano="soon"), "startTimeUnixNano"),
    ],
    ids=[
        "syntax", "array", "object-for-list", "not-utf8", "int-name", "bad-int", "bad-enum",
        "non-hex-trace-id", "odd-span-id", "bad-time",
    ],
)
def test_malformed_json_names_the_problem(body: bytes, expected: str) -> None:
    with pytest.raises(PayloadError, match=expected):
        decode_trace_request(body, "json")


def test_json_ids_of_the_wrong_length_are_rejected_per_span() -> None:
    body = _with_span(traceId="abcd")
    batch = decode_trace_request(body, "json")
    assert len(batch.rows) == 0
    assert batch.rejected == 1
    assert "traceId is 2 bytes, expected 16" in batch.error_message


# --- metrics -----------------------------------------------------------------------------------


def _metrics_data() -> Any:
    reader = InMemoryMetricReader()
    provider = MeterProvider(
        metric_readers=[reader],
        resource=Resource.create({"service.name": semconv.SERVICE_GPU_SAMPLER}),
    )
    meter = provider.get_meter(semconv.SCOPE_NAME, "0.1")
    gauge = meter.create_gauge(semconv.METRIC_GPU_MEMORY_USED, unit="By")
    gauge.set(1024, {semconv.GPU_HOST: "h1", semconv.GPU_INDEX: 0})
    gauge.set(2048.5, {semconv.GPU_HOST: "h1", semconv.GPU_INDEX: 1})
    retained = meter.create_up_down_counter(semconv.METRIC_KV_RETAINED, unit="By")
    retained.add(4096, {semconv.ENGINE_ID: "d0"})
    meter.create_counter("requests").add(3)
    meter.create_histogram("latency").record(1.5)
    data = reader.get_metrics_data()
    provider.shutdown()
    return data


def test_metric_rows_equal_the_in_process_rows_and_others_are_counted() -> None:
    data = _metrics_data()
    body = encode_metrics(data).SerializeToString()

    batch = decode_metrics_request(body, "protobuf")

    expected = metrics_to_rows(data)
    assert len(expected) == 3
    assert _columns(batch.rows) == _columns(expected)
    assert batch.rejected == 2
    assert "monotonic sum points are not stored" in batch.error_message
    assert "histogram points are not stored" in batch.error_message


def test_metrics_json_decodes_like_protobuf() -> None:
    data = _metrics_data()
    message = encode_metrics(data)
    body = json_format.MessageToJson(message).encode()

    from_json = decode_metrics_request(body, "json")
    from_protobuf = decode_metrics_request(message.SerializeToString(), "protobuf")

    assert _columns(from_json.rows) == _columns(from_protobuf.rows)
    assert from_json.rejected == from_protobuf.rejected == 2


def test_malformed_metrics_raise_payload_error() -> None:
    with pytest.raises(PayloadError, match="ExportMetricsServiceRequest"):
        decode_metrics_request(b"\x0a\xff\xff", "protobuf")
    with pytest.raises(PayloadError, match="dataPoints"):
        decode_metrics_request(
            b'{"resourceMetrics":[{"scopeMetrics":[{"metrics":[{"gauge":{"dataPoints":3}}]}]}]}',
            "json",
        )


# --- property: random attributes round-trip through the store ----------------------------------

_keys = st.text(min_size=1, max_size=12)
_ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_floats = st.floats(allow_nan=True, allow_infinity=True)
_scalars = st.one_of(st.text(max_size=20), _ints, _floats, st.booleans())
_values = st.one_of(
    _scalars,
    st.lists(st.text(max_size=8), max_size=4),
    st.lists(_ints, max_size=4),
    st.lists(_floats, max_size=4),
    st.lists(st.booleans(), max_size=4),
)


def _stored_attributes(table: Any) -> list[dict[str, str]]:
    con = open_store(":memory:")
    try:
        insert_arrow(con, "otel_traces", table)
        return [row[0] for row in con.execute("SELECT SpanAttributes FROM otel_traces").fetchall()]
    finally:
        con.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_keys, _values, max_size=8))
def test_random_attributes_store_identically_through_both_paths(attrs: dict[str, Any]) -> None:
    spans = _record(lambda t: t.start_span(semconv.SPAN_TURN, attributes=attrs).end())
    body = encode_spans(spans).SerializeToString()

    received = _stored_attributes(decode_trace_request(body, "protobuf").to_arrow())
    in_process = _stored_attributes(spans_to_rows(spans).to_arrow())

    assert received == in_process
    # And both store what stringify() makes of the SDK's own values.
    assert received[0] == {k: stringify(v) for k, v in (spans[0].attributes or {}).items()}


def _decoded_attributes(body: bytes) -> dict[str, str]:
    batch = decode_trace_request(body, "protobuf")
    return dict(batch.rows.to_arrow().column("SpanAttributes")[0].as_py())


@pytest.mark.parametrize("value", [
    "a" * (300 * 1024),  # one byte a character
    "é" * (200 * 1024),  # two bytes a character (a chunk boundary falls inside one)
    "x" + "漢" * (600 * 1024) + "🎉",  # three and four bytes
], ids=["ascii", "two-byte", "wide"])
def test_a_big_string_value_is_cut_as_the_full_parse_cuts_it(value: str) -> None:
    """A value of more than 4 x MAX_VALUE_CHARS bytes is read off the wire (never whole as a
    field or a str): stored exactly as the full parse stores it; its neighbours untouched."""
    from kvscope.collector import otlp_decode

    attributes = [KeyValue(key="big ✓", value=AnyValue(string_value=value)),
                  KeyValue(key="small", value=AnyValue(string_value="s"))]
    body = _request(_span(attributes=attributes)).SerializeToString()
    blob = attributes[0].SerializeToString()
    assert otlp_decode._big_string(blob) == (
        "big ✓", value[:otlp_decode.MAX_VALUE_CHARS] + otlp_decode.TRUNCATED_MARK)
    stored = _decoded_attributes(body)
    assert stored == {"big ✓": value[:otlp_decode.MAX_VALUE_CHARS] + otlp_decode.TRUNCATED_MARK,
                      "small": "s"}


def test_other_big_values_take_the_full_parse() -> None:
    """Not one string filling the value (bytes, a field given twice, bad UTF-8 at its end):
    left to the full parse, whose answer (a cut value, or the refusal) stands."""
    from kvscope.collector import otlp_decode

    raw = b"\xab" * (300 * 1024)
    as_bytes = KeyValue(key="b", value=AnyValue(bytes_value=raw)).SerializeToString()
    assert otlp_decode._big_string(as_bytes) is None
    text = KeyValue(key="t", value=AnyValue(string_value="a" * (300 * 1024))).SerializeToString()
    assert otlp_decode._big_string(text + text) is None  # key and value twice: merged by proto
    bad_end = bytearray(text)
    bad_end[-1] = 0xFF  # the last byte of the value is no UTF-8
    assert otlp_decode._big_string(bytes(bad_end)) is None
    span = _span().SerializeToString() + b"\x4a" + _length(len(bad_end)) + bytes(bad_end)
    scope_spans = b"\x12" + _length(len(span)) + span
    resource_spans = b"\x12" + _length(len(scope_spans)) + scope_spans
    body = b"\x0a" + _length(len(resource_spans)) + resource_spans
    with pytest.raises(PayloadError, match="malformed protobuf ExportTraceServiceRequest"):
        decode_trace_request(body, "protobuf")


def _length(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def test_a_big_string_value_never_becomes_a_whole_str() -> None:
    """What Python allocates to decode a span with a 24 MiB attribute: the attribute's bytes as
    the parsed request hands them over (24 MiB), a chunk (1 MiB) and the cut value; never the
    value as a 24 MiB str besides (nor upb's parsed copy, which tracemalloc does not see)."""
    import tracemalloc

    value = "z" * (24 << 20)
    body = _request(_span(attributes=[
        KeyValue(key="blob", value=AnyValue(string_value=value))])).SerializeToString()
    del value
    tracemalloc.start()
    try:
        decode_trace_request(body, "protobuf")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < (29 << 20), f"{peak / 2**20:.1f} MiB traced"
