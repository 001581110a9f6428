"""The proxy's HTTP server: vLLM's multi-turn P/D proxy protocol, instrumented.

Behaviour matches vLLM's ``disagg_proxy_multiturn.py`` (see ``shared/reference`` §6): round robin
over prefill and decode instances; prefill called non-streaming with ``max_tokens=1`` and
``max_completion_tokens``/``min_tokens``/``stream_options`` dropped; decode always streamed; the
client's stream is decode's bytes, written as they arrive; non-streaming clients get the body
vLLM's proxy rebuilds (``usage: None``). Decode servers older than vLLM 0.33 stream no
``kv_transfer_params`` (only a whole response carries them): the proxy asks each decode
instance's ``GET /version`` once and calls those non-streaming (``--decode-params``), replaying
the answer as SSE to a streaming client. kvscope adds: errors as OpenAI-style JSON with 400/502/504
instead of hangs or bare 500s, one ``X-Request-Id`` and a W3C ``traceparent`` per leg, the
``X-Session-ID`` header as a fallback conversation id, ``GET /metrics``, and telemetry drops in
``GET /health``. A client that disconnects, at any point of its turn, ends the turn's upstream
calls (:data:`SERVER_OPTIONS`) and its turn is recorded as ``client_disconnected`` (499).

One shared :class:`aiohttp.ClientSession` pools upstream connections. Telemetry on the request
path is a plain record (:class:`~kvscope.collector.proxy.telemetry.TurnRecord`); no store or
network I/O happens while a client waits.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import aiohttp
from aiohttp import web

from kvscope import semconv
from kvscope.collector.proxy.conversation import SESSION_HEADER, conversation_id_from
from kvscope.collector.proxy.telemetry import ProxyTelemetry, TurnRecord, set_reply_boundary
from kvscope.reuse.boundaries import BOUNDARY_HASHES_KEPT, message_boundaries, sse_event
from kvscope.reuse.params import (
    DECODE_PARAMS_AUTO,
    DECODE_PARAMS_MODES,
    DECODE_PARAMS_STREAM,
    streams_kv_transfer_params,
)
from kvscope.reuse.router import (
    GUARD_EDITED,
    GUARD_UNCHECKED,
    ConversationRouter,
    Lookup,
    blocks_in,
    guard,
    prefill_params,
)
from kvscope.serving import BODY_READ_TIMEOUT_S, one_line_malformed_requests

logger = logging.getLogger(__name__)
# Per-turn lines in vLLM's disagg_proxy_multiturn.py words (its troubleshooting greps them).
turn_log = logging.getLogger("kvscope.collector.proxy.turns")

# Fields vLLM's proxy removes from the prefill request (prefill produces one token only).
PREFILL_DROPPED_FIELDS = ("max_completion_tokens", "min_tokens", "stream_options")
# Agent prompts with long histories exceed aiohttp's 1 MiB default request size.
MAX_REQUEST_BYTES = 64 * 1024 * 1024
# How long decode's GET /version may take once connected (--decode-params auto). The
# connect timeout alone (10 s) was too short for vLLM's API process on a loaded host.
VERSION_READ_TIMEOUT_S = 60.0
_ROUTER_KEY = web.AppKey("router", ConversationRouter)
_TELEMETRY_KEY = web.AppKey("telemetry", ProxyTelemetry)


@dataclass(frozen=True, slots=True)
class Upstream:
    """One prefill or decode server."""

    host: str
    port: int

    @property
    def name(self) -> str:
        return f"{self.host}:{self.port}"

    def url(self, api_path: str) -> str:
        return f"http://{self.host}:{self.port}/v1{api_path}"


@dataclass(frozen=True)
class ProxyConfig:
    """What the proxy routes to and how long it waits."""

    prefillers: Sequence[Upstream]
    decoders: Sequence[Upstream]
    router_ttl_s: float = 450.0
    api_key: str | None = None
    connect_timeout_s: float = 10.0
    # Whole prefill call: queue + D->P pull + prefill of a long prompt.
    prefill_timeout_s: float = 600.0
    # Longest silence between two reads from decode's stream.
    decode_idle_timeout_s: float = 600.0
    max_request_bytes: int = MAX_REQUEST_BYTES
    # Send MISS params when the history does not continue the turn decode's params came from.
    reuse_guard: bool = False
    # Log each turn's cache HIT / MISS, "Prefill done in N ms", cached D blocks, as vLLM's proxy.
    log_turns: bool = True
    # One of DECODE_PARAMS_MODES.
    decode_params: str = DECODE_PARAMS_AUTO

    def __post_init__(self) -> None:
        if not self.prefillers or not self.decoders:
            raise ValueError("the proxy needs at least one prefill and one decode instance")
        if self.decode_params not in DECODE_PARAMS_MODES:
            raise ValueError(f"decode_params must be one of {', '.join(DECODE_PARAMS_MODES)}, "
                             f"not {self.decode_params!r}")


def _log_lookup(request_id: str, conversation_id: str | None, lookup: Lookup,
                ttl_s: float) -> None:
    """The router's own lines, as vLLM's ConversationKVCache.get and request handler log them."""
    if conversation_id is None:
        turn_log.warning(
            "[%s] No conversation_id provided — KV cache reuse disabled for this request. Add "
            "a 'conversation_id' field to enable cross-turn KV sharing.", request_id)
    elif lookup.result == semconv.ROUTER_HIT:
        turn_log.info("conv=%s: cache HIT (age=%.1fs)", conversation_id, lookup.age_s or 0.0)
    elif lookup.result == semconv.ROUTER_STALE:
        turn_log.info("conv=%s: stale cache entry (age=%.1fs > ttl=%.1fs), discarding",
                      conversation_id, lookup.age_s or 0.0, ttl_s)


def _log_offer(request_id: str, conversation_id: str | None, lookup: Lookup) -> None:
    """What prefill is sent: decode's cached blocks, or vLLM's MISS params."""
    if conversation_id is None:
        return
    if lookup.params:
        turn_log.info("[%s] conv=%s: sending D's cached blocks to P (remote_request_id=%s)",
                      request_id, conversation_id, lookup.params.get("remote_request_id"))
    else:
        turn_log.info("[%s] conv=%s: cache MISS", request_id, conversation_id)


async def _stream_error(response: web.StreamResponse, message: str, code: int,
                        error_type: str) -> None:
    """The error event vLLM's OpenAI server sends when a stream fails, then ``[DONE]``.

    Same shape as vLLM's ``create_streaming_error_response`` (an ``ErrorResponse``:
    ``{"error": {"message", "type", "param", "code"}}``), so a client can tell a broken
    stream from a finished one.
    """
    event = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    await response.write(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")


async def _end_broken_stream(response: web.StreamResponse, message: str, code: int,
                             error_type: str) -> None:
    """Tell the client its stream broke and end it; a client already gone is no error."""
    try:
        await _stream_error(response, message, code, error_type)
        await response.write_eof()
    except (ConnectionResetError, aiohttp.ClientConnectionResetError, RuntimeError):
        pass


class UpstreamFailure(Exception):
    """A leg failed before anything was sent to the client; becomes an error response."""

    def __init__(self, leg: str, kind: str, status: int, message: str, body: bytes = b"") -> None:
        super().__init__(message)
        self.leg, self.kind, self.status, self.message = leg, kind, status, message
        # An upstream 4xx is the client's mistake: its body goes back unchanged.
        self.body = body


def error_body(status: int, message: str, error_type: str) -> dict[str, Any]:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": error_type, "param": None, "code": status}}


def _error_response(status: int, message: str, error_type: str) -> web.Response:
    return web.json_response(error_body(status, message, error_type), status=status)


def _storable(text: str) -> str:
    """``text`` as it can be stored: lone surrogates (JSON's ``\\ud800``, no UTF-8 for them)
    replaced, so that one client's string cannot fail the store insert of a batch of spans."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


def _tracestate(header: str | None) -> str | None:
    """A W3C ``tracestate`` (printable ASCII) to keep and forward; anything else is dropped (a
    non-ASCII byte arrives as a surrogate, which could be neither stored nor sent)."""
    if header and header.isascii() and header.isprintable():
        return header
    return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _cached_tokens(usage: dict[str, Any], known: int | None) -> int | None:
    """A usage's ``prompt_tokens_details.cached_tokens`` (vLLM with
    ``--enable-prompt-tokens-details``); ``known`` where the usage has no details."""
    details = usage.get("prompt_tokens_details")
    return _int(details.get("cached_tokens")) if isinstance(details, dict) else known


class DecodeStream:
    """Reads decode's SSE bytes on the side: events, kv_transfer_params, usage, text.

    The bytes themselves go to the client untouched; this only looks. JSON is parsed only for
    events that can carry something the proxy needs, unless the text must be collected for a
    non-streaming client.
    """

    def __init__(self, collect_text: bool, keep_payloads: bool = False) -> None:
        self.collect_text = collect_text
        # A chat reply's events, kept as bytes for its boundary hash (parsed after the turn).
        self.payloads: list[bytes] | None = [] if keep_payloads else None
        self._pending = b""
        self.events = 0
        self.first_event_ns: int | None = None
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None  # the stop string that ended it, if one did
        self.response_id: str | None = None
        self.model: str | None = None
        self.created: int | None = None
        self.completion_tokens: int | None = None
        self.cached_tokens: int | None = None  # decode's usage.prompt_tokens_details
        self.done = False

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        """Consume bytes; return the kv_transfer_params dicts completed in them."""
        data = self._pending + chunk
        lines = data.split(b"\n")
        self._pending = lines.pop()
        found: list[dict[str, Any]] = []
        for line in lines:
            params = self._line(line.rstrip(b"\r"))
            if params:
                found.append(params)
        return found

    def close(self) -> list[dict[str, Any]]:
        """Consume what is left when the stream ends without a final newline."""
        rest, self._pending = self._pending, b""
        params = self._line(rest.rstrip(b"\r")) if rest else None
        return [params] if params else []

    def _line(self, line: bytes) -> dict[str, Any] | None:
        if not line.startswith(b"data:"):
            return None
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return None
        self.events += 1
        if self.payloads is not None:
            self.payloads.append(payload)
        if self.first_event_ns is None:
            self.first_event_ns = time.time_ns()
        if not (
            self.collect_text
            or self.response_id is None
            or b"kv_transfer_params" in payload
            or b'"usage"' in payload
            or b'"finish_reason":"' in payload
            or b'"finish_reason": "' in payload
        ):
            return None
        event = sse_event(payload)
        if event is None:
            return None
        if self.response_id is None:
            self.response_id = event.get("id")
            self.model = event.get("model")
            self.created = _int(event.get("created"))
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if self.collect_text:
                text = choice.get("text")
                if isinstance(text, str):
                    self.text.append(text)
                delta = choice.get("delta")
                if isinstance(delta, dict) and isinstance(delta.get("content"), str):
                    self.text.append(delta["content"])
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
                stop = choice.get("stop_reason")
                self.stop_reason = stop if isinstance(stop, str) else None
        usage = event.get("usage")
        if isinstance(usage, dict):
            self.completion_tokens = _int(usage.get("completion_tokens"))
            self.cached_tokens = _cached_tokens(usage, self.cached_tokens)
        params = event.get("kv_transfer_params")
        return params if isinstance(params, dict) and params else None


class Proxy:
    """Request handlers and shared state of one proxy process."""

    def __init__(self, config: ProxyConfig, telemetry: ProxyTelemetry,
                 on_routed: Callable[[TurnRecord, Lookup], None] | None = None) -> None:
        self.config = config
        self.telemetry = telemetry
        # Called with each turn's record once the router (and the guard) chose prefill's params,
        # before prefill is called, and the router's lookup before the guard judged it: the
        # emulator's ground truth records the router's facts.
        self._on_routed = on_routed
        self.router = ConversationRouter(config.router_ttl_s)
        self._prefill_cycle: Iterator[Upstream] = itertools.cycle(config.prefillers)
        self._decode_cycle: Iterator[Upstream] = itertools.cycle(config.decoders)
        self._session: aiohttp.ClientSession | None = None
        self._prefill_timeout = aiohttp.ClientTimeout(
            total=config.prefill_timeout_s, sock_connect=config.connect_timeout_s
        )
        self._decode_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s,
            sock_read=config.decode_idle_timeout_s,
        )
        # --decode-params auto: whether each decode instance streams its params, once known.
        self._params_streamed: dict[Upstream, bool] = {}

    # -- lifecycle -------------------------------------------------------------------------------
    async def _client_session(self, app: web.Application) -> AsyncIterator[None]:
        # No pool limit: a cap here would queue turns invisibly behind one another.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
        self._session = aiohttp.ClientSession(connector=connector)
        try:
            yield
        finally:
            await self._session.close()
            self._session = None

    def application(self) -> web.Application:
        """The aiohttp application serving the proxy routes."""
        app = web.Application(client_max_size=self.config.max_request_bytes)
        app[_ROUTER_KEY] = self.router
        app[_TELEMETRY_KEY] = self.telemetry
        app.cleanup_ctx.append(self._client_session)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        return app

    # -- routes ----------------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/completions")

    async def health(self, request: web.Request) -> web.Response:
        evicted = self.router.evict_stale()
        return web.json_response(
            {
                "status": "ok",
                "cached_conversations": self.router.size,
                "evicted_stale": evicted,
                "telemetry": self.telemetry.telemetry_counts(),
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models`` (what OpenAI clients and gateways probe): decode's answer, relayed."""
        decode = self.config.decoders[0]
        try:
            async with self._session_or_fail().get(
                decode.url("/models"), timeout=self._prefill_timeout,
                headers=({"Authorization": f"Bearer {self.config.api_key}"}
                         if self.config.api_key else None),
            ) as resp:
                body = await resp.read()
                return web.Response(body=body, status=resp.status,
                                    content_type=resp.content_type or "application/json")
        except (TimeoutError, aiohttp.ClientError) as exc:
            return _error_response(502, f"decode {decode.name} unreachable: {exc}",
                                   "BadGatewayError")

    async def metrics(self, request: web.Request) -> web.Response:
        # Rendering takes milliseconds (every label set's buckets): on a thread, so the event
        # loop keeps serving turns between its GIL slices.
        body, content_type = await asyncio.get_running_loop().run_in_executor(
            None, self.telemetry.render_metrics, lambda: self.router.size,
            request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    # -- one turn --------------------------------------------------------------------------------
    async def _handle(self, request: web.Request, api_path: str) -> web.StreamResponse:
        record = self.telemetry.begin_turn(
            request.path,
            str(uuid.uuid4()),
            request.headers.get("traceparent"),
            _tracestate(request.headers.get("tracestate")),
        )
        try:
            return await self._turn(request, api_path, record)
        except asyncio.CancelledError:
            # The client disconnected (SERVER_OPTIONS), or the server is stopping.
            if record.decode_start_ns is not None:
                when = "during the decode leg"
            elif record.prefill_start_ns is not None:
                when = "during the prefill leg"
            elif not request.content.is_eof():
                when = "while sending its request"
            else:
                when = "during the turn"
            self._client_left(request, record, when)
            raise
        finally:
            record.end_ns = time.time_ns()
            self.telemetry.finish_turn(record)

    @staticmethod
    def _client_left(request: web.Request, record: TurnRecord, when: str) -> None:
        """Record that the client disconnected (the first failure stays the turn's cause)."""
        if record.error_kind is None:
            logger.info("kvscope proxy: client %s disconnected %s (X-Request-Id %s)",
                        request.remote, when, record.x_request_id)
        record.client_disconnected = True
        record.fail(None, semconv.ERROR_CLIENT_DISCONNECTED, 499, f"client disconnected {when}")

    async def _turn(
        self, request: web.Request, api_path: str, record: TurnRecord
    ) -> web.StreamResponse:
        try:
            body = json.loads(await asyncio.wait_for(request.read(), BODY_READ_TIMEOUT_S))
        except TimeoutError:
            # A client holding a partial body must not hold a connection for ever.
            record.fail(None, semconv.ERROR_TIMEOUT, 408,
                        f"request body not received within {BODY_READ_TIMEOUT_S:g} s")
            return _error_response(408, record.error_message, "RequestTimeoutError")
        except ConnectionError:
            # The client went while sending its body: its turn, and one line to say so (not
            # aiohttp's traceback). Nothing reaches the client; the answer only ends the handler.
            self._client_left(request, record, "while sending its request")
            return web.Response(status=499)
        except web.HTTPRequestEntityTooLarge:
            record.fail(None, semconv.ERROR_BAD_REQUEST, 413, "request body too large")
            return _error_response(413, "request body too large", "BadRequestError")
        except (ValueError, UnicodeDecodeError) as exc:
            record.fail(None, semconv.ERROR_BAD_REQUEST, 400, "malformed JSON")
            return _error_response(400, f"request body is not valid JSON: {exc}",
                                   "BadRequestError")
        except RecursionError:
            # Python's JSON decoder gives up on deep nesting (thousands of levels) with a
            # RecursionError, not a ValueError: the client's mistake all the same.
            record.fail(None, semconv.ERROR_BAD_REQUEST, 400, "JSON nested too deeply")
            return _error_response(400, "request body is JSON nested too deeply",
                                   "BadRequestError")
        if not isinstance(body, dict):
            record.fail(None, semconv.ERROR_BAD_REQUEST, 400, "body is not a JSON object")
            return _error_response(400, "request body must be a JSON object", "BadRequestError")

        conversation = conversation_id_from(body, request.headers.get(SESSION_HEADER))
        self.telemetry.conversation_started(record, conversation)
        client_wants_stream = bool(body.get("stream", False))
        record.stream = client_wants_stream
        model = body.get("model")
        record.model = _storable(model) if isinstance(model, str) else None
        lookup = self.router.lookup(conversation.value)
        record.lookup, record.lookup_age_s = lookup.result, lookup.age_s
        if self.config.log_turns:
            _log_lookup(record.x_request_id, conversation.value, lookup, self.router.ttl_s)
        hashed = False
        entry = lookup
        if self.config.reuse_guard:
            lookup, hashed = self._guard(body, lookup, record)
        if self.telemetry.enabled and not hashed:  # the guard's pass fills the span's hashes
            self.telemetry.message_boundaries(record, body)
        if self.config.log_turns:
            _log_offer(record.x_request_id, conversation.value, lookup)
        body["kv_transfer_params"] = prefill_params(lookup)
        if lookup.params is not None:
            record.d_metadata_attached = True
            offered = lookup.params.get("remote_request_id")
            record.offered_request_id = offered if isinstance(offered, str) else None
            record.offered_tokens = _int(lookup.params.get("remote_num_tokens"))
        if self._on_routed is not None:
            self._on_routed(record, entry)

        # The reply's boundary hash (a chat of one choice): for the guard's next check, and
        # for the ledger's when telemetry is on.
        reply = (isinstance(body.get("messages"), list) and body.get("n") in (None, 1)
                 and (self.config.reuse_guard or self.telemetry.enabled))
        whole: dict[str, Any] | None = None
        try:
            await self._prefill(api_path, body, record)
            decode = next(self._decode_cycle)
            if await self._streams_params(decode):
                response = await self._open_decode(api_path, body, record, decode,
                                                   include_usage=not client_wants_stream)
            else:
                whole = await self._decode_whole(api_path, body, record, decode)
        except UpstreamFailure as failure:
            record.fail(failure.leg, failure.kind, failure.status, failure.message)
            if failure.body:
                return web.Response(body=failure.body, status=failure.status,
                                    content_type="application/json")
            error_type = "GatewayTimeoutError" if failure.status == 504 else "BadGatewayError"
            return _error_response(failure.status, failure.message, error_type)

        if whole is not None:
            self._whole_ended(whole, conversation.value, decode, record)
            if reply:
                self._reply_ended(record, _whole_reply(whole, record.retention_returned),
                                  conversation.value)
            if client_wants_stream:
                return await self._replay_as_stream(request, whole, body, record)
            return web.json_response(whole)
        stream = DecodeStream(collect_text=not client_wants_stream,
                              keep_payloads=reply and client_wants_stream)
        if client_wants_stream:
            return await self._relay_stream(
                request, response, decode, stream, conversation.value, record
            )
        return await self._collect(response, decode, stream, conversation.value, body, record,
                                   reply)

    def _guard(self, body: dict[str, Any], lookup: Lookup,
               record: TurnRecord) -> tuple[Lookup, bool]:
        """--reuse-guard: keep decode's params only for a request that continues their turn;
        also whether it hashed the messages (then into the turn's boundaries too).

        Hashes every message of the request (~0.9 ms for 500 KB; the guard is opt-in). An
        edited history, a retry from an earlier point or another client's request under the
        same conversation id gets vLLM's MISS params: prefill computes, nothing is loaded.
        """
        if not isinstance(body.get("messages"), list):
            # A completions prompt is one message whose text grows: its hash cannot show a
            # continuation, so the guard does not judge it.
            record.reuse_guard = GUARD_UNCHECKED if lookup.params is not None else None
            return lookup, False
        key = self.telemetry.boundary_key
        try:
            count, hashes, roles = message_boundaries(body, key)
        except Exception:  # messages that do not hash (nested past the recursion limit)
            logger.debug("reuse guard: the request's messages do not hash", exc_info=True)
            record.reuse_guard = GUARD_UNCHECKED if lookup.params is not None else None
            return lookup, False
        chain = hashes.split(",") if hashes else []
        record.history_last = chain[-1] if chain else None
        if self.telemetry.enabled:
            # The turn's span keeps the last hashes: hashed here once, not again for telemetry.
            record.message_count = count
            record.boundary_key_id = key.key_id
            record.boundary_hashes = ",".join(chain[-BOUNDARY_HASHES_KEPT:])
            record.boundary_roles = roles[-BOUNDARY_HASHES_KEPT:]
            record.boundary_source = None
        if lookup.params is None:
            return lookup, True
        record.reuse_guard = guard(lookup, chain, roles)
        if record.reuse_guard == GUARD_EDITED:
            # A turn line (shown with the router's lines, read back by kvscope ingest).
            turn_log.info("[%s] reuse guard: conversation history edited since the turn of "
                          "decode's params; sending MISS params", record.x_request_id)
            return Lookup(lookup.result, lookup.age_s), True
        return lookup, True

    def _headers(self, record: TurnRecord, traceparent: str) -> dict[str, str]:
        headers = {
            "X-Request-Id": record.x_request_id,
            "Content-Type": "application/json",
            "Accept-Encoding": "identity",
            "traceparent": traceparent,
        }
        if record.tracestate:
            headers["tracestate"] = record.tracestate
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        return headers

    def _session_or_fail(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("proxy application is not running (no client session)")
        return self._session

    async def _prefill(self, api_path: str, body: dict[str, Any], record: TurnRecord) -> None:
        """Call prefill (non-streaming, one token) and attach its params to ``body`` for decode."""
        payload = dict(body)
        payload["stream"] = False
        payload["max_tokens"] = 1
        for name in PREFILL_DROPPED_FIELDS:
            payload.pop(name, None)
        prefill = next(self._prefill_cycle)
        record.prefill_instance = prefill.name
        leg = semconv.LEG_PREFILL
        status, raw = await self._post_whole(leg, prefill, api_path, payload, record)
        if self.config.log_turns:
            turn_log.info("[%s] Prefill done in %.0fms", record.x_request_id,
                          (record.prefill_end_ns - record.prefill_start_ns) / 1e6)
        answer = _json_object(leg, prefill, status, raw)
        usage = answer.get("usage")
        if isinstance(usage, dict):
            record.prompt_tokens = _int(usage.get("prompt_tokens"))
            record.cached_tokens = _cached_tokens(usage, record.cached_tokens)
        p_params = answer.get("kv_transfer_params")
        if isinstance(p_params, dict) and p_params:
            p_params["remote_host"] = prefill.host
            request_id = p_params.get("remote_request_id")
            record.prefill_request_id = request_id if isinstance(request_id, str) else None
            body["kv_transfer_params"] = p_params

    async def _streams_params(self, decode: Upstream) -> bool:
        """Whether ``decode`` puts its kv_transfer_params on its stream (vLLM >= 0.33).

        ``--decode-params auto`` asks the instance's ``GET /version`` once: a version before
        0.33 answers non-streaming from then on; an answer with no version keeps vLLM's
        proxy's streamed call. An instance that accepts the connection but does not answer
        within ``VERSION_READ_TIMEOUT_S`` (a loaded server's API process can be slow) is called
        non-streaming from then on, which carries decode's params on either version; an
        unreachable one is asked again at the next turn (the turn's own call says why).
        """
        mode = self.config.decode_params
        if mode != DECODE_PARAMS_AUTO:
            return mode == DECODE_PARAMS_STREAM
        known = self._params_streamed.get(decode)
        if known is not None:
            return known
        version: str | None = None
        try:
            async with self._session_or_fail().get(
                f"http://{decode.host}:{decode.port}/version",
                timeout=aiohttp.ClientTimeout(total=None,
                                              sock_connect=self.config.connect_timeout_s,
                                              sock_read=VERSION_READ_TIMEOUT_S),
                headers=({"Authorization": f"Bearer {self.config.api_key}"}
                         if self.config.api_key else None),
            ) as resp:
                if resp.status == 200:
                    answer = await resp.json(content_type=None)
                    if isinstance(answer, dict) and isinstance(answer.get("version"), str):
                        version = answer["version"]
        except aiohttp.SocketTimeoutError:
            logger.warning(
                "decode %s accepted GET /version but did not answer within %g s: calling it "
                "non-streaming from now on (its whole answer carries its kv_transfer_params "
                "on any vLLM version; streaming clients get it as one SSE event, with no TTFT "
                "measured; --decode-params stream overrides)", decode.name,
                VERSION_READ_TIMEOUT_S)
            self._params_streamed[decode] = False
            return False
        except (TimeoutError, aiohttp.ClientError):
            return True  # decode is unreachable: the turn's own call says so
        except ValueError:
            pass  # a body that is not JSON: no version
        streamed = streams_kv_transfer_params(version)
        if streamed is False:
            logger.warning(
                "decode %s runs vLLM %s, whose streamed responses carry no kv_transfer_params: "
                "calling it non-streaming (streaming clients get its answer as one SSE event; "
                "the proxy measures no TTFT for them)", decode.name, version)
        self._params_streamed[decode] = streamed is not False
        return streamed is not False

    async def _open_decode(
        self, api_path: str, body: dict[str, Any], record: TurnRecord, decode: Upstream,
        include_usage: bool,
    ) -> aiohttp.ClientResponse:
        """Start decode's stream; fail before the client sees anything when it cannot start.

        ``include_usage`` asks decode for its trailing usage event (a non-streaming client's
        turn: the proxy rebuilds that client's body, so the event reaches no one, and the
        turn's output tokens are known).
        """
        payload = dict(body)
        payload["stream"] = True
        if include_usage:
            payload["stream_options"] = {"include_usage": True}
        record.decode_instance = decode.name
        record.decode_start_ns = time.time_ns()
        leg = semconv.LEG_DECODE
        try:
            resp = await self._session_or_fail().post(
                decode.url(api_path),
                data=json.dumps(payload).encode(),
                headers=self._headers(record, record.decode_traceparent()),
                timeout=self._decode_timeout,
            )
        except TimeoutError as exc:
            record.decode_end_ns = time.time_ns()
            raise UpstreamFailure(leg, semconv.ERROR_TIMEOUT, 504,
                                  f"decode {decode.name} timed out") from exc
        except aiohttp.ClientError as exc:
            record.decode_end_ns = time.time_ns()
            raise UpstreamFailure(leg, semconv.ERROR_CONNECT, 502,
                                  f"decode {decode.name} unreachable: {exc}") from exc
        if resp.status >= 400:
            try:
                raw = await resp.read()
            except (TimeoutError, aiohttp.ClientError):
                raw = b""
            finally:
                resp.release()
                record.decode_end_ns = time.time_ns()
            _check_status(leg, decode, resp.status, raw)
        return resp

    async def _decode_whole(
        self, api_path: str, body: dict[str, Any], record: TurnRecord, decode: Upstream
    ) -> dict[str, Any]:
        """Call decode non-streaming (vLLM < 0.33: only its whole answer carries its params)."""
        payload = dict(body)
        payload["stream"] = False
        payload.pop("stream_options", None)  # vLLM refuses it on a non-streaming request
        record.decode_instance = decode.name
        record.decode_streamed = False
        leg = semconv.LEG_DECODE
        status, raw = await self._post_whole(leg, decode, api_path, payload, record)
        return _json_object(leg, decode, status, raw)

    async def _post_whole(self, leg: str, upstream: Upstream, api_path: str,
                          payload: dict[str, Any], record: TurnRecord) -> tuple[int, bytes]:
        """POST ``payload`` to ``upstream`` as ``leg`` and read its whole answer: (status,
        body). The leg's start and end times are kept on ``record``, however the call ends."""
        prefill = leg == semconv.LEG_PREFILL
        if prefill:
            record.prefill_start_ns = time.time_ns()
        else:
            record.decode_start_ns = time.time_ns()
        try:
            async with self._session_or_fail().post(
                upstream.url(api_path),
                data=json.dumps(payload).encode(),
                headers=self._headers(record, record.prefill_traceparent() if prefill
                                      else record.decode_traceparent()),
                timeout=self._prefill_timeout if prefill else self._decode_timeout,
            ) as resp:
                return resp.status, await resp.read()
        except TimeoutError as exc:
            raise UpstreamFailure(leg, semconv.ERROR_TIMEOUT, 504,
                                  f"{leg} {upstream.name} timed out") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamFailure(leg, semconv.ERROR_CONNECT, 502,
                                  f"{leg} {upstream.name} unreachable: {exc}") from exc
        finally:
            if prefill:
                record.prefill_end_ns = time.time_ns()
            else:
                record.decode_end_ns = time.time_ns()

    def _whole_ended(self, answer: dict[str, Any], conversation_id: str | None,
                     decode: Upstream, record: TurnRecord) -> None:
        """Take decode's params, output tokens and finish reasons from its whole answer; the
        params leave the answer (the client never sees decode's blocks, as with a stream)."""
        params = answer.pop("kv_transfer_params", None)
        if isinstance(params, dict) and params:
            self._keep_params([params], conversation_id, decode, record)
        usage = answer.get("usage")
        if isinstance(usage, dict):
            record.output_tokens = _int(usage.get("completion_tokens"))
        reasons = [str(c["finish_reason"]) for c in answer.get("choices") or ()
                   if isinstance(c, dict) and c.get("finish_reason")]
        if reasons:
            record.finish_reasons = reasons

    async def _replay_as_stream(self, request: web.Request, answer: dict[str, Any],
                                body: dict[str, Any], record: TurnRecord) -> web.StreamResponse:
        """A streaming client's SSE from decode's whole answer: one event per choice, the usage
        event when the client asked for it (``stream_options.include_usage``), ``[DONE]``."""
        response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        try:
            await response.prepare(request)
            for event in sse_events(answer, body):
                await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                record.chunks = (record.chunks or 0) + 1
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
            self._client_left(request, record, f"during the answer's stream ({exc or 'reset'})")
        return response

    def _reply_ended(self, record: TurnRecord, source: str | tuple[bytes, ...] | None,
                     conversation_id: str | None) -> None:
        """Keep what decode's reply is hashed from; with the guard, hash it now and give it to
        the router entry, before the client can send its next turn."""
        if source is None or record.error_kind is not None:
            return
        record.reply_source = source
        if self.config.reuse_guard and record.history_last is not None:
            try:
                set_reply_boundary(record, self.telemetry.boundary_key)
            except Exception:  # the guard never breaks a turn: the next is checked as before
                logger.debug("reuse guard: the reply does not hash", exc_info=True)
                record.reply_source = None
            if conversation_id is not None and record.reply_hash is not None:
                self.router.set_reply(conversation_id, record.history_last, record.reply_hash)

    def _keep_params(
        self, found: list[dict[str, Any]], conversation_id: str | None, decode: Upstream,
        record: TurnRecord,
    ) -> None:
        for params in found:
            record.retention_returned = True
            record.remote_num_tokens = _int(params.get("remote_num_tokens"))
            record.retention_blocks = blocks_in(params)
            request_id = params.get("remote_request_id")
            record.decode_request_id = request_id if isinstance(request_id, str) else None
            if conversation_id is not None:
                self.router.put(conversation_id, params, decode.host, record.history_last)
                if self.config.log_turns:
                    turn_log.info("conv=%s: cached D blocks (remote_request_id=%s, blocks=%d)",
                                  conversation_id, params.get("remote_request_id", "?"),
                                  record.retention_blocks or 0)

    def _stream_ended(self, stream: DecodeStream, record: TurnRecord) -> None:
        record.decode_end_ns = time.time_ns()
        record.first_token_ns = stream.first_event_ns
        record.chunks = stream.events
        record.output_tokens = stream.completion_tokens
        record.decode_cached_tokens = stream.cached_tokens
        if stream.finish_reason is not None:
            record.finish_reasons = [stream.finish_reason]

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        decode: Upstream,
        stream: DecodeStream,
        conversation_id: str | None,
        record: TurnRecord,
    ) -> web.StreamResponse:
        """Write decode's bytes to the client as they arrive, looking at them on the side."""
        response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        try:
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                # Looked at before the client has it: the router entry (and the reply's hash)
                # is in place before the client can send its next turn.
                found = stream.feed(chunk)
                if found:
                    self._keep_params(found, conversation_id, decode, record)
                if stream.done and stream.payloads is not None:
                    self._reply_ended(record, tuple(stream.payloads), conversation_id)
                    stream.payloads = None
                await response.write(chunk)
            self._keep_params(stream.close(), conversation_id, decode, record)
            if stream.done and stream.payloads is not None:  # [DONE] without a newline
                self._reply_ended(record, tuple(stream.payloads), conversation_id)
            if not stream.done:
                record.fail(semconv.LEG_DECODE, semconv.ERROR_PROTOCOL, 200,
                            f"decode {decode.name} ended its stream without [DONE]")
                await _stream_error(response, record.error_message, 502, "BadGatewayError")
            await response.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError) as exc:
            # The client left: closing (not releasing) drops the upstream connection, which is
            # how vLLM learns to abort the request.
            self._client_left(request, record, f"during decode's stream ({exc or 'reset'})")
        except TimeoutError:
            record.fail(semconv.LEG_DECODE, semconv.ERROR_TIMEOUT, 200,
                        f"decode {decode.name} went silent mid-stream")
            await _end_broken_stream(response, record.error_message, 504, "GatewayTimeoutError")
        except aiohttp.ClientError as exc:
            record.fail(semconv.LEG_DECODE, semconv.ERROR_CONNECT, 200,
                        f"decode {decode.name} failed mid-stream: {exc}")
            await _end_broken_stream(response, record.error_message, 502, "BadGatewayError")
        finally:
            upstream.close()
            self._stream_ended(stream, record)
        return response

    async def _collect(
        self,
        upstream: aiohttp.ClientResponse,
        decode: Upstream,
        stream: DecodeStream,
        conversation_id: str | None,
        body: dict[str, Any],
        record: TurnRecord,
        reply: bool = False,
    ) -> web.StreamResponse:
        """Read decode's whole stream and answer with the body vLLM's proxy builds."""
        try:
            async for chunk in upstream.content.iter_any():
                found = stream.feed(chunk)
                if found:
                    self._keep_params(found, conversation_id, decode, record)
                if stream.done:
                    break
            self._keep_params(stream.close(), conversation_id, decode, record)
        except TimeoutError:
            record.fail(semconv.LEG_DECODE, semconv.ERROR_TIMEOUT, 504,
                        f"decode {decode.name} went silent mid-stream")
            return _error_response(504, record.error_message, "GatewayTimeoutError")
        except aiohttp.ClientError as exc:
            record.fail(semconv.LEG_DECODE, semconv.ERROR_CONNECT, 502,
                        f"decode {decode.name} failed mid-stream: {exc}")
            return _error_response(502, record.error_message, "BadGatewayError")
        finally:
            upstream.close()
            self._stream_ended(stream, record)
        text = "".join(stream.text)
        if reply:
            kept = record.retention_returned and stream.stop_reason or ""
            self._reply_ended(record, text + kept, conversation_id)
        model = stream.model or body.get("model", "")
        created = stream.created or int(time.time())
        response_id = stream.response_id or record.x_request_id
        if "messages" in body:
            answer: dict[str, Any] = {
                "id": response_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": stream.finish_reason,
                    }
                ],
                "usage": None,
            }
        else:
            answer = {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": stream.finish_reason,
                    }
                ],
                "usage": None,
            }
        return web.json_response(answer)


def _whole_reply(answer: Mapping[str, Any], kept: bool) -> str | None:
    """A whole chat answer's reply text, when it is one plain-text message, with the stop
    string that ended it where decode ``kept`` its KV (see reply_text)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message")
    if not isinstance(message, dict) or message.get("tool_calls"):
        return None
    content = message.get("content")
    stop = choices[0].get("stop_reason")  # decode holds the stop string the text leaves out
    if isinstance(content, str):
        return content + stop if kept and isinstance(stop, str) else content
    return None


def sse_events(answer: Mapping[str, Any], body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The SSE events of a whole chat or text completion ``answer``, as a stream of it would
    end: each choice's message as one delta (or text), then the usage event when the request's
    ``stream_options`` asked for it."""
    chat = answer.get("object") == "chat.completion"
    head = {"id": answer.get("id"),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer.get("created"), "model": answer.get("model")}
    events: list[dict[str, Any]] = []
    for choice in answer.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if chat:
            message = choice.get("message")
            delta = ({k: v for k, v in message.items() if v is not None}
                     if isinstance(message, dict) else {})
            tool_calls = delta.get("tool_calls")
            if isinstance(tool_calls, list):  # a streamed tool call names its position
                delta["tool_calls"] = [dict(call, index=i) if isinstance(call, dict) else call
                                       for i, call in enumerate(tool_calls)]
            if not tool_calls:
                delta.pop("tool_calls", None)
            out = {"index": choice.get("index", 0), "delta": delta}
        else:
            out = {"index": choice.get("index", 0), "text": choice.get("text", "")}
        out["logprobs"] = choice.get("logprobs")
        out["finish_reason"] = choice.get("finish_reason")
        if "stop_reason" in choice:
            out["stop_reason"] = choice["stop_reason"]
        events.append({**head, "choices": [out]})
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") and answer.get("usage"):
        events.append({**head, "choices": [], "usage": answer["usage"]})
    return events


def _json_object(leg: str, upstream: Upstream, status: int, raw: bytes) -> dict[str, Any]:
    """An upstream's whole answer as a JSON object, or the failure it is."""
    _check_status(leg, upstream, status, raw)
    try:
        answer = json.loads(raw)
    except ValueError as exc:
        raise UpstreamFailure(leg, semconv.ERROR_PROTOCOL, 502,
                              f"{leg} {upstream.name} returned invalid JSON") from exc
    if not isinstance(answer, dict):
        raise UpstreamFailure(leg, semconv.ERROR_PROTOCOL, 502,
                              f"{leg} {upstream.name} returned a non-object")
    return answer


def _check_status(leg: str, upstream: Upstream, status: int, raw: bytes) -> None:
    if status < 400:
        return
    if status < 500:
        # The upstream refused the request itself (validation): pass its answer through.
        raise UpstreamFailure(leg, semconv.ERROR_UPSTREAM_STATUS, status,
                              f"{leg} {upstream.name} answered {status}", body=raw)
    raise UpstreamFailure(leg, semconv.ERROR_UPSTREAM_STATUS, 502,
                          f"{leg} {upstream.name} answered {status}")


# How the proxy's HTTP server runs (kvscope proxy, the emulator's launcher, and whoever serves
# build_app's application: pass these to aiohttp's AppRunner or run_app). A turn's handler is
# cancelled when its client disconnects (aiohttp's default since 3.9 is not to): the
# cancellation reaches the upstream call in flight, aiohttp closes that connection, and vLLM
# aborts the request. Otherwise a client that leaves during the prefill leg (where nothing is
# written to it, so nothing notices) leaves prefill running until --prefill-timeout, and a
# stop waits for it. The turn is recorded as the client's disconnect (Proxy._handle).
SERVER_OPTIONS: Mapping[str, Any] = MappingProxyType({"handler_cancellation": True})


# Young-generation collection threshold while serving (CPython's default is 700). A turn leaves
# only a few tracked objects behind for good, but 64 turns in flight hold thousands that come
# and go: at the default, a young collection ran every ~35 turns and traversed all of them
# (~0.5 ms each, ~16 µs a turn at 64 conversations, bench_proxy.py --gc); at 10,000 one runs
# every few thousand turns (below 1 µs a turn). Cyclic garbage waits longer for its
# collection: a few thousand objects, a few MB at most.
SERVING_GC_THRESHOLD = 10_000


async def configure_serving_gc(app: web.Application) -> None:
    """A start-up hook for a process that only serves the proxy (``kvscope proxy``): leave what
    start-up built (modules, the application, the upstream client session) out of every later
    garbage collection (``gc.freeze``), so a full collection traverses only what serving
    created since, not the whole heap of imported code; and collect the young generation less
    often (:data:`SERVING_GC_THRESHOLD`). Not added by :func:`build_app`: both are decisions
    about the whole process, which an embedding application makes for itself."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(SERVING_GC_THRESHOLD, middle, old)


def build_app(config: ProxyConfig, telemetry: ProxyTelemetry | None = None,
              on_routed: Callable[[TurnRecord, Lookup], None] | None = None,
              ) -> web.Application:
    """The proxy as an aiohttp application (telemetry disabled when None; ``on_routed``: see
    :class:`Proxy`)."""
    one_line_malformed_requests()
    proxy = Proxy(config, telemetry or ProxyTelemetry(None, router_ttl_s=config.router_ttl_s),
                  on_routed)
    return proxy.application()


def api_key_from_env() -> str | None:
    """``OPENAI_API_KEY``, forwarded to upstream as a Bearer token (as vLLM's proxy does)."""
    return os.environ.get("OPENAI_API_KEY") or None


__all__ = ["DecodeStream", "MAX_REQUEST_BYTES", "PREFILL_DROPPED_FIELDS", "Proxy", "ProxyConfig",
    "SERVER_OPTIONS", "SERVING_GC_THRESHOLD", "Upstream", "UpstreamFailure",
    "VERSION_READ_TIMEOUT_S", "api_key_from_env", "build_app", "configure_serving_gc",
    "error_body", "sse_events", "turn_log"]
