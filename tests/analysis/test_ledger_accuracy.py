"""The ledger against the simulator's ground truth: every turn's outcome, and the token split.

Each fault of the simulator is switched on alone and in a mix; the ledger, built only from the
spans in the store, must name the same outcome as the simulator's truth for every turn and the
same local / remote / recomputed split wherever it could measure the reusable span.
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from kvscope.analysis.ledger import HISTORY_CONTINUES, ledger
from kvscope.emulator import outcomes
from kvscope.emulator.simulator import (
    FAULT_CLOCK_SKEW,
    FAULT_HANDSHAKE,
    FAULT_INVALID_PARAMS,
    FAULT_NO_CONVERSATION_ID,
    FAULT_PREEMPT,
    FAULT_PROXY_RESTART,
    FAULT_STRIP_METADATA,
    FAULT_TRANSFER,
    SimulationSettings,
    iter_truth,
    simulate,
)
from kvscope.emulator.workloads import synthetic
from kvscope.emulator.workloads.model import Workload
from kvscope.store import StoreReader

SPLIT = ["reusable_tokens", "local_hit_tokens", "remote_reused_tokens",
         "recomputed_reusable_tokens"]


@pytest.fixture(scope="module")
def workload() -> Workload:
    # Resets, sub-agents and a shared system prompt included: the hard cases stay in.
    return synthetic.generate(
        seed=5, conversations=6, turns_p50=7, max_turns=10, system_prompt_tokens=700,
        new_input_tokens_p50=250, think_time_p50_s=4, think_time_p90_s=30,
        reset_probability=0.08, subagent_probability=0.1,
    )


def _compare(workload: Workload, db: Path, settings: SimulationSettings) -> pl.DataFrame:
    result = simulate(workload, db, settings)
    truth = pl.DataFrame(list(iter_truth(result)))
    reader = StoreReader.open(db)
    try:
        observed = ledger(reader).filter(pl.col("run_id") == result.run_id)
    finally:
        reader.close()
    assert observed.height == truth.height == result.turns
    joined = truth.join(observed, on="x_request_id", suffix="_ledger", how="inner")
    assert joined.height == truth.height
    return joined


def _assert_matches(joined: pl.DataFrame) -> None:
    wrong = joined.filter(pl.col("outcome") != pl.col("outcome_ledger"))
    assert wrong.height == 0, wrong.select(
        "conversation_id", "turn_index", "outcome", "outcome_ledger", "evidence_ledger",
        *SPLIT).to_dicts()[:5]
    # The split is compared wherever the ledger measured the reusable span: the history
    # continues and the previous turn finished (an errored turn leaves no output to count).
    measured = joined.filter((pl.col("history") == HISTORY_CONTINUES)
                             & pl.col("reusable_tokens_ledger").is_not_null())
    assert measured.height > 0
    unmeasured = joined.filter((pl.col("history") == HISTORY_CONTINUES)
                               & pl.col("reusable_tokens_ledger").is_null())
    assert unmeasured["outcome"].is_in([outcomes.NO_DECODE_METADATA]).all()
    for column in SPLIT:
        off = measured.filter(pl.col(column) != pl.col(f"{column}_ledger"))
        assert off.height == 0, (column, off.select(
            "conversation_id", "turn_index", "outcome", *SPLIT,
            *[f"{c}_ledger" for c in SPLIT]).to_dicts()[:5])


FAULT_CASES = {
    "none": {},
    FAULT_NO_CONVERSATION_ID: {"faults": {FAULT_NO_CONVERSATION_ID: 0.5}},
    FAULT_STRIP_METADATA: {"faults": {FAULT_STRIP_METADATA: 0.5}},
    FAULT_INVALID_PARAMS: {"faults": {FAULT_INVALID_PARAMS: 0.5}},
    FAULT_PROXY_RESTART: {"faults": {FAULT_PROXY_RESTART: 0.3}},
    FAULT_PREEMPT: {"faults": {FAULT_PREEMPT: 0.5}},
    "handshake_recompute": {"faults": {FAULT_HANDSHAKE: 0.5},
                            "kv_load_failure_policy": "recompute"},
    "transfer_fail_policy": {"faults": {FAULT_TRANSFER: 0.5}},
    "transfer_recompute": {"faults": {FAULT_TRANSFER: 0.5}, "kv_load_failure_policy": "recompute"},
    "clock_skew_recompute": {"faults": {FAULT_CLOCK_SKEW: 0.5},
                             "kv_load_failure_policy": "recompute"},
    "short_decode_ttl": {"decoder_kv_blocks_ttl": 8.0, "kv_load_failure_policy": "recompute"},
    "short_router_ttl": {"router_ttl": 6.0},
    "high_threshold": {"kv_recompute_threshold": 400},
    "prefill_bidir_off": {"prefill_bidirectional_kv_xfer": False},
    "decode_bidir_off": {"decode_bidirectional_kv_xfer": False},
    "small_prefill_cache": {"prefill_cache_blocks": 200},
    "mix": {"faults": {FAULT_NO_CONVERSATION_ID: 0.15, FAULT_STRIP_METADATA: 0.1,
                       FAULT_TRANSFER: 0.1, FAULT_HANDSHAKE: 0.05, FAULT_PREEMPT: 0.1,
                       FAULT_INVALID_PARAMS: 0.05, FAULT_PROXY_RESTART: 0.05},
            "decoder_kv_blocks_ttl": 20.0, "kv_load_failure_policy": "recompute"},
}


@pytest.mark.parametrize("case", list(FAULT_CASES))
def test_ledger_equals_ground_truth(workload: Workload, tmp_path: Path, case: str) -> None:
    settings = SimulationSettings(profile="tiny", label=case, seed=17, **FAULT_CASES[case])
    joined = _compare(workload, tmp_path / "acc.duckdb", settings)
    _assert_matches(joined)


def test_several_runs_in_one_store_stay_apart(workload: Workload, tmp_path: Path) -> None:
    db = tmp_path / "two.duckdb"
    first = _compare(workload, db, SimulationSettings(profile="tiny", label="ON", seed=1))
    second = _compare(workload, db, SimulationSettings(
        profile="tiny", label="OFF", seed=1, prefill_bidirectional_kv_xfer=False,
        decode_bidirectional_kv_xfer=False))
    _assert_matches(first)
    _assert_matches(second)
    assert set(second["outcome"]) <= {outcomes.FIRST_TURN, outcomes.NO_DECODE_METADATA,
                                      outcomes.PREFIX_DIVERGED}
