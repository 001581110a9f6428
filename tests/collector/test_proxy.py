"""``kvscope proxy`` against real prefill/decode stubs on 127.0.0.1: protocol, spans, failures."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.trace import SpanKind
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as om_text_string_to_metric_families,
)
from prometheus_client.parser import text_string_to_metric_families

import kvscope
from kvscope import exposition, semconv
from kvscope.boundary_key import BoundaryKey
from kvscope.cli.proxy import config_from_args
from kvscope.cli.proxy import configure as add_proxy_arguments
from kvscope.collector.otel import setup_telemetry
from kvscope.collector.proxy import (
    ConversationRouter,
    ProxyConfig,
    ProxyTelemetry,
    Upstream,
    boundary_hashes,
    build_app,
    conversation_id_from,
)
from kvscope.collector.proxy.app import (
    SERVER_OPTIONS,
    SERVING_GC_THRESHOLD,
    configure_serving_gc,
)
from kvscope.collector.proxy.conversation import MAX_CONVERSATION_ID_CHARS
from kvscope.collector.proxy.metrics import MAX_MODEL_NAMES, OTHER_MODEL, ProxyMetrics
from kvscope.collector.proxy.telemetry import TurnRecord, format_traceparent, parse_traceparent
from kvscope.errors import SettingError
from kvscope.reuse.boundaries import chain_boundary, message_boundaries
from kvscope.reuse.router import MISS_PARAMS
from tests.raw_http import partial_body_answer, post_head

sys.path.insert(0, str(Path(__file__).parent))
from upstream_stub import (  # noqa: E402
    ServerThread,
    StubState,
    decode_app,
    free_port,
    prefill_app,
)

PREFILL_HOST = "127.0.0.1"
KEY = BoundaryKey(b"test boundary key, 32 bytes long", "test")
# A different spelling of loopback so remote_host rewriting to *decode's* host is visible.
DECODE_HOST = "localhost"


@dataclass
class Deployment:
    """Prefill and decode stubs, the proxy in front of them, and its store."""

    prefill: StubState
    decode: StubState
    proxy: ServerThread
    telemetry: ProxyTelemetry
    client: httpx.Client
    spans_cache: list[dict[str, Any]] = field(default_factory=list)

    def chat(self, conversation: str | None = None, text: str = "hello there", *,
             stream: bool = True, headers: dict[str, str] | None = None,
             **extra: Any) -> httpx.Response:
        body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": text}],
                                "stream": stream, "max_tokens": 8, **extra}
        if conversation is not None:
            body["conversation_id"] = conversation
        return self.client.post("/v1/chat/completions", json=body, headers=headers)

    def spans(self) -> list[dict[str, Any]]:
        """Every stored span, flushed first, as dicts."""
        return read_spans(self.telemetry)


def read_spans(telemetry: ProxyTelemetry) -> list[dict[str, Any]]:
    """Flush the proxy's telemetry and read every span from its store."""
    tel = telemetry.telemetry
    assert tel is not None and tel.writer is not None
    # A streamed turn is finished (and its spans queued) just after the client has its last
    # byte: wait for the handlers to end before flushing.
    deadline = time.monotonic() + 10
    while telemetry.open_turns and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tel.flush(10)
    cur = tel.writer.connection.cursor()
    rows = cur.execute(
        "SELECT SpanName, SpanKind, TraceId, SpanId, ParentSpanId, "
        "epoch_ns(Timestamp), Duration, SpanAttributes, StatusCode, Events, StatusMessage "
        "FROM otel_traces ORDER BY Timestamp"
    ).fetchall()
    cur.close()
    names = ["name", "kind", "trace", "span", "parent", "start", "duration", "attrs",
             "status", "events", "status_message"]
    return [dict(zip(names, row, strict=True)) for row in rows]


@contextmanager
def deployment(tmp_path: Path, *, prefillers: list[Upstream] | None = None,
               decoders: list[Upstream] | None = None, spans: bool = True,
               **config: Any) -> Iterator[Deployment]:
    prefill, decode = StubState(engine_id="prefill-engine-001"), StubState(
        engine_id="decode-engine-001")
    with ServerThread(lambda: prefill_app(prefill)) as p, \
            ServerThread(lambda: decode_app(decode)) as d:
        cfg = ProxyConfig(
            prefillers=prefillers or [Upstream(PREFILL_HOST, p.port)],
            decoders=decoders or [Upstream(DECODE_HOST, d.port)],
            **config,
        )
        otel = (setup_telemetry(semconv.SERVICE_PROXY, db=str(tmp_path / "proxy.duckdb"))
                if spans else None)
        telemetry = ProxyTelemetry(otel, router_ttl_s=cfg.router_ttl_s)
        try:
            with ServerThread(lambda: build_app(cfg, telemetry),
                              runner_options=SERVER_OPTIONS) as proxy, \
                    httpx.Client(base_url=proxy.url, timeout=20) as client:
                yield Deployment(prefill, decode, proxy, telemetry, client)
        finally:
            if otel is not None:
                otel.shutdown()


def turn_spans(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [s for s in spans if s["name"] == semconv.SPAN_TURN]


def children(spans: list[dict[str, Any]], parent: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for s in spans:
        if s["parent"] == parent["span"] and s["trace"] == parent["trace"]:
            assert s["name"] not in found, f"two {s['name']} spans under one turn"
            found[s["name"]] = s
    return found


# --- protocol equivalence with vLLM's proxy ----------------------------------------------------
def test_stream_is_decodes_bytes_and_legs_are_rewritten_like_vllm(tmp_path: Path) -> None:
    with deployment(tmp_path, api_key="sk-test") as dep:
        resp = dep.chat("conv-1", stream=True, max_completion_tokens=8, min_tokens=2,
                        stream_options={"include_usage": False})
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.content == dep.decode.sent[0]

        p_req, d_req = dep.prefill.received[0], dep.decode.received[0]
        # Prefill: non-streaming, one token, the same fields dropped as vLLM's proxy drops.
        assert p_req.body["stream"] is False and p_req.body["max_tokens"] == 1
        for dropped in ("max_completion_tokens", "min_tokens", "stream_options",
                        "conversation_id"):
            assert dropped not in p_req.body
        assert p_req.body["kv_transfer_params"] == dict(MISS_PARAMS)
        # Decode: streaming, the client's own fields, P's params with remote_host = P's host.
        assert d_req.body["stream"] is True
        assert d_req.body["max_completion_tokens"] == 8 and d_req.body["min_tokens"] == 2
        assert "conversation_id" not in d_req.body
        d_params = d_req.body["kv_transfer_params"]
        assert d_params["do_remote_prefill"] is True
        assert d_params["remote_host"] == PREFILL_HOST
        assert d_params["remote_request_id"] == f"cmpl-{p_req.headers['X-Request-Id']}-0"
        # One X-Request-Id per turn to both legs, OPENAI_API_KEY as Bearer to both.
        assert p_req.headers["X-Request-Id"] == d_req.headers["X-Request-Id"]
        assert p_req.headers["Authorization"] == d_req.headers["Authorization"] == "Bearer sk-test"


def test_next_turn_sends_decodes_cached_params_to_prefill_once(tmp_path: Path) -> None:
    with deployment(tmp_path) as dep:
        assert dep.chat("c").status_code == 200
        first_d_params = _final_kv_params(dep.decode.sent[0])
        assert dep.chat("c", "hello there more").status_code == 200
        sent_to_p = dep.prefill.received[1].body["kv_transfer_params"]
        expected = dict(first_d_params, remote_host=DECODE_HOST, do_remote_decode=True,
                        do_remote_prefill=False)
        assert sent_to_p == expected  # every other field (expiry, engine, port) passes through
        # The entry was replaced by turn 2's decode; a third turn gets turn 2's, not turn 1's.
        assert dep.chat("c").status_code == 200
        third = dep.prefill.received[2].body["kv_transfer_params"]
        assert third["remote_request_id"] == _final_kv_params(dep.decode.sent[1])[
            "remote_request_id"]


def _final_kv_params(sse: bytes) -> dict[str, Any]:
    for line in sse.split(b"\n"):
        if line.startswith(b"data: {") and b"kv_transfer_params" in line:
            return dict(json.loads(line[6:])["kv_transfer_params"])
    raise AssertionError("decode sent no kv_transfer_params")


def test_non_streaming_client_gets_vllm_proxys_rebuilt_body(tmp_path: Path) -> None:
    with deployment(tmp_path) as dep:
        chat = dep.chat("c", stream=False).json()
        assert chat["object"] == "chat.completion" and chat["usage"] is None
        assert chat["choices"] == [{"index": 0, "message": {"role": "assistant",
                                                            "content": "tok0 tok1 tok2 tok3 "},
                                    "finish_reason": "length"}]
        assert chat["id"].startswith("chatcmpl-") and chat["model"] == "m"
        comp = dep.client.post("/v1/completions", json={"model": "m", "prompt": "a b c"}).json()
        assert comp["object"] == "text_completion" and comp["usage"] is None
        assert comp["choices"] == [{"index": 0, "text": "tok0 tok1 tok2 tok3 ",
                                    "logprobs": None, "finish_reason": "length"}]
        assert dep.decode.received[1].path == "/v1/completions"
        assert dep.decode.received[1].body["stream"] is True


def test_round_robin_over_instances() -> None:
    states = [StubState() for _ in range(4)]
    with ServerThread(lambda: prefill_app(states[0])) as p1, \
            ServerThread(lambda: prefill_app(states[1])) as p2, \
            ServerThread(lambda: decode_app(states[2])) as d1, \
            ServerThread(lambda: decode_app(states[3])) as d2:
        cfg = ProxyConfig(
            prefillers=[Upstream(PREFILL_HOST, p1.port), Upstream(PREFILL_HOST, p2.port)],
            decoders=[Upstream(DECODE_HOST, d1.port), Upstream(DECODE_HOST, d2.port)],
        )
        with ServerThread(lambda: build_app(cfg)) as proxy, \
                httpx.Client(base_url=proxy.url) as client:
            for _ in range(4):
                body = {"model": "m", "prompt": "x", "stream": True}
                assert client.post("/v1/completions", json=body).status_code == 200
    assert [len(s.received) for s in states] == [2, 2, 2, 2]


# --- spans per turn ---------------------------------------------------------------------------
def test_turn_spans_tool_wait_and_trace_context(tmp_path: Path) -> None:
    with deployment(tmp_path) as dep:
        agent_trace, agent_span = 0x1234 << 64 | 0xABCD, 0x42
        r1 = dep.chat("agent-7", "first question", headers={
            "traceparent": format_traceparent(agent_trace, agent_span), "tracestate": "k=v"})
        assert r1.status_code == 200
        time.sleep(0.2)  # the "tool call" between turns
        r2 = dep.chat("agent-7", "first question", stream=False)
        assert r2.status_code == 200
        spans = dep.spans()

    turns = turn_spans(spans)
    assert len(turns) == 2
    t1, t2 = turns
    assert t1["kind"] == "SPAN_KIND_SERVER"
    # Turn 1 joins the agent's trace as a child of its span; tracestate went upstream too.
    assert t1["trace"] == f"{agent_trace:032x}" and t1["parent"] == f"{agent_span:016x}"
    assert dep.prefill.received[0].headers["tracestate"] == "k=v"

    for turn, index, lookup in ((t1, "1", semconv.ROUTER_MISS), (t2, "2", semconv.ROUTER_HIT)):
        a = turn["attrs"]
        assert a[semconv.GEN_AI_CONVERSATION_ID] == "agent-7"
        assert a[semconv.TURN_INDEX] == index
        assert a[semconv.ROUTER_LOOKUP] == lookup
        assert a[semconv.GEN_AI_REQUEST_MODEL] == "m"
        assert a[semconv.GEN_AI_USAGE_INPUT_TOKENS] == "4"
        assert a[semconv.PREFILL_INSTANCE].startswith(PREFILL_HOST + ":")
        assert a[semconv.DECODE_INSTANCE].startswith(DECODE_HOST + ":")
        assert [e["Name"] for e in turn["events"]] == [semconv.EVENT_FIRST_TOKEN]
        legs = children(spans, turn)
        ip, gen = legs[semconv.SPAN_INPUT_PROCESSING], legs[semconv.SPAN_GENERATION]
        assert ip["kind"] == gen["kind"] == "SPAN_KIND_CLIENT"
        # The span each leg's traceparent named is the span stored for that leg.
        i = int(index) - 1
        p_tp = parse_traceparent(dep.prefill.received[i].headers["traceparent"])
        d_tp = parse_traceparent(dep.decode.received[i].headers["traceparent"])
        assert p_tp == (int(turn["trace"], 16), int(ip["span"], 16))
        assert d_tp == (int(turn["trace"], 16), int(gen["span"], 16))
        x_request_id = dep.prefill.received[i].headers["X-Request-Id"]
        assert a[semconv.X_REQUEST_ID] == ip["attrs"][semconv.X_REQUEST_ID] == x_request_id
        assert ip["attrs"][semconv.VLLM_REQUEST_ID] == f"cmpl-{x_request_id}-0"
        assert gen["attrs"][semconv.RETENTION_METADATA_RETURNED] == "true"
        assert gen["attrs"][semconv.REMOTE_NUM_TOKENS] == "7"  # 4 prompt + 4 out - 1
        assert [e["Name"] for e in gen["events"]] == [semconv.EVENT_FIRST_TOKEN]
        assert turn["start"] <= ip["start"] <= gen["start"]
        assert gen["start"] + gen["duration"] <= turn["start"] + turn["duration"]

    assert float(t2["attrs"][semconv.ROUTER_ENTRY_AGE_S]) >= 0.2
    ip2 = children(spans, t2)[semconv.SPAN_INPUT_PROCESSING]["attrs"]
    assert ip2[semconv.D_METADATA_ATTACHED] == "true"
    assert ip2[semconv.REMOTE_OFFERED_TOKENS] == "7"
    assert ip2[semconv.CACHED_TOKENS] == "4"

    # Tool wait: exactly turn 1's last byte → turn 2's arrival, inside turn 2's trace.
    waits = [s for s in spans if s["name"] == semconv.SPAN_TOOL_WAIT]
    assert len(waits) == 1
    wait = waits[0]
    assert wait["kind"] == "SPAN_KIND_INTERNAL"
    assert wait["trace"] == t2["trace"] and wait["parent"] == t2["span"]
    assert wait["start"] == t1["start"] + t1["duration"]
    assert wait["start"] + wait["duration"] == t2["start"]
    assert wait["duration"] >= 0.2e9
    assert wait["attrs"][semconv.WAIT_SOURCE] == semconv.WAIT_INFERRED
    assert wait["attrs"][semconv.TURN_INDEX] == "2"
    # Same messages, so the same boundary hashes; and never the text itself.
    hashes = t1["attrs"][semconv.MESSAGE_BOUNDARY_HASHES]
    assert hashes == t2["attrs"][semconv.MESSAGE_BOUNDARY_HASHES]
    assert all("first question" not in str(s["attrs"]) for s in spans)


def test_conversation_id_sources_and_odd_ids(tmp_path: Path) -> None:
    with deployment(tmp_path) as dep:
        header_only = dep.client.post(
            "/v1/chat/completions", headers={"X-Session-ID": "sess-1"},
            json={"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True})
        assert header_only.status_code == 200
        for odd in ("x" * (MAX_CONVERSATION_ID_CHARS + 1), "bad\x00id", ["a", "b"], 42):
            assert dep.chat(odd).status_code == 200  # type: ignore[arg-type]
        spans = dep.spans()
    turns = [t["attrs"] for t in turn_spans(spans)]
    assert turns[0][semconv.GEN_AI_CONVERSATION_ID] == "sess-1"
    assert turns[0][semconv.CONVERSATION_ID_SOURCE] == semconv.ID_SOURCE_HEADER
    rejected = [(t.get(semconv.CONVERSATION_ID_REJECTED), t[semconv.ROUTER_LOOKUP])
                for t in turns[1:4]]
    assert rejected == [
        (semconv.ID_REJECTED_TOO_LONG, semconv.ROUTER_NO_CONVERSATION_ID),
        (semconv.ID_REJECTED_NON_PRINTABLE, semconv.ROUTER_NO_CONVERSATION_ID),
        (semconv.ID_REJECTED_WRONG_TYPE, semconv.ROUTER_NO_CONVERSATION_ID),
    ]
    assert turns[4][semconv.GEN_AI_CONVERSATION_ID] == "42"
    assert all(semconv.GEN_AI_CONVERSATION_ID not in t for t in turns[1:4])


def test_body_conversation_id_wins_over_header() -> None:
    body: dict[str, Any] = {"conversation_id": "from-body"}
    cid = conversation_id_from(body, "from-header")
    assert (cid.value, cid.source) == ("from-body", semconv.ID_SOURCE_BODY)
    assert "conversation_id" not in body
    none = conversation_id_from({}, None)
    assert (none.value, none.source, none.rejected) == (None, semconv.ID_SOURCE_NONE, None)


# --- failure behaviour --------------------------------------------------------------------------
def _error_turn(dep: Deployment) -> dict[str, Any]:
    (turn,) = turn_spans(dep.spans())
    assert turn["status"] == "STATUS_CODE_ERROR"
    return turn


@pytest.mark.parametrize("payload", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_malformed_json_is_400(tmp_path: Path, payload: bytes) -> None:
    with deployment(tmp_path) as dep:
        resp = dep.client.post("/v1/chat/completions", content=payload,
                               headers={"Content-Type": "application/json"})
        assert resp.status_code == 400
        assert resp.json()["error"]["code"] == 400
        assert dep.prefill.received == []
        turn = _error_turn(dep)
        assert turn["attrs"][semconv.ERROR_KIND] == semconv.ERROR_BAD_REQUEST


def test_dead_prefill_is_502_with_error_span(tmp_path: Path) -> None:
    dead = Upstream("127.0.0.1", free_port())
    with deployment(tmp_path, prefillers=[dead], connect_timeout_s=2) as dep:
        t0 = time.monotonic()
        resp = dep.chat("c")
        assert time.monotonic() - t0 < 5
        assert resp.status_code == 502
        assert "unreachable" in resp.json()["error"]["message"]
        turn = _error_turn(dep)
        leg = children(dep.spans(), turn)[semconv.SPAN_INPUT_PROCESSING]
        assert leg["status"] == "STATUS_CODE_ERROR"
        assert leg["attrs"][semconv.ERROR_KIND] == semconv.ERROR_CONNECT
        metrics = dep.client.get("/metrics").text
        assert _value(metrics, "kvscope_proxy_upstream_errors_total", leg="prefill",
                      kind="connect") == 1


def test_slow_prefill_is_504_not_a_hang(tmp_path: Path) -> None:
    with deployment(tmp_path, prefill_timeout_s=0.5) as dep:
        dep.prefill.mode = "hang"
        t0 = time.monotonic()
        resp = dep.chat("c")
        assert resp.status_code == 504 and time.monotonic() - t0 < 5
        assert _error_turn(dep)["attrs"][semconv.ERROR_KIND] == semconv.ERROR_TIMEOUT


def test_dead_or_failing_decode_is_502(tmp_path: Path) -> None:
    dead = Upstream("127.0.0.1", free_port())
    with deployment(tmp_path, decoders=[dead]) as dep:
        assert dep.chat("c").status_code == 502
        turn = _error_turn(dep)
        gen = children(dep.spans(), turn)[semconv.SPAN_GENERATION]
        assert gen["status"] == "STATUS_CODE_ERROR"
    with deployment(tmp_path / "b") as dep:
        dep.decode.mode = "error500"
        resp = dep.chat("c")
        assert resp.status_code == 502 and resp.json()["error"]["type"] == "BadGatewayError"


def test_upstream_client_error_passes_through(tmp_path: Path) -> None:
    with deployment(tmp_path) as dep:
        dep.prefill.mode = "error400"
        resp = dep.chat("c")
        assert resp.status_code == 400
        assert resp.json()["error"]["message"] == "max_tokens too large"
        assert dep.decode.received == []


def test_prefill_bad_json_is_502(tmp_path: Path) -> None:
    with deployment(tmp_path) as dep:
        dep.prefill.mode = "bad_json"
        assert dep.chat("c").status_code == 502
        assert _error_turn(dep)["attrs"][semconv.ERROR_KIND] == semconv.ERROR_PROTOCOL


def test_decode_silent_mid_stream(tmp_path: Path) -> None:
    with deployment(tmp_path, decode_idle_timeout_s=0.5) as dep:
        dep.decode.mode = "mid_stream_hang"
        streamed = dep.chat("c", stream=True)
        # Headers were already sent: the stream ends with vLLM's error event, the span says why.
        assert streamed.status_code == 200
        relayed, _, tail = streamed.content.partition(b'data: {"error"')
        assert relayed == dep.decode.sent[0][: len(relayed)] and b"[DONE]" not in relayed
        error = json.loads(b'{"error"' + tail.split(b"\n\n")[0])["error"]
        assert error["code"] == 504 and "went silent mid-stream" in error["message"]
        assert tail.endswith(b"data: [DONE]\n\n")
        collected = dep.chat("c", stream=False)
        assert collected.status_code == 504
        turns = turn_spans(dep.spans())
        assert [t["attrs"][semconv.ERROR_KIND] for t in turns] == [semconv.ERROR_TIMEOUT] * 2


@pytest.mark.parametrize("mode", ["mid_stream_cut"])
def test_a_decode_that_dies_mid_stream_ends_the_clients_stream_with_an_error(
        tmp_path: Path, mode: str) -> None:
    """Before, the client read a clean end without [DONE] and could not tell it from success."""
    with deployment(tmp_path) as dep:
        dep.decode.mode = mode
        streamed = dep.chat("c", stream=True)
        assert streamed.status_code == 200
        assert b'data: {"error": {"message": "decode ' in streamed.content
        assert streamed.content.endswith(b"data: [DONE]\n\n")
        [turn] = turn_spans(dep.spans())
        assert turn["attrs"][semconv.ERROR_KIND] in (semconv.ERROR_CONNECT,
                                                     semconv.ERROR_PROTOCOL)


def test_client_disconnect_cancels_upstream(tmp_path: Path) -> None:
    with deployment(tmp_path) as dep:
        dep.decode.tokens, dep.decode.chunk_delay_s = 200, 0.05
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                           "stream": True, "max_tokens": 200, "conversation_id": "c"}).encode()
        with socket.create_connection(("127.0.0.1", dep.proxy.port)) as sock:
            sock.sendall(post_head("/v1/chat/completions", len(body)) + body)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 5
        while dep.decode.disconnects == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dep.decode.disconnects == 1 and dep.decode.completed == 0
        while _value(dep.client.get("/metrics").text,
                     "kvscope_proxy_client_disconnects_total") != 1:
            assert time.monotonic() < deadline, "disconnect not counted"
            time.sleep(0.05)
        turn = turn_spans(dep.spans())[0]
        assert turn["attrs"][semconv.CLIENT_DISCONNECTED] == "true"
        assert children(dep.spans(), turn)[semconv.SPAN_GENERATION]["attrs"][
            semconv.CLIENT_DISCONNECTED] == "true"


def test_unreachable_telemetry_does_not_affect_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tiny queue so that drops show up while the exporter retries a dead endpoint.
    monkeypatch.setenv("KVSCOPE_EXPORT_QUEUE_SIZE", "8")
    otel = setup_telemetry(semconv.SERVICE_PROXY, otlp_endpoint=f"http://127.0.0.1:{free_port()}")
    logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
    prefill, decode = StubState(), StubState()
    with ServerThread(lambda: prefill_app(prefill)) as p, \
            ServerThread(lambda: decode_app(decode)) as d:
        cfg = ProxyConfig([Upstream(PREFILL_HOST, p.port)], [Upstream(DECODE_HOST, d.port)])
        telemetry = ProxyTelemetry(otel)
        with ServerThread(lambda: build_app(cfg, telemetry)) as proxy, \
                httpx.Client(base_url=proxy.url, timeout=5) as client:
            for i in range(10):
                body = {"model": "m", "prompt": "x", "stream": True, "conversation_id": "c"}
                resp = client.post("/v1/completions", json=body)
                assert resp.status_code == 200 and resp.content == decode.sent[i]
            dropped = _sample(client.get("/metrics").text,
                              "kvscope_proxy_telemetry_dropped_spans_total")
            assert dropped > 0
            assert client.get("/health").json()["telemetry"]["dropped_spans"] == dropped
    # Stop the exporter's retries now rather than letting them run on behind later tests.
    otel.span_processor._exporter.shutdown()
    otel.shutdown()


# --- /health and /metrics -------------------------------------------------------------------------
def _sample(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not exposed")


def test_health_has_vllm_shape_plus_telemetry(tmp_path: Path) -> None:
    with deployment(tmp_path) as dep:
        dep.chat("a")
        dep.chat("b")
        health = dep.client.get("/health").json()
        assert health["status"] == "ok"
        assert health["cached_conversations"] == 2 and health["evicted_stale"] == 0
        assert health["telemetry"]["enabled"] is True
        assert health["telemetry"]["dropped_spans"] == 0


def _families(text: str) -> dict[str, Any]:
    """The exposition parsed by Prometheus' own text parser (it rejects malformed text)."""
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(text: str, sample: str, **labels: str) -> float:
    """The sum of ``sample`` over the series whose labels include ``labels``."""
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_exposition_is_well_formed(tmp_path: Path) -> None:
    with deployment(tmp_path) as dep:
        for i in range(3):
            dep.chat(f"c{i % 2}")
        dep.client.post("/v1/chat/completions", content=b"{")
        response = dep.client.get("/metrics")
        turn = turn_spans(dep.spans())[0]
    text = response.text
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = _families(text)
    route = "/v1/chat/completions"
    assert _value(text, "kvscope_proxy_turns_total", route=route, outcome="ok") == 3
    assert _value(text, "kvscope_proxy_turns_total", route=route, outcome="bad_request") == 1
    assert _value(text, "kvscope_proxy_router_lookups_total", result="miss") == 2
    assert _value(text, "kvscope_proxy_router_lookups_total", result="hit") == 1
    # model_name and the upstream instances label the turns and TTFT, as vLLM labels its own.
    ok = [s for s in families["kvscope_proxy_turns"].samples
          if s.name == "kvscope_proxy_turns_total" and s.labels["outcome"] == "ok"]
    assert {s.labels["model_name"] for s in ok} == {"m"}
    # The same instance names the turn's spans carry.
    prefill, decode = (turn["attrs"][semconv.PREFILL_INSTANCE],
                       turn["attrs"][semconv.DECODE_INSTANCE])
    assert {s.labels["prefill_instance"] for s in ok} == {prefill}
    assert {s.labels["decode_instance"] for s in ok} == {decode}
    assert _value(text, "kvscope_proxy_ttft_seconds_count", model_name="m",
                  prefill_instance=prefill, decode_instance=decode) == 3
    assert _value(text, "kvscope_proxy_leg_duration_seconds_count", leg="prefill") == 3
    assert _value(text, "kvscope_proxy_ttft_seconds_bucket", le="+Inf") == 3
    assert _value(text, "kvscope_proxy_router_entries") == 2
    assert families["kvscope_proxy_ttft_seconds"].type == "histogram"
    assert families["kvscope_proxy_telemetry_dropped_spans"].type == "counter"
    # vLLM's TTFT buckets, so both histograms line up in one query.
    bounds = sorted({float(s.labels["le"]) for s in families["kvscope_proxy_ttft_seconds"].samples
                     if s.name.endswith("_bucket")})
    assert bounds == [*exposition.VLLM_TTFT_BUCKETS_S, math.inf]
    build = _value(text, "kvscope_proxy_build_info", version=kvscope.__version__)
    assert build == 1
    assert "process_cpu_seconds" in families  # prometheus_client's process collector (Linux)
    assert "python_gc_objects_collected" in families


def test_metrics_openmetrics_has_trace_id_exemplars(tmp_path: Path) -> None:
    """A scraper that asks for OpenMetrics gets it, with the turn's trace id on TTFT."""
    with deployment(tmp_path) as dep:
        dep.chat("c0")
        response = dep.client.get(
            "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        spans = dep.spans()
    assert response.headers["content-type"].startswith("application/openmetrics-text")
    exemplars = [s.exemplar for family in om_text_string_to_metric_families(response.text)
                 for s in family.samples
                 if s.name == "kvscope_proxy_ttft_seconds_bucket" and s.exemplar is not None]
    assert len(exemplars) == 1
    assert exemplars[0].labels["trace_id"] == turn_spans(spans)[0]["trace"]


def _record(ttft_s: float, model: str = "m") -> TurnRecord:
    record = TurnRecord("x", "/v1/completions", 0, 1, 2, 3, 4, model=model)
    record.first_token_ns = int(ttft_s * 1e9)
    record.end_ns = record.first_token_ns + 1
    return record


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=1e4, allow_nan=False), max_size=30))
def test_ttft_buckets_count_what_was_observed(values: list[float]) -> None:
    """Nanosecond records become seconds, each counted in every bucket at or above it."""
    metrics = ProxyMetrics()
    for v in values:
        metrics.observe(_record(v))
    text = metrics.render(None)[0].decode()
    for bound in (*exposition.VLLM_TTFT_BUCKETS_S, math.inf):
        le = "+Inf" if bound == math.inf else repr(float(bound))
        expected = sum(int(v * 1e9) / 1e9 <= bound for v in values)
        assert _value(text, "kvscope_proxy_ttft_seconds_bucket", le=le) == expected


def test_each_ttft_bucket_takes_an_exemplar_at_most_once_a_second() -> None:
    metrics = ProxyMetrics()
    turns = [(0.05, 1, 0.0), (0.05, 2, 0.5), (3.0, 3, 0.6), (0.05, 4, 1.2)]  # s, trace, end s
    for ttft_s, trace_id, end_s in turns:
        record = _record(ttft_s)
        record.trace_id, record.end_ns = trace_id, int(end_s * 1e9) + record.first_token_ns
        metrics.observe(record)
    text = metrics.render("application/openmetrics-text")[0].decode()
    exemplars = {s.labels["le"]: s.exemplar.labels["trace_id"]
                 for family in om_text_string_to_metric_families(text) for s in family.samples
                 if s.name == "kvscope_proxy_ttft_seconds_bucket" and s.exemplar is not None}
    # 0.05 s falls in le=0.06: turn 2 came 0.5 s after turn 1 (skipped), turn 4 1.2 s after.
    assert exemplars == {"0.06": f"{4:032x}", "5.0": f"{3:032x}"}


def test_model_names_are_bounded() -> None:
    """model_name comes from clients: past the limit, new names are counted as one."""
    metrics = ProxyMetrics()
    for i in range(MAX_MODEL_NAMES + 5):
        metrics.observe(_record(0.01, model=f"model-{i}"))
    text = metrics.render(None)[0].decode()
    names = {s.labels["model_name"] for family in text_string_to_metric_families(text)
             for s in family.samples if s.name == "kvscope_proxy_turns_total"}
    assert len(names) == MAX_MODEL_NAMES + 1 and OTHER_MODEL in names
    assert _value(text, "kvscope_proxy_turns_total", model_name=OTHER_MODEL) == 5


def test_names_upstream_refuses_take_no_model_name_slot() -> None:
    """Once the first 32 names clients sent took the slots for good, even ones upstream
    answered 404: a served model that came later was counted as ``other``."""
    metrics = ProxyMetrics()
    for i in range(MAX_MODEL_NAMES + 5):
        refused = _record(0.01, model=f"typo-{i}")
        refused.fail("prefill", semconv.ERROR_UPSTREAM_STATUS, 404, "model not found")
        metrics.observe(refused)
    metrics.observe(_record(0.01, model="served-model"))
    text = metrics.render(None)[0].decode()
    names = {s.labels["model_name"] for family in text_string_to_metric_families(text)
             for s in family.samples if s.name == "kvscope_proxy_turns_total"}
    assert names == {"served-model", OTHER_MODEL}
    assert _value(text, "kvscope_proxy_turns_total", model_name="served-model") == 1


# --- router semantics -----------------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.sampled_from("abc")),
        st.tuples(st.just("get"), st.sampled_from("abc")),
        st.tuples(st.just("wait"), st.floats(min_value=0, max_value=30)),
        st.tuples(st.just("evict"), st.just("")),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_router_matches_a_reference_model(sequence: list[tuple[str, Any]]) -> None:
    """Single use, TTL, and the reason a lookup found nothing, against a plain model."""
    clock = _Clock()
    router = ConversationRouter(ttl_s=20.0, clock=clock)
    entries: dict[str, float] = {}
    last_fate: dict[str, str] = {}
    stale_since: dict[str, float] = {}  # when a conversation's stale entry was stored

    def drop_stale() -> list[str]:
        stale = [k for k, t in entries.items() if clock.now - t > 20.0]
        for k in stale:
            stale_since[k] = entries.pop(k)
            last_fate[k] = semconv.ROUTER_STALE
        return stale

    for i, (op, arg) in enumerate(sequence):
        if op == "put":
            # A put drops the entries past the TTL (the proxy's memory follows the TTL).
            drop_stale()
            router.put(arg, {"remote_request_id": f"r{i}", "remote_host": "side"}, "dhost")
            entries[arg] = clock.now
            last_fate.pop(arg, None)
        elif op == "wait":
            clock.now += arg
        elif op == "evict":
            assert router.evict_stale() == len(drop_stale())
        else:
            got = router.lookup(arg)
            if arg in entries:
                stored = entries.pop(arg)
                if clock.now - stored > 20.0:
                    assert got.result == semconv.ROUTER_STALE and got.params is None
                    last_fate[arg] = semconv.ROUTER_STALE
                    stale_since[arg] = stored
                else:
                    assert got.result == semconv.ROUTER_HIT and got.params is not None
                    assert got.params["remote_host"] == "dhost"
                    assert got.age_s == pytest.approx(clock.now - stored)
                    last_fate[arg] = semconv.ROUTER_CONSUMED
            else:
                assert got.result == last_fate.get(arg, semconv.ROUTER_MISS)
                if got.result == semconv.ROUTER_STALE:  # its age, as if it had waited here
                    assert got.age_s == pytest.approx(clock.now - stale_since[arg])
        assert router.size == len(entries)


def test_the_router_drops_entries_past_the_ttl_as_new_ones_come() -> None:
    """Without GET /health (vLLM's proxy evicts only there), the conversations that ended keep
    no decode params past the TTL: the soak's proxy grew 48 -> 111 MiB in 30 minutes holding
    them (9,000 conversations, ~4 KB each, up to the 100k-entry cap)."""
    clock = _Clock()
    router = ConversationRouter(ttl_s=20.0, clock=clock)
    for i in range(1000):
        router.put(f"ended-{i}", {"remote_block_ids": [list(range(500, 600))]}, "dhost")
    clock.now += 21.0
    router.put("live", {"remote_request_id": "r"}, "dhost")
    assert router.size == 1
    late = router.lookup("ended-7")
    assert (late.result, late.params) == (semconv.ROUTER_STALE, None)
    assert late.age_s == pytest.approx(21.0)
    assert router.lookup("live").result == semconv.ROUTER_HIT


def test_router_is_bounded() -> None:
    router = ConversationRouter(ttl_s=10, max_entries=3)
    for i in range(5):
        router.put(str(i), {"x": i}, "h")
    assert router.size == 3 and router.evicted_capacity == 2
    assert router.lookup("0").result == semconv.ROUTER_MISS
    assert router.lookup("4").result == semconv.ROUTER_HIT


# --- message-boundary hashes ----------------------------------------------------------------------
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                           "content": st.text(min_size=4, max_size=30)}),
    min_size=1, max_size=8,
)


def test_odd_messages_hash_and_name_their_roles_as_documented() -> None:
    parts = [{"content": "no role"}, "bare text", {"role": "tool", "content": [{"x": 1}]},
             {"role": None, "content": "none"}, {"role": "", "content": "empty"}]
    chain, expected = b"", []
    for role, text in (("", "no role"), ("", "bare text"), ("tool", '[{"x": 1}]'),
                       ("None", "none"), ("", "empty")):
        chain = chain_boundary(chain, role, text, KEY)
        expected.append(chain.hex())
    assert message_boundaries({"messages": parts}, KEY) == (5, ",".join(expected), "??tN?")
    assert message_boundaries({"messages": parts}, KEY, keep=2) == (
        5, ",".join(expected[3:]), "N?")
    assert message_boundaries({"prompt": "once"}, KEY) == (
        1, chain_boundary(b"", "user", "once", KEY).hex(), "u")
    assert message_boundaries({"prompt": None}, KEY) == message_boundaries({}, KEY) == (
        0, "", "")


@settings(max_examples=100, deadline=None)
@given(messages, messages)
def test_boundary_hashes_share_exactly_the_common_prefix(a: list[dict], b: list[dict]) -> None:
    count_a, joined_a = boundary_hashes({"messages": a}, KEY)
    ha = joined_a.split(",")
    count_b, joined_b = boundary_hashes({"messages": a + b}, KEY)
    hb = joined_b.split(",")
    assert hb[: len(ha)] == ha and len(hb) == count_b == len(a) + len(b) and count_a == len(a)
    # Keeping the last k hashes keeps exactly those.
    assert boundary_hashes({"messages": a + b}, KEY, keep=len(b)) == (
        count_b, ",".join(hb[len(a):]))
    assert boundary_hashes({"messages": a}, KEY, keep=len(a) + 5) == (count_a, joined_a)
    assert boundary_hashes({"messages": a}, KEY, keep=0) == (count_a, "")
    edited = [dict(a[0], content=a[0]["content"] + "!")] + a[1:]
    he = boundary_hashes({"messages": edited}, KEY)[1].split(",")
    assert all(x != y for x, y in zip(he, ha, strict=True))  # the chain carries the edit
    joined = ",".join(ha)
    assert all(m["content"] not in joined for m in a if len(m["content"]) >= 17)


def test_traceparent_round_trip_and_rejects() -> None:
    assert parse_traceparent(format_traceparent(5, 7)) == (5, 7)
    for bad in (None, "", "00-" + "0" * 32 + "-" + "1" * 16 + "-01", "garbage",
                "ff-" + "1" * 32 + "-" + "1" * 16 + "-01"):
        assert parse_traceparent(bad) is None


# --- command line ---------------------------------------------------------------------------------
def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_proxy_arguments(parser)
    return parser.parse_args(argv)


def test_cli_takes_vllm_flags_and_checks_them(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    args = _parse(["--prefiller-hosts", "p1", "p2", "--prefiller-ports", "8100", "8101",
                   "--decoder-host", "d1", "--decoder-port", "8200", "--port", "9000"])
    cfg = config_from_args(args)
    assert [u.name for u in cfg.prefillers] == ["p1:8100", "p2:8101"]
    assert [u.name for u in cfg.decoders] == ["d1:8200"]
    assert cfg.router_ttl_s == 450.0 and cfg.api_key == "sk-env" and args.port == 9000
    with pytest.raises(SettingError, match="prefiller"):
        config_from_args(_parse(["--prefiller-hosts", "a", "b"]))
    with caplog.at_level(logging.WARNING):
        config_from_args(_parse(["--router-ttl", "480"]))
    assert "not below" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        config_from_args(_parse(["--router-ttl", "300"]))
    assert "not below" not in caplog.text
    with pytest.raises(SettingError):
        config_from_args(_parse(["--router-ttl", "-1"]))


def test_telemetry_disabled_still_serves_and_counts(tmp_path: Path) -> None:
    with deployment(tmp_path, spans=False) as dep:
        assert dep.chat("c").status_code == 200
        assert dep.client.get("/health").json()["telemetry"] == {"enabled": False}
        assert "kvscope_proxy_turns_total" in dep.client.get("/metrics").text


def test_the_startup_hook_freezes_the_startup_heap_and_raises_the_young_threshold() -> None:
    built_before = [object() for _ in range(100)] + [[] for _ in range(100)]  # tracked
    frozen_before = gc.get_freeze_count()
    threshold_before = gc.get_threshold()
    prefill, decode = StubState(), StubState()
    try:
        with ServerThread(lambda: prefill_app(prefill)) as p, \
                ServerThread(lambda: decode_app(decode)) as d:
            cfg = ProxyConfig([Upstream(PREFILL_HOST, p.port)], [Upstream(PREFILL_HOST, d.port)])

            def app() -> web.Application:
                application = build_app(cfg)
                application.on_startup.append(configure_serving_gc)
                return application

            with ServerThread(app) as proxy, httpx.Client(base_url=proxy.url) as client:
                assert client.get("/health").status_code == 200
                assert gc.get_freeze_count() >= frozen_before + 100
                assert gc.get_threshold() == (SERVING_GC_THRESHOLD, *threshold_before[1:])
    finally:
        gc.set_threshold(*threshold_before)  # the rest of the suite keeps its own
    assert built_before


def test_build_app_leaves_the_processes_collector_alone(tmp_path: Path) -> None:
    frozen_before = gc.get_freeze_count()
    threshold_before = gc.get_threshold()
    with deployment(tmp_path, spans=False) as dep:
        assert dep.chat("c").status_code == 200
        # Nothing frozen (serve freezes ~100k+ objects): an object an earlier test froze may be
        # freed meanwhile, and leaves the permanent generation smaller, not larger.
        assert gc.get_freeze_count() <= frozen_before
        assert gc.get_threshold() == threshold_before


def test_span_kinds_are_the_designed_ones() -> None:
    telemetry = ProxyTelemetry(None)
    record = telemetry.begin_turn("/v1/completions", "x", None, None)
    record.prefill_start_ns = record.prefill_end_ns = record.arrival_ns + 1
    record.decode_start_ns = record.decode_end_ns = record.arrival_ns + 2
    record.end_ns = record.arrival_ns + 3
    kinds = {s.name: s.kind for s in telemetry.spans_for(record)}
    assert kinds == {semconv.SPAN_TURN: SpanKind.SERVER,
                     semconv.SPAN_INPUT_PROCESSING: SpanKind.CLIENT,
                     semconv.SPAN_GENERATION: SpanKind.CLIENT}


# --- through the emulator's vLLM-shaped servers ---------------------------------------------------
def test_multi_turn_reuse_through_emulated_vllm(tmp_path: Path) -> None:
    from kvscope.emulator import servers  # an import error must fail, not read as a skip

    emulation = servers.Emulation(servers.EmulatorConfig(enable_prompt_tokens_details=True))
    prefill, decode = emulation.add_prefill(), emulation.add_decode()
    with ServerThread(prefill.application) as p, ServerThread(decode.application) as d:
        cfg = ProxyConfig([Upstream(PREFILL_HOST, p.port)], [Upstream(DECODE_HOST, d.port)])
        otel = setup_telemetry(semconv.SERVICE_PROXY, db=str(tmp_path / "emu.duckdb"))
        telemetry = ProxyTelemetry(otel, router_ttl_s=cfg.router_ttl_s)
        try:
            with ServerThread(lambda: build_app(cfg, telemetry),
                              runner_options=SERVER_OPTIONS) as proxy, \
                    httpx.Client(base_url=proxy.url, timeout=20) as client:
                messages = [{"role": "user", "content": " ".join(f"w{i}" for i in range(400))}]
                for turn in range(3):
                    body = {"model": servers.DEFAULT_MODEL, "messages": messages,
                            "stream": turn != 1, "max_tokens": 16, "conversation_id": "emu"}
                    resp = client.post("/v1/chat/completions", json=body)
                    assert resp.status_code == 200, resp.text
                    messages = [*messages, {"role": "assistant", "content": "done"},
                                {"role": "user", "content": f"tool output {turn} " * 20}]
            spans = read_spans(telemetry)
        finally:
            otel.shutdown()
    turns = turn_spans(spans)
    assert [t["attrs"][semconv.ROUTER_LOOKUP] for t in turns] == [
        semconv.ROUTER_MISS, semconv.ROUTER_HIT, semconv.ROUTER_HIT]
    for t in turns[1:]:
        ip = children(spans, t)[semconv.SPAN_INPUT_PROCESSING]["attrs"]
        assert ip[semconv.D_METADATA_ATTACHED] == "true"
        # The emulated prefill pulled decode's KV: it reports those tokens as cached.
        assert int(ip[semconv.CACHED_TOKENS]) >= 400
        assert int(ip[semconv.REMOTE_OFFERED_TOKENS]) > 400


def test_long_histories_store_only_the_last_boundary_hashes() -> None:
    from kvscope.collector.proxy.telemetry import ProxyTelemetry, set_boundaries
    from kvscope.reuse.boundaries import BOUNDARY_HASHES_KEPT

    messages = [{"role": "user" if i % 2 else "assistant", "content": f"m{i}"} for i in range(40)]
    proxy = ProxyTelemetry(None)
    record = proxy.begin_turn("/v1/chat/completions", "x1", None, None)
    everything = boundary_hashes({"messages": messages}, KEY)[1].split(",")
    set_boundaries(record, {"messages": messages}, KEY)
    assert record.message_count == 40
    assert record.boundary_hashes.split(",") == everything[-BOUNDARY_HASHES_KEPT:]
    assert record.boundary_roles == "au" * (BOUNDARY_HASHES_KEPT // 2)
    record.end_ns = record.arrival_ns + 1
    turn = next(s for s in proxy.spans_for(record) if s.name == semconv.SPAN_TURN)
    kept = turn.attributes[semconv.MESSAGE_BOUNDARY_HASHES].split(",")
    assert turn.attributes[semconv.MESSAGE_COUNT] == 40
    assert kept == everything[-BOUNDARY_HASHES_KEPT:]
    assert turn.attributes[semconv.MESSAGE_ROLES] == record.boundary_roles
    # The previous turn's last hash is found among the next turn's: history continues.
    earlier = boundary_hashes({"messages": messages[:38]}, KEY)[1].split(",")[-1]
    assert earlier in kept
    # A record given every hash (a caller of its own) still stores the last ones only.
    record.boundary_hashes = ",".join(everything)
    turn = next(s for s in proxy.spans_for(record) if s.name == semconv.SPAN_TURN)
    assert turn.attributes[semconv.MESSAGE_BOUNDARY_HASHES].split(",") == kept


# --- clients that leave early (issue 22, defects 3 and 4) -------------------------------------


def _turn_until_stored(dep: Deployment, deadline_s: float = 10.0) -> dict[str, Any]:
    """The one turn span, once the proxy has finished and stored it."""
    deadline = time.monotonic() + deadline_s
    while not turn_spans(dep.spans()):
        assert time.monotonic() < deadline, "no turn span stored"
        time.sleep(0.05)
    (turn,) = turn_spans(dep.spans())
    return turn


_PARTIAL_BODY = b'{"model": "m", "messages": [{"role": "user", "content": "'
_UPLOADS = {
    "content-length": b"Content-Length: 100000\r\n\r\n" + _PARTIAL_BODY,
    "chunked": b"Transfer-Encoding: chunked\r\n\r\n"
               + f"{100000:x}\r\n".encode() + _PARTIAL_BODY,
}


@pytest.mark.parametrize("framing", sorted(_UPLOADS))
def test_a_client_that_aborts_its_upload_is_an_error_turn_logged_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, framing: str
) -> None:
    caplog.set_level(logging.DEBUG)
    with deployment(tmp_path) as dep:
        with socket.create_connection(("127.0.0.1", dep.proxy.port)) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\n" + _UPLOADS[framing])
            time.sleep(0.2)  # the proxy is reading the body when the client goes
        turn = _turn_until_stored(dep)
        assert turn["status"] == "STATUS_CODE_ERROR"
        assert turn["attrs"][semconv.ERROR_KIND] == semconv.ERROR_CLIENT_DISCONNECTED
        assert turn["attrs"][semconv.CLIENT_DISCONNECTED] == "true"
        assert turn["attrs"][semconv.HTTP_RESPONSE_STATUS_CODE] == "499"
        assert dep.prefill.received == [] and dep.decode.received == []
    # One line says so; no traceback, nothing logged as an error.
    said = [r.getMessage() for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0], said
    assert "while sending its request" in said[0]
    assert [r.getMessage() for r in caplog.records
            if r.levelno >= logging.ERROR or r.exc_info] == []


def test_a_client_that_leaves_during_prefill_cancels_the_prefill_call(tmp_path: Path) -> None:
    with deployment(tmp_path) as dep:
        dep.prefill.mode = "hang"  # prefill would answer only after --prefill-timeout (600 s)
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                           "stream": True, "max_tokens": 8, "conversation_id": "c"}).encode()
        with socket.create_connection(("127.0.0.1", dep.proxy.port)) as sock:
            sock.sendall(post_head("/v1/chat/completions", len(body)) + body)
            deadline = time.monotonic() + 5
            while not dep.prefill.received:  # the prefill leg is in flight
                assert time.monotonic() < deadline, "prefill never called"
                time.sleep(0.02)
        # The client is gone: prefill's request is cancelled, not left to its timeout.
        deadline = time.monotonic() + 5
        while dep.prefill.disconnects == 0:
            assert time.monotonic() < deadline, "the prefill call outlived its client"
            time.sleep(0.02)
        turn = _turn_until_stored(dep)
        assert turn["status"] == "STATUS_CODE_ERROR"
        assert turn["attrs"][semconv.ERROR_KIND] == semconv.ERROR_CLIENT_DISCONNECTED
        assert turn["attrs"][semconv.CLIENT_DISCONNECTED] == "true"
        assert turn["attrs"][semconv.HTTP_RESPONSE_STATUS_CODE] == "499"
        assert "during the prefill leg" in turn["status_message"]
        assert dep.decode.received == []


def test_kvscope_proxy_says_where_it_listens_at_info(tmp_path: Path) -> None:
    """The start-up line is INFO (shown, like vLLM's proxy's "Ready"), says that the default
    address is loopback only, and comes once the port listens: a client that waits for it is
    not refused (it once came before aiohttp bound the port; CI's client was refused)."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "kvscope.cli", "proxy", "--port", str(port), "--no-telemetry",
            "--prefiller-port", "1", "--decoder-port", "2"]
    process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    try:
        assert process.stderr is not None
        for _ in range(20):  # the start-up line, after anything else a process may print first
            lines.append(process.stderr.readline())
            if "kvscope proxy on" in lines[-1] or not lines[-1]:
                break
        refused = None
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except ConnectionRefusedError as exc:
            refused = exc
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(30)
    assert refused is None, "the start-up line came before the port listened"
    line = lines[-1]
    assert " INFO kvscope.collector.proxy.turns: kvscope proxy on http://127.0.0.1:" in line, lines
    assert "loopback only" in line


def test_a_group_sigterm_keeps_the_turn_in_flight_in_the_store(tmp_path: Path) -> None:
    """``kvscope proxy --db`` stopped by SIGTERM to its whole process group (a shell's kill of
    the group; systemd's default KillMode signals every process of the unit) while a turn
    streams: the proxy ends the turn, and its export child, signalled too, still stores it.
    Before, the child stopped at its own signal and the turn's spans were lost."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    from tests.stores import query

    db = tmp_path / "group.duckdb"
    decode = StubState(engine_id="decode-engine-001", tokens=6, chunk_delay_s=0.4)
    with ServerThread(lambda: prefill_app(StubState(engine_id="prefill-engine-001"))) as p, \
            ServerThread(lambda: decode_app(decode)) as d:
        port = free_port()
        argv = [sys.executable, "-m", "kvscope.cli", "proxy", "--port", str(port),
                "--db", str(db), "--prefiller-port", str(p.port), "--decoder-port", str(d.port)]
        process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            assert process.stderr is not None
            for _ in range(50):
                line = process.stderr.readline()
                if "kvscope proxy on" in line or not line:
                    break
            assert "kvscope proxy on" in line
            answers: list[httpx.Response] = []
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "stream": True, "max_tokens": 8, "conversation_id": "c-group"}
            client = threading.Thread(target=lambda: answers.append(httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30)))
            client.start()
            deadline = time.monotonic() + 20
            while not decode.received:  # the turn is in its decode leg
                assert client.is_alive(), "the turn ended before its decode leg"
                assert time.monotonic() < deadline
                time.sleep(0.02)
            os.killpg(process.pid, signal.SIGTERM)
            client.join(30)
            assert process.wait(60) == 0
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
    assert answers and answers[0].status_code == 200
    turns = query(db, "SELECT count(*) FROM otel_traces WHERE SpanName = ?",
                  [semconv.SPAN_TURN])
    assert turns == [(1,)]


def test_a_client_holding_a_partial_body_gets_408(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """300 connections holding partial bodies once stayed open indefinitely."""
    from kvscope.collector.proxy import app as proxy_app

    monkeypatch.setattr(proxy_app, "BODY_READ_TIMEOUT_S", 0.3)
    with deployment(tmp_path) as dep:
        answer = partial_body_answer("127.0.0.1", dep.proxy.port, "/v1/chat/completions")
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert b"request body not received within 0.3 s" in answer


def test_decodes_reported_cached_tokens_are_on_the_turn(tmp_path: Path) -> None:
    """vLLM's decode reports usage.prompt_tokens_details.cached_tokens in its stream's usage
    (with --enable-prompt-tokens-details and include_usage): recorded on the turn span; a turn
    whose decode reported none has no such attribute (not measured, not 0)."""
    with deployment(tmp_path) as dep:
        dep.decode.cached_tokens = 3
        assert dep.chat("c-usage", stream=True,
                        stream_options={"include_usage": True}).status_code == 200
        assert dep.chat("c-usage", "again", stream=True).status_code == 200
        spans = dep.spans()
    reported, silent = turn_spans(spans)
    assert reported["attrs"][semconv.DECODE_CACHED_TOKENS] == "3"
    assert semconv.DECODE_CACHED_TOKENS not in silent["attrs"]
