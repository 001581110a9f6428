"""The receiver's one store path: admit an OTLP export body by bytes, decode it, commit its rows.

Both transports of ``kvscope serve`` (OTLP/HTTP in :mod:`kvscope.collector.receiver`, OTLP/gRPC
in :mod:`kvscope.collector.otlp_grpc`) reserve the request's bytes through
:meth:`Intake.admitted` (:mod:`kvscope.collector.otlp_admission`), hand the body to
:meth:`Intake.export` and turn its answer into their own wire format: an
``Export*ServiceResponse`` (with ``partial_success`` when spans or points were rejected) or a
:class:`Refused` carrying both the HTTP status and the ``google.rpc`` code (the gRPC status code
of the same number) of the refusal.

A request is decoded completely before anything is queued, so a refused request never touches
rows already stored or queued. Its rows are then committed by the store writer, grouped with
those of every other request waiting (one insert, one commit), and the request is answered only
after that commit (``ack="durable"``, the default): everything acknowledged survives a SIGKILL.
A request of any number of rows is accepted (the writer inserts a large one in parts of whole
row groups, in one transaction); what bounds it is its bytes. ``ack="queued"`` keeps the earlier
behaviour (answer once queued, 503 when the writer's row queue is full, 413 for a request with
more rows than the whole queue), for comparison in ``tests/benchmarks/bench_store_throughput.py``.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import zlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
from google.protobuf.message import Message
from google.rpc import code_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsPartialSuccess,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTracePartialSuccess,
    ExportTraceServiceResponse,
)

from kvscope.collector.otlp_admission import ByteBudget, Reservation
from kvscope.collector.otlp_decode import (
    DecodedBatch,
    Encoding,
    decode_metrics_request,
    decode_trace_request,
)
from kvscope.errors import PayloadError
from kvscope.store.schema import GAUGE_TABLE, TRACES_TABLE
from kvscope.store.writer import StoreWriter

logger = logging.getLogger(__name__)

Signal = Literal["traces", "metrics"]
_DECODERS: dict[Signal, Callable[[bytes, Encoding, str | None], DecodedBatch[Any]]] = {
    "traces": decode_trace_request,
    "metrics": decode_metrics_request,
}
# Per signal: the export response, its partial success and that message's count of rejections.
_RESPONSES: dict[Signal, tuple[type[Message], type[Message], str]] = {
    "traces": (ExportTraceServiceResponse, ExportTracePartialSuccess, "rejected_spans"),
    "metrics": (ExportMetricsServiceResponse, ExportMetricsPartialSuccess, "rejected_data_points"),
}
# When a request is answered: after its rows are committed, or (the earlier way) once queued.
Ack = Literal["durable", "queued"]
# How long a busy writer asks senders to wait: HTTP's Retry-After, gRPC's RetryInfo.
RETRY_AFTER_S = 1
# Decoding is CPU work under the GIL: one thread keeps the event loop answering (health, new
# requests) while a second would only contend with it; DuckDB's insert runs in parallel on the
# writer thread with the GIL released.
_DECODE_THREADS = 1


# After a request this big, once nothing is in flight, the C heap's free pages go back to the
# system: glibc keeps what decoding, grpc's buffers and the insert freed (hundreds of MiB after
# a burst of big requests), so an idle receiver would stay at its peak.
_TRIM_AFTER_BYTES = 8 << 20


def _give_back_freed_memory() -> None:
    """``malloc_trim(0)`` (glibc; elsewhere nothing): only when a big request ends with none in
    flight, so at most once a burst."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


@dataclass
class ReceiverStats:
    """Counters of one receiver (both transports); ``GET /health`` reports them."""

    requests: int = 0
    spans_accepted: int = 0
    spans_rejected: int = 0
    values_truncated: int = 0  # attribute values stored cut (distinct per request)
    points_accepted: int = 0
    points_rejected: int = 0
    bad_requests: int = 0
    too_large: int = 0
    unsupported: int = 0
    busy: int = 0
    # Bytes of request bodies held now, and the most held at once (admission by bytes).
    inflight_bytes: int = 0
    peak_inflight_bytes: int = 0


class Refused(Exception):
    """A request refused: an HTTP status, the matching ``google.rpc`` code, a reason."""

    def __init__(self, status: int, message: str, code: int = code_pb2.INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def too_large(message: str) -> Refused:
    """The refusal of a request over a size limit (HTTP 413, RESOURCE_EXHAUSTED)."""
    return Refused(413, message, code_pb2.RESOURCE_EXHAUSTED)


def busy(message: str) -> Refused:
    """The refusal of a request the receiver cannot take now (HTTP 503 with Retry-After,
    UNAVAILABLE with RetryInfo): the OTLP exporters retry it."""
    return Refused(503, message, code_pb2.UNAVAILABLE)


def gunzip_limited(body: bytes, limit: int) -> bytes:
    """Decompress a gzip body (one or more members), refusing output past ``limit`` bytes."""
    out: list[bytes] = []
    total = 0
    data = body
    while data:
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            # Asking for one byte more than allowed tells "exactly at the limit" from "over it"
            # without ever inflating more than limit + 1 bytes.
            chunk = inflater.decompress(data, limit + 1 - total)
        except zlib.error as exc:
            raise Refused(400, f"body is not valid gzip: {exc}") from None
        total += len(chunk)
        if total > limit:
            raise too_large(f"decompressed body exceeds max_request_bytes ({limit} bytes)")
        if not inflater.eof:
            raise Refused(400, "gzip body is truncated")
        out.append(chunk)
        data = inflater.unused_data
    return b"".join(out)


class Intake:
    """Admit, decode, check and commit export requests for one store writer; count it all."""

    def __init__(self, writer: StoreWriter, *, max_request_bytes: int, max_queue_rows: int,
                 max_inflight_bytes: int | None = None, run_id: str | None = None,
                 ack: Ack = "durable") -> None:
        self.writer = writer
        # Spans whose resource names no run are stamped with this receiver's run.
        self.run_id = run_id
        self.max_request_bytes = max_request_bytes
        self.max_queue_rows = max_queue_rows
        self.max_inflight_bytes = max_inflight_bytes or 2 * max_request_bytes
        self.ack = ack
        self.budget = ByteBudget(self.max_inflight_bytes)
        self.stats = ReceiverStats()
        self._executor = ThreadPoolExecutor(_DECODE_THREADS, "kvscope-receiver-decode")
        self._warned = False

    @asynccontextmanager
    async def admitted(self, nbytes: int, wait_s: float) -> AsyncIterator[Reservation]:
        """Hold ``nbytes`` of the in-flight budget while the request is handled.

        Waits up to ``wait_s`` for room (0: not at all), then raises a 503 :class:`Refused`.
        """
        if not await self.budget.acquire(nbytes, wait_s):
            raise busy(
                f"the receiver holds its limit of request bytes in flight "
                f"(max_inflight_bytes {self.max_inflight_bytes}); retry later")
        reservation = Reservation(self.budget, nbytes)
        self.count_bytes()
        try:
            yield reservation
        finally:
            held = reservation.nbytes
            reservation.close()
            self.count_bytes()
            if held >= _TRIM_AFTER_BYTES and self.budget.in_flight == 0:
                _give_back_freed_memory()

    def count_bytes(self) -> None:
        """Copy the budget's bytes held now (and most held) into the stats."""
        self.stats.inflight_bytes = self.budget.in_flight
        self.stats.peak_inflight_bytes = self.budget.peak

    async def export(self, signal_kind: Signal, body: bytes, encoding: Encoding,
                     gzipped: bool = False, reservation: Reservation | None = None) -> Message:
        """Decode ``body`` (inflated here when ``gzipped``), commit its rows, return the response.

        ``reservation`` is what :meth:`admitted` holds for this request; a gzip body grows it by
        the inflated size before inflating. Raises :class:`Refused` for a body over
        ``max_request_bytes`` (after decompression too), a malformed one, one that does not fit
        the in-flight budget now, or rows the store could not commit; nothing is stored then.
        """
        if len(body) > self.max_request_bytes:
            raise too_large(f"body exceeds max_request_bytes ({self.max_request_bytes} bytes)")
        loop = asyncio.get_running_loop()
        if gzipped:
            body = await self._inflate(loop, body, reservation)
            if reservation is not None:
                self.count_bytes()
        table, batch = await loop.run_in_executor(
            self._executor, self._decode, signal_kind, body, encoding
        )
        del body
        if self.ack == "durable":
            await self._commit(signal_kind, table)
        else:
            self._queue(signal_kind, table)
        if signal_kind == "traces":
            self.stats.spans_accepted += table.num_rows
            self.stats.spans_rejected += batch.rejected
            self.stats.values_truncated += batch.truncated
        else:
            self.stats.points_accepted += table.num_rows
            self.stats.points_rejected += batch.rejected
        response, partial_success, rejected_field = _RESPONSES[signal_kind]
        if not batch.rejected and not batch.truncated:
            return response()
        return response(partial_success=partial_success(
            **{rejected_field: batch.rejected}, error_message=batch.error_message))

    async def _inflate(self, loop: asyncio.AbstractEventLoop, body: bytes,
                       reservation: Reservation | None) -> bytes:
        """Inflate a gzip body, within ``max_request_bytes`` and the room the budget has."""
        limit = self.max_request_bytes
        if reservation is not None:
            held = reservation.grow_to(reservation.nbytes + limit)
            limit = min(limit, held - len(body))
        try:
            inflated = await loop.run_in_executor(self._executor, gunzip_limited, body, limit)
        except Refused as refused:
            if refused.status == 413 and limit < self.max_request_bytes:
                raise busy(
                    f"the inflated body does not fit the receiver's bytes in flight now "
                    f"(max_inflight_bytes {self.max_inflight_bytes}); retry later") from None
            raise
        if reservation is not None:
            reservation.shrink_to(len(body) + len(inflated))
        return inflated

    async def _commit(self, signal_kind: Signal, table: pa.Table) -> None:
        """Hand the rows to the writer and wait until they are committed."""
        done = self.writer.commit(TRACES_TABLE if signal_kind == "traces" else GAUGE_TABLE,
                                  table)
        if done is None:  # the writer is closed
            raise busy("the store writer is busy; retry later")
        try:
            await asyncio.wrap_future(done)
        except Exception as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise busy(f"the store could not write these rows ({reason}); retry later"
                       ) from None

    def _queue(self, signal_kind: Signal, table: pa.Table) -> None:
        """The earlier acknowledgement: once queued (rows bounded by the writer's queue)."""
        if table.num_rows > self.max_queue_rows:
            raise too_large(
                f"{table.num_rows} rows in one request exceed the receiver's queue of "
                f"{self.max_queue_rows}; send smaller batches"
            )
        submit = (
            self.writer.submit_traces if signal_kind == "traces" else self.writer.submit_gauge
        )
        # Requests still in flight during a stop are accepted: the writer closes after them.
        if not submit(table):
            raise busy("the store writer is busy; retry later")

    def count_refusal(self, refused: Refused) -> None:
        """Count a refusal by kind; log the first one that is not a busy writer."""
        if refused.status == 413:
            self.stats.too_large += 1
        elif refused.status == 415:
            self.stats.unsupported += 1
        elif refused.status == 503:
            self.stats.busy += 1
        else:
            self.stats.bad_requests += 1
        if not self._warned and refused.status != 503:
            self._warned = True
            logger.warning(
                "kvscope receiver refused a request (%d: %s); further refusals are counted in "
                "/health, not logged",
                refused.status,
                refused.message,
            )

    def shutdown(self) -> None:
        """Wait for decoding in progress to finish (blocking; after both listeners stopped)."""
        self._executor.shutdown()

    # --- decoding (on the executor) -------------------------------------------------------------

    def _decode(self, signal_kind: Signal, body: bytes, encoding: Encoding
                ) -> tuple[pa.Table, DecodedBatch[Any]]:
        try:
            batch = _DECODERS[signal_kind](body, encoding, self.run_id)
            return batch.to_arrow(), batch
        except PayloadError as exc:
            raise Refused(400, str(exc)) from None


__all__ = ["Ack", "Intake", "RETRY_AFTER_S", "ReceiverStats", "Refused", "Signal", "busy",
    "gunzip_limited", "too_large"]
