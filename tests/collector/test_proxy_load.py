"""Load: 256 concurrent conversations through the proxy; every turn answered and spanned once."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from kvscope import semconv
from kvscope.collector.otel import setup_telemetry
from kvscope.collector.proxy import ProxyConfig, ProxyTelemetry, Upstream, build_app
from kvscope.collector.proxy.export_process import TurnExportProcess
from tests.stores import query

sys.path.insert(0, str(Path(__file__).parent))
from upstream_stub import ServerThread, StubState, decode_app, prefill_app  # noqa: E402

CONVERSATIONS = 256
TURNS = 2


async def _conversation(session: aiohttp.ClientSession, url: str, n: int) -> list[bytes]:
    bodies = []
    messages = [{"role": "user", "content": f"task {n} please"}]
    for turn in range(TURNS):
        body = {"model": "m", "messages": messages, "stream": turn % 2 == 0,
                "max_tokens": 4, "conversation_id": f"conv-{n}"}
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            bodies.append(await resp.read())
        messages = [*messages, {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": f"tool result {turn}"}]
    return bodies


async def _run(url: str) -> list[list[bytes]]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        return await asyncio.gather(*(_conversation(session, url, n)
                                      for n in range(CONVERSATIONS)))


@pytest.mark.parametrize("export", ["in-process", "export-process"])
def test_256_concurrent_conversations_lose_and_duplicate_nothing(tmp_path: Path,
                                                                  export: str) -> None:
    prefill, decode = StubState(), StubState()
    db = tmp_path / "load.duckdb"
    if export == "in-process":
        telemetry = ProxyTelemetry(setup_telemetry(semconv.SERVICE_PROXY, db=str(db)))
    else:  # what `kvscope proxy --db` runs
        telemetry = ProxyTelemetry(None, export_process=TurnExportProcess(
            semconv.SERVICE_PROXY, db=str(db)))
    try:
        with ServerThread(lambda: prefill_app(prefill)) as p, \
                ServerThread(lambda: decode_app(decode)) as d:
            cfg = ProxyConfig([Upstream("127.0.0.1", p.port)], [Upstream("127.0.0.1", d.port)])
            telemetry.router_ttl_s = cfg.router_ttl_s
            with ServerThread(lambda: build_app(cfg, telemetry)) as proxy:
                answers = asyncio.run(_run(proxy.url))
        assert len(answers) == CONVERSATIONS
        assert all(len(a) == TURNS and all(a) for a in answers)
        assert telemetry.flush(60)
    finally:
        telemetry.shutdown()
    rows = query(db, "SELECT SpanName, SpanAttributes[?], SpanAttributes[?], SpanAttributes[?] "
                     "FROM otel_traces",
                 [semconv.X_REQUEST_ID, semconv.ROUTER_LOOKUP, semconv.TURN_INDEX])

    sent_ids = [r.headers["X-Request-Id"] for r in prefill.received]
    assert len(sent_ids) == len(set(sent_ids)) == CONVERSATIONS * TURNS
    turn_ids = [r[1] for r in rows if r[0] == semconv.SPAN_TURN]
    # Exactly one turn span per request: nothing lost, nothing duplicated.
    assert sorted(turn_ids) == sorted(sent_ids)
    names = Counter(r[0] for r in rows)
    assert names[semconv.SPAN_INPUT_PROCESSING] == names[semconv.SPAN_GENERATION] == len(sent_ids)
    assert names[semconv.SPAN_TOOL_WAIT] == CONVERSATIONS * (TURNS - 1)
    lookups = Counter((r[3], r[2]) for r in rows if r[0] == semconv.SPAN_TURN)
    assert lookups == {("1", semconv.ROUTER_MISS): CONVERSATIONS,
                       ("2", semconv.ROUTER_HIT): CONVERSATIONS}
    assert telemetry.dropped_spans() == 0
