"""``kvscope ingest`` of a P/D proxy's log, alone and joined to the benchmark's stats.

vLLM's lines are made by Python's logging with the format, date format, logger name and format
strings of vLLM 0.33.0's ``disagg_proxy_multiturn.py`` (``dpm.py``: basicConfig at lines
90-94, logger at 95, messages at 131-156, 368-370, 397-405, 414-430, 441-445), in the order
its handler emits them; kvscope proxy's lines come from its own ``_log_lookup`` /
``_log_offer`` (``collector/proxy/app.py``) through the kvscope CLI's format. The contract tier
(``tests/vllm_contract/test_ingest_round_trip.py``) ingests a log the real vLLM proxy wrote.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import duckdb
import httpx
import pytest

from kvscope import semconv
from kvscope.collector.ingest import KINDS, detect, ingest, proxy_log
from kvscope.collector.proxy import ProxyTelemetry
from kvscope.collector.proxy import app as proxy_app
from kvscope.collector.proxy.conversation import ConversationId
from kvscope.collector.proxy.telemetry import (
    TurnRecord,
    decode_attributes,
    prefill_attributes,
    turn_attributes,
)
from kvscope.errors import IngestError
from kvscope.reuse import outcomes
from kvscope.reuse.router import GUARD_EDITED, Lookup
from tests.collector.test_ingest import Turn, _count, _ledger, write_stats
from tests.stores import query

VLLM_FORMAT = "%(asctime)s [%(levelname)s] %(name)s: %(message)s"  # dpm.py:91
VLLM_DATEFMT = "%Y-%m-%d %H:%M:%S"  # dpm.py:92
KVSCOPE_CLI_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # kvscope/cli.py main()
# The benchmark's last response ends here (Unix s), a whole second so vLLM's times are exact.
T0 = 1_764_600_000.0


class LogFile:
    """Lines written by one logger through one formatter, at chosen times."""

    def __init__(self, path: Path, name: str, fmt: str, datefmt: str | None) -> None:
        self.path, self.name = path, name
        self.formatter = logging.Formatter(fmt, datefmt)
        self.lines: list[str] = []

    def log(self, at: float, level: int, msg: str, *args: Any) -> None:
        record = logging.LogRecord(self.name, level, __file__, 0, msg, args, None)
        record.created, record.msecs = at, (at - int(at)) * 1000
        self.lines.append(self.formatter.format(record))

    def raw(self, line: str) -> None:
        self.lines.append(line)

    def write(self) -> Path:
        self.path.write_text("\n".join(self.lines) + "\n")
        return self.path


def _vllm_turn(log: LogFile, at: float, rid: str, conv: str, lookup: str,
               age: float | None = None, offered: str | None = None,
               prefill_ms: float = 30.0, decode_id: str | None = None) -> None:
    """What vLLM's _handle_request and ConversationKVCache log for one request, in order."""
    info = logging.INFO
    if lookup == semconv.ROUTER_HIT:
        log.log(at, info, "conv=%s: cache HIT (age=%.1fs)", conv, age)  # dpm.py:138-142
        log.log(at, info, "[%s] conv=%s: sending D's cached blocks to P (remote_request_id=%s)",
                rid, conv, offered)  # dpm.py:414-419
    else:
        if lookup == semconv.ROUTER_STALE:
            log.log(at, info, "conv=%s: stale cache entry (age=%.1fs > ttl=%.1fs), discarding",
                    conv, age, 450.0)  # dpm.py:131-136
        log.log(at, info, "[%s] conv=%s: cache MISS", rid, conv)  # dpm.py:430
    log.log(at + prefill_ms / 1000, info, "[%s] Prefill done in %.0fms", rid,
            prefill_ms)  # dpm.py:441-445
    log.raw('INFO:     127.0.0.1:51234 - "POST /v1/chat/completions HTTP/1.1" 200 OK')
    if decode_id is not None:
        log.log(at + 0.2, info, "conv=%s: cached D blocks (remote_request_id=%s, blocks=%d)",
                conv, decode_id, 7)  # dpm.py:150-156


# CONV_0: miss, hit, stale; CONV_1: miss with no params back from decode, then a miss.
WORKLOAD = [
    Turn("CONV_0", 1, 0.0, 400.0, 120.0),
    Turn("CONV_1", 1, 450.0, 380.0, 110.0),
    Turn("CONV_0", 2, 1000.0, 300.0, 40.0),
    Turn("CONV_1", 2, 2000.0, 310.0, 45.5),
    Turn("CONV_0", 3, 3000.0, 320.0, 42.0),
]
LAST_END_MS = 3320.0


def _at(turn_start_ms: float) -> float:
    """Unix time of a turn that started ``turn_start_ms`` into the workload."""
    return T0 - (LAST_END_MS - turn_start_ms) / 1000


def _vllm_log(path: Path) -> Path:
    log = LogFile(path, "disagg_proxy", VLLM_FORMAT, VLLM_DATEFMT)
    log.log(_at(0) - 5, logging.INFO, "Ready: %d prefill, %d decode instances", 1, 1)
    log.raw("INFO:     Uvicorn running on http://127.0.0.1:8000 (Press CTRL+C to quit)")
    _vllm_turn(log, _at(0), "r-0-1", "CONV_0", semconv.ROUTER_MISS, prefill_ms=35,
               decode_id="chatcmpl-r-0-1-aaaaaaaa")
    _vllm_turn(log, _at(450), "r-1-1", "CONV_1", semconv.ROUTER_MISS, prefill_ms=31)
    _vllm_turn(log, _at(1000), "r-0-2", "CONV_0", semconv.ROUTER_HIT, age=0.6,
               offered="chatcmpl-r-0-1-aaaaaaaa", prefill_ms=12,
               decode_id="chatcmpl-r-0-2-bbbbbbbb")
    _vllm_turn(log, _at(2000), "r-1-2", "CONV_1", semconv.ROUTER_MISS, prefill_ms=33,
               decode_id="chatcmpl-r-1-2-cccccccc")
    _vllm_turn(log, _at(3000), "r-0-3", "CONV_0", semconv.ROUTER_STALE, age=451.2,
               prefill_ms=36, decode_id="chatcmpl-r-0-3-dddddddd")
    return log.write()


def hits_log(path: Path) -> LogFile:
    """vLLM's proxy log of the workload where every follow-up turn is a router hit (decode
    returned its params every turn); written by ``.write()``."""
    proxy = LogFile(path, "disagg_proxy", VLLM_FORMAT, VLLM_DATEFMT)
    for at, rid, conv, offered, decode_id, age in (
            (0, "r-0-1", "CONV_0", None, "chatcmpl-r-0-1-aaaaaaaa", None),
            (450, "r-1-1", "CONV_1", None, "chatcmpl-r-1-1-bbbbbbbb", None),
            (1000, "r-0-2", "CONV_0", "chatcmpl-r-0-1-aaaaaaaa", "chatcmpl-r-0-2-cccccccc", 0.6),
            (2000, "r-1-2", "CONV_1", "chatcmpl-r-1-1-bbbbbbbb", "chatcmpl-r-1-2-dddddddd", 1.0),
            (3000, "r-0-3", "CONV_0", "chatcmpl-r-0-2-cccccccc", "chatcmpl-r-0-3-eeeeeeee",
             1.2)):
        _vllm_turn(proxy, _at(at), rid, conv,
                   semconv.ROUTER_MISS if offered is None else semconv.ROUTER_HIT, age=age,
                   offered=offered, decode_id=decode_id)
    return proxy


def _stats(path: Path) -> Path:
    write_stats(path, WORKLOAD)
    os.utime(path, ns=(int(T0 * 1e9), int(T0 * 1e9)))
    return path


def test_a_vllm_proxy_log_is_detected_and_read(tmp_path: Path) -> None:
    path = _vllm_log(tmp_path / "proxy.log")
    assert detect(path) is KINDS[proxy_log.KIND]
    log = proxy_log.read(path)
    by_id = {r.x_request_id: r for r in log.requests}
    assert list(by_id) == ["r-0-1", "r-1-1", "r-0-2", "r-1-2", "r-0-3"]
    assert [(r.conversation_id, r.turn_index, r.lookup) for r in log.requests] == [
        ("CONV_0", 1, semconv.ROUTER_MISS), ("CONV_1", 1, semconv.ROUTER_MISS),
        ("CONV_0", 2, semconv.ROUTER_HIT), ("CONV_1", 2, semconv.ROUTER_MISS),
        ("CONV_0", 3, semconv.ROUTER_STALE)]
    assert by_id["r-0-2"].entry_age_s == 0.6
    assert by_id["r-0-2"].offered_request_id == "chatcmpl-r-0-1-aaaaaaaa"
    assert by_id["r-0-3"].entry_age_s == 451.2
    assert [r.prefill_ms for r in log.requests] == [35, 31, 12, 33, 36]
    assert [r.params_returned for r in log.requests] == [True, False, True, True, True]
    assert by_id["r-1-2"].decode_request_id == "chatcmpl-r-1-2-cccccccc"
    # vLLM's proxy logs whole seconds, in its host's local time.
    assert by_id["r-0-1"].time_ns == int(_at(0)) * 1_000_000_000
    # Uvicorn's lines (one banner, one access line per request) are counted, not errors.
    assert log.unknown_lines == 1 + 5
    assert log.writers == ["disagg_proxy"]


def test_joined_to_the_benchmark_each_turn_takes_the_proxys_evidence(tmp_path: Path) -> None:
    db = tmp_path / "run.duckdb"
    result = ingest(db, [_stats(tmp_path / "stats.json"), _vllm_log(tmp_path / "proxy.log")])
    assert result.joined == len(WORKLOAD)
    assert [s.kind for s in result.sources] == ["vllm-bench-stats", proxy_log.KIND]
    # The stats: 5 turns and 3 tool waits; the log: each request's prefill and decode legs.
    assert [s.spans for s in result.sources] == [5 + 3, 5 * 2]
    rows = {(r["conversation_id"], r["turn_index"]): r for r in _ledger(db)}
    assert len(rows) == len(WORKLOAD)  # one row per turn: the sources were joined, not added
    expected = {
        ("CONV_0", 1): (outcomes.FIRST_TURN, semconv.ROUTER_MISS, 35.0),
        ("CONV_1", 1): (outcomes.FIRST_TURN, semconv.ROUTER_MISS, 31.0),
        # A hit says P was offered decode's KV; whether it pulled is not in these sources.
        ("CONV_0", 2): (outcomes.UNKNOWN, semconv.ROUTER_HIT, 12.0),
        # Decode returned no params for turn 1 (no "cached D blocks" line).
        ("CONV_1", 2): (outcomes.NO_DECODE_METADATA, semconv.ROUTER_MISS, 33.0),
        ("CONV_0", 3): (outcomes.ROUTER_TTL_EXPIRED, semconv.ROUTER_STALE, 36.0),
    }
    for key, (outcome, lookup, prefill_ms) in expected.items():
        row = rows[key]
        assert (row["outcome"], row["router_lookup"], row["prefill_ms"]) == (
            outcome, lookup, prefill_ms), row
        turn = next(t for t in WORKLOAD if (t.conversation, t.turn) == key)
        assert row["ttft_ms"] == turn.ttft_ms  # the client's
        assert row["turn_ms"] == pytest.approx(turn.latency_ms)
        assert row["decode_ms"] is None  # the proxy's log has no end of the decode leg
        assert row["x_request_id"] == f"r-{key[0][-1]}-{key[1]}"
    assert "not observed" in rows[("CONV_0", 2)]["evidence"]
    assert rows[("CONV_0", 3)]["router_entry_age_s"] == 451.2


def test_the_proxy_log_alone_gives_turns_whose_time_is_not_measured(tmp_path: Path) -> None:
    db = tmp_path / "run.duckdb"
    ingest(db, [_vllm_log(tmp_path / "proxy.log")])
    rows = {(r["conversation_id"], r["turn_index"]): r for r in _ledger(db)}
    assert {k: r["outcome"] for k, r in rows.items()} == {
        ("CONV_0", 1): outcomes.FIRST_TURN, ("CONV_1", 1): outcomes.FIRST_TURN,
        ("CONV_0", 2): outcomes.UNKNOWN, ("CONV_1", 2): outcomes.NO_DECODE_METADATA,
        ("CONV_0", 3): outcomes.ROUTER_TTL_EXPIRED}
    for row in rows.values():
        assert row["turn_ms"] is None and row["ttft_ms"] is None, row  # not logged: not 0
        assert row["observer"] == semconv.OBSERVER_PROXY_LOG
        assert row["prefill_ms"] is not None


def test_without_conversation_ids_the_join_is_by_time(tmp_path: Path) -> None:
    log = LogFile(tmp_path / "proxy.log", "disagg_proxy", VLLM_FORMAT, VLLM_DATEFMT)
    for index, turn in enumerate(WORKLOAD):
        rid = f"nc-{index}"
        at = _at(turn.start_ms)
        # dpm.py:397-405, then the lookup is skipped and the MISS line logs an empty conv.
        log.log(at, logging.WARNING, "[%s] No conversation_id provided — KV cache reuse "
                "disabled for this request. Add a 'conversation_id' field to enable "
                "cross-turn KV sharing. When using "
                "benchmarks/multi_turn/benchmark_serving_multi_turn.py, pass "
                "--send-conversation-id (off by default).", rid)
        log.log(at, logging.INFO, "[%s] conv=%s: cache MISS", rid, "")
        log.log(at + 0.03, logging.INFO, "[%s] Prefill done in %.0fms", rid, 30.0)
    db = tmp_path / "run.duckdb"
    result = ingest(db, [_stats(tmp_path / "stats.json"), log.write()])
    assert result.joined == len(WORKLOAD)
    rows = _ledger(db)
    assert len(rows) == len(WORKLOAD)
    assert {r["outcome"] for r in rows} == {outcomes.NO_CONVERSATION_ID}
    assert {r["x_request_id"] for r in rows} == {f"nc-{i}" for i in range(len(WORKLOAD))}


def test_kvscope_proxys_own_turn_lines_are_read(tmp_path: Path) -> None:
    path = tmp_path / "kvscope-proxy.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(KVSCOPE_CLI_FORMAT))
    turn_log = logging.getLogger(proxy_log.KVSCOPE_LOGGER)
    turn_log.addHandler(handler)
    level = turn_log.level
    turn_log.setLevel(logging.INFO)
    try:
        proxy_app._log_lookup("k-1", "conv-a", Lookup(semconv.ROUTER_MISS), 450.0)
        proxy_app._log_offer("k-1", "conv-a", Lookup(semconv.ROUTER_MISS))
        proxy_app.turn_log.info("[%s] Prefill done in %.0fms", "k-1", 41.7)  # app.py:532
        proxy_app.turn_log.info("conv=%s: cached D blocks (remote_request_id=%s, blocks=%d)",
                                "conv-a", "cmpl-k-1-0", 3)  # app.py:605
        params = {"remote_request_id": "cmpl-k-1-0"}
        proxy_app._log_lookup("k-2", "conv-a", Lookup(semconv.ROUTER_HIT, 2.25, params), 450.0)
        proxy_app._log_offer("k-2", "conv-a", Lookup(semconv.ROUTER_HIT, 2.25, params))
        proxy_app._log_lookup("k-3", None, Lookup(semconv.ROUTER_NO_CONVERSATION_ID), 450.0)
    finally:
        turn_log.removeHandler(handler)
        turn_log.setLevel(level)
        handler.close()
    log = proxy_log.read(path)
    assert [(r.x_request_id, r.conversation_id, r.turn_index, r.lookup, r.entry_age_s)
            for r in log.requests] == [
        ("k-1", "conv-a", 1, semconv.ROUTER_MISS, None),
        ("k-2", "conv-a", 2, semconv.ROUTER_HIT, 2.2),  # logged as %.1f
        ("k-3", None, None, semconv.ROUTER_NO_CONVERSATION_ID, None)]
    assert log.requests[0].prefill_ms == 42 and log.requests[0].params_returned is True
    assert log.requests[0].time_ns % 1_000_000 == 0  # kvscope's lines keep milliseconds
    assert log.unknown_lines == 0 and log.writers == [proxy_log.KVSCOPE_LOGGER]


def test_the_reuse_guards_line_is_read_as_a_hit_whose_params_were_withheld(
        tmp_path: Path) -> None:
    """kvscope proxy --reuse-guard on an edited history: the router hit, the guard logged its
    line (the proxy's real ``_guard``) and prefill got MISS params. Ingest reads it as the live
    proxy records it (lookup hit, guard history_edited, no params attached to prefill), so the
    ledger says prefix_diverged, not a router miss."""
    path = tmp_path / "kvscope-proxy.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(KVSCOPE_CLI_FORMAT))
    loggers = [logging.getLogger(proxy_log.KVSCOPE_LOGGER)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    config = proxy_app.ProxyConfig([proxy_app.Upstream("127.0.0.1", 1)],
                                   [proxy_app.Upstream("127.0.0.1", 2)], reuse_guard=True)
    proxy = proxy_app.Proxy(config, ProxyTelemetry(None, router_ttl_s=450.0))
    record = proxy.telemetry.begin_turn("/v1/chat/completions", "k-2", None, None)
    edited = {"messages": [{"role": "user", "content": "another first message"},
                           {"role": "assistant", "content": "done"},
                           {"role": "user", "content": "and a question"}]}
    params = {"remote_request_id": "cmpl-k-1-0"}
    hit = Lookup(semconv.ROUTER_HIT, 2.25, params, history="the previous turn's last hash")
    try:
        proxy_app._log_lookup("k-1", "conv-a", Lookup(semconv.ROUTER_MISS), 450.0)
        proxy_app._log_offer("k-1", "conv-a", Lookup(semconv.ROUTER_MISS))
        proxy_app.turn_log.info("[%s] Prefill done in %.0fms", "k-1", 41.7)
        proxy_app.turn_log.info("conv=%s: cached D blocks (remote_request_id=%s, blocks=%d)",
                                "conv-a", "cmpl-k-1-0", 3)
        proxy_app._log_lookup("k-2", "conv-a", hit, 450.0)
        sent, _ = proxy._guard(edited, hit, record)
        proxy_app._log_offer("k-2", "conv-a", sent)
        proxy_app.turn_log.info("[%s] Prefill done in %.0fms", "k-2", 40.2)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
        handler.close()
    assert record.reuse_guard == GUARD_EDITED and sent.params is None
    log = proxy_log.read(path)
    second = log.requests[1]
    assert (second.x_request_id, second.lookup, second.entry_age_s, second.reuse_guard,
            second.offered_request_id) == ("k-2", semconv.ROUTER_HIT, 2.2, GUARD_EDITED, None)
    assert proxy_log.turn_values(second)[semconv.REUSE_GUARD] == GUARD_EDITED
    assert log.requests[0].reuse_guard is None and log.unknown_lines == 0


def _bad(tmp_path: Path) -> list[tuple[Path, str]]:
    good = _vllm_log(tmp_path / "good.log").read_text().splitlines()
    binary = tmp_path / "binary.log"
    binary.write_bytes(("\n".join(good[:3]) + "\n").encode() + b"\xff\xfe\n")
    bad_time = tmp_path / "bad-time.log"
    bad_time.write_text("\n".join(good[:2] + [
        "2026-13-45 10:00:00 [INFO] disagg_proxy: [r-x] conv=c: cache MISS"]) + "\n")
    return [(binary, f"{binary}:4: not UTF-8 text"),
            (bad_time, f"{bad_time}:3: time '2026-13-45 10:00:00' is not a date and time")]


def test_a_malformed_log_is_one_line_naming_file_and_line_and_keeps_the_store(
        tmp_path: Path) -> None:
    db = tmp_path / "run.duckdb"
    ingest(db, [_stats(tmp_path / "stats.json")])
    before = _count(db)
    for path, message in _bad(tmp_path):
        with pytest.raises(IngestError) as raised:
            ingest(db, [path], kind=proxy_log.KIND)
        assert str(raised.value) == message
        assert "\n" not in str(raised.value)
    assert _count(db) == before


def test_a_file_named_a_proxy_log_with_no_proxy_line_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    path.write_text('INFO:     127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK\n' * 3)
    with pytest.raises(IngestError, match=r"access\.log:1: no line of vLLM's or kvscope's "
                                          r"proxy log .* in 3 lines"):
        ingest(tmp_path / "run.duckdb", [path], kind=proxy_log.KIND)


def test_re_ingesting_a_log_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "run.duckdb"
    log = _vllm_log(tmp_path / "proxy.log")
    ingest(db, [_stats(tmp_path / "stats.json"), log])
    before = _count(db)
    with pytest.raises(IngestError, match="already in"):
        ingest(db, [log])
    assert _count(db) == before


def test_cli_names_each_source_its_counts_and_the_join(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvscope import cli

    db = tmp_path / "run.duckdb"
    stats, log = _stats(tmp_path / "stats.json"), _vllm_log(tmp_path / "proxy.log")
    assert cli.main(["ingest", "--db", str(db), "--run-label", "ON", str(stats),
                     f"{proxy_log.KIND}:{log}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        f"{stats}: vllm-bench-stats, 5 records, 8 spans",
        f"{log}: vllm-proxy-log, 5 records, 10 spans, 6 lines of no known pattern (counted)",
        "5 client turns joined to the proxy's record of them"]
    assert lines[3].startswith("run ") and lines[3].endswith(f"('ON') written to {db}")
    assert len(lines) == 4


def _uvicorn_failure(log: LogFile, status: int, url: str) -> None:
    """What uvicorn logs when vLLM's proxy lets an upstream error propagate: the access line
    of the 500 its error handler sent, then the ASGI traceback ending in httpx's exception."""
    log.raw('INFO:     127.0.0.1:51234 - "POST /v1/chat/completions HTTP/1.1" 500 '
            "Internal Server Error")
    log.raw("ERROR:    Exception in ASGI application")
    log.raw("Traceback (most recent call last):")
    log.raw('  File "/app/disagg_proxy_multiturn.py", line 201, in _send_to_prefill')
    log.raw("    resp.raise_for_status()")
    log.raw("httpx.HTTPStatusError: Server error "
            f"'{status} Internal Server Error' for url '{url}'")
    log.raw("For more information check: https://example.invalid/status/500")


def test_an_upstream_failure_is_an_errored_turn_and_a_retry_is_the_same_turn(
        tmp_path: Path) -> None:
    log = LogFile(tmp_path / "proxy.log", "disagg_proxy", VLLM_FORMAT, VLLM_DATEFMT)
    url = "http://127.0.0.1:8100/v1/chat/completions"
    _vllm_turn(log, _at(0), "r-0-1", "CONV_0", semconv.ROUTER_MISS,
               decode_id="chatcmpl-r-0-1-aaaaaaaa")
    # CONV_0 turn 2: prefill answers 500; the client retries, and the retry goes through.
    log.log(_at(1000), logging.INFO, "conv=%s: cache HIT (age=%.1fs)", "CONV_0", 0.6)
    log.log(_at(1000), logging.INFO,
            "[%s] conv=%s: sending D's cached blocks to P (remote_request_id=%s)",
            "r-0-2a", "CONV_0", "chatcmpl-r-0-1-aaaaaaaa")
    _uvicorn_failure(log, 500, url)
    _vllm_turn(log, _at(1001), "r-0-2b", "CONV_0", semconv.ROUTER_MISS,
               decode_id="chatcmpl-r-0-2b-bbbbbbbb")
    _vllm_turn(log, _at(2000), "r-0-3", "CONV_0", semconv.ROUTER_HIT, age=1.0,
               offered="chatcmpl-r-0-2b-bbbbbbbb", decode_id="chatcmpl-r-0-3-cccccccc")
    # CONV_1 turn 1 fails and is not retried.
    log.log(_at(3000), logging.INFO, "[%s] conv=%s: cache MISS", "r-1-1", "CONV_1")
    _uvicorn_failure(log, 503, url)
    path = log.write()

    parsed = proxy_log.read(path)
    by_id = {r.x_request_id: r for r in parsed.requests}
    first = by_id["r-0-2a"]
    assert (first.error_status, first.retried_by, first.turn_index) == (500, "r-0-2b", 2)
    assert first.error_cause is not None and first.error_cause.startswith(
        "httpx.HTTPStatusError: Server error '500")
    assert (by_id["r-0-2b"].turn_index, by_id["r-0-2b"].attempts) == (2, 2)
    assert by_id["r-0-3"].turn_index == 3
    # The status is the proxy's answer (uvicorn's 500); the upstream's 503 is in the cause.
    assert (by_id["r-1-1"].error_status, by_id["r-1-1"].retried_by) == (500, None)
    assert parsed.errors_not_placed == 0

    db = tmp_path / "run.duckdb"
    ingest(db, [path])
    rows = {(r["conversation_id"], r["turn_index"]): r for r in _ledger(db)}
    # The retry is turn 2, once; the failed attempt is no extra turn.
    assert sorted(rows) == [("CONV_0", 1), ("CONV_0", 2), ("CONV_0", 3), ("CONV_1", 1)]
    assert rows[("CONV_0", 2)]["x_request_id"] == "r-0-2b"
    assert rows[("CONV_0", 2)]["errored"] is False
    assert rows[("CONV_1", 1)]["errored"] is True
    con = duckdb.connect(str(db), read_only=True)
    try:
        attempt = con.execute(
            "SELECT StatusCode, StatusMessage, SpanAttributes[?] FROM otel_traces "
            "WHERE SpanName = ?",
            [semconv.RETRIED_BY_REQUEST_ID, semconv.SPAN_TURN_ATTEMPT]).fetchall()
        cause = con.execute(
            "SELECT StatusMessage, SpanAttributes[?] FROM otel_traces WHERE SpanName = ? "
            "AND SpanAttributes[?] = 'r-1-1'",
            [semconv.HTTP_RESPONSE_STATUS_CODE, semconv.SPAN_TURN,
             semconv.X_REQUEST_ID]).fetchall()
    finally:
        con.close()
    assert [(a[0], a[2]) for a in attempt] == [("STATUS_CODE_ERROR", "r-0-2b")]
    assert attempt[0][1].startswith("httpx.HTTPStatusError")
    assert cause[0][0].startswith("httpx.HTTPStatusError: Server error '503")
    assert cause[0][1] == "500"


def test_a_failure_with_several_requests_in_prefill_is_not_placed(tmp_path: Path) -> None:
    log = LogFile(tmp_path / "proxy.log", "disagg_proxy", VLLM_FORMAT, VLLM_DATEFMT)
    log.log(_at(0), logging.INFO, "[%s] conv=%s: cache MISS", "r-0-1", "CONV_0")
    log.log(_at(0), logging.INFO, "[%s] conv=%s: cache MISS", "r-1-1", "CONV_1")
    _uvicorn_failure(log, 500, "http://127.0.0.1:8100/v1/chat/completions")
    parsed = proxy_log.read(log.write())
    assert parsed.errors_not_placed == 1
    assert not any(r.errored for r in parsed.requests)


# --- the proxy's span shape ------------------------------------------------------------------


def _shape(record: TurnRecord, router_ttl_s: float | None) -> dict[str, set[str]]:
    """The attribute keys per span kind the proxy's own shaping gives ``record``."""
    return {semconv.SPAN_TURN: set(turn_attributes(record, router_ttl_s)),
            semconv.SPAN_INPUT_PROCESSING: set(prefill_attributes(record)),
            semconv.SPAN_GENERATION: set(decode_attributes(record))}


def test_a_proxy_log_s_record_is_the_proxy_s_record_less_what_no_line_gives() -> None:
    """Every field the live proxy fills, against every field a proxy log can give: per span
    kind, the proxy's keys the log's record lacks are exactly ``NOT_IN_THE_LOG``, and the log's
    record has no key of its own (what only a log says is added by ingest: ``LOG_ONLY``). A key
    the proxy adds that ingest does not follow, or a stale declaration, fails here."""
    live = {kind: set() for kind in proxy_log.LOG_ONLY}
    for leg in (semconv.LEG_PREFILL, semconv.LEG_DECODE):
        record = TurnRecord(
            "x", "/v1/chat/completions", 1, 2, 3, 4, 5,
            conversation=ConversationId("c", semconv.ID_SOURCE_BODY,
                                        semconv.ID_REJECTED_TOO_LONG),
            model="m", stream=True, prompt_tokens=900, cached_tokens=880,
            decode_cached_tokens=896, lookup=semconv.ROUTER_HIT, lookup_age_s=2.0,
            offered_request_id="cmpl-1", offered_tokens=880, d_metadata_attached=True,
            reuse_guard=GUARD_EDITED, reply_hash="ab", prefill_instance="p:1",
            decode_instance="d:1", prefill_start_ns=2, prefill_end_ns=3,
            prefill_request_id="p-1", decode_start_ns=3, first_token_ns=4, decode_end_ns=5,
            decode_request_id="cmpl-2", output_tokens=20, chunks=21, finish_reasons=["stop"],
            retention_returned=True, remote_num_tokens=919, retention_blocks=58,
            message_count=3, boundary_hashes="aa,bb,cc", boundary_roles="sua",
            boundary_key_id="k", client_disconnected=True, end_ns=6)
        record.fail(leg, semconv.ERROR_UPSTREAM_STATUS, 502, "upstream 500")
        for kind, keys in _shape(record, 450.0).items():
            live[kind] |= keys
    request = proxy_log.ProxyRequest(
        7, "x", "c", 2, 1, 1_000_000, semconv.ROUTER_HIT, entry_age_s=2.0,
        offered_request_id="cmpl-1", prefill_ms=40.0, prefill_end_ns=2, reuse_guard=GUARD_EDITED,
        decode_request_id="cmpl-2", retention_blocks=58, cached_ns=3,
        error_cause="httpx.HTTPStatusError: Server error '500'", error_status=500, attempts=2)
    logged = _shape(proxy_log.turn_record(request), None)  # as ingest shapes it
    for kind in proxy_log.LOG_ONLY:
        assert logged[kind] <= live[kind], kind
        assert live[kind] - logged[kind] == proxy_log.NOT_IN_THE_LOG[kind], kind


def _keys_per_turn(db: Path, service: str) -> dict[tuple[str, str], set[str]]:
    """Attribute keys per (X-Request-Id, span kind) of the proxy spans ``service`` stored."""
    rows = query(db, "SELECT SpanAttributes['kvscope.x_request_id'], SpanName, "
                     "map_keys(SpanAttributes) FROM otel_traces "
                     "WHERE ServiceName = ? AND list_contains(?, SpanName)",
                 [service, list(proxy_log.LOG_ONLY)])
    return {(rid, name): set(keys) for rid, name, keys in rows}


def test_a_turn_ingested_from_kvscope_proxys_log_carries_the_live_turns_keys(
        tmp_path: Path) -> None:
    """The same turns seen live (kvscope proxy's spans, in front of the emulated servers) and
    read back from that proxy's log: per turn and span kind, ingest's keys are the live keys
    less ``NOT_IN_THE_LOG`` plus ``LOG_ONLY`` (turns: a miss, a hit, an edited history the
    reuse guard withheld decode's params from, a turn with no conversation id)."""
    from kvscope.emulator.launcher import EmulatedCluster
    from kvscope.emulator.servers import EmulatorConfig

    path = tmp_path / "kvscope-proxy.log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(KVSCOPE_CLI_FORMAT))
    turn_log = logging.getLogger(proxy_log.KVSCOPE_LOGGER)
    level = turn_log.level
    turn_log.addHandler(handler)
    turn_log.setLevel(logging.INFO)
    live_db = tmp_path / "live.duckdb"
    system = {"role": "system", "content": "you are a coding agent " + "rules " * 150}
    task = {"role": "user", "content": "fix the failing test " + "context " * 60}
    config = EmulatorConfig(time_scale=50.0, prefill_prefix_caching=False, stall_timeout_s=0.2)
    try:
        with EmulatedCluster(config, db=live_db, proxy=True, reuse_guard=True) as cluster:
            url = f"{cluster.proxy_url}/v1/chat/completions"

            def ask(messages: list[dict[str, str]], cid: str | None) -> str:
                body: dict[str, Any] = {"model": "kvscope-emulated", "messages": messages,
                                        "max_tokens": 40, "stream": False}
                if cid is not None:
                    body["conversation_id"] = cid
                answer = httpx.post(url, json=body, timeout=30)
                assert answer.status_code == 200, answer.text
                return str(answer.json()["choices"][0]["message"]["content"])

            reply = ask([system, task], "conv-shape")
            ask([system, task, {"role": "assistant", "content": reply},
                 {"role": "user", "content": "tool result " + "line " * 80}], "conv-shape")
            ask([system, task, {"role": "assistant", "content": "[compacted]"},
                 {"role": "user", "content": "next"}], "conv-shape")
            ask([system, task], None)
    finally:
        turn_log.removeHandler(handler)
        turn_log.setLevel(level)
        handler.close()
    post_db = tmp_path / "post.duckdb"
    ingest(post_db, [f"{proxy_log.KIND}:{path}"])
    live = _keys_per_turn(live_db, semconv.SERVICE_PROXY)
    post = _keys_per_turn(post_db, semconv.SERVICE_PROXY_LOG)
    assert len({rid for rid, _ in post}) == 4
    # Without a conversation id the log says nothing of decode's params: no decode leg.
    (no_id,) = query(post_db, "SELECT SpanAttributes['kvscope.x_request_id'] FROM otel_traces "
                              "WHERE SpanName = ? AND SpanAttributes['kvscope.router.lookup'] "
                              "= ?", [semconv.SPAN_TURN, semconv.ROUTER_NO_CONVERSATION_ID])
    assert set(live) - set(post) == {(no_id[0], semconv.SPAN_GENERATION)}
    guards = query(post_db, "SELECT count(*) FROM otel_traces WHERE "
                            "SpanAttributes['kvscope.reuse_guard'] = ?", [GUARD_EDITED])
    assert guards == [(1,)]
    log_only = {**proxy_log.LOG_ONLY, semconv.SPAN_TURN: (
        proxy_log.LOG_ONLY[semconv.SPAN_TURN] - {semconv.TURN_ATTEMPTS})}  # no retry here
    for (rid, kind), keys in post.items():
        assert keys - live[rid, kind] == log_only[kind], (rid, kind)
        # A success's status and a passed guard check are not logged (PARTLY_LOGGED).
        assert live[rid, kind] - keys <= proxy_log.NOT_IN_THE_LOG[kind] | (
            proxy_log.PARTLY_LOGGED if kind == semconv.SPAN_TURN else set()), (rid, kind)
