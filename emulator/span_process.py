"""The simulator's telemetry: the proxy's and engines' span builders, here or in a span process.

:func:`telemetry` builds, for one run, the proxy's span builder and each engine's
:class:`EngineTelemetry` (as an :class:`Emitter`), writing into a :class:`RowSink`: straight from
the builders' pieces (the direct row path) or through SDK spans (what tests compare the direct
rows with). A large run builds and writes its spans in a :class:`SpanProcess` instead, a child
at a lower CPU priority that receives the run's records in batches: the engine records (one
encoding per event: the :mod:`~kvscope.collector.engine_telemetry` named tuples, shipped as plain
tuples) and the proxy's turn records.
"""

from __future__ import annotations

import logging
import os
import random
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider

from kvscope import semconv
from kvscope.child import (
    pack,
    report_error,
    report_ready,
    set_send_buffer,
    spawn_child,
    stop_child,
    unpack,
    wait_ready,
)
from kvscope.collector.engine_telemetry import ENGINE_RECORDS, EngineRecord, EngineTelemetry
from kvscope.collector.proxy.export_process import record_from_tuple, record_to_tuple
from kvscope.collector.proxy.telemetry import ProxyTelemetry, TurnRecord
from kvscope.collector.span_rows import EngineRows, RowSink, cyclic_gc_per_batch, proxy_rows
from kvscope.errors import StoreError
from kvscope.store.database import open_store
from kvscope.store.writer import ROW_GROUP_ROWS

logger = logging.getLogger(__name__)

__all__ = ["Emitter", "LocalEmitter", "SPAN_PIPE_BUFFER", "SPAN_PROCESS_NICE", "SpanProcess",
    "TelemetrySpec", "telemetry"]

class Emitter(Protocol):
    """Where the simulation emits an engine's records: its :class:`EngineTelemetry` in this
    process (:class:`LocalEmitter`), or a :class:`SpanProcess` stand-in that ships them."""

    def emit(self, record: EngineRecord) -> None: ...


# A shipped record carries its type's index in ENGINE_RECORDS and its field values, in order:
# it crosses the pipe as a plain tuple and is rebuilt with ``_make``.
_CODE_OF = {kind: code for code, kind in enumerate(ENGINE_RECORDS)}


class LocalEmitter:
    """An engine's telemetry in this process: each record emitted at once."""

    __slots__ = ("emit",)

    def __init__(self, telemetry: EngineTelemetry) -> None:
        self.emit = telemetry.emit


_TURN = -1  # the engine index of a proxy TurnRecord
_SPAN_PROCESS = "kvscope-simulator-spans"
# The span process runs at a lower CPU priority: the simulating process is the run's critical
# path (the span process only follows it), and on a machine with fewer free cores than the
# three busy threads (model; spans; inserts) it keeps its core instead of being preempted.
# 100k turns on 2 cores: 20.6 s against 21.6 s at equal priority.
SPAN_PROCESS_NICE = 10
# Socket buffer between the two: room for a few batches, so that the simulating process
# rarely waits for the span process to read (the default, ~200 KiB, is a tenth of a batch).
SPAN_PIPE_BUFFER = 8 << 20


@dataclass(frozen=True)
class TelemetrySpec:
    """Everything the spans of a run are built from, besides the records: the proxy's and each
    engine's resource (attributes as created here, so a span process stores the same) and
    (engine id, role), and the id streams (``random`` states) to draw span ids from."""

    router_ttl_s: float
    proxy_resource: Mapping[str, Any]
    engines: tuple[tuple[Mapping[str, Any], str, str], ...]
    proxy_random: Any = None
    engine_random: Any = None


def telemetry(sink: RowSink, spec: TelemetrySpec, direct: bool
               ) -> tuple[Callable[[TurnRecord], Any], list[LocalEmitter]]:
    """The proxy's span builder and each engine's telemetry (as its emitter), writing into
    ``sink``.

    ``direct``: rows straight from the builders' pieces (no ReadableSpan, no spans_to_rows);
    otherwise SDK spans, which tests compare the direct rows with.
    """
    # ``direct``: rows straight from the span builders' pieces (no ReadableSpan, no
    # spans_to_rows); otherwise the SDK sinks.
    proxy = ProxyTelemetry(None, router_ttl_s=spec.router_ttl_s,
                           resource=Resource(dict(spec.proxy_resource)),
                           span_sink=proxy_rows(sink) if direct else None,
                           random_state=spec.proxy_random)
    engines = []
    for attributes, engine_id, role in spec.engines:
        provider = TracerProvider(resource=Resource(dict(attributes)))
        provider.add_span_processor(sink)
        tel = EngineTelemetry(provider.get_tracer(semconv.SCOPE_NAME), engine_id=engine_id,
                              role=role, background=False,
                              direct=EngineRows.into(sink) if direct else None)
        if direct and not tel.builds_directly:
            raise RuntimeError("simulator: an engine tracer needs the SDK span path")
        engines.append(LocalEmitter(tel))
    if direct:
        return proxy.spans_for, engines

    def spans_for(record: TurnRecord) -> None:
        sink.add(proxy.spans_for(record))

    return spans_for, engines


class SpanProcess:
    """The run's spans built, converted and inserted by a child process, from its records.

    The simulating process only runs the model: each finished turn's :class:`TurnRecord` and
    each engine record go to the child as plain tuples, in batches of ``batch`` (one message
    each). The child rebuilds them and runs the same builders the in-process path runs
    (:func:`telemetry`: ``ProxyTelemetry.spans_for``, ``EngineTelemetry.emit``, direct rows)
    into a :class:`RowSink` on its own connection. It continues the id streams of ``spec``,
    so its rows are those the in-process path stores. The store file must not be open
    elsewhere for writing meanwhile. The child's errors are raised here as
    :class:`StoreError` when sending or at :meth:`close`; ``written`` is known after close.
    """

    def __init__(self, db: str | Path, spec: TelemetrySpec, batch: int = 8192) -> None:
        # Returns at once; ready() waits until the child has the store open.
        self._process, self._conn = spawn_child(_main, (str(db), spec),
                                                name=_SPAN_PROCESS)
        set_send_buffer(self._conn, SPAN_PIPE_BUFFER)
        self._items: list[tuple[int, int, tuple[Any, ...]]] = []
        self._batch = batch
        self.written = 0

    def ready(self) -> None:
        """Wait until the child has the store open (ChildStartError: it never ran; it is
        stopped then, as on its own reported error, which is raised)."""
        wait_ready(self._process, self._conn, name=_SPAN_PROCESS)

    def turn(self, record: TurnRecord) -> None:
        """Ship a finished turn's record (the child runs ``ProxyTelemetry.spans_for``)."""
        self._items.append((_TURN, 0, record_to_tuple(record)))
        if len(self._items) >= self._batch:
            self.flush()

    def engine(self, index: int) -> Emitter:
        """The stand-in for engine ``index``'s telemetry: its ``emit`` ships the record."""
        items, batch, flush, codes = self._items, self._batch, self.flush, _CODE_OF

        class _Ship:
            __slots__ = ()

            def emit(self, record: EngineRecord) -> None:
                items.append((index, codes[type(record)], tuple(record)))
                if len(items) >= batch:
                    flush()

        return _Ship()

    def flush(self) -> None:
        if self._items:
            try:
                self._conn.send_bytes(pack(self._items))
            except (OSError, ValueError) as exc:
                raise StoreError(self._child_error() or "simulator: the span process "
                                 "is gone") from exc
            self._items.clear()

    def _child_error(self) -> str | None:
        try:
            if self._conn.poll(0):
                status, detail = self._conn.recv()
                if status == "error":
                    return ": ".join(detail)
        except (EOFError, OSError):
            pass
        return None

    def close(self) -> None:
        """Ship what is left, let the child store it, and raise its error if it had one."""
        self.flush()
        try:
            self._conn.send_bytes(b"")
            status, detail = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise StoreError(f"simulator: the span process exited (code "
                             f"{self._process.exitcode})") from exc
        finally:
            self._process.join(60)
        if status != "ok":
            raise StoreError("simulator: the span process failed: " + ": ".join(detail))
        self.written = detail

    def abort(self) -> None:
        """Stop the child without waiting for what it still has (idempotent)."""
        stop_child(self._process, self._conn)


def _main(conn: Connection, db: str, spec: TelemetrySpec) -> None:
    """The span process: records → spans → rows → store until the end marker, then report."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it in order
    try:
        os.nice(SPAN_PROCESS_NICE)
    except OSError:
        pass  # run at the parent's priority
    if spec.engine_random is not None:
        random.setstate(spec.engine_random)  # the engine tracers' RandomIdGenerator
    try:
        con = open_store(db, threads=1)  # it only inserts, beside the busy simulation
        report_ready(conn)
        try:
            sink = RowSink(con, insert_rows=ROW_GROUP_ROWS)
            try:
                spans_for, engines = telemetry(sink, spec, direct=True)
                emits = [engine.emit for engine in engines]
                kinds = ENGINE_RECORDS
                with cyclic_gc_per_batch():
                    while data := conn.recv_bytes():
                        for index, code, values in unpack(data):
                            if index == _TURN:
                                spans_for(record_from_tuple(values))
                            else:
                                emits[index](kinds[code]._make(values))
                sink.close()
                written = sink.written
            finally:
                sink.abort()
        finally:
            con.close()
    except Exception as exc:  # before ready: the parent raises it; after: at close
        report_error(conn, exc)
        return
    conn.send(("ok", written))


