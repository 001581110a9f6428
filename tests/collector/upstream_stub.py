"""Minimal prefill and decode servers speaking vLLM 0.33.0's P/D shapes, for proxy tests.

Prefill answers non-streaming JSON with top-level ``kv_transfer_params`` (``do_remote_prefill``
True: decode should pull from it) and ``usage``. Decode streams ``data: {json}`` SSE events: a role
event, one event per token, a final event carrying ``finish_reason`` and decode's own
``kv_transfer_params`` (``do_remote_decode`` True, ``remote_blocks_expiry_time`` in its
perf_counter domain), an optional usage event, then ``data: [DONE]``. Each stub records what it
received and can misbehave on request (``mode``) to exercise the proxy's failure paths.

Servers run on their own event loop in a background thread (:class:`ServerThread`), bound to
127.0.0.1 on an ephemeral port.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

BLOCK_SIZE = 16


def prompt_words(body: dict[str, Any]) -> int:
    """The stub's token count: whitespace-separated words of all message contents."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(len(str(m.get("content", "")).split()) for m in messages) + 2 * len(messages)
    return len(str(body.get("prompt", "")).split())


def _blocks(tokens: int, base: int) -> list[list[int]]:
    return [list(range(base, base + (tokens + BLOCK_SIZE - 1) // BLOCK_SIZE))]


@dataclass
class Received:
    """One request a stub received."""

    path: str
    headers: CIMultiDict[str]
    body: dict[str, Any]


@dataclass
class StubState:
    """Behaviour switches and what was received (shared between the test and the server)."""

    mode: str = "ok"
    tokens: int = 4
    chunk_delay_s: float = 0.0
    received: list[Received] = field(default_factory=list)
    # Exact bytes decode wrote per request, to compare with what the proxy's client got.
    sent: list[bytes] = field(default_factory=list)
    # Keep what was received and sent (tests read it). A benchmark serving ~100k turns a
    # minute turns it off: kept, it grows without bound, and so does every full collection.
    keep: bool = True
    disconnects: int = 0
    completed: int = 0
    engine_id: str = "engine"
    side_channel_host: str = "10.0.0.9"
    side_channel_port: int = 5600
    # Decode's usage.prompt_tokens_details.cached_tokens (vLLM --enable-prompt-tokens-details);
    # None: not reported.
    cached_tokens: int | None = None


def _record(state: StubState, request: web.Request, body: dict[str, Any]) -> None:
    if state.keep:
        state.received.append(Received(request.path, CIMultiDict(request.headers), body))


async def _misbehave(state: StubState) -> web.Response | None:
    if state.mode == "hang":
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:  # the caller went away (see ServerThread)
            state.disconnects += 1
            raise
    if state.mode == "error500":
        return web.json_response({"error": {"message": "engine dead", "code": 500}}, status=500)
    if state.mode == "error400":
        return web.json_response(
            {"error": {"message": "max_tokens too large", "type": "BadRequestError",
                       "param": None, "code": 400}},
            status=400,
        )
    if state.mode == "bad_json":
        return web.Response(body=b"not json{", content_type="application/json")
    return None


@web.middleware
async def _refuse_what_does_not_parse(request: web.Request, handler: Any) -> web.StreamResponse:
    """Answer 400 (vLLM's ``ErrorResponse``) for a body the stub cannot read, as vLLM's request
    validation does, instead of the stub's own 500."""
    try:
        return await handler(request)
    except (AttributeError, TypeError, ValueError, KeyError, OverflowError) as exc:
        return web.json_response(
            {"error": {"message": f"invalid request: {exc}", "type": "BadRequestError",
                       "param": None, "code": 400}}, status=400)


def _engine_app(state: StubState,
                answer: Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]
                ) -> web.Application:
    """An engine's two completion routes: each request recorded, then misbehaving as
    ``state.mode`` says or answered by ``answer``."""

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        _record(state, request, body)
        bad = await _misbehave(state)
        return bad if bad is not None else await answer(request, body)

    app = web.Application(client_max_size=64 * 1024 * 1024,
                          middlewares=[_refuse_what_does_not_parse])
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_post("/v1/completions", handle)
    return app


def prefill_app(state: StubState) -> web.Application:
    """A prefill server: one-token, non-streaming answers with P's kv_transfer_params."""

    async def answer(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        n = prompt_words(body)
        params = body.get("kv_transfer_params") or {}
        # A D->P pull happens when decode's metadata came along; report it as cached tokens.
        cached = 0
        if params.get("remote_block_ids") and params.get("remote_num_tokens"):
            cached = min(int(params["remote_num_tokens"]), n)
        rid = f"cmpl-{request.headers.get('X-Request-Id', '?')}-0"
        chat = "messages" in body
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": "t0"},
             "finish_reason": "length"}
            if chat
            else {"index": 0, "text": "t0", "logprobs": None, "finish_reason": "length"}
        )
        state.completed += 1
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": body.get("model", "stub"),
                "choices": [choice],
                "usage": {
                    "prompt_tokens": n,
                    "completion_tokens": 1,
                    "total_tokens": n + 1,
                    "prompt_tokens_details": {"cached_tokens": cached},
                },
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_block_ids": _blocks(n, 100),
                    "remote_engine_id": state.engine_id,
                    "remote_request_id": rid,
                    "remote_host": state.side_channel_host,
                    "remote_port": state.side_channel_port,
                    "tp_size": 1,
                    "remote_num_tokens": n,
                    "remote_blocks_expiry_time": None,
                    "transfer_mode": "pull",
                },
            }
        )

    return _engine_app(state, answer)


def sse(event: dict[str, Any]) -> bytes:
    """One SSE data event as vLLM writes it."""
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def decode_events(body: dict[str, Any], request_id: str, state: StubState) -> list[bytes]:
    """The SSE events decode sends for one request (without pacing)."""
    chat = "messages" in body
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}-0"
    created = int(time.time())
    model = body.get("model", "stub")
    obj = "chat.completion.chunk" if chat else "text_completion"
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or state.tokens
    n_out = min(int(max_tokens), state.tokens)
    n_in = prompt_words(body)

    def event(choice: dict[str, Any], **extra: Any) -> bytes:
        return sse({"id": rid, "object": obj, "created": created, "model": model,
                    "choices": [choice], **extra})

    events = []
    if chat:
        events.append(event({"index": 0, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}))
    for i in range(n_out):
        last = i == n_out - 1
        reason = "length" if last else None
        choice = (
            {"index": 0, "delta": {"content": f"tok{i} "}, "logprobs": None,
             "finish_reason": reason}
            if chat
            else {"index": 0, "text": f"tok{i} ", "logprobs": None, "finish_reason": reason}
        )
        if last:
            choice["stop_reason"] = None
            events.append(event(choice, kv_transfer_params={
                "do_remote_prefill": False,
                "do_remote_decode": True,
                "remote_block_ids": _blocks(n_in + n_out, 500),
                "remote_engine_id": state.engine_id,
                "remote_request_id": rid,
                "remote_host": state.side_channel_host,
                "remote_port": state.side_channel_port,
                "tp_size": 1,
                "remote_num_tokens": n_in + n_out - 1,
                "remote_blocks_expiry_time": time.perf_counter() + 480.0,
                "transfer_mode": "pull",
            }))
        else:
            events.append(event(choice))
    options = body.get("stream_options") or {}
    if options.get("include_usage"):
        events.append(sse({"id": rid, "object": obj, "created": created, "model": model,
                           "choices": [], "usage": {"prompt_tokens": n_in,
                                                    "completion_tokens": n_out,
                                                    "total_tokens": n_in + n_out,
                                                    **({"prompt_tokens_details": {
                                                        "cached_tokens": state.cached_tokens}}
                                                       if state.cached_tokens is not None
                                                       else {})}}))
    events.append(b"data: [DONE]\n\n")
    return events


def decode_app(state: StubState) -> web.Application:
    """A decode server streaming vLLM-shaped SSE with D's kv_transfer_params at the end."""

    async def answer(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        events = decode_events(body, request.headers.get("X-Request-Id", "?"), state)
        if state.keep:
            state.sent.append(b"".join(events))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i, event in enumerate(events):
                if state.mode == "mid_stream_hang" and i == 1:
                    await asyncio.sleep(3600)
                if state.mode == "mid_stream_cut" and i == 1:
                    # Drop the connection without ending the chunked body.
                    if request.transport is not None:
                        request.transport.close()
                    return response
                await response.write(event)
                if state.chunk_delay_s:
                    await asyncio.sleep(state.chunk_delay_s)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            state.disconnects += 1
            raise
        state.completed += 1
        return response

    return _engine_app(state, answer)


class ServerThread:
    """Runs an aiohttp application on 127.0.0.1 (ephemeral port) in a background thread.

    By default a handler is cancelled when its client disconnects (``handler_cancellation``),
    as vLLM's server aborts a request whose client went; ``runner_options`` replaces that (the
    proxy runs with its own ``SERVER_OPTIONS``, as ``kvscope proxy`` does).
    """

    def __init__(self, app_factory: Callable[[], web.Application], port: int = 0, *,
                 runner_options: Mapping[str, Any] | None = None) -> None:
        self._factory = app_factory
        self._runner_options = dict(
            {"handler_cancellation": True} if runner_options is None else runner_options)
        self._requested_port = port
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self._stop is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:  # surfaced to the test through __enter__
            self._error = exc
            self._ready.set()
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        runner = web.AppRunner(self._factory(), access_log=None, shutdown_timeout=1.0,
                               **self._runner_options)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self._requested_port)
        await site.start()
        self.port = int(runner.addresses[0][1])
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()


def free_port() -> int:
    """A port nothing listens on (bound, read, closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
