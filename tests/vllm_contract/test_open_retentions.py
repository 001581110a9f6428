"""Retentions decode still holds when vLLM stops reach the store, open, on the real scheduler.

vLLM's API server stops its engine core with SIGTERM and, with its default
``--shutdown-timeout 0``, SIGKILL right after (``vllm/v1/utils.py`` ``shutdown``): no hook, atexit
handler or signal handler of the engine core runs in time. So a retention held longer than
``retention_snapshot_s`` is recorded open (no end) while the engine runs, and its release's span
later supersedes that snapshot; when vLLM does give the engine core time, its shutdown
(``EngineCore.shutdown`` → ``Scheduler.shutdown`` → the connector's) records every retention
still held and sends the spans.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvscope import semconv
from tests.vllm_contract.conftest import Captured, block_bytes, instrumented
from tests.vllm_contract.test_scheduler_hooks import finish, request


@pytest.fixture
def snapshots() -> Iterator[Captured]:
    """Instrumented with a short retention_snapshot_s."""
    with instrumented(retention_snapshot_s=0.2) as cap:
        yield cap


def _open(cap: Captured) -> list[Any]:
    return [s for s in cap.spans(semconv.SPAN_KV_RETENTION)
            if s.attributes[semconv.RETENTION_RELEASE_REASON] == semconv.RELEASE_OPEN]


def test_a_long_held_retention_is_recorded_open_then_its_release(
    snapshots: Captured, make_scheduler_connector: Any
) -> None:
    sched = make_scheduler_connector("kv_consumer", engine_id="d0").connector_scheduler
    req = request("d-held", 170, {"do_remote_prefill": False, "do_remote_decode": False})
    finish(sched, req, RequestStatus.FINISHED_STOPPED, 11)
    assert _open(snapshots) == []  # not yet held for 0.2 s
    deadline = time.monotonic() + 10
    while not _open(snapshots) and time.monotonic() < deadline:
        time.sleep(0.05)
    [snapshot] = _open(snapshots)
    a = snapshot.attributes
    assert a[semconv.VLLM_REQUEST_ID] == "d-held"
    assert a[semconv.RETENTION_BLOCKS] == 11 and a[semconv.RETENTION_BYTES] == 11 * block_bytes()
    assert a[semconv.REMOTE_NUM_TOKENS] == 173
    assert snapshot.end_time == snapshot.start_time  # open: no end
    time.sleep(0.5)
    assert len(_open(snapshots)) == 1  # recorded once
    sched.update_connector_output(KVConnectorOutput(finished_sending={"d-held"}))
    spans = snapshots.spans(semconv.SPAN_KV_RETENTION)
    assert [s.attributes[semconv.RETENTION_RELEASE_REASON] for s in spans] == [
        semconv.RELEASE_OPEN, semconv.RELEASE_NOTIFIED]
    assert spans[1].start_time == snapshot.start_time and spans[1].end_time > spans[1].start_time


def test_the_engine_stopping_records_what_it_still_holds(
    captured: Captured, make_scheduler_connector: Any
) -> None:
    """The default snapshot time (10 s) is not reached: the connector's shutdown records it."""
    connector = make_scheduler_connector("kv_consumer", engine_id="d1")
    sched = connector.connector_scheduler
    for i in range(3):
        req = request(f"d-last-{i}", 100, {"do_remote_prefill": False,
                                           "do_remote_decode": False})
        finish(sched, req, RequestStatus.FINISHED_STOPPED, 4)
    sched.update_connector_output(KVConnectorOutput(finished_sending={"d-last-0"}))
    assert [s.attributes[semconv.RETENTION_RELEASE_REASON]
            for s in captured.spans(semconv.SPAN_KV_RETENTION)] == [semconv.RELEASE_NOTIFIED]
    connector.shutdown()  # what vLLM's Scheduler.shutdown calls
    opened = _open(captured)
    assert sorted(s.attributes[semconv.VLLM_REQUEST_ID] for s in opened) == [
        "d-last-1", "d-last-2"]
    assert all(s.end_time == s.start_time for s in opened)
