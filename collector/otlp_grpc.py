"""OTLP/gRPC for ``kvscope serve``: the trace and metrics services on the receiver's event loop.

The services are the ones ``opentelemetry-proto`` generates (``TraceService/Export``,
``MetricsService/Export``; names taken from its descriptors, the servicers derive from its
generated base classes) served by ``grpc.aio`` on the same loop, writer and
:class:`~kvscope.collector.otlp_intake.Intake` as OTLP/HTTP, so both transports share one
decoder, one set of limits and one store path.

Requests are registered with no deserializer: the handler receives the request's bytes, as
OTLP/HTTP does, which lets the intake decode them with its own fast path and lets a malformed
body be answered ``INVALID_ARGUMENT`` with the decoder's message (grpc's own deserializer would
answer ``INTERNAL``). gzip (and deflate) are inflated by grpc itself, whose
``grpc.max_receive_message_length`` is set to ``max_request_bytes``; the intake checks the
inflated size again. A call waits for one of :func:`concurrent_rpcs` slots (from that budget)
before grpc reads its message (:class:`_Slots`: waiting, a call holds at most its stream's 1 MiB
window, and is not refused); its message is then admitted by its bytes (``max_inflight_bytes``)
without waiting. A call whose message has not come within the body timeout loses its slot.
Refusals carry the ``google.rpc`` code of the HTTP refusal (the same numbers as gRPC's status
codes): INVALID_ARGUMENT, RESOURCE_EXHAUSTED, and UNAVAILABLE with a ``google.rpc.RetryInfo``
in the trailers, which the OTLP exporters honour.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvscope.collector.otlp_intake import RETRY_AFTER_S, Intake, Refused, Signal
from kvscope.errors import KvscopeError
from kvscope.serving import BODY_READ_TIMEOUT_S

_RETRY_INFO_KEY = "google.rpc.retryinfo-bin"
# Most calls whose messages grpc reads at once (the slots). Each may hold a message of up to
# max_request_bytes that grpc read before the intake's byte admission sees it, so
# :func:`concurrent_rpcs` sizes the slots to the budget.
GRPC_MAX_CONCURRENT_RPCS = 16
# Most calls grpc holds at once, served or waiting for a slot (:class:`_Slots`); past it grpc
# answers RESOURCE_EXHAUSTED itself (the Go exporters drop such a batch: it carries no
# RetryInfo). Each waiting call holds at most its stream's window.
GRPC_MAX_WAITING_RPCS = 64
# The receive window of each stream (grpc's lookahead; its bandwidth-delay probe is off).
GRPC_STREAM_WINDOW_BYTES = 1 << 20


def concurrent_rpcs(max_request_bytes: int, max_inflight_bytes: int | None) -> int:
    """Calls whose messages grpc may read at once (the slots): as many whole requests as the
    in-flight budget holds, at least 2 (a small request passes beside a big one) and at most
    :data:`GRPC_MAX_CONCURRENT_RPCS`.

    grpc reads a message whole before its handler runs, so what it holds beyond the budget is
    bounded by this many messages: 16 of 64 MiB once took 7.9 GB under 24 concurrent 60 MiB
    requests. One more than the budget holds (3 at the defaults) read a message the intake then
    refused, again and again under that load: peak +720..+892 MiB and 708 MiB held when idle,
    against +372..+440 and back to the base with 2 (docs/benchmarks.md). With the defaults (64
    MiB requests, 128 MiB budget) it is 2.
    """
    budget = max_inflight_bytes or 2 * max_request_bytes
    return max(2, min(GRPC_MAX_CONCURRENT_RPCS, budget // max(1, max_request_bytes)))
_STATUS_BY_CODE = {status.value[0]: status for status in grpc.StatusCode}


def grpc_target(host: str, port: int) -> str:
    """``host:port`` as gRPC writes an address (IPv6 literals in brackets)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    """``opentelemetry.proto.collector.trace.v1.TraceService`` over the shared intake."""

    def __init__(self, intake: Intake) -> None:
        self.intake = intake

    async def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC's name)
        return await _export(self.intake, "traces", request, context)


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    """``opentelemetry.proto.collector.metrics.v1.MetricsService`` over the shared intake."""

    def __init__(self, intake: Intake) -> None:
        self.intake = intake

    async def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC's name)
        return await _export(self.intake, "metrics", request, context)


async def _export(intake: Intake, signal_kind: Signal, body: bytes,
                  context: grpc.aio.ServicerContext[Any, Any]) -> Any:
    intake.stats.requests += 1
    try:
        # grpc has read the message already: its bytes are admitted now or refused (a wait
        # would hold them); the slots (_Slots) bound the messages it reads.
        async with intake.admitted(len(body), 0) as reservation:
            return await intake.export(signal_kind, body, "protobuf", reservation=reservation)
    except Refused as refused:
        intake.count_refusal(refused)
        trailers: tuple[tuple[str, bytes], ...] = ()
        if refused.code == grpc.StatusCode.UNAVAILABLE.value[0]:
            retry = RetryInfo(retry_delay=Duration(seconds=RETRY_AFTER_S))
            trailers = ((_RETRY_INFO_KEY, retry.SerializeToString()),)
        await context.abort(_STATUS_BY_CODE[refused.code], refused.message, trailers)


def _handler(service: Any, servicer: Any, response_class: Any) -> grpc.GenericRpcHandler:
    method = service.methods_by_name["Export"]
    return grpc.method_handlers_generic_handler(service.full_name, {
        method.name: grpc.unary_unary_rpc_method_handler(
            servicer.Export,
            request_deserializer=None,  # the intake decodes the bytes itself
            response_serializer=response_class.SerializeToString,
        ),
    })


class _Slots(grpc.aio.ServerInterceptor):
    """Calls wait here for one of ``slots`` before grpc reads their message (an interceptor runs
    when a call's headers arrive; grpc reads the request only once it returns): a waiting call
    holds at most its stream's receive window (:data:`GRPC_STREAM_WINDOW_BYTES`), not its
    message, and is not refused. A slot is freed when its call's task ends, however it ends
    (answered, refused, cancelled by the client's deadline); a call whose message has not
    arrived within ``read_timeout_s`` of taking its slot is cancelled (as OTLP/HTTP answers a
    body that slow 408), so slow senders cannot hold the slots."""

    def __init__(self, slots: int, read_timeout_s: float | None = None) -> None:
        self.slots = slots
        self.read_timeout_s = BODY_READ_TIMEOUT_S if read_timeout_s is None else read_timeout_s
        self.waiting = 0
        self.read_timeouts = 0
        self._free: asyncio.Semaphore | None = None

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        if self._free is None:
            self._free = asyncio.Semaphore(self.slots)
        free = self._free
        self.waiting += 1
        try:
            await free.acquire()
        finally:
            self.waiting -= 1
        task = asyncio.current_task()
        if task is None:  # not on a task: nothing would free the slot later
            free.release()
            return await continuation(details)
        task.add_done_callback(lambda _task: free.release())
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        arrived = False

        def too_slow() -> None:
            if not arrived and not task.done():
                self.read_timeouts += 1
                task.cancel()

        watchdog = asyncio.get_running_loop().call_later(self.read_timeout_s, too_slow)
        behaviour = handler.unary_unary

        async def received(request: Any, context: Any) -> Any:
            nonlocal arrived
            arrived = True
            watchdog.cancel()
            return await behaviour(request, context)

        return grpc.unary_unary_rpc_method_handler(
            received, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


class GrpcListener:
    """The OTLP/gRPC server of one receiver (bind, start and stop on the receiver's event loop).

    :meth:`bind` takes the port and nothing more (grpc binds when a port is added); the receiver
    opens its store only after both of its ports are bound, then :meth:`start` serves the
    intake. A start that cannot bind its gRPC port therefore leaves the store untouched.
    """

    def __init__(self, max_request_bytes: int, max_inflight_bytes: int | None = None) -> None:
        self.max_request_bytes = max_request_bytes
        self.max_concurrent_rpcs = concurrent_rpcs(max_request_bytes, max_inflight_bytes)
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._started = False

    async def bind(self, host: str, port: int) -> int:
        """Bind ``host:port`` without serving yet (0 picks a free port; returned and kept in
        :attr:`port`). Raises :class:`~kvscope.errors.KvscopeError` when it cannot be bound."""
        self.slots = _Slots(self.max_concurrent_rpcs)
        server = grpc.aio.server(interceptors=[self.slots],
                                 maximum_concurrent_rpcs=GRPC_MAX_WAITING_RPCS, options=[
            ("grpc.max_receive_message_length", self.max_request_bytes),
            # grpc sets SO_REUSEPORT by default, so a second server on a busy port would share
            # it silently instead of failing to start.
            ("grpc.so_reuseport", 0),
            # A fixed receive window per stream (1 MiB) instead of one that grpc's bandwidth-
            # delay probe grows: what calls waiting for a slot hold stays bounded (24
            # concurrent 60 MiB requests: +375 MiB peak; with 4 MiB windows +406..+424, with
            # the probe on and grpc refusing instead +546..+690). At 1 MiB a round trip a big
            # message still crosses a 50 ms link at ~20 MB/s.
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", GRPC_STREAM_WINDOW_BYTES),
        ])
        target = grpc_target(host, port)
        try:
            bound = server.add_insecure_port(target)
        except RuntimeError as exc:
            bound = 0
            reason = str(exc)
        else:
            reason = "address in use or not available"
        if not bound:
            await server.stop(None)
            raise KvscopeError(f"cannot listen for OTLP/gRPC on {target}: {reason}")
        self._server = server
        self.port = bound
        return bound

    async def start(self, intake: Intake) -> None:
        """Serve the trace and metrics services over ``intake`` on the port :meth:`bind` took."""
        if self._server is None:
            raise RuntimeError("OTLP/gRPC listener not bound")
        self._server.add_generic_rpc_handlers((
            _handler(trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"],
                     _TraceService(intake), trace_service_pb2.ExportTraceServiceResponse),
            _handler(metrics_service_pb2.DESCRIPTOR.services_by_name["MetricsService"],
                     _MetricsService(intake), metrics_service_pb2.ExportMetricsServiceResponse),
        ))
        await self._server.start()
        self._started = True

    async def stop(self, grace_s: float | None) -> None:
        """Refuse new calls at once and let calls in flight finish within ``grace_s`` (also
        releases a port bound but never served)."""
        if self._server is not None:
            if not self._started:
                # grpc releases a port it bound only when a started server stops (a server
                # stopped before it started keeps listening until the process ends); with no
                # services registered, a call in this instant is answered UNIMPLEMENTED.
                await self._server.start()
                self._started = True
            await self._server.stop(grace_s)
            self._server = None


__all__ = ["GRPC_MAX_CONCURRENT_RPCS", "GRPC_MAX_WAITING_RPCS", "GRPC_STREAM_WINDOW_BYTES",
    "GrpcListener", "concurrent_rpcs", "grpc_target"]
