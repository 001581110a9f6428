"""The receiver's one store path: decode an OTLP export body, check its limits, queue its rows.

Both transports of ``kvscope serve`` (OTLP/HTTP in :mod:`kvscope.collector.receiver`, OTLP/gRPC
in :mod:`kvscope.collector.otlp_grpc`) hand the uncompressed request body to :meth:`Intake.export`
and turn its answer into their own wire format: an ``Export*ServiceResponse`` (with
``partial_success`` when spans or points were rejected) or a :class:`Refused` carrying both the
HTTP status and the ``google.rpc`` code (the gRPC status code of the same number) of the refusal.

A request is decoded completely before anything is queued, so a refused request never touches
rows already stored or queued.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

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

from kvscope.collector.otlp_decode import Encoding, decode_metrics_request, decode_trace_request
from kvscope.errors import PayloadError
from kvscope.store.writer import StoreWriter

logger = logging.getLogger(__name__)

Signal = Literal["traces", "metrics"]
# How long a busy writer asks senders to wait: HTTP's Retry-After, gRPC's RetryInfo.
RETRY_AFTER_S = 1
# Decoding is CPU work under the GIL: one thread keeps the event loop answering (health, new
# requests) while a second would only contend with it; DuckDB's insert runs in parallel on the
# writer thread with the GIL released.
_DECODE_THREADS = 1


@dataclass
class ReceiverStats:
    """Counters of one receiver (both transports); ``GET /health`` reports them."""

    requests: int = 0
    spans_accepted: int = 0
    spans_rejected: int = 0
    points_accepted: int = 0
    points_rejected: int = 0
    bad_requests: int = 0
    too_large: int = 0
    unsupported: int = 0
    busy: int = 0


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
    """Decode, check and queue export requests for one store writer; count what happens."""

    def __init__(self, writer: StoreWriter, *, max_request_bytes: int, max_queue_rows: int,
                 run_id: str | None = None) -> None:
        self.writer = writer
        # Spans whose resource names no run are stamped with this receiver's run.
        self.run_id = run_id
        self.max_request_bytes = max_request_bytes
        self.max_queue_rows = max_queue_rows
        self.stats = ReceiverStats()
        self._executor = ThreadPoolExecutor(_DECODE_THREADS, "kvscope-receiver-decode")
        self._warned = False

    async def export(self, signal_kind: Signal, body: bytes, encoding: Encoding,
                     gzipped: bool = False) -> Message:
        """Decode ``body`` (inflated here when ``gzipped``), queue its rows, return the response.

        Raises :class:`Refused` for a body over ``max_request_bytes`` (after decompression too),
        a malformed one, one with more rows than the writer's whole queue, or a writer that
        cannot take the rows now; nothing is queued then.
        """
        if len(body) > self.max_request_bytes:
            raise too_large(f"body exceeds max_request_bytes ({self.max_request_bytes} bytes)")
        loop = asyncio.get_running_loop()
        work = self._decode_traces if signal_kind == "traces" else self._decode_metrics
        table, accepted, rejected, error_message = await loop.run_in_executor(
            self._executor, work, body, gzipped, encoding
        )
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
            raise Refused(503, "the store writer is busy; retry later", code_pb2.UNAVAILABLE)
        if signal_kind == "traces":
            self.stats.spans_accepted += accepted
            self.stats.spans_rejected += rejected
            return ExportTraceServiceResponse(
                partial_success=ExportTracePartialSuccess(
                    rejected_spans=rejected, error_message=error_message
                )
                if rejected
                else None
            )
        self.stats.points_accepted += accepted
        self.stats.points_rejected += rejected
        return ExportMetricsServiceResponse(
            partial_success=ExportMetricsPartialSuccess(
                rejected_data_points=rejected, error_message=error_message
            )
            if rejected
            else None
        )

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

    def _inflate(self, body: bytes, gzipped: bool) -> bytes:
        return gunzip_limited(body, self.max_request_bytes) if gzipped else body

    def _decode_traces(self, body: bytes, gzipped: bool, encoding: Encoding
                       ) -> tuple[pa.Table, int, int, str]:
        try:
            batch = decode_trace_request(self._inflate(body, gzipped), encoding, self.run_id)
            table = batch.to_arrow()
        except PayloadError as exc:
            raise Refused(400, str(exc)) from None
        return table, table.num_rows, batch.rejected_spans, batch.error_message

    def _decode_metrics(self, body: bytes, gzipped: bool, encoding: Encoding
                        ) -> tuple[pa.Table, int, int, str]:
        try:
            batch = decode_metrics_request(self._inflate(body, gzipped), encoding, self.run_id)
            table = batch.to_arrow()
        except PayloadError as exc:
            raise Refused(400, str(exc)) from None
        return table, table.num_rows, batch.rejected_points, batch.error_message


__all__ = [
    "RETRY_AFTER_S", "Intake", "ReceiverStats", "Refused", "Signal", "gunzip_limited",
    "too_large",
]
