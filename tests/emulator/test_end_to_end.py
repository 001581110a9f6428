"""replay → kvscope proxy → emulated P and D, into one DuckDB store plus a ground-truth file."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from kvscope import semconv
from kvscope.emulator.ground_truth import read_truth
from kvscope.emulator.launcher import EmulatedCluster
from kvscope.emulator.replay import replay
from kvscope.emulator.servers import EmulatorConfig
from kvscope.emulator.workloads.model import Workload
from kvscope.emulator.workloads.synthetic import generate
from kvscope.reuse import outcomes
from tests.stores import query

TIME_SCALE = 50.0


def _workload(seed: int = 1) -> Workload:
    return generate(
        conversations=3, seed=seed, system_prompt_tokens=120, shared_system_prompt=False,
        turns_p50=3, max_turns=3, new_input_tokens_p50=40, output_tokens_p50=120,
        think_time_p50_s=1.0, think_time_p90_s=2.0, arrival_rate_per_s=0, summary_tokens=50,
        max_context_tokens=20_000, reset_probability=0, subagent_probability=0,
    )


def _run(tmp: Path, bidir: bool, seed: int = 1) -> tuple[Path, list[dict[str, Any]]]:
    db = tmp / f"run-{bidir}-{seed}.duckdb"
    config = EmulatorConfig(time_scale=TIME_SCALE, bidirectional_kv_xfer=bidir,
                            prefill_prefix_caching=False, seed=seed)
    with EmulatedCluster(config, db=db, proxy=True, run_label=f"bidir={bidir}") as cluster:
        assert cluster.proxy_url is not None
        result = asyncio.run(replay(_workload(seed), cluster.proxy_url, time_scale=TIME_SCALE,
                                    concurrency=4))
        assert result.summary()["errors"] == 0
    return db, read_truth(f"{db}.truth.jsonl")


def _spans(db: Path, name: str, key: str) -> list[tuple[str, Any]]:
    rows = query(db, "SELECT ServiceName, SpanAttributes[?] FROM otel_traces WHERE SpanName = ?",
                 [key, name])
    return [(service, value) for service, value in rows]


def test_bidir_on_pulls_on_later_turns_and_spans_join_the_proxy_trace(tmp_path: Path) -> None:
    db, truth = _run(tmp_path, bidir=True)
    later = [r for r in truth if r["turn_index"] >= 2]
    assert len(truth) == 9 and len(later) == 6
    assert all(r["outcome"] == outcomes.FIRST_TURN for r in truth if r["turn_index"] == 1)
    assert all(r["outcome"] == outcomes.REUSED_REMOTE for r in later)
    assert all(r["remote_reused_tokens"] > 0 for r in later)
    decisions = [v for _, v in _spans(db, semconv.SPAN_REUSE_DECISION, semconv.DECISION)]
    assert decisions.count(semconv.DECISION_PULL) == 6
    transfers = _spans(db, semconv.SPAN_KV_TRANSFER, semconv.TRANSFER_DIRECTION)
    d_to_p = [s for s, v in transfers if v == semconv.DIRECTION_D_TO_P]
    assert d_to_p == [semconv.SERVICE_PREFILL] * 6
    statuses = {v for _, v in _spans(db, semconv.SPAN_KV_TRANSFER, semconv.TRANSFER_STATUS)}
    assert statuses == {semconv.TRANSFER_OK}
    releases = [v for _, v in _spans(db, semconv.SPAN_KV_RETENTION,
                                     semconv.RETENTION_RELEASE_REASON)]
    # Each turn 1 and 2 was read by the next turn; each last turn is still held at the end.
    assert sorted(releases) == [semconv.RELEASE_OPEN] * 3 + [semconv.RELEASE_READ] * 6
    orphans = query(db, "SELECT count(*) FROM otel_traces WHERE ServiceName IN (?, ?) AND "
                        "TraceId NOT IN (SELECT TraceId FROM otel_traces WHERE SpanName = ?)",
                    [semconv.SERVICE_PREFILL, semconv.SERVICE_DECODE, semconv.SPAN_TURN])
    [gauge] = query(db, "SELECT count(*), max(Value) FROM otel_metrics_gauge WHERE MetricName = ?",
                    [semconv.METRIC_KV_RETAINED])
    [run] = query(db, "SELECT settings, ended_at FROM kvscope_runs")
    assert orphans == [(0,)]  # engine spans carry the proxy's traceparent
    assert gauge[0] >= 1 and gauge[1] > 0
    assert run[1] is not None
    settings = json.loads(run[0])
    assert settings["time_scale"] == TIME_SCALE and settings["bidirectional_kv_xfer"] is True
    assert settings["decoder_kv_blocks_ttl_wall_s"] == 480.0 / TIME_SCALE


def test_bidir_off_never_pulls(tmp_path: Path) -> None:
    db, truth = _run(tmp_path, bidir=False)
    later = [r for r in truth if r["turn_index"] >= 2]
    assert len(later) == 6
    assert {r["outcome"] for r in later} == {outcomes.NO_DECODE_METADATA}
    assert all(r["remote_reused_tokens"] == 0 and not r["params_returned"] for r in truth)
    directions = {v for _, v in _spans(db, semconv.SPAN_KV_TRANSFER,
                                       semconv.TRANSFER_DIRECTION)}
    assert semconv.DIRECTION_D_TO_P not in directions
    assert _spans(db, semconv.SPAN_KV_RETENTION, semconv.RETENTION_RELEASE_REASON) == []


def test_truth_is_deterministic_under_seed(tmp_path: Path) -> None:
    fields = ("turn_index", "reusable_tokens", "remote_reused_tokens", "local_hit_tokens",
              "outcome", "prompt_tokens", "output_tokens", "transfer_bytes")

    def signature(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        return sorted(tuple(r[f] for f in fields) for r in rows)

    _, first = _run(tmp_path / "a", bidir=True, seed=5)
    _, second = _run(tmp_path / "b", bidir=True, seed=5)
    assert signature(first) == signature(second)
    assert not any("content" in json.dumps(r) for r in first)  # ids and counts only


def test_engines_and_proxy_exporting_to_one_receiver_are_one_run(tmp_path: Path) -> None:
    """The README's shape: engines and proxy in other processes send OTLP to one ``kvscope
    serve``; its run is every span's run (the emulator stamps none of its own over OTLP)."""
    from kvscope.collector.receiver import Receiver

    db = tmp_path / "served.duckdb"
    with Receiver(db, port=0, record_run=True) as rx:
        config = EmulatorConfig(time_scale=TIME_SCALE, prefill_prefix_caching=False, seed=3)
        with EmulatedCluster(config, otlp_endpoint=rx.url, proxy=True) as cluster:
            assert cluster.proxy_url is not None
            result = asyncio.run(replay(_workload(3), cluster.proxy_url,
                                        time_scale=TIME_SCALE, concurrency=2))
            assert result.summary()["errors"] == 0
    runs = query(db, "SELECT ServiceName, list(DISTINCT ResourceAttributes[?]) FROM otel_traces "
                     "GROUP BY 1 ORDER BY 1", [semconv.RUN_ID])
    recorded = [r[0] for r in query(db, "SELECT run_id FROM kvscope_runs")]
    assert len(recorded) == 1
    assert {service for service, _ in runs} == {
        semconv.SERVICE_PROXY, semconv.SERVICE_PREFILL, semconv.SERVICE_DECODE}
    assert all(ids == recorded for _, ids in runs), runs
