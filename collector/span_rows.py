"""Spans straight to ``otel_traces`` rows: the direct path that skips ``ReadableSpan``.

:class:`RowSink` collects rows and writes them in large batches through a :class:`StoreWriter`.
A span reaches it either as an SDK ``ReadableSpan`` (:meth:`RowSink.on_end`; converted by
``spans_to_rows`` at flush) or, on the direct path, as the pieces it would be built from
(:attr:`RowSink.row`), kept as one tuple and converted with its batch (:func:`rows_to_arrow`)
to the values ``spans_to_rows`` would store. The pieces come from the one place each span is
shaped: the producers take their sink at construction, :func:`proxy_rows` as a
:class:`ProxyTelemetry`'s ``span_sink`` (the last step of ``spans_for``: pieces → row instead of
``ReadableSpan``) and :meth:`EngineRows.into` as an :class:`EngineTelemetry`'s ``direct``
(:meth:`DirectSpans.finish`: row instead of span), so attributes, statuses, events and ids are
theirs; nothing is patched on an instance. Used by the virtual-time simulator and by the proxy's
export process; tests compare the rows with the SDK path's column for column.
"""

from __future__ import annotations

import gc
import struct
from array import array
from binascii import hexlify
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate, chain
from operator import methodcaller
from typing import Any, Protocol, cast

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode

from kvscope.collector.convert import attribute_pairs as attrs_to_rows
from kvscope.collector.convert import spans_to_rows
from kvscope.collector.engine_telemetry import DirectSpans
from kvscope.collector.proxy.telemetry import SpanBuilder, SpanEvent, SpanSink
from kvscope.errors import StoreError
from kvscope.store.rows import stringify
from kvscope.store.schema import SPAN_KIND_NAMES, STATUS_CODE_NAMES, TRACES_ARROW
from kvscope.store.writer import StoreWriter


class RowTarget(Protocol):
    """Anything with the direct path's ``row`` function (a :class:`RowSink`)."""

    row: Callable[..., None]


class RowSink(SpanProcessor):
    """Collects finished spans as store rows and writes them in large batches, one in flight.

    Spans arrive either as SDK ``ReadableSpan`` objects (:meth:`on_end`, :meth:`add`; converted
    by ``spans_to_rows`` at flush) or, on the simulator's direct path, as the pieces a span is
    built from (:meth:`row`, converted per batch by :func:`rows_to_arrow`). The DuckDB insert
    runs on a :class:`StoreWriter` thread (DuckDB releases the GIL), overlapping the building of
    the next batch. Waiting for the previous batch before handing over the
    next keeps at most one batch queued, so the writer's bounded queue never drops; a failed or
    dropped insert raises :class:`StoreError` at the next flush.
    """

    def __init__(self, con: duckdb.DuckDBPyConnection, batch: int = 20_000, *,
                 strict: bool = True, name: str = "kvscope-simulator-writer",
                 insert_rows: int = 0) -> None:
        # strict: a lost batch raises StoreError at the next flush (a simulation must be
        # whole); otherwise it is only counted in writer_stats (a long-running exporter).
        self._strict = strict
        self._batch = batch
        # Converted batches are held and inserted by whole multiples of this many rows (0: each
        # batch at once). See ROW_GROUP_ROWS.
        self._insert_rows = insert_rows
        self._tables: list[pa.Table] = []
        self._table_rows = 0
        self._spans: list[ReadableSpan] = []
        # The direct path's rows, each the tuple of pieces ``row`` was called with.
        self._rows: list[tuple[Any, ...]] = []
        # row(name, trace_id, span_id, parent span id or None, trace_state, kind name,
        # resource row, scope, attributes, start_ns, end_ns, events as (timestamp, name,
        # attributes) tuples, status code, status message): one span's row, stored as
        # spans_to_rows would store the ReadableSpan those pieces make (the direct path).
        self.row = self._appender()
        self.written = 0
        # Its own cursor: closing the writer leaves the caller's connection open.
        self._writer = StoreWriter(con.cursor(), max_queue_rows=4 * max(batch, insert_rows),
                                   name=name)
        self.writer_stats = self._writer.stats

    def on_end(self, span: ReadableSpan) -> None:
        self._spans.append(span)
        if len(self._spans) >= self._batch:
            self.flush()

    def add(self, spans: list[ReadableSpan]) -> None:
        self._spans.extend(spans)
        if len(self._spans) >= self._batch:
            self.flush()

    def _appender(self) -> Callable[..., None]:
        """The direct path's ``row`` function (see :attr:`row`): keep the pieces as one tuple.

        Nothing is converted per row: :func:`rows_to_arrow` turns a whole batch of tuples into
        columns at flush (transposed by ``zip``, each column converted in one comprehension),
        about a third of the cost of appending each piece to its column as it arrives.
        """
        rows = self._rows
        append = rows.append
        batch = self._batch

        def row(*pieces: Any) -> None:
            append(pieces)
            if len(rows) >= batch:
                self.flush()

        return row

    def flush(self) -> None:
        """Convert what is collected; with ``insert_rows``, insert whole multiples of it from
        what is held (:meth:`sync` and :meth:`close` insert everything)."""
        self._convert()
        rows = self._table_rows
        if self._insert_rows:
            rows -= rows % self._insert_rows
        if rows:
            self._submit(rows)

    def _convert(self) -> None:
        if not self.pending:
            return
        if self._spans:
            self._tables.append(spans_to_rows(self._spans).to_arrow())
        if self._rows:
            self._tables.append(rows_to_arrow(self._rows))
        self._table_rows += len(self._spans) + len(self._rows)
        # Drop the batch's Python rows (Arrow holds copies) before the collection below.
        self._spans = []
        self._rows.clear()
        if not gc.isenabled():
            # Reclaim this batch's few reference cycles (see cyclic_gc_per_batch).
            gc.collect(1)

    def _submit(self, rows: int | None = None) -> None:
        """Hand the first ``rows`` held rows (all by default) to the writer; keep the rest."""
        tables = self._tables
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        if rows is None or rows >= table.num_rows:
            rows = table.num_rows
            self._tables, self._table_rows = [], 0
        else:
            self._tables, self._table_rows = [table.slice(rows)], table.num_rows - rows
            table = table.slice(0, rows)
        self._wait()
        if not self._writer.submit_traces(table) and self._strict:  # else counted there
            raise StoreError(f"simulator: the store writer refused {table.num_rows} span rows")
        self.written += rows

    @property
    def pending(self) -> int:
        """Rows collected and not yet converted."""
        return len(self._spans) + len(self._rows)

    @property
    def held(self) -> int:
        """Rows converted and held for a larger insert (see ``insert_rows``)."""
        return self._table_rows

    def _wait(self) -> None:
        self._writer.flush()
        stats = self._writer.stats
        if self._strict and (stats.failed_rows or stats.dropped_rows):
            raise StoreError(
                f"simulator: writing spans failed ({stats.failed_rows} rows failed, "
                f"{stats.dropped_rows} dropped); see the log for the database error"
            )

    def _flush_all(self) -> None:
        self._convert()
        if self._table_rows:
            self._submit()

    def sync(self) -> None:
        """Write everything collected so far and wait until it is stored (the writer stays)."""
        self._flush_all()
        self._wait()

    def close(self) -> None:
        """Write everything collected, wait for it, and stop the writer thread."""
        try:
            self._flush_all()
            self._wait()
        finally:
            self._writer.close()

    def abort(self) -> None:
        """Stop the writer thread without writing what is still collected (idempotent)."""
        self._writer.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._flush_all()
        return True


_KIND_NAMES = {kind: SPAN_KIND_NAMES.get(kind.value + 1, "") for kind in SpanKind}
_STATUS_NAMES = {code: STATUS_CODE_NAMES.get(code.value, "") for code in StatusCode}
_UNSET_CODE = StatusCode.UNSET
_UNSET_NAME = _STATUS_NAMES[_UNSET_CODE]
# Span kind names by the kind's id(): an enum's own hash is a Python call.
_KIND_NAMES_BY_ID = {id(kind): name for kind, name in _KIND_NAMES.items()}
_INTERNAL_NAME = _KIND_NAMES[SpanKind.INTERNAL]
_MAP_TYPE = TRACES_ARROW.field("SpanAttributes").type


def _value_str(value: object) -> str:
    """An attribute value as stored: ``spans_to_rows``' ``attribute_pairs``, branch for branch."""
    t = type(value)
    if t is int:
        return str(value)
    if t is bool:
        return "true" if value else "false"
    return stringify(value)


# Value types whose str() is what the store keeps (str(float) == repr(float), as stringify).
_STR_TYPES = frozenset({str, int, float})
_BOOL_STRINGS = pa.array(["True", "False"])


def _stored_values(values: list[Any]) -> pa.Array:
    """Attribute values as stored (``_value_str`` of each), converted by C calls, not a loop.

    ``str`` is right for str, int and float values. A bool's ``str`` is "True"/"False": the
    values that read so are found by Arrow and those that are bools stored as "true"/"false".
    Values of any other type (none of kvscope's own) take ``_value_str`` one by one.
    """
    out = list(map(str, values))
    odd = set(map(type, values)) - _STR_TYPES
    if odd - {bool}:
        out = [s if type(v) in _STR_TYPES else _value_str(v)
               for s, v in zip(out, values, strict=True)]
    array = pa.array(out, type=pa.string())
    if bool in odd:
        mask = pc.is_in(array, value_set=_BOOL_STRINGS)
        array = pc.replace_with_mask(array, mask, pa.array(
            [_value_str(values[i]) if type(values[i]) is bool else out[i]
             for i in pc.indices_nonzero(mask).to_pylist()], type=pa.string()))
    return array


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


def rows_to_arrow(rows: Sequence[tuple[Any, ...]]) -> pa.Table:
    """The direct path's rows (``RowSink.row``'s pieces, one tuple a span) as an Arrow table in
    ``otel_traces`` column order and types, the values ``spans_to_rows`` would store.

    Column by column: the batch is transposed by ``zip`` and each column converted by one
    comprehension or a C call. Resources and scopes repeat on every row, so each distinct one
    is converted once and its map gathered (``take``) into place.
    """
    n = len(rows)
    (names, trace_ids, span_ids, parents, states, kinds, resources, scopes, attributes,
     starts, ends, events, codes, messages) = zip(*rows, strict=True)
    string = pa.string()
    # Distinct resources (unhashable: by identity) and scopes, and each row's index into them.
    by_id: dict[int, int] = {}
    distinct: list[ResourceRow] = []
    resource_index = []
    for resource in resources:
        i = by_id.get(id(resource))
        if i is None:
            i = by_id[id(resource)] = len(distinct)
            distinct.append(resource)
        resource_index.append(i)
    resource_take = pa.array(resource_index, type=pa.int32())
    resource_maps = pa.MapArray.from_arrays(
        pa.array(list(accumulate((len(r.keys) for r in distinct), initial=0)), type=pa.int32()),
        pa.array([k for r in distinct for k in r.keys], type=string),
        pa.array([v for r in distinct for v in r.values], type=string), type=_MAP_TYPE)
    scope_ids: dict[tuple[str, str], int] = {}
    scope_take = pa.array([scope_ids.setdefault(scope, len(scope_ids)) for scope in scopes],
                          type=pa.int32())
    distinct_scopes = list(scope_ids)
    arrays = [
        pa.array(starts, type=TRACES_ARROW.field("Timestamp").type),
        _hex_ids(trace_ids, 16),
        _hex_ids(span_ids, 8),
        _parent_ids(parents),
        pa.array(states, type=string),
        pa.array(names, type=string),
        pa.array(kinds, type=string),
        pa.array([r.service for r in distinct], type=string).take(resource_take),
        resource_maps.take(resource_take),
        pa.array([s[0] for s in distinct_scopes], type=string).take(scope_take),
        pa.array([s[1] for s in distinct_scopes], type=string).take(scope_take),
        _attribute_maps(attributes),
        pa.array([e - s if e > s else 0 for s, e in zip(starts, ends, strict=True)],
                 type=pa.uint64()),
        # (An enum's hash is a Python call: compare with the common code by identity first.)
        pa.array([_UNSET_NAME if c is _UNSET_CODE else _STATUS_NAMES[c] for c in codes],
                 type=string),
        pa.array(messages, type=string),
        _events(events),
        pa.array([[]] * n, type=TRACES_ARROW.field("Links").type),
    ]
    return pa.Table.from_arrays(arrays, schema=TRACES_ARROW)


def _hex_ids(ids: Sequence[int], width: int) -> pa.Array:
    """Ids of ``width`` bytes as fixed-width lower-case hex strings (``f"{id:0{2*width}x}"``),
    converted as one byte string: no Python string per id (8-byte ids packed by ``struct`` in
    one call, a seventh of the time of ``int.to_bytes`` per id)."""
    raw = None
    if width == 8:
        try:
            raw = struct.pack(f">{len(ids)}Q", *ids)
        except struct.error:  # a value that does not fit: to_bytes raises the right error
            pass
    if raw is None:
        raw = b"".join(map(methodcaller("to_bytes", width, "big"), ids))
    return pa.StringArray.from_buffers(len(ids), _fixed_offsets(len(ids), 2 * width),
                                       pa.py_buffer(hexlify(raw)))


def _parent_ids(parents: Sequence[int | None]) -> pa.Array:
    """Parent span ids as hex, "" for a root span."""
    present = pa.array(parents, type=pa.uint64())  # None -> null
    if not present.null_count:
        return _hex_ids(cast(Sequence[int], parents), 8)
    return pc.if_else(present.is_valid(), _hex_ids([p or 0 for p in parents], 8), "")


# int32 offsets 0, step, 2 * step, ... by step (shared: Arrow buffers are immutable).
_FIXED_OFFSETS: dict[int, pa.Buffer] = {}


def _fixed_offsets(n: int, step: int) -> pa.Buffer:
    """A buffer of at least ``n + 1`` offsets of strings ``step`` bytes long each."""
    buffer = _FIXED_OFFSETS.get(step)
    if buffer is None or buffer.size < 4 * (n + 1):
        count = max(n + 1, 1 << 15)
        buffer = _FIXED_OFFSETS[step] = pa.py_buffer(array("i", range(0, step * count, step)))
    return buffer


_EVENTS_TYPE = TRACES_ARROW.field("Events").type


def _events(events: Sequence[Sequence[tuple[int, str, Mapping[str, Any]]]]) -> pa.Array:
    """Each row's (timestamp, name, attributes) events as the Events column, built flat (most
    rows have none; attribute maps the way span attributes are built)."""
    offsets = pa.array(list(accumulate(map(len, events), initial=0)), type=pa.int32())
    flat = list(chain.from_iterable(events))
    struct_type = _EVENTS_TYPE.value_type
    if not flat:
        return pa.ListArray.from_arrays(offsets, pa.array([], type=struct_type),
                                        type=_EVENTS_TYPE)
    times, names, attributes = zip(*flat, strict=True)
    structs = pa.StructArray.from_arrays(
        [pa.array(times, type=struct_type.field("Timestamp").type),
         pa.array(names, type=pa.string()), _attribute_maps(attributes)],
        fields=list(struct_type))
    return pa.ListArray.from_arrays(offsets, structs, type=_EVENTS_TYPE)


def _attribute_maps(attributes: Sequence[Mapping[str, Any]]) -> pa.MapArray:
    """Attribute dicts as one MAP array, built flat: keys in order (a dict iterates its keys),
    values as stored, offsets."""
    return pa.MapArray.from_arrays(
        pa.array(list(accumulate(map(len, attributes), initial=0)), type=pa.int32()),
        pa.array(list(chain.from_iterable(attributes)), type=pa.string()),
        _stored_values(list(chain.from_iterable(map(methodcaller("values"), attributes)))),
        type=_MAP_TYPE)


def scope_row(scope: InstrumentationScope | None) -> tuple[str, str]:
    return (scope.name, scope.version or "") if scope is not None else ("", "")


class EngineRows(DirectSpans):
    """EngineTelemetry's direct span builder, ending in store rows instead of a ReadableSpan.

    Everything up to the finished span (attributes, status, timestamps, sampling, the order ids
    are drawn in) is EngineTelemetry's own code; only :meth:`finish` differs, appending the row
    ``spans_to_rows`` would produce for the span :meth:`DirectSpans.finish` builds.
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
    def into(cls, sink: RowTarget) -> Callable[[object], DirectSpans | None]:
        """The row sink of an :class:`EngineTelemetry` (its ``direct``): the engine's spans as
        rows appended to ``sink``; None (the SDK path) for a tracer only ``start_span`` serves
        exactly."""
        def build(tracer: object) -> DirectSpans | None:
            direct = cls.of(tracer)
            if not isinstance(direct, EngineRows):
                return None
            direct.sink = sink
            direct.resource_row = resource_row(direct.resource)
            direct.scope_row = scope_row(direct.scope)
            return direct

        return build

    resource_row: ResourceRow
    scope_row: tuple[str, str]


def proxy_rows(sink: RowTarget) -> SpanSink:
    """The row sink of a :class:`ProxyTelemetry` (its ``span_sink``): each finished span's
    pieces appended to ``sink`` as a store row (``spans_for`` then returns no spans).

    :meth:`ProxyTelemetry.spans_for` stays the one place the turn's spans are shaped; only its
    last step (pieces → span) differs from the SDK sink. The pieces are already what a row holds
    (ids, (timestamp, name, attributes) events; no trace state).
    """
    row = sink.row
    kinds = _KIND_NAMES_BY_ID

    def bind(resource: Resource, scope: InstrumentationScope) -> SpanBuilder:
        resource_values = resource_row(resource)
        scope_values = scope_row(scope)

        def span(name: str, trace_id: int, span_id: int, parent_span_id: int | None,
                 parent_is_remote: bool, kind: SpanKind, start_ns: int, end_ns: int,
                 attributes: dict[str, Any], events: tuple[SpanEvent, ...],
                 status: Status) -> None:
            row(name, trace_id, span_id, parent_span_id, "", kinds[id(kind)], resource_values,
                scope_values, attributes, start_ns, max(end_ns, start_ns), events,
                status.status_code, status.description or "")

        return span

    return bind


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


__all__ = ["EngineRows", "ResourceRow", "RowSink", "RowTarget", "cyclic_gc_per_batch", "proxy_rows",
    "resource_row", "rows_to_arrow", "scope_row"]
