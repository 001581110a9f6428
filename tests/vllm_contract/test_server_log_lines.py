"""vLLM 0.33.0 server log lines made by the real classes, read by ``kvscope ingest``.

The records come from running the code paths the parser cites (CPU, no model): the real
``Scheduler`` with the real ``NixlConnector`` (``tests/vllm_contract/test_scheduler_e2e.py``'s
engines) skipping a pull below ``kv_recompute_threshold`` and failing a request whose read failed
under ``kv_load_failure_policy="fail"``; ``KVConnectorLogging.log`` over real
``NixlKVConnectorStats``; ``NixlBaseConnectorWorker._log_failure``. Each record is written by
vLLM's own formatter (``vllm/logger.py``'s format and date format through
``vllm.logging_utils.NewLineFormatter``), as a server's log file holds it. The worker-side lines
(declined expired read, potentially invalid blocks, released expired blocks) come from the real
NIXL worker in ``tests/vllm_contract/test_real_worker_claims.py``, which reads them back with
:func:`write_vllm_log` too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.v1.outputs import KVConnectorOutput

from kvscope import semconv
from kvscope.collector.ingest import server_log
from tests.vllm_contract import test_scheduler_e2e as e2e
from tests.vllm_contract.test_real_scheduler_claims import Runner, add

# The module-scoped tiny-Llama fixtures of the end-to-end tests, registered here too.
model_dir = e2e.model_dir
model_config = e2e.model_config

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"


PLAIN, COLOURED, JSON = "plain", "coloured", "json"
STYLES = (PLAIN, COLOURED, JSON)


def vllm_formatter(style: str = PLAIN) -> logging.Formatter:
    """vLLM's own formatter of a style, as ``vllm/logger.py``'s logging config builds it: the
    ``vllm`` (NewLineFormatter) and ``vllm_color`` (ColoredFormatter) formatters of
    DEFAULT_LOGGING_CONFIG, or, for ``--log-formatter json``, python-json-logger's JsonFormatter
    with ``JSON_FORMAT`` (logger.py:241-248)."""
    from vllm.logger import _DATE_FORMAT, _FORMAT
    from vllm.logging_utils import ColoredFormatter, NewLineFormatter
    from vllm.logging_utils.formatter import JSON_FORMAT

    if style == JSON:
        from pythonjsonlogger.jsonlogger import JsonFormatter

        return JsonFormatter(JSON_FORMAT)
    kind = ColoredFormatter if style == COLOURED else NewLineFormatter
    return kind(_FORMAT, _DATE_FORMAT, log_level="DEBUG")


def write_vllm_log(path: Path, records: Iterable[logging.LogRecord],
                   style: str = PLAIN) -> Path:
    """``records`` as vLLM's own handler formats them (vllm/logger.py DEFAULT_LOGGING_CONFIG)."""
    formatter = vllm_formatter(style)
    for record in records:
        if not hasattr(record, "vllm_process_name"):
            # A record made before vLLM installed its record factory: the factory's own
            # fallback (vllm/logger.py:47-48).
            record.vllm_process_name = record.processName
    path.write_text("".join(formatter.format(r) + "\n" for r in records))
    return path


class Collect(logging.Handler):
    """Every record of the ``vllm`` logger tree, DEBUG included."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        # Freeze the message now, as vLLM's StreamHandler formats it when emitted: the args can
        # be objects vLLM changes right after logging them (update_state_after_alloc's
        # kv_transfer_params gains _remote_blocks_processed), which a later format would show.
        record.msg, record.args = record.getMessage(), None
        self.records.append(record)


# The loggers of the cited lines. A module imported before vLLM configured logging (here: by
# other tests of this process) has its logger disabled by that dictConfig, and this process may
# run with a raised level; a server imports them after, at INFO, so they log here as there.
LOGGERS = (f"{NIXL}.pull_scheduler", f"{NIXL}.base_worker", "vllm.v1.core.sched.scheduler",
           "vllm.distributed.kv_transfer.kv_connector.v1.metrics", f"{NIXL}.base_scheduler")
# At DEBUG, as a server at VLLM_LOGGING_LEVEL=DEBUG logs them: the skip, the allocation and
# "Finished recving" lines.
DEBUG_LOGGERS = (LOGGERS[0], LOGGERS[2])


@pytest.fixture
def vllm_records() -> Iterator[list[logging.LogRecord]]:
    handler = Collect()
    root = logging.getLogger("vllm")
    loggers = [logging.getLogger(name) for name in LOGGERS]
    saved = [(log.level, log.disabled) for log in loggers]
    root.addHandler(handler)
    for log in loggers:
        # DEBUG for the scheduler's lines; the others as a server at its default INFO logs
        # them (this test process may have raised the "vllm" logger's level).
        log.disabled = False
        log.setLevel(logging.DEBUG if log.name in DEBUG_LOGGERS else logging.INFO)
    try:
        yield handler.records
    finally:
        root.removeHandler(handler)
        for log, (level, disabled) in zip(loggers, saved, strict=True):
            log.setLevel(level)
            log.disabled = disabled


def test_prefill_lines_of_the_real_scheduler_connector_and_stats(
        tmp_path: Path, model_config: Any,  # noqa: F811
        vllm_records: list[logging.LogRecord]) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import (
        NixlBaseConnectorWorker,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

    below, failed = "chatcmpl-turn-below-Ab12Cd34", "chatcmpl-turn-failed-Ef56Gh78"
    pulled = "chatcmpl-turn-pulled-Ij90Kl12"
    # 1. The pull scheduler skips an offer 48 tokens long: below the threshold of 64.
    # Prefix caching off: the second request's prompt is the first's.
    p = e2e.Engine(model_config, "kv_producer", prefix_caching=False)
    p.add(below, 170, e2e.offer(48))
    p.step()
    # 2. A pulled read that goes well: the scheduler allocates 160 tokens to load (DEBUG
    # update_state_after_alloc) and the worker reports the read finished ("Finished recving").
    add(p, pulled, 170, e2e.offer(160), SamplingParams(max_tokens=1))
    runner = Runner(p)
    for _ in range(3):
        out = p.scheduler.schedule()
        p.scheduler.update_from_output(out, runner.answer(out))
    # 3. A pulled read fails (the worker's report) under the default policy "fail".
    # The NIXL worker reports a failed non-HMA read as failed_recving with every local block
    # invalid (base_worker.py get_transfer_results; test_real_scheduler_claims.read_then_fail).
    req = add(p, failed, 170, e2e.offer(160), SamplingParams(max_tokens=1))
    out = p.scheduler.schedule()
    [local] = out.kv_connector_metadata.reqs_to_recv[failed].local_block_ids
    p.scheduler.update_from_output(out, Runner(p).answer(out, KVConnectorOutput()))
    out = p.scheduler.schedule()
    p.scheduler.update_from_output(out, Runner(p).answer(out, KVConnectorOutput(
        finished_recving={failed}, failed_recving={failed}, invalid_block_ids=set(local))))
    assert req.is_finished()
    # 4. The worker's structured failure line for that read.
    NixlBaseConnectorWorker._log_failure(
        SimpleNamespace(engine_id="prefill-engine", _recving_metadata={}),
        failure_type="transfer_failed", req_id=failed)
    # 5. One logging interval of real connector stats: 2 reads, 1 failure, 1 expired request.
    stats = NixlKVConnectorStats()
    for _ in range(2):
        stats.record_transfer(SimpleNamespace(xferDuration=1500, postDuration=200,
                                              totalBytes=4 * 2**20, descCount=32))
    stats.record_failed_transfer()
    stats.record_kv_expired_req()
    kv_logging = KVConnectorLogging(p.config.kv_transfer_config)
    kv_logging.observe(stats.data)
    kv_logging.log()

    texts = []
    for style in STYLES:
        path = write_vllm_log(tmp_path / f"prefill-{style}.log", vllm_records, style)
        texts.append(path.read_text())
        _check_prefill_log(path, below, pulled, failed)
    # Three formats indeed: colour codes in one, JSON objects in another.
    assert "\x1b[" in texts[1] and "\x1b[" not in texts[0]
    assert all(line.startswith("{") for line in texts[2].splitlines())


def _check_prefill_log(path: Path, below: str, pulled: str, failed: str) -> None:
    text = path.read_text()
    assert "Skipping remote pull for" in text and "Failing 1 request(s)" in text, text
    assert "update_state_after_alloc: num_external_tokens=160" in text, text
    assert f"Finished recving KV transfer for request {pulled}" in text, text
    log = server_log.read_prefill(path)
    assert [(e.request_id, e.what) for e in log.events] == [
        (below, semconv.DECISION_BELOW_THRESHOLD),
        (pulled, semconv.DECISION_PULL),
        (pulled, semconv.TRANSFER_OK),
        (failed, semconv.DECISION_PULL),
        (failed, semconv.OUTCOME_ERROR),
        (failed, semconv.TRANSFER_FAILED)], text
    assert (log.events[0].count_tokens, log.events[0].threshold_tokens) == (48, 64)
    pull = log.events[1]
    assert (pull.count_tokens, pull.local_hit_tokens, pull.offered_tokens) == (160, 0, 160)
    assert pull.remote_engine_id == "decode-engine"
    assert log.metrics == {"Num successful transfers": 2, "Num failed transfers": 1,
                           "Num KV expired reqs": 1, "Num notifs after expiry": 0,
                           "MB transferred": 8.0}
    assert log.counts["kv_transfer_metrics"] == 1
    assert "allocated_reads_never_named" not in log.counts
    # The connector's start-up line (base_scheduler.py:187-194) with this engine's settings.
    assert log.engine == {"kv_recompute_threshold": 64, "decoder_kv_blocks_ttl": 480}, text
