"""Fuzzing the OTLP decoders and the receiver (issue 22): every input gets 2xx or 4xx, never 5xx.

Three levels, each bounded (``max_examples``, no deadline) so that they fit in the suite:

- bytes: random bytes and byte-level mutations (flips, cuts, insertions) of real requests made
  by the official OTLP encoder, through the protobuf decoders;
- structure: requests built field by field with values the schema allows but a sane sender
  would not write (ids of any length, any enum number, timestamps up to 2**64-1, nested
  arrays and maps, invalid UTF-8 bytes), and JSON documents of any shape around the OTLP keys;
  what the decoder accepts is then inserted into a real store file, because an accepted row
  the store refuses would be a 503 the sender retries for ever;
- the receiver: a real ``Receiver`` on 127.0.0.1 takes arbitrary bodies, content types and
  encodings over HTTP (and bodies over gRPC); the answer is below 500 and the rows stored
  before stay as they were.
"""

from __future__ import annotations

import gzip
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import grpc
import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    Gauge,
    Metric,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ResourceProto
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace import Status as SdkStatus
from opentelemetry.trace import StatusCode as SdkStatusCode

from kvscope import semconv
from kvscope.collector.otlp_decode import (
    Encoding,
    decode_metrics_request,
    decode_trace_request,
)
from kvscope.collector.receiver import Receiver
from kvscope.errors import PayloadError
from kvscope.store.database import open_store
from kvscope.store.writer import insert_arrow

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROTOBUF = {"Content-Type": "application/x-protobuf"}


# --- real requests to mutate ---------------------------------------------------------------


def _sdk_spans() -> list[ReadableSpan]:
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(
        {"service.name": semconv.SERVICE_PROXY, semconv.RUN_ID: "fuzz"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer(semconv.SCOPE_NAME, "1.0")
    with tracer.start_as_current_span(semconv.SPAN_TURN, kind=SpanKind.SERVER, attributes={
            semconv.GEN_AI_CONVERSATION_ID: "conv-1", semconv.TURN_INDEX: 2,
            "list": [1, 2, 3], "flag": True, "ratio": 0.5}) as turn:
        turn.add_event(semconv.EVENT_FIRST_TOKEN, {"n": 1})
        with tracer.start_as_current_span(semconv.SPAN_GENERATION, kind=SpanKind.CLIENT,
                                          links=[Link(turn.get_span_context())]) as leg:
            leg.set_status(SdkStatus(SdkStatusCode.ERROR, "decode 502"))
    provider.shutdown()
    return list(memory.get_finished_spans())


def _metrics_body() -> bytes:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create(
        {"service.name": "vllm-decode"}))
    meter = provider.get_meter(semconv.SCOPE_NAME)
    meter.create_gauge(semconv.METRIC_KV_RETAINED).set(1024, {"engine": "d0"})
    meter.create_gauge(semconv.METRIC_GPU_MEMORY_USED).set(3.5e9, {semconv.GPU_INDEX: 0})
    data = reader.get_metrics_data()
    provider.shutdown()
    assert data is not None
    return encode_metrics(data).SerializeToString()


_sdk_spans_sent = _sdk_spans()
TRACE_BODY = encode_spans(_sdk_spans_sent).SerializeToString()
METRICS_BODY = _metrics_body()


@st.composite
def _mutated(draw: st.DrawFn, body: bytes) -> bytes:
    data = bytearray(body)
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(("flip", "cut", "insert", "delete")))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=12))
        elif data:
            del data[at:at + draw(st.integers(1, 16))]
    return bytes(data)


# --- what a decoder may do with any input ---------------------------------------------------


@pytest.fixture(scope="module")
def store() -> Iterator[duckdb.DuckDBPyConnection]:
    with tempfile.TemporaryDirectory(prefix="kvscope-fuzz-") as tmp:
        con = open_store(Path(tmp) / "fuzz.duckdb")
        yield con
        con.close()


def _decode_and_store(con: duckdb.DuckDBPyConnection, body: bytes, encoding: Encoding,
                      signal: str) -> None:
    """Decode like the receiver; what is accepted must also be storable."""
    try:
        if signal == "traces":
            trace_batch = decode_trace_request(body, encoding, "fuzz-run")
            table, rejected = trace_batch.to_arrow(), trace_batch.rejected
            target = "otel_traces"
        else:
            gauge_batch = decode_metrics_request(body, encoding, "fuzz-run")
            table, rejected = gauge_batch.to_arrow(), gauge_batch.rejected
            target = "otel_metrics_gauge"
    except PayloadError as exc:
        assert str(exc) and "\n" not in str(exc)  # one line that says what is wrong
        return
    assert rejected >= 0
    if table.num_rows:
        insert_arrow(con, target, table)


@FUZZ
@given(body=st.one_of(st.binary(max_size=512), _mutated(TRACE_BODY)))
def test_any_trace_bytes_decode_or_raise_payload_error(
        store: duckdb.DuckDBPyConnection, body: bytes) -> None:
    _decode_and_store(store, body, "protobuf", "traces")


@FUZZ
@given(body=st.one_of(st.binary(max_size=512), _mutated(METRICS_BODY)))
def test_any_metrics_bytes_decode_or_raise_payload_error(
        store: duckdb.DuckDBPyConnection, body: bytes) -> None:
    _decode_and_store(store, body, "protobuf", "metrics")


_text = st.text(max_size=12)
_any_value: st.SearchStrategy[AnyValue] = st.recursive(
    st.one_of(
        st.builds(lambda v: AnyValue(string_value=v), _text),
        st.builds(lambda v: AnyValue(bool_value=v), st.booleans()),
        st.builds(lambda v: AnyValue(int_value=v), st.integers(-2**63, 2**63 - 1)),
        st.builds(lambda v: AnyValue(double_value=v), st.floats()),
        st.builds(lambda v: AnyValue(bytes_value=v), st.binary(max_size=12)),
        st.just(AnyValue()),
    ),
    lambda inner: st.one_of(
        st.builds(lambda vs: AnyValue(array_value=ArrayValue(values=vs)),
                  st.lists(inner, max_size=3)),
        st.builds(lambda kvs: AnyValue(kvlist_value=KeyValueList(
            values=[KeyValue(key=k, value=v) for k, v in kvs])),
            st.lists(st.tuples(_text, inner), max_size=3)),
    ),
    max_leaves=6,
)
_attributes = st.lists(st.builds(lambda k, v: KeyValue(key=k, value=v), _text, _any_value),
                       max_size=4)
_id = st.one_of(st.binary(min_size=0, max_size=20), st.binary(min_size=8, max_size=8),
                st.binary(min_size=16, max_size=16))
_time = st.one_of(st.integers(0, 2**64 - 1), st.just(0), st.just(2**63),
                  st.integers(1_600_000_000_000_000_000, 1_800_000_000_000_000_000))
_span = st.builds(
    lambda trace_id, span_id, parent, name, kind, start, end, attrs, code, message: Span(
        trace_id=trace_id, span_id=span_id, parent_span_id=parent, name=name, kind=kind,
        start_time_unix_nano=start, end_time_unix_nano=end, attributes=attrs,
        events=[Span.Event(time_unix_nano=start, name=name, attributes=attrs)],
        links=[Span.Link(trace_id=trace_id, span_id=parent, attributes=attrs)],
        status=Status(code=code, message=message)),
    _id, _id, _id, _text, st.integers(-2**31, 2**31 - 1), _time, _time, _attributes,
    st.integers(-2**31, 2**31 - 1), _text,
)
_trace_request = st.builds(
    lambda resources: ExportTraceServiceRequest(resource_spans=[
        ResourceSpans(resource=ResourceProto(attributes=attrs),
                      scope_spans=[ScopeSpans(spans=spans)]) for attrs, spans in resources]),
    st.lists(st.tuples(_attributes, st.lists(_span, max_size=3)), max_size=2),
)
_point = st.builds(
    lambda time, value, attrs: NumberDataPoint(
        time_unix_nano=time, attributes=attrs,
        **({"as_int": value} if isinstance(value, int) else {"as_double": value})),
    _time, st.one_of(st.integers(-2**63, 2**63 - 1), st.floats()), _attributes,
)
_metrics_request = st.builds(
    lambda attrs, name, points: ExportMetricsServiceRequest(resource_metrics=[ResourceMetrics(
        resource=ResourceProto(attributes=attrs), scope_metrics=[ScopeMetrics(metrics=[
            Metric(name=name, gauge=Gauge(data_points=points))])])]),
    _attributes, _text, st.lists(_point, max_size=3),
)


@FUZZ
@given(request=_trace_request)
def test_schema_valid_but_hostile_trace_requests_decode_and_store(
        store: duckdb.DuckDBPyConnection, request: ExportTraceServiceRequest) -> None:
    _decode_and_store(store, request.SerializeToString(), "protobuf", "traces")


@FUZZ
@given(request=_metrics_request)
def test_schema_valid_but_hostile_metrics_requests_decode_and_store(
        store: duckdb.DuckDBPyConnection, request: ExportMetricsServiceRequest) -> None:
    _decode_and_store(store, request.SerializeToString(), "protobuf", "metrics")


_json: st.SearchStrategy[Any] = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
              st.text(max_size=10), st.sampled_from(["00" * 16, "00" * 8, "zz", "1e400"])),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from([
            "resourceSpans", "resource_spans", "scopeSpans", "spans", "traceId", "spanId",
            "parentSpanId", "name", "kind", "startTimeUnixNano", "endTimeUnixNano",
            "attributes", "key", "value", "stringValue", "intValue", "arrayValue", "values",
            "kvlistValue", "events", "links", "status", "code", "resourceMetrics",
            "scopeMetrics", "metrics", "gauge", "dataPoints", "asDouble", "asInt",
            "timeUnixNano", "x"]), inner, max_size=4),
    ),
    max_leaves=12,
)


@FUZZ
@given(document=_json, signal=st.sampled_from(["traces", "metrics"]))
# Found by this test: protobuf's parse error quoted the bad value, a newline and all.
@example(document={"resourceSpans": "\n"}, signal="traces")
def test_any_json_document_decodes_or_raises_payload_error(
        store: duckdb.DuckDBPyConnection, document: Any, signal: str) -> None:
    _decode_and_store(store, json.dumps(document).encode(), "json", signal)


# --- the receiver ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with tempfile.TemporaryDirectory(prefix="kvscope-fuzz-rx-") as tmp:
        with Receiver(Path(tmp) / "fuzz.duckdb", grpc_port=0,
                      max_request_bytes=64 * 1024) as rx:
            response = httpx.post(f"{rx.url}/v1/traces", content=TRACE_BODY, headers=PROTOBUF)
            assert response.status_code == 200
            assert len(_sentinels(rx)) == len(_SENTINEL_IDS) == 2
            yield rx


@pytest.fixture(scope="module")
def first_rows(receiver: Receiver) -> list[tuple[Any, ...]]:
    return _sentinels(receiver)


_SENTINEL_IDS = [format(span.context.span_id, "016x") for span in _sdk_spans_sent]


def _sentinels(rx: Receiver) -> list[tuple[Any, ...]]:
    """Every stored row with the span id of a row the fixture stored first (accepted fuzz
    requests may add more rows, even with those ids; they must never change or remove one)."""
    cursor = rx.writer.connection.cursor()
    try:
        return cursor.execute(
            "SELECT SpanId, TraceId, Timestamp, SpanName, SpanAttributes, ResourceAttributes, "
            "Events FROM otel_traces WHERE SpanId IN (SELECT unnest(?)) ORDER BY ALL",
            [_SENTINEL_IDS]).fetchall()
    finally:
        cursor.close()


def _assert_sentinels_intact(rx: Receiver, first: list[tuple[Any, ...]]) -> None:
    now = _sentinels(rx)
    for row in first:
        assert row in now, row


@st.composite
def _http_request(draw: st.DrawFn) -> tuple[str, dict[str, str], bytes]:
    path = draw(st.sampled_from(["/v1/traces", "/v1/metrics"]))
    content_type = draw(st.one_of(
        st.sampled_from(["application/x-protobuf", "application/json",
                         "application/json; charset=utf-8", "text/plain", ""]),
        st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=20)))
    encoding = draw(st.sampled_from(["identity", "gzip", "GZIP", "br", "deflate", ""]))
    body = draw(st.one_of(
        st.binary(max_size=256), _mutated(TRACE_BODY), _mutated(METRICS_BODY),
        _json.map(lambda d: json.dumps(d).encode()),
        _trace_request.map(lambda r: r.SerializeToString()),
    ))
    if encoding.lower() == "gzip" and draw(st.booleans()):
        body = gzip.compress(body)
        if draw(st.booleans()):
            body = body[:draw(st.integers(0, len(body)))]
    headers = {"Content-Type": content_type}
    if encoding:
        headers["Content-Encoding"] = encoding
    return path, headers, body


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(request=_http_request())
def test_any_http_request_gets_2xx_or_4xx_and_stored_rows_stay(
        receiver: Receiver, first_rows: list[tuple[Any, ...]],
        request: tuple[str, dict[str, str], bytes]) -> None:
    path, headers, body = request
    response = httpx.post(f"{receiver.url}{path}", content=body, headers=headers, timeout=30)
    assert 200 <= response.status_code < 500, (response.status_code, response.content[:200])
    _assert_sentinels_intact(receiver, first_rows)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(body=st.one_of(st.binary(max_size=256), _mutated(TRACE_BODY)))
def test_any_grpc_body_is_ok_or_invalid_argument(
        receiver: Receiver, first_rows: list[tuple[Any, ...]], body: bytes) -> None:
    with grpc.insecure_channel(receiver.grpc_url.removeprefix("http://")) as channel:
        export = channel.unary_unary(
            "/opentelemetry.proto.collector.trace.v1.TraceService/Export",
            request_serializer=None, response_deserializer=None)
        try:
            export(body, timeout=30)
        except grpc.RpcError as error:
            assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (  # type: ignore[attr-defined]
                error.code(), error.details())  # type: ignore[attr-defined]
    _assert_sentinels_intact(receiver, first_rows)
