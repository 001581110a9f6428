"""The reuse ladder: monotone steps ending at the observed reuse, losses where they belong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl
import pytest

from kvscope.analysis import ladder
from kvscope.analysis.registry import AnalysisContext, run
from kvscope.emulator.simulator import (
    FAULT_HANDSHAKE,
    FAULT_NO_CONVERSATION_ID,
    FAULT_PREEMPT,
    FAULT_STRIP_METADATA,
    SimulationSettings,
    simulate,
)
from kvscope.emulator.workloads import synthetic
from kvscope.emulator.workloads.model import Workload


def _workload(think_p50: float, think_p90: float) -> Workload:
    return synthetic.generate(
        seed=6, conversations=8, turns_p50=6, max_turns=8, system_prompt_tokens=512,
        new_input_tokens_p50=300, think_time_p50_s=think_p50, think_time_p90_s=think_p90,
        reset_probability=0.0, subagent_probability=0.0)


def _ladder(workload: Workload, path: Path, **overrides: Any) -> tuple[pl.DataFrame, int]:
    simulate(workload, path, SimulationSettings(profile="tiny", **overrides))
    with AnalysisContext.open(path) as ctx:
        steps = run(ctx, "ladder")
        later = ctx.ledger().filter(
            (pl.col("turn_index") >= 2) & pl.col("reusable_tokens").is_not_null())
    observed = int((later["local_hit_tokens"].fill_null(0)
                    + later["remote_reused_tokens"].fill_null(0)).sum())
    return steps, observed


def _lost(steps: pl.DataFrame) -> dict[str, int]:
    return {r["lost_to"]: r["lost_tokens"] for r in steps.iter_rows(named=True) if r["lost_to"]}


def _check_shape(steps: pl.DataFrame, observed: int) -> None:
    assert steps["step"].to_list() == list(ladder.STEPS)
    tokens = steps["tokens"].to_list()
    assert all(a >= b for a, b in zip(tokens, tokens[1:], strict=False)), tokens
    assert tokens[-1] == observed
    assert sum(_lost(steps).values()) == tokens[0] - tokens[-1]
    assert steps["rate"][0] == 1.0
    assert steps["basis"].to_list() == ["measured", "estimated", "estimated", "estimated",
                                        "measured"]


@pytest.mark.parametrize("faults", [
    {},
    {FAULT_PREEMPT: 0.3, FAULT_HANDSHAKE: 0.2, FAULT_STRIP_METADATA: 0.1,
     FAULT_NO_CONVERSATION_ID: 0.2},
])
def test_steps_are_monotone_and_end_at_the_observed_reuse(tmp_path: Path,
                                                          faults: dict[str, float]) -> None:
    steps, observed = _ladder(_workload(30.0, 400.0), tmp_path / "s.duckdb", faults=faults)
    _check_shape(steps, observed)
    if faults:
        lost = _lost(steps)
        assert lost["memory"] > 0  # preempted after the read
        assert lost["system"] > 0  # handshakes, stripped metadata, missing ids


def test_waits_past_the_ttl_are_the_ttls_loss(tmp_path: Path) -> None:
    workload = _workload(100.0, 100.0)
    steps, observed = _ladder(workload, tmp_path / "60.duckdb", decoder_kv_blocks_ttl=60.0)
    _check_shape(steps, observed)
    lost = _lost(steps)
    assert lost["ttl"] == steps["tokens"][0] - observed > 0
    assert lost["threshold"] == lost["memory"] == lost["system"] == 0
    assert "60 s" in steps.filter(pl.col("step") == "ttl_bounded")["evidence"].item()
    # Every wait fits 480 s: the TTL costs nothing.
    steps, observed = _ladder(workload, tmp_path / "480.duckdb")
    assert _lost(steps)["ttl"] == 0


def test_a_threshold_above_every_pull_is_the_thresholds_loss(tmp_path: Path) -> None:
    steps, observed = _ladder(_workload(10.0, 60.0), tmp_path / "t.duckdb",
                              kv_recompute_threshold=10**6)
    _check_shape(steps, observed)
    lost = _lost(steps)
    assert lost["threshold"] == steps["tokens"][0] - observed > 0
    assert lost["ttl"] == lost["system"] == 0


def test_without_engine_settings_the_steps_say_not_measured() -> None:
    turns = pl.DataFrame({
        "run_id": ["r", "r"], "later": [False, True], "has_prev": [False, True],
        "reusable_tokens": [0, 1000], "local_tokens": [0, 400], "observed_remote": [0, 0],
        "gap_s": [None, 10.0], "age_s": [None, 10.0], "prev_ret_ttl_s": [None, None],
        "offered_tokens": [None, 1000], "prompt_tokens": [500, 1200],
        "decision_local": [0, 400], "outcome": ["first_turn", "unknown"],
        "expired_read": [False, False], "errored": [False, False],
    }, schema_overrides={"gap_s": pl.Float64, "age_s": pl.Float64,
                         "prev_ret_ttl_s": pl.Float64, "offered_tokens": pl.Int64})
    observed = pl.DataFrame({"run_id": ["r"], "ttl_s": [None], "threshold_tokens": [None],
                             "router_ttl_s": [None]},
                            schema_overrides={"ttl_s": pl.Float64, "threshold_tokens": pl.Int64,
                                              "router_ttl_s": pl.Float64})
    steps = ladder.ladder_table(turns, observed)
    assert steps["basis"].to_list() == ["measured", "not measured", "not measured", "estimated",
                                        "measured"]
    assert steps["tokens"].to_list() == [1000, 1000, 1000, 1000, 400]
    assert _lost(steps) == {"ttl": 0, "threshold": 0, "memory": 0, "system": 600}
