"""The load driver behind ``kvscope replay``: send a workload's turns to an OpenAI-style server.

Works against any endpoint that takes ``conversation_id`` as a top-level body field: the
emulator, the kvscope proxy, or a real vLLM deployment behind vLLM's multi-turn proxy. Each turn is
``POST {url}/v1/chat/completions`` with ``model``, ``messages``, ``max_tokens`` (the turn's output
tokens), ``stream`` (+ ``stream_options.include_usage``), optionally ``ignore_eos`` (so servers
produce exactly ``max_tokens``), ``conversation_id`` in the body and the ``X-Session-ID`` header
(each can be left out, to exercise the "no conversation id" miss), like vLLM's
``benchmark_serving_multi_turn.py --send-conversation-id``.

Timing: conversation ``c`` starts ``c.start_s / time_scale`` after the run starts; turn k is sent
``think_time_s / time_scale`` after turn k-1's response ended (strictly sequential per
conversation by default), or, when the trace records its send time (``sent_at_s``), then or at
that response's end if later. ``overlap_turns`` instead sends turn k that long after turn k-1 was
*sent*, without waiting for it, and ``retries`` re-sends a failed turn at once: both make a turn
arrive while its conversation's router entry is already consumed (``handle_consumed``). At most
``concurrency`` requests are in flight; tool waits hold no slot.

Each request yields one :class:`RequestRecord` (fields like vLLM's ``--stats-json-output``:
``ttft_ms`` from the first content delta, ``latency_ms``, ``start_time_ms``, ``input_num_turns``,
``output_num_tokens``, ``conversation_id``, plus ``http_status`` and ``error``), written as JSON
lines to ``output`` as requests finish. Replies are kept in memory only to rebuild the next turn's
history; no prompt or completion text is ever written. Endpoint errors are recorded, never raised;
the run ends after the last turn, or at ``deadline_s``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp

from kvscope.collector.proxy.conversation import SESSION_HEADER
from kvscope.emulator.workloads.model import ChatHistory, Conversation, Turn, Workload
from kvscope.errors import SettingError

DEFAULT_MODEL = "kvscope-emulated"
# Told (requests finished, turns in the workload, seconds since the start) after each request.
Progress = Callable[[int, int, float], None]
CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class RequestRecord:
    """What one request measured; no prompt or completion text."""

    conversation_id: str
    turn_index: int
    attempt: int
    start_time_ms: float  # wall clock (epoch ms), to line up with spans; vLLM uses perf_counter
    ttft_ms: float | None
    tpot_ms: float | None
    latency_ms: float
    input_num_turns: int  # messages sent
    input_num_tokens: int  # the turn's prompt tokens under the emulator's chat template
    max_tokens: int
    output_num_tokens: int | None  # usage.completion_tokens, else words received
    output_num_chunks: int
    think_time_s: float  # the wait slept before sending (already divided by time_scale)
    http_status: int | None
    error: str | None

    @property
    def ok(self) -> bool:
        """True when the request completed with HTTP 200 and no error."""
        return self.error is None and self.http_status == 200


@dataclass
class ReplayResult:
    """Every request's record, plus the run's wall time and what was left unsent."""

    records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0
    unsent_turns: int = 0
    # The run was cancelled (Ctrl-C): the records are those finished before it.
    interrupted: bool = False

    def summary(self) -> dict[str, float | int | None]:
        """Headline numbers: requests, errors, TTFT and latency percentiles (ms)."""
        ok = [r for r in self.records if r.ok]
        ttft = sorted(r.ttft_ms for r in ok if r.ttft_ms is not None)
        latency = sorted(r.latency_ms for r in ok)
        return {
            "requests": len(self.records),
            "errors": len(self.records) - len(ok),
            "unsent_turns": self.unsent_turns,
            "interrupted": self.interrupted,
            "duration_s": round(self.duration_s, 3),
            "ttft_ms_p50": _percentile(ttft, 0.5),
            "ttft_ms_p90": _percentile(ttft, 0.9),
            "latency_ms_p50": _percentile(latency, 0.5),
            "output_tokens": sum(r.output_num_tokens or 0 for r in ok),
        }


def _percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    return round(values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))], 3)


@dataclass(frozen=True)
class _Reply:
    text: str
    record: RequestRecord


class _Driver:
    def __init__(
        self,
        workload: Workload,
        url: str,
        session: aiohttp.ClientSession,
        *,
        model: str,
        concurrency: int,
        time_scale: float,
        stream: bool,
        ignore_eos: bool,
        send_conversation_id: bool,
        send_session_header: bool,
        overlap_turns: bool,
        retries: int,
        sink: IO[str] | None,
    ) -> None:
        self.workload = workload
        self.endpoint = url.rstrip("/") + CHAT_PATH
        self.session = session
        self.model = model
        self.slots = asyncio.Semaphore(concurrency)
        self.time_scale = time_scale
        self.stream = stream
        self.ignore_eos = ignore_eos
        self.send_conversation_id = send_conversation_id
        self.send_session_header = send_session_header
        self.overlap_turns = overlap_turns
        self.retries = retries
        self.sink = sink
        self.result = ReplayResult()
        self.sent_turns = 0
        self.progress: Progress | None = None
        self.total_turns = workload.num_requests
        self.started = time.perf_counter()

    def _record(self, record: RequestRecord) -> None:
        self.result.records.append(record)
        if self.sink is not None:
            self.sink.write(json.dumps(asdict(record), sort_keys=True) + "\n")
            self.sink.flush()
        if self.progress is not None:
            self.progress(len(self.result.records), self.total_turns,
                          time.perf_counter() - self.started)

    def _body(self, conv: Conversation, turn: Turn, messages: list[dict[str, str]]) -> dict:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": turn.output_tokens,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.send_conversation_id:
            body["conversation_id"] = conv.id
        return body

    async def _post(
        self, conv: Conversation, turn: Turn, messages: list[dict[str, str]], attempt: int,
        think_s: float,
    ) -> _Reply:
        body = self._body(conv, turn, messages)
        headers = {SESSION_HEADER: conv.id} if self.send_session_header else {}
        status: int | None = None
        error: str | None = None
        ttft: float | None = None
        usage_tokens: int | None = None
        chunks = 0
        pieces: list[str] = []
        async with self.slots:
            wall_start = time.time()
            start = time.perf_counter()
            try:
                async with self.session.post(self.endpoint, json=body, headers=headers) as resp:
                    status = resp.status
                    if resp.status != 200:
                        detail = (await resp.text())[:200].replace("\n", " ")
                        error = f"HTTP {resp.status}: {detail}"
                    elif self.stream:
                        async for raw in resp.content:
                            line = raw.decode("utf-8", "replace").strip()
                            if not line.startswith("data:"):
                                continue
                            data = line[5:].strip()
                            if data == "[DONE]":
                                break
                            chunk = json.loads(data)
                            if "error" in chunk:
                                error = f"stream error: {str(chunk['error'])[:200]}"
                                break
                            chunks += 1
                            usage_tokens = _usage(chunk) or usage_tokens
                            for choice in chunk.get("choices") or []:
                                text = (choice.get("delta") or {}).get("content")
                                if text:
                                    if ttft is None:
                                        ttft = time.perf_counter() - start
                                    pieces.append(text)
                    else:
                        payload = await resp.json()
                        chunks = 1
                        usage_tokens = _usage(payload)
                        for choice in payload.get("choices") or []:
                            text = (choice.get("message") or {}).get("content")
                            if text:
                                pieces.append(text)
                        ttft = time.perf_counter() - start
            except (
                TimeoutError, aiohttp.ClientError, ValueError, AttributeError, TypeError
            ) as exc:
                # A malformed or failed response is this request's outcome, never the run's.
                error = f"{type(exc).__name__}: {str(exc)[:200]}"
            latency = time.perf_counter() - start
        text = "".join(pieces)
        out_tokens = usage_tokens if usage_tokens is not None else len(text.split())
        tpot = None
        if ttft is not None and out_tokens and out_tokens > 1:
            tpot = round((latency - ttft) * 1000 / (out_tokens - 1), 3)
        record = RequestRecord(
            conversation_id=conv.id,
            turn_index=turn.index,
            attempt=attempt,
            start_time_ms=round(wall_start * 1000, 3),
            ttft_ms=None if ttft is None else round(ttft * 1000, 3),
            tpot_ms=tpot,
            latency_ms=round(latency * 1000, 3),
            input_num_turns=len(messages),
            input_num_tokens=turn.prompt_tokens,
            max_tokens=turn.output_tokens,
            output_num_tokens=out_tokens if error is None else None,
            output_num_chunks=chunks,
            think_time_s=round(think_s, 6),
            http_status=status,
            error=error,
        )
        self._record(record)
        return _Reply(text, record)

    async def _turn(
        self, conv: Conversation, turn: Turn, messages: list[dict[str, str]], think_s: float
    ) -> str:
        self.sent_turns += 1
        reply = await self._post(conv, turn, messages, 1, think_s)
        attempt = 1
        while not reply.record.ok and attempt <= self.retries:
            attempt += 1
            reply = await self._post(conv, turn, messages, attempt, 0.0)
        return reply.text if reply.record.ok else ""

    async def conversation(self, conv: Conversation, t0: float) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, t0 + conv.start_s / self.time_scale - loop.time()))
        history = ChatHistory(conv, self.workload.block_size)
        pending: asyncio.Task[str] | None = None
        for turn in conv.turns:
            think = turn.think_time_s / self.time_scale if turn.index > 1 else 0.0
            if pending is not None:
                if self.overlap_turns:
                    await asyncio.sleep(think)
                    # The previous turn may still be running: carry its reply only if it is in.
                    history.add_reply(pending.result() if pending.done() else "")
                else:
                    history.add_reply(await pending)
                    if turn.sent_at_s is not None:  # the trace's send time, once answered
                        think = max(0.0, t0 + turn.sent_at_s / self.time_scale - loop.time())
                    await asyncio.sleep(think)
            messages = history.messages(turn)
            pending = asyncio.create_task(self._turn(conv, turn, messages, think))
            if not self.overlap_turns:
                await pending
        if pending is not None:
            await pending


def _usage(payload: dict) -> int | None:
    usage = payload.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    return None


async def replay(
    workload: Workload,
    url: str,
    *,
    concurrency: int = 16,
    time_scale: float = 1.0,
    model: str = DEFAULT_MODEL,
    stream: bool = True,
    ignore_eos: bool = True,
    send_conversation_id: bool = True,
    send_session_header: bool = True,
    overlap_turns: bool = False,
    retries: int = 0,
    request_timeout_s: float = 600.0,
    deadline_s: float | None = None,
    output: str | Path | None = None,
    progress: Progress | None = None,
) -> ReplayResult:
    """Replay ``workload`` against ``url`` and return every request's record.

    ``progress`` hears (requests finished, turns, seconds) after each request. Cancelled (Ctrl-C
    under ``asyncio.run``), the run stops sending, and the records finished so far come back
    with ``interrupted`` set instead of being lost.
    """
    if not url.startswith(("http://", "https://")):
        raise SettingError(f"--url={url!r}: must start with http:// or https://")
    if concurrency < 1:
        raise SettingError(f"--concurrency={concurrency}: must be >= 1")
    if time_scale <= 0:
        raise SettingError(f"--time-scale={time_scale}: must be > 0")
    if retries < 0:
        raise SettingError(f"--retries={retries}: must be >= 0")
    sink = Path(output).open("w") if output is not None else None
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency)
    started = time.perf_counter()
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            driver = _Driver(
                workload, url, session, model=model, concurrency=concurrency,
                time_scale=time_scale, stream=stream, ignore_eos=ignore_eos,
                send_conversation_id=send_conversation_id,
                send_session_header=send_session_header, overlap_turns=overlap_turns,
                retries=retries, sink=sink,
            )
            driver.progress = progress
            t0 = asyncio.get_running_loop().time()
            tasks = [
                asyncio.create_task(driver.conversation(conv, t0))
                for conv in workload.conversations
            ]
            try:
                done, not_done = await asyncio.wait(tasks, timeout=deadline_s)
            except asyncio.CancelledError:
                # Ctrl-C: keep what finished. Uncancelled, asyncio.run returns the result
                # rather than raising KeyboardInterrupt over it.
                current = asyncio.current_task()
                if current is not None:
                    current.uncancel()
                driver.result.interrupted = True
                done, not_done = set(), set(tasks)
            for task in not_done:
                task.cancel()
            await asyncio.gather(*not_done, return_exceptions=True)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
    finally:
        if sink is not None:
            sink.close()
    result = driver.result
    result.duration_s = time.perf_counter() - started
    result.unsent_turns = workload.num_requests - driver.sent_turns
    return result


__all__ = ["CHAT_PATH", "DEFAULT_MODEL", "Progress", "ReplayResult", "RequestRecord", "replay"]
