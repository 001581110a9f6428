"""A ledger from engine spans alone: a deployment routed by something other than kvscope's proxy.

The emulated engines export their hook spans (as the vLLM plugin does through ``kvscope serve``),
vLLM's own ``llm_request`` spans join them, and a router that writes no span — kvscope proxy
with telemetry off, in vLLM's proxy's place — sits in front. Each request becomes one ledger
row from what the engines saw; what needs the conversation is unknown. Ingesting that router's
log later turns the same requests into turns of the same run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import polars as pl
import pytest

from kvscope import semconv
from kvscope.analysis.ledger import ledger
from kvscope.analysis.task_time import task_table
from kvscope.collector.ingest import ingest
from kvscope.collector.ingest.spans import KIND_SERVER, add_span, ingest_id
from kvscope.collector.proxy.app import SERVER_OPTIONS, ProxyConfig, Upstream, build_app, turn_log
from kvscope.emulator.launcher import EmulatedCluster
from kvscope.emulator.servers import EmulatorConfig
from kvscope.reuse import outcomes
from kvscope.store.database import open_store
from kvscope.store.rows import TraceRows
from kvscope.store.schema import RUNS_TABLE, TRACES_TABLE
from kvscope.store.source import open_reader
from kvscope.store.writer import insert_arrow
from tests.collector.upstream_stub import ServerThread
from tests.stores import query

MODEL = "kvscope-emulated"
OUTPUT = 30


def _upstream(url: str) -> Upstream:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return Upstream(host, int(port))


def _conversation(url: str, cid: str) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"agent {cid} " + "rules " * 120},
        {"role": "user", "content": "task " + "context " * 30}]
    for step in range(3):
        body = {"model": MODEL, "messages": messages, "max_tokens": OUTPUT, "ignore_eos": True,
                "stream": False, "conversation_id": cid}
        resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        messages += [resp.json()["choices"][0]["message"],
                     {"role": "user", "content": f"tool {step} " + "line " * 20}]


def _llm_requests(db: Path, run_id: str) -> int:
    """vLLM's own request spans for each request the engines saw: prefill's (one token) and
    decode's, as its tracing exports them to kvscope serve (which stamps the run)."""
    keys = [k for (k,) in query(
        db, "SELECT DISTINCT regexp_replace(SpanAttributes[?], '-[0-9A-Za-z]{8}$', '') "
            "FROM otel_traces WHERE SpanName = ?",
        [semconv.VLLM_REQUEST_ID, semconv.SPAN_REUSE_DECISION])]
    rows = TraceRows()
    for key in keys:
        for leg, max_tokens, completion in (("p", 1, 1), ("d", OUTPUT, OUTPUT)):
            request_id = f"{key}-{leg}0000000"
            add_span(rows, resource_attrs=[("service.name", "vllm"), (semconv.RUN_ID, run_id)],
                     service="vllm", name=semconv.SPAN_VLLM_REQUEST,
                     trace_id=ingest_id("t", request_id, size=16),
                     span_id=ingest_id("s", request_id, size=8), parent="", kind=KIND_SERVER,
                     start_ns=1_767_225_600_000_000_000, end_ns=1_767_225_600_100_000_000,
                     values={semconv.VLLM_GEN_AI_REQUEST_ID: request_id,
                             semconv.VLLM_PROMPT_TOKENS: 250,
                             semconv.VLLM_COMPLETION_TOKENS: completion,
                             semconv.VLLM_MAX_TOKENS: max_tokens})
    con = open_store(db)
    try:
        insert_arrow(con, TRACES_TABLE, rows.to_arrow())
    finally:
        con.close()
    return len(keys)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """(store, the router's log, the engines' run id) after two 3-turn conversations."""
    tmp = tmp_path_factory.mktemp("engine-only")
    db, log = tmp / "run.duckdb", tmp / "proxy.log"
    handler = logging.FileHandler(log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    level = turn_log.level
    turn_log.addHandler(handler)
    turn_log.setLevel(logging.INFO)
    try:
        config = EmulatorConfig(time_scale=50.0, prefill_prefix_caching=False)
        with EmulatedCluster(config, db=db) as cluster:
            proxy = ProxyConfig(prefillers=[_upstream(u) for u in cluster.prefill_urls],
                                decoders=[_upstream(u) for u in cluster.decode_urls])
            with ServerThread(lambda: build_app(proxy), runner_options=SERVER_OPTIONS) as p:
                for cid in ("a", "b"):
                    _conversation(p.url, cid)
            run_id = cluster.run_id
    finally:
        turn_log.removeHandler(handler)
        turn_log.setLevel(level)
        handler.close()
    assert _llm_requests(db, run_id) == 6
    return db, log, run_id


def _ledger(db: Path) -> pl.DataFrame:
    reader = open_reader(db)
    try:
        return ledger(reader)
    finally:
        reader.close()


def test_engine_spans_alone_build_one_row_per_request(
        deployment: tuple[Path, Path, str]) -> None:
    db, _, run_id = deployment
    assert query(db, "SELECT count(*) FROM otel_traces WHERE SpanName = ?",
                 [semconv.SPAN_TURN]) == [(0,)]
    rows = _ledger(db)
    assert rows.height == 6
    assert set(rows["observer"]) == {semconv.OBSERVER_ENGINE}
    assert set(rows["run_id"]) == {run_id}
    assert rows["conversation_id"].null_count() == 6 and rows["turn_index"].null_count() == 6
    assert rows["prompt_tokens"].to_list() == [250] * 6
    assert rows["output_tokens"].to_list() == [OUTPUT] * 6  # decode's leg, not prefill's one
    # Rows in arrival order: each conversation's first request found no offer, its later ones
    # pulled decode's KV (an engine fact); whether a first request had an earlier turn is not.
    first = rows.filter(pl.col("decision") == semconv.DECISION_NO_OFFER)
    assert first.height == 2 and set(first["outcome"]) == {outcomes.UNKNOWN}
    assert all(e.startswith("engine spans only: prefill was offered no decode KV")
               for e in first["evidence"])
    later = rows.filter(pl.col("decision") == semconv.DECISION_PULL)
    assert later.height == 4 and set(later["outcome"]) == {outcomes.REUSED_REMOTE}
    assert all(n > 0 for n in later["remote_reused_tokens"])
    assert set(later["reuse_validity"]) == {"not_verified"}  # no history to check against
    # No conversation, so no task.
    assert task_table(rows).height == 0


def test_ingesting_the_routers_log_joins_the_same_run(
        deployment: tuple[Path, Path, str], tmp_path: Path) -> None:
    source, log, run_id = deployment
    db = tmp_path / "copy.duckdb"
    db.write_bytes(source.read_bytes())
    result = ingest(db, [log])
    assert result.run_id == run_id
    assert query(db, f"SELECT count(*) FROM {RUNS_TABLE}") == [(1,)]
    rows = _ledger(db).sort("conversation_id", "turn_index")
    assert rows.height == 6
    assert set(rows["observer"]) == {semconv.OBSERVER_PROXY_LOG}
    assert rows["conversation_id"].to_list() == ["a"] * 3 + ["b"] * 3
    assert rows["outcome"].to_list() == [outcomes.FIRST_TURN, outcomes.REUSED_REMOTE,
                                         outcomes.REUSED_REMOTE] * 2
    # The file is recorded with the run: ingesting it again is refused.
    with pytest.raises(Exception, match="already in"):
        ingest(db, [log])


def test_a_stray_engine_request_in_a_proxied_run_adds_no_row(tmp_path: Path) -> None:
    """A request sent to an engine directly (a warm-up) in a run the proxy recorded."""
    db = tmp_path / "proxied.duckdb"
    config = EmulatorConfig(time_scale=50.0, prefill_prefix_caching=False)
    with EmulatedCluster(config, db=db, proxy=True) as cluster:
        assert cluster.proxy_url is not None
        _conversation(cluster.proxy_url, "a")
        body = {"model": MODEL, "prompt": "warm up " * 50, "max_tokens": 2,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
        resp = httpx.post(cluster.prefill_urls[0] + "/v1/completions", json=body,
                          headers={"X-Request-Id": "warm-up"}, timeout=30)
        assert resp.status_code == 200, resp.text
    assert query(db, "SELECT count(*) FROM otel_traces WHERE SpanAttributes[?] LIKE ?",
                 [semconv.VLLM_REQUEST_ID, "%warm-up%"])[0][0] >= 1
    rows = _ledger(db)
    assert rows.height == 3 and rows["observer"].null_count() == 3
