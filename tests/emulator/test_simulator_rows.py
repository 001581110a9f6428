"""The simulator's direct row path stores exactly the rows the SDK span path stores."""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path
from typing import Any

import pytest

from kvscope import semconv
from kvscope.child import ChildStartError, pack, unpack
from kvscope.collector.engine_telemetry import (
    ENGINE_RECORDS,
    KvRetentionRecord,
    KvTransferRecord,
    ReuseDecisionRecord,
)
from kvscope.collector.proxy.telemetry import ProxyTelemetry
from kvscope.emulator import simulator, span_process
from kvscope.emulator.simulator import (
    FAULT_CLOCK_SKEW,
    FAULT_HANDSHAKE,
    FAULT_INVALID_PARAMS,
    FAULT_NO_CONVERSATION_ID,
    FAULT_PREEMPT,
    FAULT_PROXY_RESTART,
    FAULT_STRIP_METADATA,
    FAULT_TRANSFER,
    SimulationResult,
    SimulationSettings,
    Simulator,
)
from kvscope.emulator.workloads import synthetic
from kvscope.emulator.workloads.model import Workload
from kvscope.store.query import Query
from kvscope.store.source import open_reader

_ALL_SPANS = {
    semconv.SPAN_TURN, semconv.SPAN_INPUT_PROCESSING, semconv.SPAN_GENERATION,
    semconv.SPAN_TOOL_WAIT, semconv.SPAN_REUSE_DECISION, semconv.SPAN_KV_TRANSFER,
    semconv.SPAN_KV_RETENTION,
}


@pytest.fixture(scope="module")
def workload() -> Workload:
    return synthetic.generate(
        seed=5, conversations=12, turns_p50=6, max_turns=10, system_prompt_tokens=512,
        new_input_tokens_p50=300, think_time_p50_s=5, think_time_p90_s=600,
        reset_probability=0.1,
    )


def _run(workload: Workload, db: Path, settings: SimulationSettings, direct: bool,
         monkeypatch: pytest.MonkeyPatch, *, process: bool = False, truth: bool = True
         ) -> tuple[SimulationResult, list[tuple[Any, ...]]]:
    """Simulate with deterministic span and trace ids; the stored rows in insertion order."""
    init = ProxyTelemetry.__init__

    def seeded(self: ProxyTelemetry, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._rand.seed(11)  # the proxy's trace and span ids

    with monkeypatch.context() as patch:
        patch.setattr(ProxyTelemetry, "__init__", seeded)
        random.seed(13)  # the engine tracers' RandomIdGenerator
        sim = Simulator(settings)
        sim._direct_rows = direct
        # process: spans are built and written by the span process (any size of workload).
        sim._process_rows_min_turns = 0 if process else 10**12
        result = sim.run(workload, db, truth=truth)
    reader = open_reader(db)
    _, rows = reader.rows(Query("SELECT * FROM otel_traces ORDER BY rowid"))
    return result, rows


def _normalised(rows: list[tuple[Any, ...]], run_id: str) -> list[str]:
    # The run id (a fresh uuid per run) is in resource attributes and X-Request-Ids.
    return [repr(row).replace(run_id, "<run>") for row in rows]


@pytest.mark.parametrize("faults", [
    {},
    {FAULT_HANDSHAKE: 0.15, FAULT_TRANSFER: 0.15, FAULT_PREEMPT: 0.15, FAULT_CLOCK_SKEW: 0.1,
     FAULT_STRIP_METADATA: 0.1, FAULT_INVALID_PARAMS: 0.1, FAULT_NO_CONVERSATION_ID: 0.2,
     FAULT_PROXY_RESTART: 0.05},
], ids=["clean", "faults"])
def test_direct_rows_equal_sdk_span_rows(workload: Workload, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch,
                                         faults: dict[str, float]) -> None:
    settings = SimulationSettings(profile="tiny", faults=faults, seed=2, prefill_nodes=2,
                                  decode_nodes=2, decode_cache_blocks=400)
    sdk, sdk_rows = _run(workload, tmp_path / "sdk.duckdb", settings, False, monkeypatch)
    direct, direct_rows = _run(workload, tmp_path / "direct.duckdb", settings, True,
                               monkeypatch)
    process, process_rows = _run(workload, tmp_path / "process.duckdb", settings, True,
                                 monkeypatch, process=True)
    assert sdk.spans == direct.spans == len(sdk_rows) == len(direct_rows)
    assert process.spans == len(process_rows) == len(sdk_rows)
    assert _normalised(process_rows, process.run_id) == _normalised(sdk_rows, sdk.run_id)
    assert [replace_run(t, sdk.run_id) for t in sdk.truth] == [
        replace_run(t, direct.run_id) for t in direct.truth]
    assert _normalised(direct_rows, direct.run_id) == _normalised(sdk_rows, sdk.run_id)
    # The comparison covered every span kind, error statuses and first-token events.
    names = {row[5] for row in sdk_rows}
    assert names == _ALL_SPANS
    assert any(row[-1] for row in sdk_rows) is False  # no links anywhere
    assert any(row[15] for row in sdk_rows)  # events
    if faults:
        statuses = {(row[5], row[13]) for row in sdk_rows}
        assert (semconv.SPAN_KV_TRANSFER, "STATUS_CODE_ERROR") in statuses
        assert (semconv.SPAN_TURN, "STATUS_CODE_ERROR") in statuses
        assert (semconv.SPAN_INPUT_PROCESSING, "STATUS_CODE_ERROR") in statuses


def test_without_truth_the_store_is_the_same(workload: Workload, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvscope simulate`` without ``--truth`` skips the truth labelling: the same spans."""
    settings = SimulationSettings(profile="tiny", seed=2, decode_cache_blocks=400, faults={
        FAULT_HANDSHAKE: 0.15, FAULT_TRANSFER: 0.15, FAULT_PREEMPT: 0.15,
        FAULT_STRIP_METADATA: 0.1, FAULT_NO_CONVERSATION_ID: 0.2, FAULT_PROXY_RESTART: 0.05})
    labelled, labelled_rows = _run(workload, tmp_path / "truth.duckdb", settings, True,
                                   monkeypatch)
    bare, bare_rows = _run(workload, tmp_path / "bare.duckdb", settings, True, monkeypatch,
                           truth=False)
    assert labelled.truth and not bare.truth
    assert (bare.turns, bare.spans, bare.decode_queued_turns) == (
        labelled.turns, labelled.spans, labelled.decode_queued_turns)
    assert _normalised(bare_rows, bare.run_id) == _normalised(labelled_rows, labelled.run_id)


def replace_run(row: Any, run_id: str) -> str:
    return repr(row).replace(run_id, "<run>")


def test_without_a_span_process_the_spans_are_written_here(
        workload: Workload, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    settings = SimulationSettings(profile="tiny", seed=2)
    expected, expected_rows = _run(workload, tmp_path / "here.duckdb", settings, True,
                                   monkeypatch)

    def no_process(db: object, spec: object) -> None:
        raise ChildStartError("kvscope-simulator-spans exited at start (code 1)")

    monkeypatch.setattr(simulator, "SpanProcess", no_process)
    result, rows = _run(workload, tmp_path / "fallback.duckdb", settings, True, monkeypatch,
                        process=True)
    assert "kvscope-simulator-spans exited at start" in caplog.text
    assert _normalised(rows, result.run_id) == _normalised(expected_rows, expected.run_id)


def test_span_process_runs_at_lower_priority_with_a_wide_pipe(tmp_path: Path) -> None:
    settings = SimulationSettings(profile="tiny", seed=2)
    spec = Simulator(settings)._telemetry_spec("r", ids=True)
    process = span_process.SpanProcess(tmp_path / "spans.duckdb", spec)
    try:
        process.ready()
        pid = process._process.pid
        assert pid is not None
        assert (os.getpriority(os.PRIO_PROCESS, pid)
                == min(os.getpriority(os.PRIO_PROCESS, 0) + span_process.SPAN_PROCESS_NICE, 19))
        left, right = socket.socketpair()
        with left, right, socket.socket(fileno=os.dup(process._conn.fileno())) as sock:
            default = left.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) > default
        process.close()
    finally:
        process.abort()
    assert process.written == 0


@pytest.mark.parametrize("record", [
    ReuseDecisionRecord("r-1", 5, 32, 96, 64, 64, "pull", True, 128, "decode-0", "00-ab-cd-01"),
    KvTransferRecord("r-1", 5, 9, "d_to_p", "ok", 4096, 2, "decode-0", None, None),
    KvRetentionRecord("r-2", 1, None, 3, 6144, 480.0, "open", 48),
])
def test_an_engine_record_crosses_to_the_span_process_as_its_values(record: Any) -> None:
    """One encoding per engine event: what the span process rebuilds is the record itself."""
    code = ENGINE_RECORDS.index(type(record))
    shipped = unpack(pack([(0, code, tuple(record))]))
    assert shipped and pack(shipped)[:1] == b"M"  # plain values: marshal, not pickle
    (_, got_code, values), = shipped
    assert ENGINE_RECORDS[got_code]._make(values) == record
