"""The proxy's turn telemetry in a child process: records out of the event loop's process.

Building a turn's spans, converting them to rows and inserting them into DuckDB (or encoding
OTLP) costs ~180 µs of CPU per turn. In the proxy's own process that work holds the GIL the
event loop needs, so under load every turn waits for it. :class:`TurnExportProcess` moves all
of it to a child process: when a turn finishes, the event loop flattens its
:class:`TurnRecord` to a tuple with the request's messages (see
:meth:`ProxyTelemetry.message_boundaries`), packs it to bytes (:func:`~kvscope.child.pack`:
marshal: ~4.5 µs for a few short messages in a tight loop, ~12 µs timed inside a serving
proxy, where its code and the record are out of the CPU's caches) and appends that to a bounded
deque (no lock); a sender thread, every 250 ms, writes what is queued to a pipe as one batch.
The child hashes the message boundaries, rebuilds each record and runs the same
:meth:`ProxyTelemetry.spans_for`.

Both choices come from the event loop setting a turn's latency at saturation. Any Python work in
the sender thread holds the GIL the loop needs (with the records flattened and boundaries hashed
there, telemetry still added ~0.7 ms p50 at 64 conversations when the child discarded everything
it received; queueing the records themselves and packing each batch in one call in the sender
cost the proxy's process the same CPU a turn as packing each turn on the loop, 735 against 735
µs, as the sender then reads records gone cold). And records kept as objects until the sender
took them (a record, the request body it references) survived into older garbage-collector
generations, so the loop's collections traversed more and ran more often at CPython's default
thresholds (0.55 s of collection in the on-rounds against 0.34 s off); queued as packed bytes,
which the collector never visits (span counts beside them), they do not. ``kvscope proxy``
also collects its young generation rarely (``configure_serving_gc``: below 1 µs of collection
a turn, telemetry on or off). The messages' text crosses only this local pipe: the child
keeps their hashes, never the text. To a store file (``--db``) the child takes the direct row
path of :mod:`~kvscope.collector.span_rows` (each span's pieces kept as a row and converted by
column: about half the CPU of building ``ReadableSpan`` objects and converting them); to OTLP it
uses the SDK exporters. Either way the stored spans equal the in-process path's (tested).

The child runs at a lower CPU priority (``nice`` +10): when the proxy's machine is saturated
the scheduler serves requests first and the child catches up when there is room, its backlog
bounded by the pipe and the deque. Records that do not fit are dropped and counted (as the
spans they would have made), never waited for; a child that dies costs spans, not turns.

The child ignores SIGINT (a Ctrl-C reaches the whole process group; the proxy then closes it in
order): it stops when the proxy sends the end-of-records marker (:meth:`TurnExportProcess.close`,
also registered with ``atexit``), when the pipe closes because the proxy is gone, or on SIGTERM,
and flushes what it has received in every case. A SIGTERM that stops the proxy too (to the
process group, or systemd's control group) does not cut the turns the proxy still ends: the
proxy says it is stopping (:meth:`TurnExportProcess.stopping`) and the child receives until the
proxy closes it (at most :data:`TERM_DRAIN_S`).
"""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing as mp
import operator
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection
from typing import Any

from kvscope.boundary_key import BoundaryKey
from kvscope.child import pack, report_error, report_ready, start_child, unpack
from kvscope.collector.proxy.conversation import ConversationId
from kvscope.collector.proxy.telemetry import TurnRecord, set_boundaries, set_reply_boundary
from kvscope.errors import KvscopeError

logger = logging.getLogger(__name__)

# Added to the child's nice value: serving first, telemetry with what is left.
CHILD_NICE = 10
# How often the sender thread ships what is queued (a half-full queue, or a flush, ships at
# once). Each wake-up takes the GIL from the event loop, which at saturation sets every turn's
# latency; at 64 conversations (bench_proxy.py, 5 runs each) telemetry added a median +0.63 ms
# p50 shipping every 250 ms against +1.18 ms every 20 ms (before bench_proxy.py let the child
# catch up between rounds; measured since, 50 ms against 250 ms side by side over 36 rounds:
# +0.27 ms, interval -0.67 .. +0.74). Spans still reach the store within about a second and a
# quarter.
SEND_INTERVAL_S = 0.25
MAX_QUEUED_RECORDS = 65536

# boundary_source travels last, as the messages (or prompt) only: see boundary_input.
_FIELDS = tuple(f.name for f in fields(TurnRecord) if f.name != "boundary_source")
_CONVERSATION = _FIELDS.index("conversation")
_values = operator.attrgetter(*_FIELDS)

# Slots of the shared counter array the child publishes.
(_RECEIVED, _BUILD_FAILED, _QUEUED, _EXPORTED, _DROPPED, _EXPORT_FAILED, _WRITE_FAILED,
 _FLUSHED, _STORE_WRITES, _STORE_WRITE_NS, _STOPPING) = range(11)
# Control messages on the pipe (record batches are packed: they never start with these).
_END = b""
_FLUSH = b"F"
# How often an idle child publishes its exporter's counters.
_PUBLISH_INTERVAL_S = 0.2
# A SIGTERM reaches the child alone (someone stops it: it flushes and exits) or with the proxy
# (a stop of the process group, systemd's default KillMode=control-group): the proxy then says
# it is stopping (:meth:`TurnExportProcess.stopping`) and still records the turns in flight,
# which it waits for up to aiohttp's 60 s. The child waits this long for that word, then, if it
# came, receives until the proxy's end marker or the pipe closes, at most TERM_DRAIN_S after the
# signal. A second SIGTERM ends it at once (after the flush). 2 s was once too short for a proxy
# on a loaded machine (a test's group stop under a parallel suite lost the turn in flight).
_TERM_WAIT_S = 5.0
TERM_DRAIN_S = 90.0
# The longest collected rows wait before they go to the store (--db); sooner when the sink's
# batch (20,000 rows) fills. A store write costs about the same CPU whatever its size up to
# thousands of rows (DuckDB's commit of a small append: ~5.5 ms for 75 rows, plus the rows'
# conversion), and more as the table's last row group fills (8.3 -> 12.6 ms a write of 100 spans
# over the first 125k spans of a store), so one write a second made that cost most of the
# child's CPU per turn at tens of turns a second, and its growth showed per turn. Writing every
# 5 s instead: 100-span writes 8-12 ms each, 500-span writes 15-17 ms (0.40 -> 0.13 ms a turn;
# ``bench_soak.py --write-sizes`` prints both side by side). The cost: a child killed outright
# (SIGKILL, OOM) loses up to 5 s of spans instead of 1 s; one whose proxy dies still flushes.
STORE_INTERVAL_S = 5.0
# The child's cyclic garbage collection: automatic passes paused, one full pass this often over
# what start-up did not leave behind (frozen). Spans and rows are acyclic and freed by reference
# counting; the automatic passes, triggered by their allocation, traversed the rows a batch
# holds again and again (~10 of ~85 µs of the child's CPU a turn).
_COLLECT_INTERVAL_S = 1.0


def record_to_tuple(record: TurnRecord) -> tuple[Any, ...]:
    """A record as plain values in field order (packed several times faster than the
    dataclass), its ``boundary_source`` last as only what the boundaries are hashed from."""
    values = list(_values(record))
    conversation = values[_CONVERSATION]
    if conversation is not None:
        values[_CONVERSATION] = (conversation.value, conversation.source, conversation.rejected)
    source = record.boundary_source
    values.append(None if source is None else boundary_input(source))
    return tuple(values)


def record_from_tuple(values: tuple[Any, ...]) -> TurnRecord:
    """The record :func:`record_to_tuple` flattened (``boundary_source`` still to hash: see
    :func:`resolve_boundaries`)."""
    record = TurnRecord(*values)
    if record.conversation is not None:
        record.conversation = ConversationId(*record.conversation)
    return record


def boundary_input(body: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a request body its message boundaries are hashed from (the messages, or a
    completions prompt), so that a record carries no more of the body than that."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return {"messages": messages}
    return {"prompt": body.get("prompt")}


def resolve_boundaries(record: TurnRecord, key: BoundaryKey) -> None:
    """Hash a record's ``boundary_source`` into its boundaries with ``key`` (``set_boundaries``)
    and its reply (``set_reply_boundary``), and drop both sources (a body that does not hash
    leaves the turn without boundaries)."""
    source = record.boundary_source
    record.boundary_source = None
    try:
        if source is not None:
            set_boundaries(record, source, key)
        set_reply_boundary(record, key)
    except Exception:
        logger.debug("kvscope proxy telemetry: message boundaries failed", exc_info=True)
        record.reply_source = None


def span_count(record: TurnRecord) -> int:
    """How many spans :meth:`ProxyTelemetry.spans_for` makes of ``record`` (to count drops)."""
    tool_wait = (
        record.conversation is not None
        and record.conversation.value is not None
        and record.previous_end_ns is not None
        and record.previous_end_ns <= record.arrival_ns
    )
    return (1 + (record.prefill_start_ns is not None) + (record.decode_start_ns is not None)
            + tool_wait)


@dataclass
class ExportProcessStats:
    """What the parent side counted (the child's counters are read through :meth:`counts`)."""

    submitted: int = 0
    sent: int = 0
    dropped_records: int = 0
    dropped_spans: int = 0


class TurnExportProcess:
    """A child process that turns the proxy's records into stored spans.

    ``service_name``, ``db`` / ``otlp_endpoint`` and ``router_ttl_s`` are what
    :func:`~kvscope.collector.otel.setup_telemetry` and
    :class:`~kvscope.collector.proxy.telemetry.ProxyTelemetry` take in-process;
    ``boundary_key`` is what the child hashes message boundaries with (one for this process
    only when None: see :mod:`kvscope.boundary_key`). The constructor
    returns once the child has opened its destination, and raises the child's error when it
    cannot (a locked store file: ``StoreLockedError``), or
    :class:`~kvscope.child.ChildStartError` when the child did not start.
    """

    def __init__(
        self,
        service_name: str,
        *,
        db: str | None = None,
        otlp_endpoint: str | None = None,
        router_ttl_s: float | None = None,
        max_queue: int = MAX_QUEUED_RECORDS,
        send_interval_s: float = SEND_INTERVAL_S,
        nice: int = CHILD_NICE,
        boundary_key: BoundaryKey | None = None,
    ) -> None:
        self.boundary_key = boundary_key or BoundaryKey.ephemeral()
        self._counters = mp.get_context("spawn").Array("q", 11, lock=False)
        self._process, self._conn = start_child(
            _child_main, (service_name, db, otlp_endpoint, router_ttl_s, nice, self._counters,
                          self.boundary_key.secret),
            name="kvscope-proxy-telemetry",
        )
        self.stats = ExportProcessStats()
        # Each finished turn as its packed record: bytes, which the cyclic garbage collector
        # never visits, so that nothing of a turn (record, request body, not even a tuple)
        # outlives it on the proxy's heap while it waits for the sender; beside it, in the same
        # order, the spans it makes (small ints: shared objects), counted if it is dropped.
        self._queue: deque[bytes] = deque()
        self._queue_spans: deque[int] = deque()
        self._max_queue = max_queue
        self._wake_at = max(max_queue // 2, 1)
        self._interval = send_interval_s
        self._cond = threading.Condition()
        self._closed = False
        self._broken = False
        self._drop_lock = threading.Lock()
        self._flushes_requested = 0
        self._flushes_sent = 0
        self._thread = threading.Thread(target=self._send_loop, name="kvscope-proxy-sender",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # --- the event loop's side ----------------------------------------------------------------
    def submit(self, record: TurnRecord) -> None:
        """Queue a finished turn's record, packed; drop and count it when the queue is full."""
        queue = self._queue
        spans = span_count(record)
        if self._closed or self._broken or len(queue) >= self._max_queue:
            self._dropped(1, spans)
            return
        try:
            packed = pack(record_to_tuple(record))
        except Exception:  # never raise into the request path: count it as lost
            logger.debug("kvscope proxy telemetry: could not pack a record", exc_info=True)
            self._dropped(1, spans)
            return
        # Atomic under the GIL; spans first, so that the sender finds them for every record.
        self._queue_spans.append(spans)
        queue.append(packed)
        self.stats.submitted += 1
        if len(queue) == self._wake_at:
            with self._cond:
                self._cond.notify()

    # --- the sender thread --------------------------------------------------------------------
    def _send_loop(self) -> None:
        queue, queue_spans = self._queue, self._queue_spans
        while True:
            with self._cond:
                if not self._closed:
                    self._cond.wait(self._interval)
                closed = self._closed
                flushes = self._flushes_requested
            batch: list[bytes] = []
            spans = 0
            while queue:
                batch.append(queue.popleft())
                spans += queue_spans.popleft()
            if batch:
                self._send(batch, spans)
            if flushes > self._flushes_sent:
                self._control(_FLUSH)
                self._flushes_sent = flushes
            if closed and not queue:
                break
        self._control(_END)

    def _control(self, message: bytes) -> None:
        if not self._broken:
            try:
                self._conn.send_bytes(message)
            except (OSError, ValueError):
                self._broken = True

    def _send(self, batch: list[bytes], spans: int) -> None:
        if not self._broken:
            try:
                payload = pack(batch)  # a list of bytes: copies
                self._conn.send_bytes(payload)  # blocks (GIL released) while the child is behind
                self.stats.sent += len(batch)
                return
            except (OSError, ValueError):
                self._broken = True
                logger.error("kvscope proxy telemetry: the export process is gone (exit code "
                             "%s); spans are dropped and counted from now on",
                             self._process.exitcode)
            except Exception:  # never raise from the sender thread: count
                logger.exception("kvscope proxy telemetry: could not send a batch")
        self._dropped(len(batch), spans)

    def _dropped(self, records: int, spans: int) -> None:
        # Both the event loop and the sender thread drop: count under a lock (a rare path).
        with self._drop_lock:
            self.stats.dropped_records += records
            self.stats.dropped_spans += spans

    # --- counters and shutdown ----------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """Spans queued and exported by the child, and every span lost on either side."""
        c = self._counters
        return {
            "queued_spans": int(c[_QUEUED]),
            "exported_spans": int(c[_EXPORTED]),
            "dropped_spans": int(self.stats.dropped_spans + c[_BUILD_FAILED] + c[_DROPPED]
                                 + c[_EXPORT_FAILED] + c[_WRITE_FAILED]),
            "pending_records": len(self._queue),
            # Store writes (--db) and the seconds the child waited for them, in ns (the rows'
            # conversion included): their mean is the insert latency a soak follows.
            "store_writes": int(c[_STORE_WRITES]),
            "store_write_ns": int(c[_STORE_WRITE_NS]),
        }

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until the child has exported (and stored) every record submitted so far."""
        with self._cond:
            self._flushes_requested += 1
            wanted = self._flushes_requested
            self._cond.notify()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self._broken:
            if self._counters[_FLUSHED] >= wanted:
                return True
            time.sleep(0.005)
        return False

    def stopping(self) -> None:
        """Tell the child the proxy is stopping in order (its turns in flight still end and are
        sent): a SIGTERM the child gets with the proxy's then waits for :meth:`close`."""
        self._counters[_STOPPING] = 1

    def close(self, timeout_s: float = 60.0) -> None:
        """Send what is queued, let the child flush and exit; then stop the sender thread."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)
        self._process.join(timeout_s)
        if self._process.is_alive():
            logger.error("kvscope proxy telemetry: the export process did not exit in %.0f s; "
                         "terminating it", timeout_s)
            self._process.terminate()
            self._process.join(5)
            if self._process.is_alive():
                self._process.terminate()  # a second SIGTERM ends it at once, after its flush
                self._process.join(5)
        self._conn.close()
        atexit.unregister(self.close)


class _SdkExport:
    """Spans through the SDK providers and exporters (the OTLP destination)."""

    def __init__(self, service_name: str, otlp_endpoint: str, router_ttl_s: float | None
                 ) -> None:
        from kvscope.collector.otel import setup_telemetry
        from kvscope.collector.proxy.telemetry import ProxyTelemetry

        self.telemetry = setup_telemetry(service_name, otlp_endpoint=otlp_endpoint)
        self.proxy = ProxyTelemetry(self.telemetry, router_ttl_s=router_ttl_s)
        self._on_end = self.telemetry.span_processor.on_end

    def add(self, record: TurnRecord) -> int:
        spans = self.proxy.spans_for(record)
        for span in spans:
            self._on_end(span)
        return len(spans)

    def tick(self) -> None:
        """The processor exports on its own schedule."""

    def sync(self) -> None:
        self.telemetry.flush()

    def publish(self, counters: Any, built: int) -> None:
        stats = self.telemetry.span_processor.stats
        counters[_QUEUED] = stats.queued
        counters[_EXPORTED] = stats.sent
        counters[_DROPPED] = stats.dropped
        counters[_EXPORT_FAILED] = stats.failed

    def shutdown(self) -> None:
        self.telemetry.shutdown()


class _RowExport:
    """Rows straight into the store file: the direct row path (no ReadableSpan, no row
    conversion of SDK spans), about half the CPU of the SDK path for the same rows."""

    def __init__(self, service_name: str, db: str, router_ttl_s: float | None) -> None:
        from kvscope.collector.proxy.telemetry import ProxyTelemetry
        from kvscope.collector.span_rows import RowSink, proxy_rows
        from kvscope.store.database import open_store

        self._con = open_store(db, threads=1)  # it only inserts, beside the busy proxy
        self._sink = RowSink(self._con, strict=False, name="kvscope-proxy-rows")
        # spans_for appends rows: the row sink.
        self.proxy = ProxyTelemetry(None, router_ttl_s=router_ttl_s, service_name=service_name,
                                    span_sink=proxy_rows(self._sink))
        self._flushed_at = time.monotonic()
        self._writes = 0
        self._write_ns = 0

    def add(self, record: TurnRecord) -> int:
        return len(self.proxy.spans_for(record))

    def tick(self) -> None:
        """Store collected rows at least every :data:`STORE_INTERVAL_S` (what a killed child can
        lose), and wait for the insert: building rows and DuckDB's insert (which releases the GIL,
        on the writer's thread) then take turns, so the child never holds both of a small machine's
        CPUs at once, at the same CPU a turn. Measured against overlapping them, in separate proxy
        processes side by side at 64 conversations: median per-round differences of -0.42 and -0.30
        ms, intervals -1.65 .. +0.37 and -1.11 .. +1.28 ms; not significant, as two identical proxy
        processes differ by as much (see ``bench_proxy.py``)."""
        if self._sink.pending and time.monotonic() - self._flushed_at >= STORE_INTERVAL_S:
            self._write()

    def sync(self) -> None:
        self._write()

    def _write(self) -> None:
        """Store what is collected and wait for it; count the write and its wait."""
        rows = self._sink.pending + self._sink.held
        started = time.perf_counter_ns()
        self._sink.sync()
        if rows:
            self._writes += 1
            self._write_ns += time.perf_counter_ns() - started
        self._flushed_at = time.monotonic()

    def publish(self, counters: Any, built: int) -> None:
        stats = self._sink.writer_stats
        counters[_QUEUED] = built
        counters[_EXPORTED] = stats.written_rows
        counters[_DROPPED] = stats.dropped_rows
        counters[_WRITE_FAILED] = stats.failed_rows
        counters[_STORE_WRITES] = self._writes
        counters[_STORE_WRITE_NS] = self._write_ns

    def shutdown(self) -> None:
        try:
            self._sink.close()
        finally:
            self._con.close()


def _child_main(conn: Connection, service_name: str, db: str | None, otlp_endpoint: str | None,
                router_ttl_s: float | None, nice: int, counters: Any, key_secret: bytes) -> None:
    """The export process: rebuild records, build their spans, export them, until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    terminated: list[float] = []  # when SIGTERM came (monotonic)

    def _terminate(signum: int, frame: object) -> None:
        if terminated:
            raise SystemExit(0)  # a second one: unwinds into the flush below
        terminated.append(time.monotonic())

    signal.signal(signal.SIGTERM, _terminate)
    export: _SdkExport | _RowExport
    key = BoundaryKey(key_secret)
    try:
        if db is not None:
            export = _RowExport(service_name, db, router_ttl_s)
        elif otlp_endpoint is not None:
            export = _SdkExport(service_name, otlp_endpoint, router_ttl_s)
        else:
            raise KvscopeError("proxy telemetry needs --db FILE or --otlp-endpoint URL")
    except Exception as exc:  # the parent raises it again (same class when kvscope's)
        report_error(conn, exc)
        return
    report_ready(conn)
    # Lower priority only now: the proxy waits for this child's imports and store before it
    # serves, and a niced child on a busy host (a vLLM server starting beside it) took 112 s.
    if nice:
        try:
            os.nice(nice)
        except OSError:
            pass
    built = 0
    warned = False
    gc.freeze()
    gc.disable()
    collected_at = time.monotonic()
    try:
        while True:
            now = time.monotonic()
            if terminated and now - terminated[0] >= (
                    TERM_DRAIN_S if counters[_STOPPING] else _TERM_WAIT_S):
                break  # stopped alone, or the proxy's stop took too long: flush what arrived
            if now - collected_at >= _COLLECT_INTERVAL_S:
                gc.collect()
                collected_at = time.monotonic()
            try:
                if not conn.poll(_PUBLISH_INTERVAL_S):
                    export.tick()
                    export.publish(counters, built)
                    continue
                data = conn.recv_bytes()
            except (EOFError, OSError):
                break  # the proxy is gone: flush what arrived
            if data == _END:
                break
            if data == _FLUSH:
                export.sync()
                export.publish(counters, built)
                counters[_FLUSHED] += 1
                continue
            for packed in unpack(data):
                counters[_RECEIVED] += 1
                try:
                    record = record_from_tuple(unpack(packed))
                    resolve_boundaries(record, key)
                    built += export.add(record)
                except Exception:
                    counters[_BUILD_FAILED] += 1
                    if not warned:
                        warned = True
                        logger.exception("kvscope proxy telemetry: building a turn's spans "
                                         "failed (further failures are counted)")
            export.tick()
            export.publish(counters, built)
    finally:
        export.shutdown()
        export.publish(counters, built)


__all__ = ["CHILD_NICE", "ExportProcessStats", "MAX_QUEUED_RECORDS", "SEND_INTERVAL_S",
    "STORE_INTERVAL_S", "TERM_DRAIN_S", "TurnExportProcess", "boundary_input",
    "record_from_tuple", "record_to_tuple", "resolve_boundaries", "span_count"]
