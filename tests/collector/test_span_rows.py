"""The direct row path's batch conversion stores what the SDK path stores, value for value."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from kvscope.collector.convert import spans_to_rows
from kvscope.collector.span_rows import (
    RowSink,
    _hex_ids,
    _parent_ids,
    resource_row,
    rows_to_arrow,
    scope_row,
)
from kvscope.store.database import open_store
from kvscope.store.schema import SPAN_KIND_NAMES


class _Level(enum.IntEnum):
    HIGH = 3


# Every value type an attribute can hold, and strings that look like what others become.
_ATTRIBUTES: list[dict[str, Any]] = [
    {"s": "True", "t": "False", "b": True, "f": False, "n": 7, "neg": -12, "one": 1, "zero": 0},
    {"float": 0.1, "whole": 2.0, "big": 1e300, "tiny": 5e-324, "huge": 2**70},
    {"list": ["a", 1], "tuple": (1.5, 2), "enum": _Level.HIGH, "empty": ""},
    {},
    {"only": "text"},
]


def _spans() -> list[ReadableSpan]:
    resources = [Resource({"service.name": "a", "k": 1}), Resource({"service.name": "b"})]
    scopes = [InstrumentationScope("kvscope", "1.0"), InstrumentationScope("other")]
    spans = []
    for i, attributes in enumerate(_ATTRIBUTES):
        trace_id = 1 if i % 2 else (1 << 128) - 1 - i  # leading zeros, and the widest ids
        context = SpanContext(trace_id, 1 + i if i % 2 else (1 << 64) - 1 - i, False,
                              TraceFlags(TraceFlags.SAMPLED))
        parent = None if i % 3 == 0 else SpanContext(trace_id, 255, False)
        events = (Event("first_token", {"ms": 1.5, "ok": True}, timestamp=10 + i),
                  Event("later", {}, timestamp=20 + i)) if i % 2 == 0 else ()
        status = Status(StatusCode.ERROR, "bad") if i == 1 else Status(StatusCode.UNSET)
        spans.append(ReadableSpan(
            f"span-{i}", context=context, parent=parent, resource=resources[i % 2],
            attributes=attributes, events=events, kind=list(SpanKind)[i % 5], status=status,
            start_time=100 + i, end_time=100 + i * (i % 2), instrumentation_scope=scopes[i % 2]))
    return spans


def _pieces(span: ReadableSpan) -> tuple[Any, ...]:
    """The row function's arguments for ``span`` (what proxy_rows' span() passes)."""
    context, parent = span.context, span.parent
    assert context is not None and span.start_time is not None and span.end_time is not None
    return (span.name, context.trace_id, context.span_id,
            None if parent is None else parent.span_id, "",
            SPAN_KIND_NAMES.get(span.kind.value + 1, ""), resource_row(span.resource),
            scope_row(span.instrumentation_scope), dict(span.attributes or {}),
            span.start_time, span.end_time,
            [(e.timestamp, e.name, dict(e.attributes or {})) for e in span.events],
            span.status.status_code, span.status.description or "")


def test_a_batch_of_every_value_type_converts_as_the_sdk_path_stores_it() -> None:
    spans = _spans()
    # The same resource and scope objects on many rows, as the builders pass them.
    pieces = [_pieces(span) for span in spans]
    shared = {id(s.resource): p[6] for s, p in zip(spans, pieces, strict=True)}
    pieces = [(*p[:6], shared[id(s.resource)], *p[7:])
              for s, p in zip(spans, pieces, strict=True)]
    direct = rows_to_arrow(pieces)
    expected = spans_to_rows(spans).to_arrow()
    for name in expected.column_names:  # column by column: a failure names the column
        assert direct[name].to_pylist() == expected[name].to_pylist() if name not in (
            "Timestamp", "Events") else direct[name].equals(expected[name]), name
    assert direct.equals(expected)
    values = dict(direct["SpanAttributes"][0].as_py())
    assert (values["s"], values["t"], values["b"], values["f"]) == ("True", "False", "true",
                                                                    "false")
    assert (values["one"], values["zero"]) == ("1", "0")  # equal to True/False, not bools
    assert dict(direct["SpanAttributes"][1].as_py())["huge"] == str(2**70)
    assert direct["TraceId"][1].as_py() == f"{1:032x}"
    assert direct["SpanId"][0].as_py() == "f" * 16


def test_ids_convert_to_fixed_width_hex_at_both_widths_and_every_batch_size() -> None:
    ids8 = [1, 0xABCDEF, 2**64 - 1, 2**63]
    ids16 = [1, 2**64, 2**128 - 1]
    for n in (0, 1, 4, 40_000):  # the shared offsets buffer grows past its first size
        batch8 = (ids8 * (n // 4 + 1))[:n]
        assert _hex_ids(batch8, 8).to_pylist() == [f"{i:016x}" for i in batch8]
    assert _hex_ids(ids16, 16).to_pylist() == [f"{i:032x}" for i in ids16]
    parents = [None, 5, None, 2**64 - 1]
    assert _parent_ids(parents).to_pylist() == ["", f"{5:016x}", "", "f" * 16]
    assert _parent_ids([7]).to_pylist() == [f"{7:016x}"]


def test_a_sink_with_insert_rows_inserts_whole_multiples_of_it(
        tmp_path: Path) -> None:
    con = open_store(tmp_path / "held.duckdb")
    sink = RowSink(con, batch=4, insert_rows=10)
    try:
        pieces = [_pieces(span) for span in _spans()]  # 5 rows

        def stored() -> int:
            sink._wait()
            row = con.execute("SELECT count(*) FROM otel_traces").fetchone()
            assert row is not None
            return int(row[0])

        for row in pieces + pieces[:3]:  # 8 rows: two batches of 4 converted, none inserted
            sink.row(*row)
        assert (sink.pending, sink.held, sink.written, stored()) == (0, 8, 0, 0)
        for row in pieces[:4]:  # the third batch makes 12 held rows: 10 inserted, 2 kept
            sink.row(*row)
        assert (sink.pending, sink.held, sink.written, stored()) == (0, 2, 10, 10)
        assert sink.writer_stats.batches_written == 1
        for row in pieces[:3]:
            sink.row(*row)
        assert (sink.pending, sink.held, stored()) == (3, 2, 10)
        sink.sync()  # everything, below the threshold too
        assert (sink.pending, sink.held, sink.written, stored()) == (0, 0, 15, 15)
    finally:
        sink.close()
        con.close()
