"""``kvscope ingest`` of vLLM server logs (prefill, decode), alone and with the run's other files.

Lines are formatted with vLLM 0.33.0's line format and date format (``vllm/logger.py:28-33``:
``(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d]
%(message)s``, ``%m-%d %H:%M:%S``) and the exact format strings of the cited vLLM lines; the
contract tier (``tests/vllm_contract/test_server_log_lines.py``) reads lines the real vLLM
classes log.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from kvscope import semconv
from kvscope.collector.ingest import KINDS, detect, ingest, server_log
from kvscope.errors import IngestError
from kvscope.reuse import outcomes
from kvscope.store.rows import TraceRows
from tests.collector.test_ingest import _count, _ledger
from tests.collector.test_ingest_proxy_log import (
    T0,
    VLLM_DATEFMT,
    VLLM_FORMAT,
    LogFile,
    _at,
    _stats,
    _vllm_turn,
    hits_log,
)

VLLM_LINE_FORMAT = ("(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s "
                    "[%(fileinfo)s:%(lineno)d] %(message)s")  # vllm/logger.py:28-32
VLLM_LINE_DATEFMT = "%m-%d %H:%M:%S"  # vllm/logger.py:33


# vllm/logging_utils/formatter.py:107-136 (ColoredFormatter): cyan process, grey time and file,
# the level in its colour.
GREY, RESET = "\033[90m", "\033[0m"
LEVEL_COLOURS = {"DEBUG": "\033[37m", "INFO": "\033[32m", "WARNING": "\033[33m",
                 "ERROR": "\033[31m", "CRITICAL": "\033[35m"}
VLLM_COLOURED_FORMAT = ("\033[0;36m(%(vllm_process_name)s pid=%(process)d)\033[0;0m "
                        f"%(levelname)s {GREY}%(asctime)s{RESET} "
                        f"{GREY}[%(fileinfo)s:%(lineno)d]{RESET} %(message)s")
PLAIN, COLOURED, JSON = "plain", "coloured", "json"
STYLES = (PLAIN, COLOURED, JSON)


class ServerLogFile:
    """Lines as vLLM's logger writes them, from a given source file and line, at given times,
    in one of its three formats: plain (``vllm`` formatter), coloured (``vllm_color``) or JSON
    (``--log-formatter json``: python-json-logger over ``formatter.py:7-9``'s fields, logging's
    default date format)."""

    def __init__(self, path: Path, style: str = PLAIN) -> None:
        self.path, self.style = path, style
        self.formatter = logging.Formatter(
            VLLM_COLOURED_FORMAT if style == COLOURED else VLLM_LINE_FORMAT, VLLM_LINE_DATEFMT)
        self.lines: list[str] = []

    def log(self, at: float, level: int, where: str, msg: str, *args: Any) -> None:
        filename, lineno = where.split(":")
        record = logging.LogRecord("vllm.x", level, filename, int(lineno), msg, args, None)
        record.created, record.msecs = at, 0.0
        record.vllm_process_name = "EngineCore_DP0"
        record.process = 4242
        record.fileinfo = filename
        if self.style == JSON:
            self.lines.append(json.dumps({
                "asctime": logging.Formatter().formatTime(record), "levelname":
                record.levelname, "name": "vllm.x", "processName": "EngineCore_DP0",
                "process": 4242, "message": record.getMessage()}))
            return
        if self.style == COLOURED:
            record.levelname = f"{LEVEL_COLOURS[record.levelname]}{record.levelname}{RESET}"
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
    # The start-up line gives the engine's settings; the traceback is not vLLM's format.
    assert log.engine == {"kv_recompute_threshold": 64, "decoder_kv_blocks_ttl": 480}
    assert log.unknown_lines == 1
    # Whole seconds in the server's local time; the year from the file's mtime.
    assert log.events[0].time_ns == int(_at(1000)) * 1_000_000_000


def test_prefill_evidence_makes_the_outcome_specific(tmp_path: Path) -> None:
    """With the prefill's log beside the stats and the proxy's log, turns the two files left
    ``unknown`` get the cause prefill logged."""
    proxy = hits_log(tmp_path / "proxy.log")
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


def _params(rid: str | None, tokens: int | None, blocks: list[int] | None) -> dict[str, Any]:
    """The kv_transfer_params vLLM's proxy sends prefill: decode's, or none to read."""
    return {"do_remote_decode": True, "do_remote_prefill": False,
            "remote_engine_id": "decode-engine-0" if rid else None,
            "remote_request_id": rid, "remote_block_ids": blocks,
            "remote_host": "10.0.0.2" if rid else None, "remote_port": 5600 if rid else None,
            "remote_num_tokens": tokens}


def _allocation(log: ServerLogFile, at: float, computed: int, external: int,
                params: dict[str, Any]) -> None:
    """The scheduler's two DEBUG lines for one request (pull_scheduler.py:52-57, 112-117)."""
    log.log(at, logging.DEBUG, "pull_scheduler.py:52",
            "NIXLConnector get_num_new_matched_tokens: num_computed_tokens=%s, "
            "kv_transfer_params=%s", computed, params)
    log.log(at, logging.DEBUG, "pull_scheduler.py:112",
            "NIXLConnector update_state_after_alloc: num_external_tokens=%s, "
            "kv_transfer_params=%s", external, params)


def _pull_log(path: Path, style: str) -> Path:
    """Prefill's log of one pulled turn (CONV_0 turn 2), a failed read (CONV_0 turn 3) and a
    notify-only request whose handshake failed (CONV_1 turn 2), at vLLM's DEBUG level."""
    log = ServerLogFile(path, style)
    log.log(_at(0) - 30, logging.INFO, "base_scheduler.py:188",
            "Bidirectional KV transfer is enabled and the kv recompute threshold is set to %d "
            "tokens.KV blocks on D are released after a TTL of %d seconds.", 64, 480)
    # Turn 1 of CONV_0: nothing to read.
    _allocation(log, _at(0), 0, 0, _params(None, None, None))
    # CONV_0 turn 2: 16 tokens of its own, 384 to load from decode's 25 blocks.
    pulled = "chatcmpl-r-0-2-Xy12Ab34"
    _allocation(log, _at(1000), 16, 384, _params("chatcmpl-r-0-1-aaaaaaaa", 400, [*range(25)]))
    log.log(_at(1000), logging.DEBUG, "pull_worker.py:61",
            "start_load_kv for request %s from remote engine %s. Num local_block_ids: %s. "
            "Num remote_block_ids: %s. ", pulled, "decode-engine-0", 24, 25)
    log.log(_at(1000) + 1, logging.DEBUG, "scheduler.py:3570",
            "Finished recving KV transfer for request %s", pulled)
    # CONV_1 turn 2: prefill's own cache covers the offer, so it only notifies decode
    # (num_external_tokens 0); the handshake for that notification fails.
    notify = "chatcmpl-r-1-2-Qw12Er34"
    _allocation(log, _at(2000), 380, 0, _params("chatcmpl-r-1-1-bbbbbbbb", 380, [*range(24)]))
    log.log(_at(2000), logging.DEBUG, "pull_worker.py:61",
            "start_load_kv for request %s from remote engine %s. Num local_block_ids: %s. "
            "Num remote_block_ids: %s. ", notify, "decode-engine-1", 0, 24)
    context = {"failure_type": "handshake_failed", "request_id": notify,
               "engine_id": "prefill-engine-0", "remote_engine_id": "decode-engine-1",
               "remote_request_id": "chatcmpl-r-1-1-bbbbbbbb", "remote_host": "10.0.0.3",
               "remote_port": 5600, "num_local_blocks": 0, "num_remote_blocks": 24,
               "local_block_ids_sample": []}
    log.log(_at(2000), logging.ERROR, "base_worker.py:1471",
            "NIXL transfer failure: %s | Context: %s", "handshake_failed", context)
    log.log(_at(2000), logging.WARNING, "base_worker.py:4011",
            "Local NIXL metadata for remote engine %s was invalidated; re-handshaking after "
            "reads drain%s.", "decode-engine-0", " and a 2s backoff")
    # CONV_0 turn 3: a read of the invalidated peer fails fast, with no per-read failure line.
    failed = "chatcmpl-r-0-3-Zx98Cv76"
    _allocation(log, _at(3000), 16, 300, _params("chatcmpl-r-0-2-cccccccc", 316, [*range(20)]))
    log.log(_at(3000), logging.WARNING, "base_worker.py:3253",
            "Skipping KV post-processing for failed request %s", failed)
    log.log(_at(3000), logging.DEBUG, "scheduler.py:3570",
            "Finished recving KV transfer for request %s", failed)
    log.log(_at(3000) + 5, logging.INFO, "loggers.py:335",
            "Engine 000: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
            "tokens/s, Running: %d reqs, Waiting: %d reqs, KV fetch: %d waiting to start, %d "
            "in progress, %d completed waiting, Preemptions: %d, %s KV cache usage: %.1f%%",
            120.0, 30.5, 1, 2, 0, 2, 0, 3, "GPU", 4.5)
    return log.write()


@pytest.mark.parametrize("style", STYLES)
def test_every_format_gives_the_same_evidence(tmp_path: Path, style: str) -> None:
    path = _pull_log(tmp_path / f"prefill-{style}.log", style)
    assert detect(path) is KINDS[server_log.KIND]
    log = server_log.read_prefill(path)
    assert log.unknown_lines == 0, path.read_text()
    assert [(e.request_id, e.what, e.count_tokens, e.local_hit_tokens) for e in log.events] == [
        ("chatcmpl-r-0-2-Xy12Ab34", semconv.DECISION_PULL, 384, 16),
        ("chatcmpl-r-0-2-Xy12Ab34", semconv.TRANSFER_OK, None, None),
        ("chatcmpl-r-0-3-Zx98Cv76", semconv.DECISION_PULL, 300, 16),
        ("chatcmpl-r-0-3-Zx98Cv76", semconv.TRANSFER_FAILED, None, None)]
    assert log.events[0].remote_engine_id == "decode-engine-0"
    assert log.events[0].offered_request_id == "chatcmpl-r-0-1-aaaaaaaa"
    # The notify-only request's failed handshake is no read (vLLM drops it).
    assert log.counts["notify_only_failures"] == 1
    assert log.counts["allocations_without_read"] == 2
    assert log.counts["remote_metadata_invalidated"] == 1
    assert log.invalidated_remote_engines == ["decode-engine-0"]
    assert log.engine == {"kv_recompute_threshold": 64, "decoder_kv_blocks_ttl": 480}
    assert log.metrics == {"Max KV fetch in progress": 2, "Max KV fetch waiting to start": 0,
                           "Preemptions": 3}
    # Whole seconds in the plain formats, milliseconds in JSON: here the same instants.
    assert log.events[1].time_ns == int(_at(1000) + 1) * 1_000_000_000


def test_a_pull_the_log_shows_is_reused_in_the_ledger(tmp_path: Path) -> None:
    """num_external_tokens and "Finished recving" are a pull and its success: the turn is no
    longer ``unknown``; the notify-only handshake failure adds no read."""
    proxy = hits_log(tmp_path / "proxy.log")
    db = tmp_path / "run.duckdb"
    prefill = _pull_log(tmp_path / "prefill.log", PLAIN)
    ingest(db, [_stats(tmp_path / "stats.json"), proxy.write(),
                f"{server_log.KIND_PREFILL}:{prefill}"])
    rows = {(r["conversation_id"], r["turn_index"]): r for r in _ledger(db)}
    pulled = rows[("CONV_0", 2)]
    assert pulled["d2p_status"] == semconv.TRANSFER_OK
    assert pulled["to_pull_tokens"] == 384
    # The offer (remote_num_tokens 400) is the reusable span; 16 were prefill's own.
    assert (pulled["outcome"], pulled["evidence"]) == (outcomes.REUSED_REMOTE,
                                                       "pulled 384, local 16")
    assert (pulled["reusable_tokens"], pulled["local_hit_tokens"],
            pulled["remote_reused_tokens"], pulled["recomputed_reusable_tokens"]) == (
        400, 16, 384, 0)
    failed = rows[("CONV_0", 3)]
    assert failed["d2p_status"] == semconv.TRANSFER_FAILED
    assert failed["remote_reused_tokens"] == 0
    notify = rows[("CONV_1", 2)]
    assert notify["d2p_status"] is None and notify["decision"] is None
    # Prefill's log shows no decision for it: what it reused is not measured.
    assert notify["remote_reused_tokens"] is None
    assert notify["recomputed_reusable_tokens"] is None


def _reissue_log(path: Path) -> Path:
    """CONV_0 turn 2 read, then preempted and allocated again; CONV_0 turn 3's read fails and,
    under policy recompute, is allocated again: vLLM 0.32.0's lines as a real prefill logged
    them (tests/vllm_real's decode_killed_recompute scenario), the second allocation's params
    marked ``_remote_blocks_processed``."""
    log = ServerLogFile(path)
    pulled, offer = "chatcmpl-r-0-2-Xy12Ab34", "chatcmpl-r-0-1-aaaaaaaa"
    _allocation(log, _at(1000), 16, 384, _params(offer, 400, [*range(25)]))
    log.log(_at(1000), logging.DEBUG, "pull_worker.py:61",
            "start_load_kv for request %s from remote engine %s. Num local_block_ids: %s. "
            "Num remote_block_ids: %s. ", pulled, "decode-engine-0", 24, 25)
    log.log(_at(1000), logging.DEBUG, "scheduler.py:3570",
            "Finished recving KV transfer for request %s", pulled)
    _allocation(log, _at(1000), 16, 384, {**_params(offer, 400, [*range(25)]),
                                          "_remote_blocks_processed": True})
    failed, second_offer = "chatcmpl-r-0-3-Zx98Cv76", "chatcmpl-r-0-2-cccccccc"
    _allocation(log, _at(3000), 32, 79, _params(second_offer, 111, [[120, 113, 102, 83]]))
    context = {"failure_type": "transfer_setup_failed", "request_id": failed,
               "engine_id": "prefill-engine-0", "remote_engine_id": "decode-engine-0",
               "remote_request_id": second_offer, "remote_host": "127.0.0.1",
               "remote_port": 5600, "num_local_blocks": 5, "num_remote_blocks": 4,
               "local_block_ids_sample": [7, 8, 9]}
    log.log(_at(3000), logging.ERROR, "pull_worker.py:562",
            "NIXL transfer failure: %s. Deferring failure reporting until outstanding "
            "transfers finish | Context: %s", "transfer_setup_failed", context)
    log.log(_at(3000), logging.WARNING, "base_worker.py:2915",
            "Skipping KV post-processing for failed request %s", failed)
    log.log(_at(3000), logging.WARNING, "scheduler.py:3774",
            "Recovered from KV load failure: %d request(s) rescheduled (%d tokens affected).",
            1, 79)
    _allocation(log, _at(3000), 32, 79, {**_params(second_offer, 111, [[120, 113, 102, 83]]),
                                         "_remote_blocks_processed": True})
    # A re-allocation of an offer no read of this log used: counted, not placed.
    _allocation(log, _at(4000), 0, 50, {**_params("chatcmpl-elsewhere", 50, [[1]]),
                                        "_remote_blocks_processed": True})
    return log.write()


def test_a_load_allocated_again_is_the_requests_reissued_load(tmp_path: Path) -> None:
    """An allocation whose params say the request's one read was set up already is a re-issued
    load (vLLM queues no read: the request waits for one that never comes), tied to the request
    whose read of the same offer came before: after a failed read (policy recompute) the turn
    is ``load_stalled``, after a good one ``preempted``, as the hooks say on the real servers."""
    path = _reissue_log(tmp_path / "prefill.log")
    log = server_log.read_prefill(path)
    assert log.unknown_lines == 0, path.read_text()
    assert [(e.request_id, e.what, e.count_tokens) for e in log.events] == [
        ("chatcmpl-r-0-2-Xy12Ab34", semconv.DECISION_PULL, 384),
        ("chatcmpl-r-0-2-Xy12Ab34", semconv.TRANSFER_OK, None),
        ("chatcmpl-r-0-2-Xy12Ab34", semconv.DECISION_REISSUED, 0),
        ("chatcmpl-r-0-3-Zx98Cv76", semconv.DECISION_PULL, 79),
        ("chatcmpl-r-0-3-Zx98Cv76", semconv.TRANSFER_FAILED, None),  # the failure line
        ("chatcmpl-r-0-3-Zx98Cv76", semconv.TRANSFER_FAILED, None),  # post-processing skipped
        ("chatcmpl-r-0-3-Zx98Cv76", semconv.DECISION_REISSUED, 0)]
    assert (log.counts["reissued_loads"], log.counts["reissued_loads_unplaced"]) == (2, 1)
    # Within one second of the plain format, the re-issue still comes after the read's decision.
    assert log.events[2].time_ns > log.events[0].time_ns
    proxy = hits_log(tmp_path / "proxy.log")
    db = tmp_path / "run.duckdb"
    ingest(db, [_stats(tmp_path / "stats.json"), proxy.write(),
                f"{server_log.KIND_PREFILL}:{path}"])
    rows = {(r["conversation_id"], r["turn_index"]): r for r in _ledger(db)}
    assert rows[("CONV_0", 3)]["outcome"] == outcomes.LOAD_STALLED
    assert rows[("CONV_0", 3)]["evidence"] == outcomes.EVIDENCE_LOAD_STALLED.format(
        semconv.TRANSFER_FAILED)
    assert rows[("CONV_0", 2)]["outcome"] == outcomes.PREEMPTED


def test_a_decode_log_s_pull_is_a_p_to_d_read_and_no_reuse_decision(tmp_path: Path) -> None:
    """On decode, an allocation with do_remote_prefill is its P→D read of prefill's blocks:
    a read, never a reuse decision (those are prefill's)."""
    log = ServerLogFile(tmp_path / "decode.log")
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_block_ids": [[1, 2, 3]], "remote_engine_id": "prefill-engine-0",
              "remote_request_id": "chatcmpl-r-0-1-pppppppp", "remote_host": "10.0.0.1",
              "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 47}
    _allocation(log, _at(0), 0, 47, params)
    log.log(_at(0) + 1, logging.DEBUG, "scheduler.py:3570",
            "Finished recving KV transfer for request %s", "chatcmpl-r-0-1-dddddddd")
    parsed = server_log.read_decode(log.write())
    assert [(e.what, e.direction) for e in parsed.events] == [
        (semconv.DECISION_PULL, semconv.DIRECTION_P_TO_D),
        (semconv.TRANSFER_OK, semconv.DIRECTION_P_TO_D)]
    rows = TraceRows()
    assert server_log.add_spans(parsed, "run", rows) == 1  # the read only
    table = rows.to_arrow().to_pylist()
    assert [r["SpanName"] for r in table] == [semconv.SPAN_KV_TRANSFER]


def test_decode_s_read_after_release_line_makes_the_read_invalid(tmp_path: Path) -> None:
    """Decode's "Potentially invalid KV blocks for unrecognized request R" (pull_worker.py:
    675-680) names the retention a read found released: the turn offered R's blocks loaded freed
    KV, ``reused_invalid`` after release, though prefill's own lines show a read that went well
    (the real tier: a read posted in time that ended after decode's reaper released the blocks).
    The retention's time held is not in the line: not measured, never 0."""
    from kvscope.analysis import retention

    proxy = LogFile(tmp_path / "proxy.log", "disagg_proxy", VLLM_FORMAT, VLLM_DATEFMT)
    _vllm_turn(proxy, _at(0), "r-0-1", "CONV_0", semconv.ROUTER_MISS,
               decode_id="chatcmpl-r-0-1-aaaaaaaa")
    _vllm_turn(proxy, _at(1000), "r-0-2", "CONV_0", semconv.ROUTER_HIT, age=0.6,
               offered="chatcmpl-r-0-1-aaaaaaaa", decode_id="chatcmpl-r-0-2-cccccccc")
    decode = ServerLogFile(tmp_path / "decode.log")
    decode.log(_at(1000) + 2, logging.WARNING, "pull_worker.py:675",
               "Potentially invalid KV blocks for unrecognized request %s were retrieved by a "
               "decode worker. They may have expired.", "chatcmpl-r-0-1-aaaaaaaa")
    db = tmp_path / "run.duckdb"
    ingest(db, [_stats(tmp_path / "stats.json"), proxy.write(),
                f"{server_log.KIND_PREFILL}:{_pull_log(tmp_path / 'prefill.log', PLAIN)}",
                f"{server_log.KIND_DECODE}:{decode.write()}"])
    rows = {(r["conversation_id"], r["turn_index"]): r for r in _ledger(db)}
    read = rows[("CONV_0", 2)]
    assert read["d2p_status"] == semconv.TRANSFER_OK
    assert (read["outcome"], read["invalid_kind"]) == (outcomes.REUSED_INVALID, "after_release")
    assert read["remote_reused_tokens"] == 0
    from kvscope.store.source import open_reader
    reader = open_reader(db)
    try:
        held = retention.shape_retentions(reader.frame(retention.RETENTION_QUERY))
    finally:
        reader.close()
    assert held.select("request_id", "reason", "duration_ns").rows() == [
        ("chatcmpl-r-0-1-aaaaaaaa", semconv.RELEASE_EXPIRED, None)]


def _keys_per_kind(db: Path) -> dict[str, set[str]]:
    from kvscope.store.query import Query
    from kvscope.store.source import open_reader

    reader = open_reader(db)
    try:
        frame = reader.frame(Query(
            "SELECT SpanName AS name, list_distinct(flatten(list(map_keys(SpanAttributes)))) "
            "AS keys FROM otel_traces WHERE list_contains($kinds, SpanName) GROUP BY 1",
            {"kinds": list(server_log.LOG_ONLY)}, name="attribute keys per span kind"))
    finally:
        reader.close()
    return {row["name"]: set(row["keys"]) for row in frame.to_dicts()}


def test_an_ingested_engine_span_has_the_engine_s_shape(tmp_path: Path) -> None:
    """Per span kind, the attribute keys of engine spans read from logs are the engine's own
    (here the emulator's, built by the same engine telemetry as the vLLM hooks') less what no
    log line gives (``NOT_IN_THE_LOG``), plus what only a log says (``LOG_ONLY``): a key the
    engine adds or renames that ingest does not follow fails here."""
    from kvscope.emulator.simulator import SimulationSettings, simulate
    from kvscope.emulator.workloads import synthetic

    live_db = tmp_path / "live.duckdb"
    simulate(synthetic.generate(conversations=6, seed=3), live_db,
             SimulationSettings(faults={"transfer_fail": 0.3}))
    live = _keys_per_kind(live_db)
    decode = ServerLogFile(tmp_path / "decode.log")
    decode.log(_at(1000) + 2, logging.WARNING, "pull_worker.py:675",
               "Potentially invalid KV blocks for unrecognized request %s were retrieved by a "
               "decode worker. They may have expired.", "chatcmpl-r-0-1-aaaaaaaa")
    logged = tmp_path / "logged.duckdb"
    ingest(logged, [_stats(tmp_path / "stats.json"),
                    f"{server_log.KIND_PREFILL}:{_prefill_log(tmp_path / 'p1.log')}",
                    f"{server_log.KIND_PREFILL}:{_pull_log(tmp_path / 'p2.log', PLAIN)}",
                    f"{server_log.KIND_DECODE}:{decode.write()}"])
    post = _keys_per_kind(logged)
    assert set(live) == set(post) == set(server_log.LOG_ONLY)
    for kind in server_log.LOG_ONLY:
        assert post[kind] - live[kind] == server_log.LOG_ONLY[kind], kind
        assert live[kind] - post[kind] == server_log.NOT_IN_THE_LOG[kind], kind
