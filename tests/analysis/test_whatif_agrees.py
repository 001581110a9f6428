"""What-if at the observed setting equals what was observed, on every kind of store the tests
make: simulated (fault-free and with faults), an HTTP emulator run at a time scale, and the
demo's (HTTP, TTL cut with the waits). Retained GiB·s within 2 %, reuse, pulls and failures
equal, the TTL read on the run's clock, and the observed setting never ruled out by the
recommendation."""

from __future__ import annotations

import asyncio
from pathlib import Path

import polars as pl
import pytest

from kvscope.analysis import whatif
from kvscope.analysis.registry import AnalysisContext, run
from kvscope.cli.demo import DemoOptions, run_demo
from kvscope.emulator.launcher import EmulatedCluster
from kvscope.emulator.replay import replay
from kvscope.emulator.servers import EmulatorConfig
from kvscope.emulator.simulator import SimulationSettings, simulate
from kvscope.emulator.workloads.synthetic import generate
from tests.stores import busy_workload, on_off_store

OUTCOME_COLUMNS = ("reused_tokens", "remote_tokens", "turns_reused", "turns_pulled",
                   "turns_errored")


def _assert_agrees(db: Path) -> int:
    """Every run with retention spans: the replay at its observed setting equals the observed
    row; the recommendation (budget: the observed GiB·s) never rules that setting out. Returns
    how many runs were checked."""
    with AnalysisContext.open(db) as ctx:
        table = run(ctx, "whatif", {"ttl": [60.0], "threshold": [0, 64]})
        held_max = {r: float(f["held_s"].max())
                    for (r,), f in whatif.inputs(ctx)["retentions"].group_by("run_id")}
    checked = 0
    for (run_id,), rows in table.group_by("run_id"):
        observed = rows.filter(pl.col("source") == whatif.SOURCE_OBSERVED).row(0, named=True)
        if observed["retained_gib_s"] is None:
            continue  # the feature off: nothing held, nothing to compare
        same = rows.filter((pl.col("source") == whatif.SOURCE_REPLAY)
                           & pl.col("is_observed_setting")).row(0, named=True)
        assert same["decoder_kv_blocks_ttl"] == observed["decoder_kv_blocks_ttl"]
        assert same["retained_gib_s"] == pytest.approx(observed["retained_gib_s"], rel=0.02), (
            run_id, same["retained_gib_s"], observed["retained_gib_s"])
        for column in OUTCOME_COLUMNS:
            assert same[column] == observed[column], (run_id, column)
        # One time base: no handle is held longer than the TTL the what-if reads it under.
        assert held_max[run_id] <= observed["decoder_kv_blocks_ttl"] * (1 + 1e-9)
        if same["ttft_p50_ms"] is not None:
            assert "no setting within" not in observed["note"], observed["note"]
            assert rows.filter(pl.col("recommended")).height == 1
        checked += 1
    return checked


def test_simulated_stores_agree(tmp_path: Path) -> None:
    db = on_off_store(tmp_path / "sim.duckdb", seed=3, conversations=6, turns_p50=5,
                      max_turns=8)
    work = busy_workload(turns_p50=5, max_turns=10)
    simulate(work, db, SimulationSettings(
        label="faults", seed=4, faults={"transfer_fail": 0.1, "strip_stream_metadata": 0.1,
                                        "handshake_fail": 0.05, "preempt_after_read": 0.05}))
    simulate(work, db, SimulationSettings(label="ttl 60", decoder_kv_blocks_ttl=60, seed=5))
    assert _assert_agrees(db) == 3


def test_a_time_scaled_emulator_run_agrees_on_its_own_clock(tmp_path: Path) -> None:
    """Model time 40x the wall clock: the spans record TTL 480 (model s) and hold handles at
    most 12 wall seconds; the what-if reads the TTL as 12 s of the run's clock."""
    scale = 40.0
    db = tmp_path / "emulated.duckdb"
    work = generate(conversations=3, seed=2, system_prompt_tokens=120,
                    shared_system_prompt=False, turns_p50=3, max_turns=4,
                    new_input_tokens_p50=40, output_tokens_p50=60, think_time_p50_s=20.0,
                    think_time_p90_s=600.0, arrival_rate_per_s=0, summary_tokens=50,
                    max_context_tokens=20_000, reset_probability=0, subagent_probability=0)
    config = EmulatorConfig(time_scale=scale, prefill_prefix_caching=False, seed=2)
    with EmulatedCluster(config, db=db, proxy=True, run_label="scaled") as cluster:
        assert cluster.proxy_url is not None
        asyncio.run(replay(work, cluster.proxy_url, time_scale=scale, concurrency=3))
    assert _assert_agrees(db) == 1
    with AnalysisContext.open(db) as ctx:
        seen = whatif.inputs(ctx)["observed"].row(0, named=True)
    assert seen["ttl_s"] == pytest.approx(480.0 / scale)


@pytest.mark.slow
def test_the_demo_store_agrees(tmp_path: Path) -> None:
    """The demo's three runs (OFF, ON, ON with faults: HTTP, waits and TTL cut 12-fold); the
    demo store said 53.98 GiB·s observed and 748.1 replayed at TTL 40 before."""
    assert run_demo(tmp_path, DemoOptions(out=tmp_path, conversations=4, max_turns=5)) == 0
    assert _assert_agrees(tmp_path / "kvscope.duckdb") == 2
