"""vLLM's own ``llm_request`` spans join the ledger by request id: engine TTFT and queueing.

The spans carry the attributes ``OutputProcessor.do_tracing`` sets (vLLM 0.33.0
``vllm/v1/engine/output_processor.py:941-1001``, names from ``vllm/tracing/utils.py:15-44``,
declared once in :mod:`kvscope.semconv`), as the OTLP receiver stores them; the contract tier
(``tests/vllm_contract/test_vllm_spans_in_ledger.py``) makes them with ``do_tracing`` itself.
Here the run's turns come from ingested files (the benchmark's stats and vLLM's proxy log):
a run with no kvscope span at all.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from kvscope import semconv
from kvscope.analysis.ledger import ENGINE_EVIDENCE_LOG
from kvscope.analysis.task_time import task_table
from kvscope.collector.ingest import ingest, server_log
from kvscope.collector.ingest.spans import KIND_SERVER, add_span, ingest_id
from kvscope.store.database import open_store
from kvscope.store.rows import TraceRows
from kvscope.store.schema import TRACES_TABLE
from kvscope.store.writer import insert_arrow
from tests.collector.test_ingest import _ledger
from tests.collector.test_ingest_proxy_log import _at, _stats, _vllm_log
from tests.collector.test_ingest_server_log import _prefill_log

_NS = 1_000_000_000


def _llm_request(rows: TraceRows, external_id: str, arrival: float, ttft_s: float,
                 queue_s: float, max_tokens: int) -> None:
    """One span as do_tracing builds it: start at arrival, vLLM's attribute names."""
    add_span(rows, resource_attrs=[("service.name", "vllm")], service="vllm",
             name=semconv.SPAN_VLLM_REQUEST, trace_id=ingest_id("t", external_id, arrival,
                                                                size=16),
             span_id=ingest_id("s", external_id, arrival, size=8), parent="", kind=KIND_SERVER,
             start_ns=int(arrival * _NS), end_ns=int((arrival + ttft_s + 0.01) * _NS),
             values={semconv.VLLM_GEN_AI_REQUEST_ID: external_id,
                     semconv.VLLM_TIME_TO_FIRST_TOKEN: ttft_s,
                     semconv.VLLM_TIME_IN_QUEUE: queue_s,
                     semconv.VLLM_E2E: ttft_s + 0.01,
                     semconv.VLLM_PROMPT_TOKENS: 170,
                     semconv.VLLM_MAX_TOKENS: max_tokens})


def _add(db: Path, rows: TraceRows) -> None:
    con = open_store(db)
    try:
        insert_arrow(con, TRACES_TABLE, rows.to_arrow())
    finally:
        con.close()


def test_engine_ttft_and_queueing_join_ingested_turns(tmp_path: Path) -> None:
    db = tmp_path / "run.duckdb"
    ingest(db, [_stats(tmp_path / "stats.json"), _vllm_log(tmp_path / "proxy.log")])
    rows = TraceRows()
    # CONV_0 turn 2 (X-Request-Id r-0-2): prefill's leg (max_tokens 1), then decode's.
    start = _at(1000)
    _llm_request(rows, "chatcmpl-r-0-2", start, ttft_s=0.012, queue_s=0.004, max_tokens=1)
    _llm_request(rows, "chatcmpl-r-0-2", start + 0.020, ttft_s=0.005, queue_s=0.001,
                 max_tokens=64)
    # CONV_1 turn 1 (r-1-1): only decode's engine traced.
    _llm_request(rows, "chatcmpl-r-1-1", _at(450) + 0.05, ttft_s=0.007, queue_s=0.0,
                 max_tokens=64)
    _add(db, rows)
    ledger = {r["x_request_id"]: r for r in _ledger(db)}
    assert len(ledger) == 5  # vLLM's spans add no turn: they join the ones the files gave
    turn = ledger["r-0-2"]
    # First leg's arrival → last leg's first token; the legs' queues summed.
    assert turn["engine_ttft_ms"] == pytest.approx(25.0, abs=0.01)
    assert turn["engine_queue_ms"] == pytest.approx(5.0)
    assert turn["ttft_ms"] == 40.0  # the client's, kept apart
    assert ledger["r-1-1"]["engine_ttft_ms"] == pytest.approx(7.0, abs=0.01)
    assert ledger["r-1-1"]["engine_queue_ms"] == 0.0  # measured: no wait
    for rid in ("r-0-1", "r-1-2", "r-0-3"):
        assert ledger[rid]["engine_ttft_ms"] is None and ledger[rid]["engine_queue_ms"] is None


    table = {r["conversation_id"]: r for r in task_table(
        pl.DataFrame(list(ledger.values()))).to_dicts()}
    assert table["CONV_0"]["engine_ttft_sum_s"] == pytest.approx(0.025, abs=1e-5)
    assert table["CONV_0"]["engine_queue_s"] == pytest.approx(0.005)
    assert table["CONV_1"]["engine_ttft_sum_s"] == pytest.approx(0.007, abs=1e-5)


def test_a_decision_from_a_server_log_is_not_hook_evidence(tmp_path: Path) -> None:
    db = tmp_path / "run.duckdb"
    ingest(db, [_stats(tmp_path / "stats.json"), _vllm_log(tmp_path / "proxy.log"),
                f"{server_log.KIND_PREFILL}:{_prefill_log(tmp_path / 'prefill.log')}"])
    ledger = _ledger(db)
    by_id = {r["x_request_id"]: r for r in ledger}
    assert by_id["r-1-2"]["engine_evidence"] == ENGINE_EVIDENCE_LOG
    assert by_id["r-0-1"]["engine_evidence"] is None


    # The log names no read that worked: the transfer part of task time is not measured.
    table = task_table(pl.DataFrame(ledger))
    assert table["transfer_s"].to_list() == [None, None]


def _verdict_text(db: Path) -> str:
    from kvscope.analysis import registry
    from kvscope.analysis.verdict import verdict_sentences

    with registry.AnalysisContext.open(db) as ctx:
        (row,) = registry.run(ctx, "verdict").to_dicts()
    return " ".join(verdict_sentences(row))


def test_the_verdict_names_the_sources_and_what_the_absent_ones_would_tell(
        tmp_path: Path) -> None:
    db = tmp_path / "run.duckdb"
    ingest(db, [_stats(tmp_path / "stats.json"), _vllm_log(tmp_path / "proxy.log")])
    text = _verdict_text(db)
    assert ("Sources: the client's record (the benchmark's --stats-json-output), the proxy's "
            "log.") in text
    assert "Not in this run: prefill's reuse decision" in text
    assert "such turns are unknown" in text  # why the HIT turn reads unknown
    assert "vLLM's own request traces (llm_request) (would have told engine-side TTFT" in text
    assert "decode's retention spans" in text
    # With prefill's log, the decision is there but not the hooks' read bytes and times.
    db2 = tmp_path / "run2.duckdb"
    ingest(db2, [_stats(tmp_path / "stats.json"), _vllm_log(tmp_path / "proxy.log"),
                 f"{server_log.KIND_PREFILL}:{_prefill_log(tmp_path / 'prefill.log')}"])
    text = _verdict_text(db2)
    assert "the prefill server's log." in text
    assert "Not in this run: kvscope's engine hooks (would have told tokens pulled" in text
    assert "prefill's reuse decision" not in text
