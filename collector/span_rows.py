"""Spans straight to ``otel_traces`` rows: the direct path that skips ``ReadableSpan``.

:class:`RowSink` collects rows and writes them in large batches through a :class:`StoreWriter`.
A span reaches it either as an SDK ``ReadableSpan`` (:meth:`RowSink.on_end`; converted by
``spans_to_rows`` at flush) or, on the direct path, as the pieces it would be built from
(:attr:`RowSink.row`), appended straight to the columns as ``spans_to_rows`` would. The pieces
come from the one place each span is shaped: :func:`proxy_rows` replaces only the last step of
:meth:`ProxyTelemetry.spans_for` (pieces → ``ReadableSpan``) and :class:`EngineRows` only
:meth:`_DirectSpans.finish` of :class:`EngineTelemetry`, so attributes, statuses, events and ids
are theirs. Used by the virtual-time simulator and by the proxy's export process; tests compare
the rows with the SDK path's column for column.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import duckdb
import pyarrow as pa
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode

from kvscope.collector.convert import _attrs as attrs_to_rows
from kvscope.collector.convert import spans_to_rows
from kvscope.collector.engine_telemetry import EngineTelemetry, _DirectSpans
from kvscope.collector.proxy.telemetry import ProxyTelemetry
from kvscope.errors import StoreError
from kvscope.store.rows import stringify
from kvscope.store.schema import SPAN_KIND_NAMES, STATUS_CODE_NAMES, TRACES_ARROW
from kvscope.store.writer import StoreWriter


class RowTarget(Protocol):
    """Anything with the direct path's ``row`` function (a :class:`RowSink`, or a sink that
    ships the pieces to another process)."""

    row: Callable[..., None]


class RowSink(SpanProcessor):
    """Collects finished spans as store rows and writes them in large batches, one in flight.

    Spans arrive either as SDK ``ReadableSpan`` objects (:meth:`on_end`, :meth:`add`; converted
    by ``spans_to_rows`` at flush) or, on the simulator's direct path, as the pieces a span is
    built from (:meth:`row`, appended straight to the columns, as ``spans_to_rows`` would). The
    DuckDB insert runs on a :class:`StoreWriter` thread (DuckDB releases the GIL), overlapping
    the simulation of the next batch. Waiting for the previous batch before handing over the
    next keeps at most one batch queued, so the writer's bounded queue never drops; a failed or
    dropped insert raises :class:`StoreError` at the next flush.
    """

    def __init__(self, con: duckdb.DuckDBPyConnection, batch: int = 20_000, *,
                 strict: bool = True, name: str = "kvscope-simulator-writer") -> None:
        # strict: a lost batch raises StoreError at the next flush (a simulation must be
        # whole); otherwise it is only counted in writer_stats (a long-running exporter).
        self._strict = strict
        self._batch = batch
        self._spans: list[ReadableSpan] = []
        self._columns = Columns()
        # row(name, trace_id, span_id, parent span id or None, trace_state, kind name,
        # resource row, scope, attributes, start_ns, end_ns, events as (timestamp, name,
        # attributes) tuples, status code, status message): append one span's row as
        # spans_to_rows would for the ReadableSpan those pieces make (the direct path). Plain
        # values only, so a _ProcessRowSink can ship them to another process.
        self.row = self._appender()
        self._pending = 0
        self.written = 0
        # Its own cursor: closing the writer leaves the caller's connection open.
        self._writer = StoreWriter(con.cursor(), max_queue_rows=4 * batch, name=name)
        self.writer_stats = self._writer.stats

    def on_end(self, span: ReadableSpan) -> None:
        self._spans.append(span)
        self._pending += 1
        if self._pending >= self._batch:
            self.flush()

    def add(self, spans: list[ReadableSpan]) -> None:
        self._spans.extend(spans)
        self._pending += len(spans)
        if self._pending >= self._batch:
            self.flush()

    def _appender(self) -> Callable[..., None]:
        """The direct path's ``row`` function (see :attr:`row`), bound to this sink's columns.

        A closure over the column lists' bound ``append``/``extend`` methods: ~8 rows a turn, so
        attribute lookups per column would cost more than the appends.
        """
        c = self._columns
        timestamp, trace_ids, span_ids = c.timestamp.append, c.trace_id.append, c.span_id.append
        parents, states, names = c.parent.append, c.trace_state.append, c.name.append
        kinds, services = c.kind.append, c.service.append
        resource_keys, resource_values = c.resource_keys, c.resource_values
        resource_offsets = c.resource_offsets.append
        scope_names, scope_versions = c.scope_name.append, c.scope_version.append
        attr_keys, attr_values, attr_offsets = c.attr_keys, c.attr_values, c.attr_offsets.append
        durations, codes = c.duration.append, c.status_code.append
        messages, events_col = c.status_message.append, c.events.append
        unset, status_names = StatusCode.UNSET, _STATUS_NAMES

        def row(name: str, trace_id: int, span_id: int, parent_span_id: int | None,
                trace_state: str, kind: str, resource: ResourceRow, scope: tuple[str, str],
                attributes: Mapping[str, Any], start_ns: int, end_ns: int,
                events: Sequence[tuple[int, str, Mapping[str, Any]]], code: StatusCode,
                message: str) -> None:
            timestamp(start_ns)
            trace_ids(f"{trace_id:032x}")
            span_ids(f"{span_id:016x}")
            parents("" if parent_span_id is None else f"{parent_span_id:016x}")
            states(trace_state)
            names(name)
            kinds(kind)
            services(resource.service)
            resource_keys.extend(resource.keys)
            resource_values.extend(resource.values)
            resource_offsets(len(resource_keys))
            scope_names(scope[0])
            scope_versions(scope[1])
            attr_keys.extend(attributes)
            # Most values are str or int: convert those inline (a call per value costs more).
            attr_values.extend([v if type(v) is str else str(v) if type(v) is int
                                else _value_str(v) for v in attributes.values()])
            attr_offsets(len(attr_keys))
            durations(end_ns - start_ns if end_ns > start_ns else 0)
            codes(status_names[code] if code is not unset else _UNSET_NAME)
            messages(message)
            events_col(
                [{"Timestamp": ts, "Name": event_name, "Attributes": attrs_to_rows(event_attrs)}
                 for ts, event_name, event_attrs in events]
                if events
                else []
            )
            self._pending += 1
            if self._pending >= self._batch:
                self.flush()

        return row

    def flush(self) -> None:
        if self._pending:
            tables = []
            if self._spans:
                tables.append(spans_to_rows(self._spans).to_arrow())
            if self._columns.timestamp:
                tables.append(self._columns.to_arrow())
            table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
            # Drop the batch's Python rows (Arrow holds copies) before the collection below.
            self._spans = []
            self._columns.clear()
            self._wait()
            if not self._writer.submit_traces(table) and self._strict:  # else counted there
                raise StoreError(f"simulator: the store writer refused {table.num_rows} span rows")
            self.written += self._pending
            self._pending = 0
            if not gc.isenabled():
                # Reclaim this batch's few reference cycles (see cyclic_gc_per_batch).
                gc.collect(1)

    @property
    def pending(self) -> int:
        """Rows collected and not yet handed to the writer."""
        return self._pending

    def _wait(self) -> None:
        self._writer.flush()
        stats = self._writer.stats
        if self._strict and (stats.failed_rows or stats.dropped_rows):
            raise StoreError(
                f"simulator: writing spans failed ({stats.failed_rows} rows failed, "
                f"{stats.dropped_rows} dropped); see the log for the database error"
            )

    def sync(self) -> None:
        """Write everything collected so far and wait until it is stored (the writer stays)."""
        self.flush()
        self._wait()

    def close(self) -> None:
        """Write everything collected, wait for it, and stop the writer thread."""
        try:
            self.flush()
            self._wait()
        finally:
            self._writer.close()

    def abort(self) -> None:
        """Stop the writer thread without writing what is still collected (idempotent)."""
        self._writer.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.flush()
        return True


_KIND_NAMES = {kind: SPAN_KIND_NAMES.get(kind.value + 1, "") for kind in SpanKind}
_STATUS_NAMES = {code: STATUS_CODE_NAMES.get(code.value, "") for code in StatusCode}
_UNSET_NAME = _STATUS_NAMES[StatusCode.UNSET]
_INTERNAL_NAME = _KIND_NAMES[SpanKind.INTERNAL]
_MAP_TYPE = TRACES_ARROW.field("SpanAttributes").type


def _value_str(value: object) -> str:
    """An attribute value as stored: ``spans_to_rows``' ``_attrs``, branch for branch."""
    t = type(value)
    if t is int:
        return str(value)
    if t is bool:
        return "true" if value else "false"
    return stringify(value)


@dataclass(frozen=True, slots=True)
class ResourceRow:
    """A resource as every row of its spans stores it."""

    service: str
    keys: list[str]
    values: list[str]


def resource_row(resource: Resource) -> ResourceRow:
    """A resource's service name and stored attributes (as ``spans_to_rows`` derives them)."""
    attrs = attrs_to_rows(resource.attributes)
    return ResourceRow(str(resource.attributes.get("service.name", "")),
                        [k for k, _ in attrs], [v for _, v in attrs])


class Columns:
    """``otel_traces`` columns for the direct path, attribute maps kept flat (keys, values,
    end offsets) so that they become Arrow map arrays without a per-row Python conversion."""

    def __init__(self) -> None:
        self.timestamp: list[int] = []
        self.trace_id: list[str] = []
        self.span_id: list[str] = []
        self.parent: list[str] = []
        self.trace_state: list[str] = []
        self.name: list[str] = []
        self.kind: list[str] = []
        self.service: list[str] = []
        self.resource_keys: list[str] = []
        self.resource_values: list[str] = []
        self.resource_offsets: list[int] = [0]
        self.scope_name: list[str] = []
        self.scope_version: list[str] = []
        self.attr_keys: list[str] = []
        self.attr_values: list[str] = []
        self.attr_offsets: list[int] = [0]
        self.duration: list[int] = []
        self.status_code: list[str] = []
        self.status_message: list[str] = []
        self.events: list[list[dict[str, Any]]] = []

    def clear(self) -> None:
        """Empty every column in place (the lists' bound methods stay valid)."""
        for values in vars(self).values():
            values.clear()
        self.resource_offsets.append(0)
        self.attr_offsets.append(0)

    def to_arrow(self) -> pa.Table:
        """The rows as an Arrow table in ``otel_traces`` column order and types."""
        string = pa.string()

        def strings(values: list[str]) -> pa.Array:
            return pa.array(values, type=string)

        def mapping(offsets: list[int], keys: list[str], values: list[str]) -> pa.Array:
            return pa.MapArray.from_arrays(pa.array(offsets, type=pa.int32()), strings(keys),
                                           strings(values), type=_MAP_TYPE)

        n = len(self.timestamp)
        arrays = [
            pa.array(self.timestamp, type=TRACES_ARROW.field("Timestamp").type),
            strings(self.trace_id),
            strings(self.span_id),
            strings(self.parent),
            strings(self.trace_state),
            strings(self.name),
            strings(self.kind),
            strings(self.service),
            mapping(self.resource_offsets, self.resource_keys, self.resource_values),
            strings(self.scope_name),
            strings(self.scope_version),
            mapping(self.attr_offsets, self.attr_keys, self.attr_values),
            pa.array(self.duration, type=pa.uint64()),
            strings(self.status_code),
            strings(self.status_message),
            pa.array(self.events, type=TRACES_ARROW.field("Events").type),
            pa.array([[]] * n, type=TRACES_ARROW.field("Links").type),
        ]
        return pa.Table.from_arrays(arrays, schema=TRACES_ARROW)


def scope_row(scope: InstrumentationScope | None) -> tuple[str, str]:
    return (scope.name, scope.version or "") if scope is not None else ("", "")


class EngineRows(_DirectSpans):
    """EngineTelemetry's direct span builder, ending in store rows instead of a ReadableSpan.

    Everything up to the finished span (attributes, status, timestamps, sampling, the order ids
    are drawn in) is EngineTelemetry's own code; only :meth:`finish` differs, appending the row
    ``spans_to_rows`` would produce for the span :meth:`_DirectSpans.finish` builds.
    """

    sink: RowTarget

    def finish(self, name: str, parent: SpanContext | None, attributes: dict[str, Any],
               start_ns: int, end_ns: int, status: Status) -> None:
        if parent is None:
            trace_id = self.id_generator.generate_trace_id()
            trace_state = ""
        else:
            trace_id = parent.trace_id
            trace_state = parent.trace_state.to_header() if parent.trace_state else ""
        span_id = self.id_generator.generate_span_id()
        self.sink.row(name, trace_id, span_id, None if parent is None else parent.span_id,
                      trace_state, _INTERNAL_NAME, self.resource_row, self.scope_row,
                      attributes, start_ns, end_ns, (), status.status_code,
                      status.description or "")

    @classmethod
    def attach(cls, tel: EngineTelemetry, sink: RowTarget) -> bool:
        """Make ``tel`` write rows into ``sink``; False when its tracer needs the SDK path."""
        direct = cls.of(tel._tracer)
        if not isinstance(direct, EngineRows):
            return False
        direct.sink = sink
        direct.resource_row = resource_row(direct.resource)
        direct.scope_row = scope_row(direct.scope)
        tel._direct = direct
        return True

    resource_row: ResourceRow
    scope_row: tuple[str, str]


def proxy_rows(proxy: ProxyTelemetry, sink: RowTarget) -> None:
    """Make ``proxy.spans_for`` append its spans' rows to ``sink`` (it then returns no spans).

    :meth:`ProxyTelemetry.spans_for` stays the one place the turn's spans are shaped: only its
    last step, ``_span`` (pieces → ReadableSpan), is replaced on this instance.
    """
    resource = resource_row(proxy._resource)
    scope = scope_row(proxy._scope)
    row = sink.row
    kinds = _KIND_NAMES

    def span(name: str, context: SpanContext, parent: SpanContext | None, kind: SpanKind,
             start_ns: int, end_ns: int, attributes: dict[str, Any], events: tuple[Event, ...],
             status: Status) -> None:
        state = context.trace_state
        row(name, context.trace_id, context.span_id, None if parent is None else parent.span_id,
            state.to_header() if state else "", kinds[kind], resource, scope, attributes, start_ns,
            max(end_ns, start_ns),
            [(e.timestamp, e.name, dict(e.attributes or {})) for e in events] if events else (),
            status.status_code, status.description or "")

    proxy._span = span


@contextmanager
def cyclic_gc_per_batch() -> Iterator[None]:
    """Pause automatic cyclic garbage collection; the sink collects once per span batch instead.

    A run allocates millions of short-lived objects (spans, attribute maps, rows) and almost no
    cycles (~2 per turn), so the collector's automatic passes cost ~20% of the run and find
    little; one young-generation pass per batch keeps memory bounded.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
