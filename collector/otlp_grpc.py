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
inflated size again. Each message is admitted by its bytes (``max_inflight_bytes``) without
waiting, and :func:`concurrent_rpcs` (from that budget) bounds how many grpc holds at once.
Refusals carry the ``google.rpc`` code of the HTTP refusal (the same numbers as gRPC's status
codes): INVALID_ARGUMENT, RESOURCE_EXHAUSTED, and UNAVAILABLE with a ``google.rpc.RetryInfo``
in the trailers, which the OTLP exporters honour.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvscope.collector.otlp_intake import RETRY_AFTER_S, Intake, Refused, Signal
from kvscope.errors import KvscopeError

_RETRY_INFO_KEY = "google.rpc.retryinfo-bin"
# Most RPCs grpc serves at once; past it grpc answers RESOURCE_EXHAUSTED itself (the OTLP
# exporters retry it). Each may hold a message of up to max_request_bytes that grpc read before
# the intake's byte admission sees it, so :func:`concurrent_rpcs` sizes the limit to the budget.
GRPC_MAX_CONCURRENT_RPCS = 16
# The receive window of each stream (grpc's lookahead; its bandwidth-delay probe is off).
GRPC_STREAM_WINDOW_BYTES = 4 << 20


def concurrent_rpcs(max_request_bytes: int, max_inflight_bytes: int | None) -> int:
    """RPCs grpc may serve at once: as many whole requests as the in-flight budget holds, at
    least 2 (a small request passes beside a big one) and at most
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
        # would hold them); grpc's maximum_concurrent_rpcs bounds the messages it reads.
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
        server = grpc.aio.server(maximum_concurrent_rpcs=self.max_concurrent_rpcs, options=[
            ("grpc.max_receive_message_length", self.max_request_bytes),
            # grpc sets SO_REUSEPORT by default, so a second server on a busy port would share
            # it silently instead of failing to start.
            ("grpc.so_reuseport", 0),
            # A fixed receive window per stream (4 MiB) instead of one that grpc's bandwidth-
            # delay probe grows: the data of RPCs waiting or refused stays bounded (24
            # concurrent 60 MiB requests: +360 MiB peak instead of +546..+690). At 4 MiB a
            # round trip a big message still crosses a 50 ms link at ~80 MB/s.
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


__all__ = ["GRPC_MAX_CONCURRENT_RPCS", "GRPC_STREAM_WINDOW_BYTES", "GrpcListener",
    "concurrent_rpcs", "grpc_target"]
