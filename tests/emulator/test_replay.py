"""The load driver against a tiny OpenAI-compatible SSE stub on loopback (test scaffolding)."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvscope import cli
from kvscope.emulator import tokens
from kvscope.emulator.replay import replay
from kvscope.emulator.workloads import Conversation, Turn, Workload, synthetic

REPLY_WORD = "zyx"  # the stub's reply words: easy to spot if text ever leaks into a file


@dataclass
class Seen:
    body: dict[str, Any]
    headers: dict[str, str]
    arrived: float
    ended: float = 0.0


@dataclass
class Stub:
    url: str = ""
    seen: list[Seen] = field(default_factory=list)
    delay_s: float = 0.0
    fail: set[str] = field(default_factory=set)  # conversation ids answered with HTTP 500
    broken: set[str] = field(default_factory=set)  # conversation ids answered with bad SSE
    in_flight: int = 0
    max_in_flight: int = 0

    def reply_words(self, body: dict[str, Any]) -> list[str]:
        turn = len(self.seen) - 1  # index of the request being answered
        return [f"{REPLY_WORD}{turn}w{i}" for i in range(body["max_tokens"])]


STUB_KEY = web.AppKey("stub", Stub)


async def _handle(request: web.Request) -> web.StreamResponse:
    stub = request.app[STUB_KEY]
    body = await request.json()
    seen = Seen(body, dict(request.headers), time.monotonic())
    stub.seen.append(seen)
    conv = str(body.get("conversation_id", ""))
    stub.in_flight += 1
    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
    try:
        await asyncio.sleep(stub.delay_s)
        if conv in stub.fail:
            return web.json_response({"error": "boom"}, status=500)
        words = stub.reply_words(body)
        if not body.get("stream"):
            return web.json_response({
                "choices": [{"message": {"role": "assistant", "content": " ".join(words)}}],
                "usage": {"completion_tokens": len(words)},
            })
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if conv in stub.broken:
            await resp.write(b"data: {not json\n\n")
            return resp

        async def send(obj: object) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        await send({"choices": [{"delta": {"role": "assistant"}}]})
        for start in range(0, len(words), 3):
            piece = " ".join(words[start : start + 3])
            await send({"choices": [{"delta": {"content": piece if not start else " " + piece}}]})
        await send({"choices": [], "usage": {"completion_tokens": len(words)}})
        await resp.write(b"data: [DONE]\n\n")
        return resp
    finally:
        stub.in_flight -= 1
        seen.ended = time.monotonic()


@pytest.fixture
def stub() -> Iterator[Stub]:
    state = Stub()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    runner_box: list[web.AppRunner] = []

    async def start() -> None:
        app = web.Application()
        app[STUB_KEY] = state
        app.router.add_post("/v1/chat/completions", _handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        state.url = f"http://127.0.0.1:{port}"
        runner_box.append(runner)

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    ready.wait(10)
    yield state
    asyncio.run_coroutine_threadsafe(runner_box[0].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def _workload(*conversations: Conversation) -> Workload:
    return Workload("test", 16, conversations, "test")


def _conv(conv_id: str, *, think_s: float = 0.0, start_s: float = 0.0, turns: int = 4,
          reset_at: int | None = None) -> Conversation:
    out: list[Turn] = []
    system, task = 40, 12
    prompt, output = system + task + 1, 6
    out.append(Turn(1, 0.0, prompt, output, 0, prompt))
    for index in range(2, turns + 1):
        if index == reset_at:
            new_prompt, shared = system + task + 20 + 3, system + task
        else:
            shared = prompt + output
            new_prompt = shared + 10 + 4
        out.append(Turn(index, think_s, new_prompt, output + index, shared, new_prompt - shared,
                        index == reset_at))
        prompt, output = new_prompt, output + index
    return Conversation(conv_id, start_s, tuple(out), seed=7, system_seed=3,
                        system_prompt_tokens=system, task_tokens=task)


def test_bodies_headers_and_growing_history(stub: Stub, tmp_path: Path) -> None:
    conv = _conv("c-1", reset_at=3)
    result = asyncio.run(replay(_workload(conv), stub.url, output=tmp_path / "out.jsonl"))
    assert [r.ok for r in result.records] == [True] * 4
    bodies = [s.body for s in stub.seen]
    for seen, turn in zip(stub.seen, conv.turns, strict=True):
        body = seen.body
        assert body["conversation_id"] == "c-1" and seen.headers["X-Session-ID"] == "c-1"
        assert body["max_tokens"] == turn.output_tokens
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["model"]
        assert len(tokens.apply_chat_template(body["messages"])) == turn.prompt_tokens
    # Turn 2 re-sends turn 1 and the reply the server actually produced.
    first, second, third, fourth = (b["messages"] for b in bodies)
    assert second[: len(first)] == first
    reply = second[len(first)]
    assert reply["role"] == "assistant"
    assert reply["content"].split() == [f"{REPLY_WORD}0w{i}" for i in range(6)]
    # Turn 3 is a reset: system prompt and task, then a summary; turn 4 extends turn 3 again.
    assert third[:2] == first[:2] and len(third) == 3
    assert fourth[: len(third)] == third and fourth[len(third)]["role"] == "assistant"
    for record, turn in zip(result.records, conv.turns, strict=True):
        assert record.output_num_tokens == turn.output_tokens
        assert record.input_num_turns == len(bodies[turn.index - 1]["messages"])
        assert record.ttft_ms is not None and 0 < record.ttft_ms <= record.latency_ms


def test_conversation_id_and_header_can_be_left_out(stub: Stub) -> None:
    work = _workload(_conv("c-2", turns=2))
    asyncio.run(replay(work, stub.url, send_conversation_id=False, send_session_header=False,
                       stream=False, ignore_eos=False))
    for seen in stub.seen:
        assert "conversation_id" not in seen.body and "X-Session-ID" not in seen.headers
        assert seen.body["stream"] is False and "stream_options" not in seen.body
        assert "ignore_eos" not in seen.body
    # Non-streaming replies are carried into the history as well.
    assert stub.seen[1].body["messages"][2]["content"].startswith(f"{REPLY_WORD}0w0")


def test_think_times_and_start_offsets_are_scaled(stub: Stub) -> None:
    work = _workload(_conv("slow", think_s=3.0, start_s=2.0, turns=3))
    started = time.monotonic()
    result = asyncio.run(replay(work, stub.url, time_scale=10.0))
    assert stub.seen[0].arrived - started >= 0.2  # start_s 2.0 / 10
    assert stub.seen[0].arrived - started < 1.5  # and not the unscaled 2 s
    for before, after in zip(stub.seen, stub.seen[1:], strict=False):
        gap = after.arrived - before.ended
        assert 0.29 <= gap < 2.0  # think 3.0 / 10, measured from the previous response's end
    assert [r.think_time_s for r in result.records] == [0.0, 0.3, 0.3]


def test_a_recorded_send_time_places_the_turn_once_answered(stub: Stub) -> None:
    # As the Mooncake importer gives: send times on the trace's clock (quantised, so a turn can
    # be due before its previous answer has ended; it is then sent at that end).
    conv = _conv("sent", turns=3, start_s=0.2)
    turns = [dataclasses.replace(t, sent_at_s=at, think_time_s=99.0)
             for t, at in zip(conv.turns, (0.2, 0.8, 0.8), strict=True)]
    work = _workload(dataclasses.replace(conv, turns=tuple(turns)))
    stub.delay_s = 0.3
    started = time.monotonic()
    asyncio.run(replay(work, stub.url))
    first, second, third = stub.seen
    assert 0.75 <= second.arrived - started < 1.2  # at its send time, the answer being in
    assert 0.0 <= third.arrived - second.ended < 0.2  # due already: right after the answer


def test_concurrency_limit_holds(stub: Stub) -> None:
    stub.delay_s = 0.15
    work = _workload(*(_conv(f"p{i}", turns=1) for i in range(6)))
    asyncio.run(replay(work, stub.url, concurrency=2))
    assert len(stub.seen) == 6 and stub.max_in_flight == 2
    stub.seen.clear()
    stub.max_in_flight = 0
    asyncio.run(replay(work, stub.url, concurrency=6))
    assert stub.max_in_flight == 6


def test_turns_are_sequential_unless_overlap_is_asked(stub: Stub) -> None:
    stub.delay_s = 0.2
    work = _workload(_conv("seq", turns=3))
    asyncio.run(replay(work, stub.url))
    for before, after in zip(stub.seen, stub.seen[1:], strict=False):
        assert after.arrived >= before.ended
    stub.seen.clear()
    asyncio.run(replay(work, stub.url, overlap_turns=True))
    assert stub.seen[1].arrived < stub.seen[0].ended  # turn 2 sent while turn 1 still running


def test_errors_are_recorded_not_raised(stub: Stub, tmp_path: Path) -> None:
    stub.fail.add("bad")
    stub.broken.add("garbled")
    work = _workload(_conv("bad", turns=2), _conv("garbled", turns=1), _conv("good", turns=2))
    out = tmp_path / "records.jsonl"
    result = asyncio.run(replay(work, stub.url, retries=1, output=out))
    by_conv: dict[str, list[Any]] = {}
    for record in result.records:
        by_conv.setdefault(record.conversation_id, []).append(record)
    assert [(r.turn_index, r.attempt, r.http_status) for r in by_conv["bad"]] == [
        (1, 1, 500), (1, 2, 500), (2, 1, 500), (2, 2, 500)
    ]
    assert all("HTTP 500" in (r.error or "") for r in by_conv["bad"])
    assert by_conv["garbled"][0].error and by_conv["garbled"][0].http_status == 200
    assert all(r.ok for r in by_conv["good"])
    assert result.summary()["errors"] == 6
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(result.records)
    # Unreachable endpoint: every request records the connection error; the run still ends.
    dead = asyncio.run(replay(_workload(_conv("x", turns=2)), "http://127.0.0.1:9"))
    assert [r.http_status for r in dead.records] == [None, None]
    assert all(r.error for r in dead.records)


def test_result_file_fields_and_no_text(stub: Stub, tmp_path: Path) -> None:
    out = tmp_path / "stats.jsonl"
    asyncio.run(replay(_workload(_conv("f", turns=2)), stub.url, output=out))
    text = out.read_text()
    assert REPLY_WORD not in text
    rows = [json.loads(line) for line in text.splitlines()]
    for key in ("ttft_ms", "latency_ms", "start_time_ms", "input_num_turns", "output_num_tokens",
                "conversation_id", "http_status", "error", "tpot_ms", "input_num_tokens"):
        assert key in rows[0]
    assert rows[0]["start_time_ms"] > 1.6e12  # wall clock, to join with spans
    assert rows[1]["input_num_turns"] == 4 and rows[1]["error"] is None
    messages_text = json.dumps([s.body["messages"] for s in stub.seen])
    some_filler = stub.seen[0].body["messages"][0]["content"].split()[0]
    assert some_filler in messages_text and some_filler not in text


def test_cli_entry_point(stub: Stub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.jsonl"
    assert cli.main([
        "replay", "--workload", "synthetic", "--conversations", "2", "--max-turns", "2",
        "--time-scale", "100000", "--url", stub.url, "--output", str(out), "--concurrency", "4",
    ]) == 0
    summary = json.loads(capsys.readouterr().out)
    expected = synthetic.generate(conversations=2, seed=0, max_turns=2).num_requests
    assert summary["requests"] == expected == len(out.read_text().splitlines())
    assert summary["errors"] == 0
    assert cli.main(["replay", "--url", "http://127.0.0.1:9", "--conversations", "1",
                     "--max-turns", "1", "--no-conversation-id"]) == 1
    capsys.readouterr()
    assert cli.main(["replay", "--workload", "mooncake"]) == 2
    assert "--trace is required" in capsys.readouterr().err
    assert cli.main(["replay", "--url", stub.url, "--concurrency", "0"]) == 2
    assert "--concurrency=0" in capsys.readouterr().err


def test_ctrl_c_prints_the_summary_of_what_finished(
        stub: Stub, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SIGINT mid-run (as Ctrl-C sends it): the requests that finished are summarised and
    written, the command exits 130, and nothing is left running."""
    import os
    import signal

    stub.delay_s = 0.2
    out = tmp_path / "cut.jsonl"
    # A terminal's Ctrl-C meets Python's own SIGINT handler, which asyncio.run replaces with its
    # own; in one full-suite run the signal met another (the run finished, exit 0), so the test
    # starts from Python's.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        code = cli.main(["replay", "--workload", "synthetic", "--conversations", "3",
                         "--max-turns", "40", "--time-scale", "100000", "--url", stub.url,
                         "--output", str(out), "--concurrency", "2"])
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, before)
    assert code == 130
    summary = json.loads(capsys.readouterr().out)
    assert summary["interrupted"] is True
    total = synthetic.generate(conversations=3, seed=0, max_turns=40).num_requests
    assert 0 < summary["requests"] < total
    assert summary["unsent_turns"] > 0
    assert len(out.read_text().splitlines()) == summary["requests"]


def test_progress_says_turns_rate_and_eta() -> None:
    from kvscope.cli.emulator import ReplayProgress

    assert ReplayProgress.text(12, 80, 4.0) == "12/80 turns (15%), 3.0 turns/s, ETA 23 s"
    assert ReplayProgress.text(0, 80, 0.0).endswith("ETA unknown")
    stream = io.StringIO()
    line = ReplayProgress(stream, every_s=10.0)
    line(1, 80, 0.5)
    line(2, 80, 0.6)  # within every_s: not redrawn
    line(80, 80, 0.7)  # the last is always drawn
    line.close()
    # Not a terminal: plain lines (kvscope.progress.Line, as simulate's), the first and last.
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("1/80 turns")
    assert lines[1].startswith("80/80 turns (100%)")


def test_help_states_what_the_time_scale_divides() -> None:
    parser = cli.build_parser()
    text = parser._subparsers._group_actions[0].choices["replay"].format_help()  # type: ignore[union-attr,index]
    flat = " ".join(text.split())
    assert "divide every think time" in flat and "start offset" in flat
    assert "TTLs are not scaled" in flat


def test_the_output_is_ingested_as_client_turns(stub: Stub, tmp_path: Path) -> None:
    """kvscope ingest reads replay's own output (issue 30): one client turn per turn, its
    failed attempts kept as kvscope.turn_attempt spans, a turn that never succeeded errored."""
    from kvscope.collector.ingest import KINDS, detect, ingest, replay_records
    from tests.collector.test_ingest import _ledger

    stub.fail.add("bad")
    out = tmp_path / "records.jsonl"
    asyncio.run(replay(_workload(_conv("bad", turns=1), _conv("good", turns=2)), stub.url,
                       retries=1, output=out))
    assert detect(out) is KINDS[replay_records.KIND]
    db = tmp_path / "run.duckdb"
    result = ingest(db, [out])
    assert [(s.kind, s.records) for s in result.sources] == [(replay_records.KIND, 3)]
    rows = {(r["conversation_id"], r["turn_index"]): r for r in _ledger(db)}
    assert sorted(rows) == [("bad", 1), ("good", 1), ("good", 2)]
    assert rows[("bad", 1)]["errored"] is True
    assert rows[("good", 2)]["errored"] is False and rows[("good", 2)]["ttft_ms"] is not None
    assert rows[("good", 2)]["tool_wait_s"] is not None
    import duckdb

    from kvscope import semconv

    con = duckdb.connect(str(db), read_only=True)
    try:
        attempts = con.execute("SELECT StatusCode, StatusMessage FROM otel_traces WHERE "
                               "SpanName = ?", [semconv.SPAN_TURN_ATTEMPT]).fetchall()
    finally:
        con.close()
    assert [code for code, _ in attempts] == ["STATUS_CODE_ERROR"]
    assert "HTTP 500" in attempts[0][1]
