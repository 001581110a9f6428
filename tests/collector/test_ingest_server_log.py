"""``kvscope ingest`` of vLLM server logs (prefill, decode), alone and with the run's other files.

Lines are formatted with vLLM 0.33.0's line format and date format (``vllm/logger.py:28-33``:
``(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d]
%(message)s``, ``%m-%d %H:%M:%S``) and the exact format strings of the cited vLLM lines; the
contract tier (``tests/vllm_contract/test_server_log_lines.py``) reads lines the real vLLM
classes log.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from kvscope import semconv
from kvscope.collector.ingest import KINDS, detect, ingest, server_log
from kvscope.errors import IngestError
from kvscope.reuse import outcomes
from tests.collector.test_ingest import _count, _ledger
from tests.collector.test_ingest_proxy_log import (
    T0,
    VLLM_DATEFMT,
    VLLM_FORMAT,
    LogFile,
    _at,
    _stats,
    _vllm_turn,
)

VLLM_LINE_FORMAT = ("(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s "
                    "[%(fileinfo)s:%(lineno)d] %(message)s")  # vllm/logger.py:28-32
VLLM_LINE_DATEFMT = "%m-%d %H:%M:%S"  # vllm/logger.py:33


class ServerLogFile:
    """Lines as vLLM's logger writes them, from a given source file and line, at given times."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.formatter = logging.Formatter(VLLM_LINE_FORMAT, VLLM_LINE_DATEFMT)
        self.lines: list[str] = []

    def log(self, at: float, level: int, where: str, msg: str, *args: Any) -> None:
        filename, lineno = where.split(":")
        record = logging.LogRecord("vllm", level, filename, int(lineno), msg, args, None)
        record.created, record.msecs = at, 0.0
        record.vllm_process_name = "EngineCore_DP0"
        record.process = 4242
        record.fileinfo = filename
        self.lines.append(self.formatter.format(record))

    def write(self, mtime: float = T0 + 60) -> Path:
        self.path.write_text("\n".join(self.lines) + "\n")
        os.utime(self.path, (mtime, mtime))
        return self.path


def _metrics(log: ServerLogFile, at: float, transfers: int, failed: int, expired: int) -> None:
    values = {"Num successful transfers": transfers, "Avg xfer time (ms)": 1.5,
              "P90 xfer time (ms)": 2.0, "Avg post time (ms)": 0.2, "P90 post time (ms)": 0.3,
              "Avg MB per transfer": 4.0, "Throughput (MB/s)": 2666.667,
              "Avg number of descriptors": 32.0, "Num failed transfers": failed,
              "Num KV expired reqs": expired, "Num notifs after expiry": 0}
    # metrics.py:105-108 joins reduce()'s dict (nixl/stats.py:145-160) as "k=v, ...".
    log.log(at, logging.INFO, "metrics.py:108", "KV Transfer metrics: %s",
            ", ".join(f"{k}={v}" for k, v in values.items()))


def _prefill_log(path: Path) -> Path:
    """Prefill's view of the proxy test's workload (request ids chatcmpl-<X-Request-Id>-<8>)."""
    log = ServerLogFile(path)
    log.log(_at(0) - 30, logging.INFO, "base_scheduler.py:188",
            "Bidirectional KV transfer is enabled and the kv recompute threshold is set to %d "
            "tokens.KV blocks on D are released after a TTL of %d seconds.", 64, 480)
    # CONV_0 turn 2 was offered decode's KV (a HIT) but the read was declined: expired.
    log.log(_at(1000), logging.WARNING, "pull_worker.py:161",
            "Declining expired remote read for %s from engine %s.",
            "chatcmpl-r-0-2-Xy12Ab34", "decode-engine-0")
    # CONV_1 turn 2: the offer's remaining tokens were below the threshold (DEBUG).
    log.log(_at(2000), logging.DEBUG, "pull_scheduler.py:96",
            "Skipping remote pull for %s: %d remote tokens < threshold %d",
            "chatcmpl-r-1-2-Qw12Er34", 40, 64)
    # A failed read of CONV_0 turn 3, logged by _log_failure, then the scheduler fails it.
    context = {"failure_type": "transfer_failed", "request_id": "chatcmpl-r-0-3-Zx98Cv76",
               "engine_id": "prefill-engine-0", "remote_engine_id": "decode-engine-0",
               "remote_request_id": "chatcmpl-r-0-2-Xy12Ab34", "remote_host": "10.0.0.2",
               "remote_port": 5600, "num_local_blocks": 10, "num_remote_blocks": 10,
               "local_block_ids_sample": [1, 2, 3]}
    log.log(_at(3000), logging.ERROR, "base_worker.py:1377",
            "NIXL transfer failure: %s | Context: %s", "transfer_failed", context)
    log.log(_at(3000), logging.ERROR, "scheduler.py:3765",
            "Failing %d request(s) due to KV load failure (failure_policy=fail, %d tokens "
            "affected). Request IDs: %s", 1, 160, {"chatcmpl-r-0-3-Zx98Cv76"})
    _metrics(log, _at(3000), transfers=3, failed=1, expired=1)
    _metrics(log, _at(3000) + 10, transfers=2, failed=0, expired=0)
    log.lines.append("Traceback (most recent call last):")  # not a vLLM line: counted
    return log.write()


def test_a_vllm_server_log_is_detected_and_read(tmp_path: Path) -> None:
    path = _prefill_log(tmp_path / "prefill.log")
    assert detect(path) is KINDS[server_log.KIND]
    log = server_log.read_prefill(path)
    assert [(e.request_id, e.what) for e in log.events] == [
        ("chatcmpl-r-0-2-Xy12Ab34", semconv.TRANSFER_DECLINED_EXPIRED),
        ("chatcmpl-r-1-2-Qw12Er34", semconv.DECISION_BELOW_THRESHOLD),
        ("chatcmpl-r-0-3-Zx98Cv76", semconv.TRANSFER_FAILED),
        ("chatcmpl-r-0-3-Zx98Cv76", semconv.OUTCOME_ERROR)]
    skip = log.events[1]
    assert (skip.count_tokens, skip.threshold_tokens) == (40, 64)
    assert log.events[2].remote_engine_id == "decode-engine-0"
    assert log.metrics == {"Num successful transfers": 5, "Num failed transfers": 1,
                           "Num KV expired reqs": 1, "Num notifs after expiry": 0,
                           "MB transferred": 20.0}
    assert log.counts == {"kv_transfer_metrics": 2, "nixl_failure_transfer_failed": 1,
                          "failing_requests_lines": 1}
    # The startup line carries no per-request evidence; the traceback is not vLLM's format.
    assert log.unknown_lines == 2
    # Whole seconds in the server's local time; the year from the file's mtime.
    assert log.events[0].time_ns == int(_at(1000)) * 1_000_000_000


def test_prefill_evidence_makes_the_outcome_specific(tmp_path: Path) -> None:
    """With the prefill's log beside the stats and the proxy's log, turns the two files left
    ``unknown`` get the cause prefill logged."""
    proxy = LogFile(tmp_path / "proxy.log", "disagg_proxy", VLLM_FORMAT, VLLM_DATEFMT)
    _vllm_turn(proxy, _at(0), "r-0-1", "CONV_0", semconv.ROUTER_MISS,
               decode_id="chatcmpl-r-0-1-aaaaaaaa")
    _vllm_turn(proxy, _at(450), "r-1-1", "CONV_1", semconv.ROUTER_MISS,
               decode_id="chatcmpl-r-1-1-bbbbbbbb")
    _vllm_turn(proxy, _at(1000), "r-0-2", "CONV_0", semconv.ROUTER_HIT, age=0.6,
               offered="chatcmpl-r-0-1-aaaaaaaa", decode_id="chatcmpl-r-0-2-cccccccc")
    _vllm_turn(proxy, _at(2000), "r-1-2", "CONV_1", semconv.ROUTER_HIT, age=1.0,
               offered="chatcmpl-r-1-1-bbbbbbbb", decode_id="chatcmpl-r-1-2-dddddddd")
    _vllm_turn(proxy, _at(3000), "r-0-3", "CONV_0", semconv.ROUTER_HIT, age=1.2,
               offered="chatcmpl-r-0-2-cccccccc", decode_id="chatcmpl-r-0-3-eeeeeeee")
    db = tmp_path / "run.duckdb"
    prefill = _prefill_log(tmp_path / "prefill.log")
    result = ingest(db, [_stats(tmp_path / "stats.json"), proxy.write(),
                         f"{server_log.KIND_PREFILL}:{prefill}"])
    assert [s.kind for s in result.sources] == [
        "vllm-bench-stats", "vllm-proxy-log", server_log.KIND_PREFILL]
    rows = {(r["conversation_id"], r["turn_index"]): r for r in _ledger(db)}
    assert len(rows) == 5
    assert rows[("CONV_0", 2)]["outcome"] == outcomes.DECODE_TTL_EXPIRED
    assert rows[("CONV_0", 2)]["d2p_status"] == semconv.TRANSFER_DECLINED_EXPIRED
    assert rows[("CONV_0", 2)]["d2p_ms"] is None  # the log gives no time for the read
    assert rows[("CONV_1", 2)]["outcome"] == outcomes.BELOW_THRESHOLD
    assert rows[("CONV_1", 2)]["evidence"] == "40 < 64"
    assert rows[("CONV_0", 3)]["outcome"] == outcomes.LOAD_FAILED_ERRORED
    assert rows[("CONV_0", 3)]["errored"] is True


def test_without_a_role_a_failed_read_is_counted_not_placed(tmp_path: Path) -> None:
    db = tmp_path / "run.duckdb"
    result = ingest(db, [_prefill_log(tmp_path / "server.log")])
    (source,) = result.sources
    assert source.kind == server_log.KIND
    # The declined read (always D->P) and the skip place; the failed read's direction is the
    # role's, which the log does not show: its 2 lines add no span.
    assert source.records == 4
    assert source.spans == 2 + 1


def test_a_malformed_server_log_is_one_line_naming_file_and_line(tmp_path: Path) -> None:
    db = tmp_path / "run.duckdb"
    ingest(db, [_stats(tmp_path / "stats.json")])
    before = _count(db)
    good = _prefill_log(tmp_path / "good.log").read_text().splitlines()
    bad = tmp_path / "bad.log"
    bad.write_text("\n".join(good[:2] + [good[2].replace(good[2].split(" ")[3], "13-45", 1)])
                   + "\n")
    with pytest.raises(IngestError) as raised:
        ingest(db, [f"{server_log.KIND_PREFILL}:{bad}"])
    assert str(raised.value).startswith(f"{bad}:3: time '13-45 ")
    empty = tmp_path / "empty.log"
    empty.write_text("just text\n")
    with pytest.raises(IngestError, match=r"empty\.log:1: no line in vLLM's log format"):
        ingest(db, [empty], kind=server_log.KIND_DECODE)
    assert _count(db) == before


@pytest.mark.parametrize(("value", "message"), [
    ("9" * 5000, "the count 999999999999999999999999... is larger than 9223372036854775807"),
    ("9223372036854775808", "the count 9223372036854775808 is larger than"),
])
def test_a_count_past_int64_is_one_line_naming_file_and_line(
    tmp_path: Path, value: str, message: str
) -> None:
    good = _prefill_log(tmp_path / "good.log").read_text().splitlines()
    assert ": 40 remote tokens" in good[2]
    bad = tmp_path / "bad.log"
    bad.write_text("\n".join(good[:2] + [good[2].replace(": 40 ", f": {value} ")]) + "\n")
    with pytest.raises(IngestError) as raised:
        ingest(tmp_path / "run.duckdb", [f"{server_log.KIND_PREFILL}:{bad}"])
    assert str(raised.value).startswith(f"{bad}:3: {message}")
    assert not (tmp_path / "run.duckdb").exists()


def test_kind_prefix_names_a_known_kind_only(tmp_path: Path) -> None:
    with pytest.raises(IngestError, match="cannot read"):
        ingest(tmp_path / "run.duckdb", [f"{server_log.KIND_DECODE}:{tmp_path}/missing.log"])
    with pytest.raises(IngestError, match="cannot read"):
        ingest(tmp_path / "run.duckdb", [f"no-such-kind:{tmp_path}/x.log"])
