"""``kvscope ingest`` of the WEKA kv-cache-tester's output files.

Headers and keys are the tester's own (``callanjfox/kv-cache-tester``: the files of its
``results/`` folder); the rows are written here in that shape (values made up, not copied).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvscope.collector.ingest import KINDS, detect, ingest, weka_tester
from kvscope.errors import IngestError
from kvscope.store.database import open_store

DETAILED_HEADER = ("request_id,phase_id,working_set_size,cache_hit_rate,context_size,"
                   "cached_tokens,unique_tokens,output_tokens,ttft,ttlt,generation_time,"
                   "total_time,launch_time,finish_time,concurrency_level,itl")
SUMMARY_HEADER = (
    "period_number,start_time,end_time,active_users,idle_users,users_with_requests,"
    "requests_completed,requests_launched,requests_completed_new,requests_completed_prior,"
    "requests_in_progress,requests_in_progress_new,requests_in_progress_prior,"
    "requests_per_second,input_tokens_per_second,output_tokens_per_second,ttft_avg,ttft_p50,"
    "ttft_p95,ttft_p99,avg_cache_hit_rate,working_set_blocks,users_added,users_completed,"
    "total_request_time,idle_time_pct,new_tokens_ingested,ttft_headroom_pct,"
    "rate_limited_users,rate_limit_events,admission_blocked_events,dispatch_delay_avg,"
    "dispatch_delay_max,in_flight_prefilling,in_flight_decoding")
LIFECYCLE_HEADER = "timestamp,user_id,event_type,trace_id,details"


def _files(tmp_path: Path) -> dict[str, Path]:
    detailed = tmp_path / "detailed_results_64000_20260310_153008.csv"
    rows = [f"P1_c1_r{i},SUSTAINED_P1,8000000,96,64000,61440,2560,1,{0.3 + i / 10},"
            f"{0.31 + i / 10},0.0003,{0.32 + i / 10},{1773169207.0 + i},{1773169207.5 + i},1,0.0"
            for i in range(5)]
    rows.append("P2_c21_r0,SUSTAINED_P2,8000000,96,64000,61440,2560,1,0.9,0.91,0.001,0.92,"
                "1773169237.1,1773169238.0,21,0.0")
    detailed.write_text("\n".join([DETAILED_HEADER, *rows]) + "\n")
    summary = tmp_path / "summary_trace_replay.csv"
    period = ("1,1773219165.8587172,1773219195.8587172,1,19,20,22,22,22,0,1,1,0,0.73,32574.1,"
              "161.7,7.43,6.68,19.06,22.79,0.0246,14882,0,0,535.1,10.8,3809792,25.7,0,0,0,0.41,"
              "0.95,0,1")
    summary.write_text(f"{SUMMARY_HEADER}\n{period}\n")
    lifecycle = tmp_path / "user_lifecycle.csv"
    lifecycle.write_text(
        f"{LIFECYCLE_HEADER}\n"
        '1773219165.85887,User-001,started,trace_0109,"601 requests, 47,714 initial tokens"\n'
        '1773219398.8755867,User-001,truncated,trace_0109,"4/601 requests, 74.3% cache hit"\n'
        '1773219399.1747348,User-002,started,trace_0392,"21 requests, 12,073 initial tokens"\n')
    metadata = tmp_path / "test_metadata.json"
    metadata.write_text(json.dumps({
        "model": "Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8", "api_endpoint": "http://localhost:8125",
        "mode": "trace_replay", "timestamp": "2026-03-11T09:38:21.658212+00:00",
        "trace_stats": {"total_traces": 642}, "config": {"max_ttft": 10.0, "seed": 42}},
        indent=2))
    return {"detailed": detailed, "summary": summary, "lifecycle": lifecycle,
            "metadata": metadata}


def test_each_output_is_detected_and_what_it_measured_recorded(tmp_path: Path) -> None:
    files = _files(tmp_path)
    for path in files.values():
        assert detect(path) is KINDS[weka_tester.KIND], path.name
    detailed = weka_tester.read(files["detailed"])
    assert (detailed.file, detailed.rows) == ("detailed_results", 6)
    phase = detailed.measured["phases"]["SUSTAINED_P1"]
    assert phase["requests"] == 5 and phase["ttft_p50_s"] == pytest.approx(0.5)
    assert phase["intended_cached_tokens"] == 5 * 61440
    assert weka_tester.read(files["summary"]).measured["periods"][0]["ttft_p50"] == 6.68
    assert weka_tester.read(files["lifecycle"]).measured == {
        "events": {"started": 2, "truncated": 1}, "users": 2}
    assert weka_tester.read(files["metadata"]).measured["mode"] == "trace_replay"

    db = tmp_path / "run.duckdb"
    result = ingest(db, list(files.values()))
    assert {s.kind for s in result.sources} == {weka_tester.KIND}
    assert all(s.spans == 0 for s in result.sources)  # no turn is invented
    con = open_store(db)
    try:
        (settings,) = con.execute("SELECT settings FROM kvscope_runs").fetchone()
    finally:
        con.close()
    recorded = {f["tester_file"] for f in json.loads(settings)["files"]}
    assert recorded == {"detailed_results", "summary_trace_replay", "user_lifecycle",
                        "test_metadata"}


def test_a_bad_number_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "detailed_results_1.csv"
    bad.write_text(f"{DETAILED_HEADER}\nr0,P1,1,96,64000,61440,2560,1,fast,1,0,1,1,2,1,0.0\n")
    with pytest.raises(IngestError, match=r"detailed_results_1\.csv:2: column 'ttft' is 'fast'"):
        ingest(tmp_path / "run.duckdb", [bad])
